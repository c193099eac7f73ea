"""GLU convolution on the CUDA extension (``csrc/glu_conv/``).

Two kernels families:

* **Whole sequences** (``glu_conv.cu``): implicit GEMMs over ``(k x C_in)`` on tensor cores.  ``x`` is
  first copied once into a padded channel-last buffer ``xpad`` ``[B, L_out + k - 1, C_in]`` (holding
  ``pad_value``), which makes every tap's tile an aligned 16-byte load with no padding predicate.
  The weight is packed once per forward as ``[2C, k * C_in]`` with the value and gate rows of each
  channel interleaved, so one tile holds both GLU halves and the epilogue computes
  ``(a * sigmoid(g) + residual) * scale`` in registers.  Forward saves the packed weight; backward
  recomputes the pre-activation from ``x`` in the kernel that writes its gradient ``grad_z``, then
  ``grad_x`` (a transposed convolution) and ``grad_weight`` with ``grad_bias`` are one GEMM each.
* **Decoding steps** (``glu_step.cu``): :func:`transformer_kernels.glu_conv1d_step` convolves the
  window (state, then the new input) into one position; one batched-GEMV kernel does it and writes
  the pre-activation ``[B, 1, 2C]``, on which backward runs the eager composition.

Served: float16 and bfloat16; a whole sequence needs ``C_in`` a multiple of 8 and ``C`` a multiple of
4, a step ``C_in * k`` a multiple of 8.  Anything else is Triton's or eager's.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.glu_conv import GluConvArgs, empty_output, is_channels_last
from ...ops.glu_conv import results_in_x_layout as results_channel_last
from ..eager import glu_conv as eager_glu_conv
from ._common import dtype_reason, in_chunks, raw_ops, size_reason

__all__ = ["forward", "backward", "unsupported_reason", "empty_saved", "results_channel_last"]


def _uses_step_kernel(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs) -> bool:
    """A decoding step (one output position, no padding) whose window the step kernel can load."""
    is_step = args.pad_left == 0 and args.pad_right == 0 and x.shape[2] == weight.shape[2]
    return is_step and weight.shape[1] * weight.shape[2] % 8 == 0


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> Optional[str]:
    reason = dtype_reason(x.dtype)
    if reason is not None:
        return reason
    if _uses_step_kernel(x, weight, args):
        return size_reason(x=x.numel(), weight=weight.numel())
    channels_z, channels_in, kernel_size = weight.shape
    if channels_in % 8 != 0 or channels_z % 8 != 0:
        return (
            f"the CUDA convolution kernels need C_in a multiple of 8 and C a multiple of 4, "
            f"got C_in = {channels_in}, C = {channels_z // 2}"
        )
    batch, length_out = x.shape[0], args.output_length(x.shape[2], kernel_size)
    return size_reason(
        weight=weight.numel(),
        padded_x=batch * (length_out + kernel_size - 1) * channels_in,
        preactivation_gradient=batch * length_out * channels_z,
    )


def empty_saved(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs) -> torch.Tensor:
    """What ``forward`` returns for backward: a step's pre-activation ``[B, 1, 2C]``, else the packed
    weight ``[2C, k * C_in]``."""
    channels_z, channels_in, kernel_size = weight.shape
    if _uses_step_kernel(x, weight, args):
        return x.new_empty(x.shape[0], 1, channels_z)
    return weight.new_empty(channels_z, kernel_size * channels_in)


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[2C, C_in, k]`` as ``[2C, k * C_in]``, value and gate rows interleaved (always a
    copy: an op's output may not alias its input)."""
    channels_z, channels_in, kernel_size = weight.shape
    interleaved = weight.view(2, channels_z // 2, channels_in, kernel_size).permute(1, 0, 3, 2)
    return interleaved.clone(memory_format=torch.contiguous_format).view(channels_z, kernel_size * channels_in)


def _packed_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.view(2, -1).t().contiguous().view(-1)


def _unpacked_weight(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_packed_weight`, contiguous ``[2C, C_in, k]`` (``weight`` gives the shape)."""
    channels_z, channels_in, kernel_size = weight.shape
    unpacked = packed.view(channels_z // 2, 2, kernel_size, channels_in).permute(1, 0, 3, 2)
    return unpacked.reshape(channels_z, channels_in, kernel_size)


def _unpacked_bias(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_packed_bias`."""
    return packed.view(-1, 2).t().reshape(-1)


def _xpad(x: torch.Tensor, args: GluConvArgs) -> torch.Tensor:
    return eager_glu_conv.padded_rows(x, args.pad_left, args.pad_right, args.pad_value)


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, saved)``: ``out`` in ``x``'s layout; ``saved`` as :func:`empty_saved` describes."""
    channels_z, _, kernel_size = weight.shape
    if _uses_step_kernel(x, weight, args):
        window, weight = in_chunks(x, contiguous=True), in_chunks(weight, contiguous=True)
        bias = None if bias is None else bias.contiguous()
        out, z = raw_ops().glu_conv1d_step(window, weight, bias, residual, args.residual_scale)
        if is_channels_last(x):  # a channel-last window: the kernel's contiguous memory, other strides
            out = empty_output(x, channels_z // 2, 1, channel_last=True).copy_(out)
        return out, z
    packed = _packed_weight(weight)
    out = empty_output(x, channels_z // 2, args.output_length(x.shape[2], kernel_size))
    raw_ops().glu_conv1d_forward(
        _xpad(x, args), packed, _packed_bias(bias), residual, out, x.shape[2], args.pad_left, args.residual_scale
    )
    return out, packed


def backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    saved: torch.Tensor,
    args: GluConvArgs,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)``; an output not asked for is an empty tensor."""
    if _uses_step_kernel(x, weight, args):  # saved: the step's pre-activation
        return eager_glu_conv.backward(
            grad_out, x, weight, bias, saved, args, needs_grad_x, needs_grad_weight, needs_grad_bias
        )
    ops, length_in, pad_left = raw_ops(), x.shape[2], args.pad_left
    xpad = _xpad(x, args)
    grad_z = ops.glu_conv1d_grad_preactivation(
        xpad, saved, _packed_bias(bias), grad_out, length_in, pad_left, args.residual_scale
    )
    grad_x = grad_weight = grad_bias = x.new_empty(0)
    if needs_grad_x:
        grad_x = empty_output(x, x.shape[1], length_in)
        ops.glu_conv1d_grad_input(grad_z, xpad, saved, grad_x, pad_left)
    with_bias = needs_grad_bias and bias is not None
    if needs_grad_weight or with_bias:
        grad_packed, grad_packed_bias = ops.glu_conv1d_grad_weight(grad_z, xpad, saved, length_in, pad_left, with_bias)
        if needs_grad_weight:
            grad_weight = _unpacked_weight(grad_packed, weight)
        if with_bias:
            grad_bias = _unpacked_bias(grad_packed_bias)
    return grad_x, grad_weight, grad_bias
