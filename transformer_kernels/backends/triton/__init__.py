"""Triton kernels, one module per op; ``_common`` holds what they share.

The op modules import triton, so they are loaded only once the triton backend
was chosen; this package itself only registers the backend.  It runs CUDA
tensors, and CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from types import ModuleType
from typing import Optional

import torch

from ..._backend import register_backend, version_reason

# The triton that torch 2.11, the oldest supported torch, ships with.
MIN_TRITON = (3, 6)


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# A constant to torch.compile, which calls it while tracing instead of tracing into it: Dynamo
# ignores lru_cache and, in torch 2.11, cannot trace importlib's find_spec (a fullgraph compile of
# any call that considers this backend failed there).
@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result
def triton_reason() -> Optional[str]:
    """Why the installed triton cannot run our kernels, or None (looked up once: calls pay nothing)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return version_reason("triton", importlib.metadata.version("triton"), MIN_TRITON)


def _device_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    reason = triton_reason()
    if reason is not None:
        return reason
    if device.type == "cuda":
        if interpreter_enabled():
            return "TRITON_INTERPRET=1 is set, which only runs on CPU tensors"
        return None
    if device.type != "cpu" or not interpreter_enabled():
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors), got device {device}"
    if dtype == torch.bfloat16:
        # The interpreter silently computes zeros for bfloat16.
        return "the Triton interpreter does not support bfloat16"
    return None


_modules: dict[str, ModuleType] = {}


def _load(op: str) -> ModuleType:
    if not _modules:  # once: an import statement costs microseconds even when done
        # An import statement, not importlib: torch.compile traces it.
        from . import attention, glu_conv, glu_conv_update, qkv

        _modules.update(attention=attention, glu_conv=glu_conv, glu_conv_update=glu_conv_update, qkv=qkv)
    return _modules[op]


def _traces_into_kernels(device: torch.device) -> bool:
    """Every launch goes through ``run_launches``, which traces it with ``wrap_triton``: on CUDA
    tensors, whose kernels Triton compiles (interpreted ones cannot be traced)."""
    return device.type == "cuda" and not interpreter_enabled()


register_backend(
    "triton", rank=1, auto_device_types=("cuda",), device_reason=_device_reason,
    ops=("attention", "glu_conv", "glu_conv_update", "qkv"), load=_load, traces_into_kernels=_traces_into_kernels,
)
