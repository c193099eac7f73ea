"""Seed QKV projection: one nn.Linear per projection, then view/transpose/contiguous."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def qkv_projection(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], num_heads: int
) -> tuple[torch.Tensor, ...]:
    """``weight`` is ``[n*E, E]`` packed like ``in_proj_weight``; returns n tensors ``[B, H, L, E/H]``."""
    embed = x.shape[-1]
    outputs = []
    for i in range(weight.shape[0] // embed):
        rows = slice(i * embed, (i + 1) * embed)
        y = F.linear(x, weight[rows], None if bias is None else bias[rows])
        y = y.view(*x.shape[:-1], num_heads, embed // num_heads).transpose(-3, -2).contiguous()
        outputs.append(y)
    return tuple(outputs)
