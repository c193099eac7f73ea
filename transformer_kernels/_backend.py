"""The backend registry, and choosing a backend for one call.

Each backend package under ``transformer_kernels/backends/`` registers itself
on import with :func:`register_backend`: its name, its rank in ``"auto"``'s
order, why it cannot run tensors of a device and dtype, and the ops it serves
with a loader for each op's module.  An op module provides
``forward(...)``, ``backward(...)`` and ``unsupported_reason(...)``, which takes
``forward``'s arguments and says why the backend cannot serve them (head dim
too large, ...) or returns None; it may provide ``prepare_forward(...)``, which takes
``forward``'s arguments and returns a forward for the calls of their layout (or None), for the
public function's call plans to keep.  Adding a backend is adding a package.

Precedence: the ``backend=`` argument, then the innermost :func:`use_backend`
context, then the ``TRANSFORMER_KERNELS_BACKEND`` environment variable, then
``"auto"``.

``"auto"`` tries the backends in rank order, each only on the device types it
is auto-chosen for and where its ``auto_reason`` does not pass it over: CUDA
tensors go to the CUDA extension when it is built, able and preferred on the
GPU's architecture, else to Triton, else to eager; CPU tensors go to eager.  When auto passes a
backend over, the reason is logged once at DEBUG level on the
``transformer_kernels`` logger.  An explicitly requested backend that cannot
serve a call raises :class:`BackendUnavailableError` carrying the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from types import ModuleType
from typing import Callable, Iterator, Optional

import torch

__all__ = ["ENV_VAR", "BackendUnavailableError", "register_backend", "backend_names", "use_backend", "select_backend"]

ENV_VAR = "TRANSFORMER_KERNELS_BACKEND"

_logger = logging.getLogger("transformer_kernels")
_logged_reasons: set[tuple[str, str, str]] = set()
# A plain list rather than a ContextVar: torch.compile traces reads of module
# globals without a graph break, and backend choice is a per-process setting (as
# torch.nn.attention.sdpa_kernel's is).  Each entry is (token, name): a block
# leaving removes its own entry, not the top one, which another thread's block
# may have pushed since.
_backend_stack: list[tuple[object, str]] = []


class BackendUnavailableError(RuntimeError):
    """Raised when an explicitly requested backend cannot serve a call."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered backend; see :func:`register_backend`."""

    name: str
    rank: int
    auto_device_types: Optional[tuple[str, ...]]
    device_reason: Callable[[torch.device, torch.dtype], Optional[str]]
    ops: tuple[str, ...]
    load: Callable[[str], ModuleType]
    auto_reason: Optional[Callable[[str, str, torch.device], Optional[str]]] = None
    traces_into_kernels: Optional[Callable[[torch.device], bool]] = None


# Name -> backend, in "auto"'s order: sorted by rank at registration, not on every call.
_registry: dict[str, Backend] = {}


def register_backend(
    name: str,
    *,
    rank: int,
    device_reason: Callable[[torch.device, torch.dtype], Optional[str]],
    ops: tuple[str, ...],
    load: Callable[[str], ModuleType],
    auto_device_types: Optional[tuple[str, ...]] = None,
    auto_reason: Optional[Callable[[str, str, torch.device], Optional[str]]] = None,
    traces_into_kernels: Optional[Callable[[torch.device], bool]] = None,
) -> None:
    """Register backend ``name``.

    Args:
        rank: ``"auto"`` tries backends in increasing rank.
        device_reason: ``(device, dtype) -> reason or None``: why the backend
            cannot run tensors of this device and dtype at all.  Called on
            every call: keep it cheap and free of imports.
        ops: the ops (``"attention"``, ``"glu_conv"``, ``"qkv"``) it serves;
            for any other op the reason is that it has no kernel for it.
        load: ``op -> module`` with the op's ``forward``, ``backward`` and
            ``unsupported_reason``.  Use import statements, not importlib:
            torch.compile traces those, and an op module may import heavy
            dependencies only once the backend is chosen.
        auto_device_types: the device types ``"auto"`` may choose it for;
            ``None`` for every device.
        auto_reason: ``(op, public_name, device) -> reason or None``: why ``"auto"``
            should pass it over for ``op`` (called as the public function
            ``public_name``: one op may serve several) on this device although it
            could serve the call (another backend measured faster there);
            explicit requests ignore it.
        traces_into_kernels: ``device -> bool``: whether torch.compile may trace
            the op modules' ``forward`` and ``backward`` on tensors of this device
            (see :func:`traces_into_kernels`); ``None``: never.
    """
    global _registry
    if name == "auto" or name in _registry:
        raise ValueError(f"backend name {name!r} is taken")
    backends = [*_registry.values(), Backend(
        name, rank, auto_device_types, device_reason, tuple(ops), load, auto_reason, traces_into_kernels
    )]
    _registry = {backend.name: backend for backend in sorted(backends, key=lambda backend: backend.rank)}


