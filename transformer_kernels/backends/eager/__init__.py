"""Compositions of PyTorch ops: the CPU path and the fallback for every op, on any device and
floating dtype."""

from types import ModuleType

from ..._backend import register_backend
from . import attention, glu_conv, glu_conv_update, qkv

_MODULES = {"attention": attention, "glu_conv": glu_conv, "glu_conv_update": glu_conv_update, "qkv": qkv}


def _load(op: str) -> ModuleType:
    # A function rather than the dict's bound __getitem__: torch 2.11's Dynamo cannot trace a call of
    # that builtin, and every torch.compile(fullgraph=True) of an op on CPU tensors broke there.
    return _MODULES[op]


register_backend("eager", rank=2, device_reason=lambda device, dtype: None, ops=tuple(_MODULES), load=_load)
