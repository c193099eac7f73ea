"""Choosing a backend for one call.

Precedence: the ``backend=`` argument, then the innermost :func:`use_backend`
context, then the ``TRANSFORMER_KERNELS_BACKEND`` environment variable, then
``"auto"``.

``"auto"`` sends CUDA tensors to the CUDA extension when it is built and able,
else to Triton, else to eager; CPU tensors go to eager.  When auto passes a
backend over, the reason is logged once at DEBUG level on the
``transformer_kernels`` logger.  An explicitly requested backend that cannot
serve a call raises :class:`BackendUnavailableError` carrying the reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
import os
from types import ModuleType
from typing import Iterator, Optional

import torch

__all__ = ["BACKENDS", "ENV_VAR", "BackendUnavailableError", "use_backend", "select_backend"]

BACKENDS = ("auto", "cuda", "triton", "eager")
ENV_VAR = "TRANSFORMER_KERNELS_BACKEND"

_logger = logging.getLogger("transformer_kernels")
_logged_reasons: set[tuple[str, str, str]] = set()
# A plain list rather than a ContextVar: torch.compile traces reads of module
# globals without a graph break, and backend choice is a per-process setting.
_backend_stack: list[str] = []


class BackendUnavailableError(RuntimeError):
    """Raised when an explicitly requested backend cannot serve a call."""


def _check_name(name: str, origin: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{origin} must be one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the calls inside the ``with`` block on backend ``name``.

    An explicit ``backend=`` argument still wins over the context.

    Example::

        with transformer_kernels.use_backend("eager"):
            out = transformer_kernels.scaled_dot_product_attention(q, k, v)
    """
    _backend_stack.append(_check_name(name, "use_backend(name)"))
    try:
        yield
    finally:
        _backend_stack.pop()


def requested_backend(backend: Optional[str]) -> str:
    """The backend asked for, before any capability check."""
    if backend is not None:
        return _check_name(backend, "backend")
    if _backend_stack:
        return _backend_stack[-1]
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_name(env, f"environment variable {ENV_VAR}")
    return "auto"


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Supported stacks: torch 2.11 (with triton 3.6) up to torch 2.13 (with triton 3.9).
MIN_TORCH = (2, 11)
MIN_TRITON = (3, 6)


def version_reason(package: str, version: str, minimum: tuple[int, int]) -> Optional[str]:
    """Why ``package`` at ``version`` is too old, or None.  Pre-release and local tags are ignored, so
    ``"2.11.0a0+git1234"`` counts as 2.11."""
    release = tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])
    if release < minimum:
        return f"{package} {version} is older than {'.'.join(map(str, minimum))}, the oldest supported"
    return None


def check_torch_version() -> None:
    """Raise ImportError on a torch older than the oldest supported one."""
    reason = version_reason("torch", torch.__version__, MIN_TORCH)
    if reason is not None:
        raise ImportError(f"transformer_kernels cannot run: {reason}")


@functools.lru_cache(maxsize=None)
def _triton_reason() -> Optional[str]:
    """Why the installed triton cannot run our kernels, or None (looked up once: calls pay nothing)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return version_reason("triton", importlib.metadata.version("triton"), MIN_TRITON)


def _generic_reason(name: str, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> Optional[str]:
    if name == "eager":
        return None
    if name == "cuda":
        from .backends import cuda

        if device.type != "cuda":
            return f"the cuda backend needs CUDA tensors, got device {device}"
        return cuda.unavailable_reason()
    triton_reason = _triton_reason()
    if triton_reason is not None:
        return triton_reason
    if device.type == "cuda":
        if triton_interpreter_enabled():
            return "TRITON_INTERPRET=1 is set, which only runs on CPU tensors"
        return None
    if device.type != "cpu" or not triton_interpreter_enabled():
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors), got device {device}"
    if torch.bfloat16 in dtypes:
        # The interpreter silently computes zeros for bfloat16.
        return "the Triton interpreter does not support bfloat16"
    return None


def backend_module(op: str, name: str) -> ModuleType:
    """The module holding ``op``'s ``forward``/``backward`` for backend ``name``.

    Imported on first use so the package imports without triton; import
    statements (unlike importlib calls) are traceable by torch.compile.
    """
    if name == "eager":
        from .backends.eager import attention, glu_conv, qkv
    elif name == "triton":
        from .backends.triton import attention, glu_conv, qkv
    else:
        raise ValueError(f"{op} has no {name!r} backend module")
    return {"attention": attention, "glu_conv": glu_conv, "qkv": qkv}[op]


def select_backend(op: str, public_name: str, backend: Optional[str], reference: torch.Tensor, *reason_args) -> str:
    """Resolve ``backend`` to the concrete backend that runs this call of ``op``.

    ``reference`` gives the call's device and dtype; ``reason_args`` go to
    each candidate backend module's ``unsupported_reason``, which says why it
    cannot serve these arguments (head dim too large, ...) or returns None.
    """

    def reason(name: str) -> Optional[str]:
        generic = _generic_reason(name, reference.device, (reference.dtype,))
        if generic is not None:
            return generic
        if name == "cuda":
            return f"the CUDA extension has no {public_name} kernel"
        return backend_module(op, name).unsupported_reason(*reason_args)

    requested = requested_backend(backend)
    candidates = (requested,) if requested != "auto" else (
        ("cuda", "triton", "eager") if reference.device.type == "cuda" else ("eager",)
    )
    for name in candidates:
        why_not = reason(name)
        if why_not is None:
            return name
        if requested != "auto":
            raise BackendUnavailableError(f"{public_name}: backend={name!r} cannot serve this call: {why_not}")
        key = (public_name, name, why_not)
        if key not in _logged_reasons and not torch.compiler.is_compiling():
            _logged_reasons.add(key)
            _logger.debug("%s: auto backend skipped %r: %s", public_name, name, why_not)
    raise AssertionError("the eager backend serves every call")
