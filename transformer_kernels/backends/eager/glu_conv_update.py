"""``glu_conv1d_update`` composed of PyTorch ops: the window gathered from the ring, the step's
convolution as :mod:`.glu_conv` runs it, then the new input scattered into its slot.  Off the CPU
every op reads the position on the device, so a CUDA graph can capture the call."""

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
    step = GluConvArgs(0, 0, 0.0, args.residual_scale)
    residual = None if residual is None else residual[:, :, None]
    if position.dim() == 0 and position.device.type == "cpu":
        # A CPU tensor's value costs nothing to read: the window is one cat of at most two slices of
        # the ring (the oldest slot first) and x_t, the functional step's ops (the device route's
        # index arithmetic, gather and scatter cost a decoding step on a CPU 8%).
        slot = int(position) % kernel_size
        oldest = (slot + 1) % kernel_size
        old = [conv_state[:, :, oldest:], conv_state[:, :, :slot]] if oldest else [conv_state[:, :, :slot]]
        out, _ = glu_conv.forward(torch.cat([*old, x_t[:, :, None]], dim=2), weight, bias, residual, step)
        conv_state.select(2, slot).copy_(x_t)
        return out[:, :, 0]
    slots = _ring_slots(position.expand(batch), kernel_size)  # [B, k]: the window's slots, the new input's last
    window = conv_state.gather(2, slots[:, None, :-1].expand(batch, channels_in, kernel_size - 1))
    out, _ = glu_conv.forward(torch.cat([window, x_t[:, :, None]], dim=2), weight, bias, residual, step)
    conv_state.scatter_(2, slots[:, None, -1:].expand(batch, channels_in, 1), x_t[:, :, None])
    return out[:, :, 0]


def _ring_slots(position: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """``[B, k]``: the slots of positions ``p - k + 1 .. p`` for each row's position ``p`` (``[B]``),
    oldest first: ``(p - k + 1 + tap) % k``, which is ``(p % k + 1 + tap) % k`` (taken modulo k first,
    so that no position near the integer's limit overflows)."""
    taps = torch.arange(kernel_size, device=position.device)
    return (position[:, None].long() % kernel_size + 1 + taps) % kernel_size
