"""``glu_conv1d_update`` composed of PyTorch ops: the window gathered from the ring, the step's
convolution as :mod:`.glu_conv` runs it, then the new input scattered into its slot.  Every op
reads the position on the device, so a CUDA graph can capture the call."""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.glu_conv import GluConvArgs
from ...ops.glu_conv_update import GluUpdateArgs
from . import glu_conv

__all__ = ["unsupported_reason", "forward"]


def unsupported_reason(x_t, conv_state, position, weight, bias, residual, args: GluUpdateArgs) -> Optional[str]:
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
    batch, channels_in, kernel_size = conv_state.shape
    slots = _ring_slots(position.expand(batch), kernel_size)  # [B, k]: the window's slots, the new input's last
    window = conv_state.gather(2, slots[:, None, :-1].expand(batch, channels_in, kernel_size - 1))
    window = torch.cat([window, x_t[:, :, None]], dim=2)
    step = GluConvArgs(0, 0, 0.0, args.residual_scale)
    out, _ = glu_conv.forward(window, weight, bias, None if residual is None else residual[:, :, None], step)
    conv_state.scatter_(2, slots[:, None, -1:].expand(batch, channels_in, 1), x_t[:, :, None])
    return out[:, :, 0]


def _ring_slots(position: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """``[B, k]``: the slots of positions ``p - k + 1 .. p`` for each row's position ``p`` (``[B]``),
    oldest first: ``(p - k + 1 + tap) % k``, which is ``(p % k + 1 + tap) % k`` (taken modulo k first,
    so that no position near the integer's limit overflows)."""
    taps = torch.arange(kernel_size, device=position.device)
    return (position[:, None].long() % kernel_size + 1 + taps) % kernel_size
