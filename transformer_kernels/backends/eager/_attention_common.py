"""What the eager attention's two paths share (:mod:`.attention` tells them apart): the causal
shift, undoing broadcast views, and storing a result in a target's layout."""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.attention import Causal

__all__ = ["causal_shift", "undo_broadcast", "in_layout"]


def causal_shift(causal: Causal, lq: int, lk: int) -> Optional[int]:
    """``shift`` such that query ``i`` sees key ``j`` iff ``j <= i + shift``; None without causality."""
    if causal == Causal.NONE:
        return None
    return 0 if causal == Causal.TOP_LEFT else lk - lq


def undo_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Narrow every stride-0 dimension of an ``expand``-ed tensor to size 1 (a view, no copy)."""
    for dim in range(tensor.dim()):
        if tensor.stride(dim) == 0 and tensor.shape[dim] > 1:
            tensor = tensor.narrow(dim, 0, 1)
    return tensor


def in_layout(tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``tensor`` with ``target``'s dtype and strides: itself, restrided as a view where only the
    strides of size-1 dimensions differ (they address nothing: one query row, one head), else
    ``target`` filled with a copy (a new tensor laid out like ``target`` when that is a meta
    tensor, which describes the layout without allocating it)."""
    if tensor.dtype == target.dtype:
        if tensor.stride() == target.stride():
            return tensor
        if all(a == b for a, b, size in zip(tensor.stride(), target.stride(), tensor.shape) if size > 1):
            return tensor.as_strided(target.shape, target.stride())
    if target.is_meta:
        target = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype, device=tensor.device)
    return target.copy_(tensor)
