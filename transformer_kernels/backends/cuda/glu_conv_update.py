"""``glu_conv1d_update`` on the CUDA extension: the decoding-step kernel (``csrc/glu_conv/glu_step.cu``)
in its ring form, which reads the ring and ``x_t``, writes the output and stores ``x_t`` into the
ring.  Served: float16 and bfloat16, ``C_in * k`` a multiple of 8, a contiguous ring with a 16-byte
aligned start (written in place, so never a copy); ``x_t``, the weight and an int32 position are
copied where the kernel cannot read them as they are."""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.glu_conv_update import GluUpdateArgs
from ._common import dtype_reason, in_chunks, raw_ops, size_reason

__all__ = ["forward", "unsupported_reason"]


def unsupported_reason(x_t, conv_state, position, weight, bias, residual, args: GluUpdateArgs) -> Optional[str]:
    reason = dtype_reason(x_t.dtype)
    if reason is not None:
        return reason
    _, channels_in, kernel_size = conv_state.shape
    if channels_in * kernel_size % 8 != 0:
        return f"the CUDA step kernel needs C_in * k a multiple of 8, got {channels_in * kernel_size}"
    if not conv_state.is_contiguous() or conv_state.data_ptr() % 16 != 0:
        return "the CUDA step kernel updates a contiguous conv_state with a 16-byte aligned start in place"
    return size_reason(conv_state=conv_state.numel(), weight=weight.numel())


def forward(
    x_t: torch.Tensor,
    conv_state: torch.Tensor,
    position: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    args: GluUpdateArgs,
) -> torch.Tensor:
    return raw_ops().glu_conv1d_update(
        x_t.contiguous(), conv_state, position.long().contiguous(), in_chunks(weight, contiguous=True),
        None if bias is None else bias.contiguous(), None if residual is None else residual.unsqueeze(2),
        args.residual_scale,
    )
