"""Seed GLU convolution block: explicit padding, nn.Conv1d, F.glu, residual then scale."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def glu_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    padding: str = "same",
    pad_value: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    residual_scale: float = 1.0,
) -> torch.Tensor:
    """``x`` ``[B, C_in, L]``, ``weight`` ``[2C, C_in, k]`` -> ``[B, C, L]``.

    ``residual_scale`` applies with or without ``residual`` (``None`` adds zero).
    """
    k = weight.shape[-1]
    left, right = ((k - 1) // 2, k // 2) if padding == "same" else (k - 1, 0)
    padded = F.pad(x, (left, right), value=pad_value)
    out = F.glu(F.conv1d(padded, weight, bias), dim=1)
    if residual is not None:
        out = out + residual
    return out * residual_scale
