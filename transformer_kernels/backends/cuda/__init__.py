"""The compiled CUDA C++ extension ``transformer_kernels._C``, when it was built.

The extension is optional at build time (see ``setup.py``).  Importing it registers raw CUDA ops as
``torch.ops.transformer_kernels_C.*``; the op modules here (``qkv``, ``glu_conv``, ``attention``) call them behind
the registered ops of ``transformer_kernels.ops``, which keep the autograd and fake kernels.  Each
op module's ``unsupported_reason`` says which calls it cannot serve (float32, sizes its kernels do not
handle), and ``backend="auto"`` moves on to Triton.

``"auto"`` prefers these kernels over Triton per (public function, architecture) only where a
measurement says so.  On sm_90 the H200 report of 2026-11-27
(``benchmarks/results/nvidia-h200-2026-11-27-c3c60f6``) timed the GLU decoding step's kernel ahead
of Triton's at every batch it tried, and every other kernel here behind Triton's (which use wgmma;
these use sm_80's mma.sync): there auto takes only the decoding step.  On sm_80, not yet measured,
it prefers them (mma.sync is what both emit there).  Attention is never auto's choice: it runs
here only when named, ``backend="cuda"``.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional

import torch

from ..._backend import cuda_capability, register_backend

# The compute capabilities (major) on which "auto" prefers this backend to Triton.
AUTO_PREFERRED_MAJORS = (8,)
# Elsewhere, the public functions a committed GPU measurement shows faster here, by major.
MEASURED_FASTER = {9: ("glu_conv1d_step",)}


@functools.lru_cache(maxsize=None)
def extension() -> Optional[ModuleType]:
    """The extension module, or None.  Probed once: ``backend="auto"`` asks on
    every CUDA call, and a failed import searches the file system each time."""
    try:
        return importlib.import_module("transformer_kernels._C")
    except ImportError:
        return None


# A constant to torch.compile, which calls it while tracing instead of tracing into it: Dynamo
# ignores lru_cache and cannot trace importlib (a fullgraph compile of any call on CUDA tensors
# that considers this backend failed).
@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result
def _extension_built() -> bool:
    return extension() is not None


def _device_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    if device.type != "cuda":
        return f"the cuda backend needs CUDA tensors, got device {device}"
    if not _extension_built():
        return "the CUDA extension transformer_kernels._C is not built"
    return None


def _auto_reason(op: str, public_name: str, device: torch.device) -> Optional[str]:
    if op == "attention":
        return "auto prefers triton for attention: the CUDA kernels measured slower"
    major, minor = cuda_capability(device)
    if major in AUTO_PREFERRED_MAJORS or public_name in MEASURED_FASTER.get(major, ()):
        return None
    return f"auto prefers triton for {public_name} on sm_{major}{minor}: no GPU measurement shows the CUDA kernels faster"


_modules: dict[str, ModuleType] = {}


def _load(op: str) -> ModuleType:
    if not _modules:  # once: an import statement costs microseconds even when done
        # An import statement, not importlib: torch.compile traces it.
        from . import attention, glu_conv, glu_conv_update, qkv

        _modules.update(attention=attention, glu_conv=glu_conv, glu_conv_update=glu_conv_update, qkv=qkv)
    return _modules[op]


register_backend(
    "cuda", rank=0, auto_device_types=("cuda",), device_reason=_device_reason,
    ops=("attention", "glu_conv", "glu_conv_update", "qkv"),
    load=_load, auto_reason=_auto_reason,
)
