"""``glu_conv1d_update`` on Triton: one launch of the decoding step's kernel in its ``RING`` form
(:mod:`._glu_step`), which reads the ring and ``x_t``, writes the output and stores ``x_t``."""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.glu_conv_update import GluUpdateArgs
from ._common import run_launches
from ._glu_step import MAX_LAUNCH_ROWS, as_rows, ring_launch
from .glu_conv import _SUPPORTED_DTYPES

__all__ = ["unsupported_reason", "forward"]


def unsupported_reason(x_t, conv_state, position, weight, bias, residual, args: GluUpdateArgs) -> Optional[str]:
    if x_t.dtype not in _SUPPORTED_DTYPES:
        return f"the Triton kernels support float16, bfloat16 and float32, got {x_t.dtype}"
    if x_t.shape[0] > MAX_LAUNCH_ROWS:
        return f"the kernel's grid takes at most {MAX_LAUNCH_ROWS} rows, got {x_t.shape[0]}"
    return None


def forward(
    x_t: torch.Tensor,
    conv_state: torch.Tensor,
    position: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    args: GluUpdateArgs,
) -> torch.Tensor:
    out = x_t.new_empty(x_t.shape[0], weight.shape[0] // 2)
    if x_t.shape[0] > 0:
        run_launches([ring_launch(x_t, conv_state, position, as_rows(weight), bias, residual, out,
                                  args.residual_scale)], x_t)
    return out
