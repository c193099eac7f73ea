"""Compositions of PyTorch ops: the CPU path and the fallback for every op, on any device and
floating dtype."""

from ..._backend import register_backend
from . import attention, glu_conv, qkv

_MODULES = {"attention": attention, "glu_conv": glu_conv, "qkv": qkv}

register_backend(
    "eager", rank=2, device_reason=lambda device, dtype: None, ops=tuple(_MODULES), load=_MODULES.__getitem__
)
