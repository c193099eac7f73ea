"""``torch.autocast`` for the public functions, as it treats the torch ops they replace: ``nn.Linear``
(the QKV projection), ``F.conv1d`` (the GLU convolution) and ``F.scaled_dot_product_attention`` are
lower-precision autocast ops, which run in the autocast dtype whatever floating dtype their inputs
arrive in (float64 aside)."""

from __future__ import annotations

import torch

__all__ = ["autocast", "autocast_enabled"]

# torch.autocast casts these to its dtype and leaves float64 alone.
_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)
# Device types with an autocast mode (torch.amp.is_autocast_available, which torch 2.11's
# torch.compile cannot trace); asking torch.is_autocast_enabled about any other raises.
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla")
# Those whose autocast torch._C._is_any_autocast_enabled does not see (torch 2.11 to 2.13).
_UNCOVERED_DEVICE_TYPES = ("mps", "maia")


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``; False for a device type without an autocast mode
    (``meta``), which ``torch.is_autocast_enabled`` refuses."""
    return device_type in _DEVICE_TYPES and torch.is_autocast_enabled(device_type)


def _may_be_enabled(reference: torch.Tensor) -> bool:
    """False where autocast is surely off for ``reference``'s device type, at a fifth of the cost of
    asking for that type (reading a device's type alone takes 0.4 us): no autocast is on among the
    types ``torch._C._is_any_autocast_enabled`` covers, which are all but those in
    ``_UNCOVERED_DEVICE_TYPES`` (``tests/test_autocast.py`` checks that list against torch)."""
    return torch._C._is_any_autocast_enabled() or reference.is_mps or reference.is_maia


def autocast(reference: object, *tensors: object) -> tuple:
    """``tensors`` as a lower-precision autocast op takes them: where autocast is on for
    ``reference``'s device type, its float16/bfloat16/float32 tensors of that device type cast to the
    autocast dtype (``torch.get_autocast_dtype``: bfloat16 on CPU and float16 on CUDA by default);
    float64 and non-floating tensors (bool masks), tensors of other devices and non-tensors as they
    are, for the checks after this to word their errors.  Outside autocast, ``tensors`` unchanged."""
    if not isinstance(reference, torch.Tensor) or not _may_be_enabled(reference):
        return tensors
    device_type = reference.device.type
    if not autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _ELIGIBLE and t.device.type == device_type else t
        for t in tensors
    )