def traces_into_kernels(name: str, device: torch.device) -> bool:
    """Whether backend ``name``'s ``forward`` and ``backward`` on tensors of ``device`` are made of
    what torch.compile can trace: torch ops, and kernel launches through
    ``torch.library.wrap_triton``, which Inductor compiles into its own graph.  Where they are, the
    registered ops decompose into them under torch.compile (``ops/_library.py``); elsewhere each
    op stays one opaque call."""
    backend = _registry.get(name)
    return backend is not None and backend.traces_into_kernels is not None and backend.traces_into_kernels(device)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA ``device`` (the current one where it names no index), asked once
    per GPU: torch's query costs microseconds, and backends ask on every call."""
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


# A constant to torch.compile too (Dynamo ignores lru_cache): called while tracing, not traced.
@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def registry_version() -> object:
    """What identifies the registry's present contents: a new object whenever a backend is
    registered (a decision cached from the registry holds it, to compare)."""
    return _registry


def backend_names() -> tuple[str, ...]:
    """``"auto"`` and the registered backends in ``"auto"``'s order."""
    return ("auto", *_registry)


def _check_name(name: str, origin: str) -> str:
    if name != "auto" and name not in _registry:
        raise ValueError(f"{origin} must be one of {backend_names()}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the calls inside the ``with`` block on backend ``name``.

    An explicit ``backend=`` argument still wins over the context.  The setting is the
    process's, not the thread's (as ``torch.nn.attention.sdpa_kernel``'s is): while a
    block is open, calls from every thread that name no backend take the innermost
    block's, whichever thread opened it.

    Example::

        with transformer_kernels.use_backend("eager"):
            out = transformer_kernels.scaled_dot_product_attention(q, k, v)
    """
    entry = (object(), _check_name(name, "use_backend(name)"))
    _backend_stack.append(entry)
    try:
        yield
    finally:
        _backend_stack.remove(entry)


def requested_backend(backend: Optional[str]) -> str:
    """The backend asked for, before any capability check."""
    if backend is not None:
        return _check_name(backend, "backend")
    if _backend_stack:
        return _backend_stack[-1][1]
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_name(env, f"environment variable {ENV_VAR}")
    return "auto"


def backend_module(op: str, name: str) -> ModuleType:
    """The module holding ``op``'s ``forward``/``backward``/``unsupported_reason`` for backend ``name``."""
    return _registry[name].load(op)


def _reason(backend: Backend, op: str, public_name: str, reference: torch.Tensor, forward_args: tuple) -> Optional[str]:
    why_not = backend.device_reason(reference.device, reference.dtype)
    if why_not is not None:
        return why_not
    if op not in backend.ops:
        return f"the {backend.name} backend has no {public_name} kernel"
    return backend.load(op).unsupported_reason(*forward_args)


def select_backend(op: str, public_name: str, backend: Optional[str], reference: torch.Tensor, *forward_args) -> str:
    """Resolve ``backend`` to the registered backend that runs this call of ``op``.

    ``reference`` gives the call's device and dtype; ``forward_args`` are the
    arguments the op module's ``forward`` will get, passed to each candidate's
    ``unsupported_reason``.
    """
    requested = requested_backend(backend)
    if requested == "auto":
        device_type = reference.device.type
        candidates = [
            candidate
            for candidate in _registry.values()
            if candidate.auto_device_types is None or device_type in candidate.auto_device_types
        ]
    else:
        candidates = [_registry[requested]]
    for candidate in candidates:
        why_not = _reason(candidate, op, public_name, reference, forward_args)
        if why_not is None and requested == "auto" and candidate.auto_reason is not None:
            why_not = candidate.auto_reason(op, public_name, reference.device)
        if why_not is None:
            return candidate.name
        if requested != "auto":
            raise BackendUnavailableError(f"{public_name}: backend={candidate.name!r} cannot serve this call: {why_not}")
        key = (public_name, candidate.name, why_not)
        if key not in _logged_reasons and not torch.compiler.is_compiling():
            _logged_reasons.add(key)
            _logger.debug("%s: auto backend skipped %r: %s", public_name, candidate.name, why_not)
    raise BackendUnavailableError(f"{public_name}: no registered backend can serve this call on {reference.device}")


# Supported stacks: torch 2.11 (with triton 3.6) up to torch 2.13 (with triton 3.9).
MIN_TORCH = (2, 11)


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
