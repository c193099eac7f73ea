"""GLU convolution composed of PyTorch ops: the CPU path and the fallback.

The convolution is one GEMM on unfolded windows (im2col), using ``weight``
in the layout ``nn.Conv1d`` holds it, so no call copies or reorders weights
(that copy dominates small batches)::

    xpad = pad(x) as channel-last [B, Lp, C_in]                 (Lp = pad_left + L + pad_right)
    cols[b*L_out + s, ci*k + tap] = xpad[b, s + tap, ci]        [B*L_out, C_in*k]
    z = bias + cols @ weight.view(2C, C_in*k).T                   [B*L_out, 2C], channel-last
    out = (glu(z) + residual) * residual_scale

Backward transposes the same GEMM: ``grad_weight = (gz.T @ cols).view(2C, C_in, k)``
and ``grad_cols = gz @ weight.view(2C, C_in*k)``, folded back onto
``grad_xpad`` with ``k`` shifted adds (col2im).  On a CPU this runs faster
than ``nn.Conv1d`` (oneDNN) for the seq2seq shapes, in both directions.

``forward`` returns the pre-activation ``z`` ``[B, L_out, 2C]`` for backward:
here the GEMMs are the whole cost, so recomputing them would make training
slower than plain PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["forward", "backward", "unsupported_reason", "empty_output", "empty_saved", "is_channels_last"]


def is_channels_last(x: torch.Tensor) -> bool:
    """``x`` ``[B, C, L]`` is a contiguous ``[B, L, C]`` transposed (and not also contiguous)."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


def empty_output(x: torch.Tensor, channels: int, length: int) -> torch.Tensor:
    """An uninitialized ``[B, channels, length]`` tensor in ``x``'s memory layout.

    Channel-last when ``x`` is channel-last, else contiguous; every backend and
    the fake kernel allocate through this, so their strides agree.
    """
    batch = x.shape[0]
    if is_channels_last(x):
        return x.new_empty(batch, length, channels).transpose(1, 2)
    return x.new_empty(batch, channels, length)


def empty_saved(x: torch.Tensor, weight: torch.Tensor, pad_left: int, pad_right: int) -> torch.Tensor:
    """What ``forward`` returns for backward: the pre-activation ``[B, L_out, 2C]`` (for the fake kernel)."""
    length_out = pad_left + x.shape[2] + pad_right - weight.shape[2] + 1
    return x.new_empty(x.shape[0], length_out, weight.shape[0])


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor]
) -> Optional[str]:
    return None


def _padded_rows(x: torch.Tensor, pad_left: int, pad_right: int, pad_value: float) -> torch.Tensor:
    """``x`` padded with ``pad_value`` along positions, as a contiguous ``[B, Lp, C_in]``."""
    batch, channels_in, length = x.shape
    padded = x.new_empty(batch, pad_left + length + pad_right, channels_in)
    padded[:, :pad_left].fill_(pad_value)
    padded[:, pad_left + length :].fill_(pad_value)
    padded[:, pad_left : pad_left + length].copy_(x.transpose(1, 2))
    return padded


def _windows(x: torch.Tensor, kernel_size: int, pad_left: int, pad_right: int, pad_value: float) -> torch.Tensor:
    """im2col ``[B * L_out, C_in * k]``: row ``b * L_out + s``, column ``ci * k + tap`` holds ``xpad[b, s + tap, ci]``."""
    padded = _padded_rows(x, pad_left, pad_right, pad_value)
    batch, padded_length, channels_in = padded.shape
    length_out = padded_length - kernel_size + 1
    return padded.unfold(1, kernel_size, 1).reshape(batch * length_out, channels_in * kernel_size)


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    pad_left: int,
    pad_right: int,
    pad_value: float,
    residual_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, z)``: ``out`` in ``x``'s layout; ``z`` ``[B, L_out, 2C]`` kept for backward."""
    channels_z, _, kernel_size = weight.shape
    cols = _windows(x, kernel_size, pad_left, pad_right, pad_value)
    weight_rows = weight.reshape(channels_z, weight.shape[1] * kernel_size)
    z = torch.mm(cols, weight_rows.t()) if bias is None else torch.addmm(bias, cols, weight_rows.t())
    length_out = pad_left + x.shape[2] + pad_right - kernel_size + 1
    z = z.view(x.shape[0], length_out, channels_z)
    out = empty_output(x, channels_z // 2, length_out)
    torch.ops.aten.glu.out(z, 2, out=out.transpose(1, 2))
    if residual is not None:
        out.add_(residual)
    if residual_scale != 1.0:
        out.mul_(residual_scale)
    return out, z


def backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    z: torch.Tensor,
    pad_left: int,
    pad_right: int,
    pad_value: float,
    residual_scale: float,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)``; an output not asked for is an empty tensor."""
    batch, channels_in, length_in = x.shape
    channels_z, _, kernel_size = weight.shape
    length_out = z.shape[1]
    if residual_scale != 1.0:
        grad_out = grad_out * residual_scale
    grad_z = torch.ops.aten.glu_backward(grad_out.transpose(1, 2), z, 2).view(batch * length_out, channels_z)
    weight_rows = weight.reshape(channels_z, weight.shape[1] * kernel_size)

    grad_x = x.new_empty(0)
    if needs_grad_x:
        grad_cols = torch.mm(grad_z, weight_rows).view(batch, length_out, channels_in, kernel_size)
        grad_padded = x.new_zeros(batch, length_out + kernel_size - 1, channels_in)
        for tap in range(kernel_size):
            grad_padded[:, tap : tap + length_out] += grad_cols[:, :, :, tap]
        grad_x = empty_output(x, channels_in, length_in)
        grad_x.transpose(1, 2).copy_(grad_padded[:, pad_left : pad_left + length_in])

    grad_weight = weight.new_empty(0)
    if needs_grad_weight:
        cols = _windows(x, kernel_size, pad_left, pad_right, pad_value)
        grad_weight = torch.mm(grad_z.t(), cols).view(weight.shape)

    grad_bias = grad_z.sum(0) if needs_grad_bias and bias is not None else weight.new_empty(0)
    return grad_x, grad_weight, grad_bias
