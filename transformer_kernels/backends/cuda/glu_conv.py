"""GLU convolution on the CUDA extension: so far its decoding step (``csrc/glu_conv/glu_step.cu``).

:func:`transformer_kernels.glu_conv1d_step` convolves the window (state, then the new input) with no
padding into one output position; that call is one kernel here, which also writes the
pre-activation ``[B, 1, 2C]`` for backward.  Backward of a step is the eager composition on that
pre-activation (two small GEMMs).  Whole-sequence convolutions (``glu_conv1d``) have no CUDA kernel
yet: ``unsupported_reason`` says so and they run on Triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.glu_conv import GluConvArgs, empty_output
from ..eager import glu_conv as eager_glu_conv
from ._common import dtype_reason, raw_ops

__all__ = ["forward", "backward", "unsupported_reason", "empty_saved"]


def _is_step(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs) -> bool:
    return args.pad_left == 0 and args.pad_right == 0 and x.shape[2] == weight.shape[2]


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> Optional[str]:
    reason = dtype_reason(x.dtype)
    if reason is not None:
        return reason
    if not _is_step(x, weight, args):
        return "the cuda backend has a GLU kernel for decoding steps only (glu_conv1d_step), not for whole sequences yet"
    window = weight.shape[1] * weight.shape[2]
    if window % 8 != 0:
        return f"the CUDA step kernel needs C_in * k to be a multiple of 8, got {window}"
    return None


def empty_saved(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs) -> torch.Tensor:
    """What ``forward`` returns for backward: the pre-activation ``[B, L_out, 2C]``, contiguous."""
    return x.new_empty(x.shape[0], args.output_length(x.shape[2], weight.shape[2]), weight.shape[0])


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, z)``: ``out`` ``[B, C, 1]`` in ``x``'s layout, ``z`` the pre-activation ``[B, 1, 2C]``."""
    out, z = raw_ops().glu_conv1d_step(
        x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), residual,
        args.residual_scale,
    )
    expected = empty_output(x, weight.shape[0] // 2, 1)
    if expected.stride() != out.stride():  # a channel-last window: the same memory, other strides
        out = expected.copy_(out)
    return out, z


def backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    z: torch.Tensor,
    args: GluConvArgs,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)``: the eager backward on the saved pre-activation."""
    return eager_glu_conv.backward(
        grad_out, x, weight, bias, z, args, needs_grad_x, needs_grad_weight, needs_grad_bias
    )
