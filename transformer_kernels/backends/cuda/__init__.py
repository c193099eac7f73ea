"""The compiled CUDA C++ extension ``transformer_kernels._C``, when it was built.

The extension is optional at build time, and it serves no op yet: every call
gets a reason (not a CUDA tensor, not built, no kernel for the op), and
``backend="auto"`` moves on to Triton.  An op served here gets a module in this
package and an entry in ``ops`` and ``_load``.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional

import torch

from ..._backend import register_backend


@functools.lru_cache(maxsize=None)
def extension() -> Optional[ModuleType]:
    """The extension module, or None.  Probed once: ``backend="auto"`` asks on
    every CUDA call, and a failed import searches the file system each time."""
    try:
        return importlib.import_module("transformer_kernels._C")
    except ImportError:
        return None


def _device_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    if device.type != "cuda":
        return f"the cuda backend needs CUDA tensors, got device {device}"
    if extension() is None:
        return "the CUDA extension transformer_kernels._C is not built"
    return None


def _load(op: str) -> ModuleType:
    raise AssertionError(f"the cuda backend serves no {op} kernel")


register_backend("cuda", rank=0, auto_device_types=("cuda",), device_reason=_device_reason, ops=(), load=_load)
