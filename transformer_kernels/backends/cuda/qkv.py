"""Fused QKV projection on the CUDA extension's tensor-core GEMMs (``csrc/qkv/qkv.cu``).

Forward is one GEMM whose epilogue adds the bias and writes each output head-split; backward reads
the head-split gradients in place, ``grad_x`` in one GEMM and ``grad_weight`` with ``grad_bias`` in
another.  Served: float16 and bfloat16, ``E`` and the head dim multiples of 8 (each 16-byte load stays
inside one head); any other call is Triton's or eager's.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.qkv import QkvProjectionArgs
from ._common import dtype_reason, in_chunks, loads_in_chunks, own_tensor, raw_ops, size_reason

__all__ = ["forward", "backward", "unsupported_reason"]


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: QkvProjectionArgs
) -> Optional[str]:
    reason = dtype_reason(x.dtype)
    if reason is not None:
        return reason
    embed_dim = x.shape[-1]
    head_dim = embed_dim // args.num_heads
    if embed_dim % 8 != 0 or head_dim % 8 != 0:
        return (
            f"the CUDA kernels need E and the head dim to be multiples of 8, got E = {embed_dim}, head dim {head_dim}"
        )
    return size_reason(x=x.numel(), weight=weight.numel())


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """``[*batch, L, E]`` as ``[B, L, E]`` (a view when the strides allow), readable in chunks."""
    return in_chunks(x.reshape(-1, *x.shape[-2:]))


def forward(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: QkvProjectionArgs
) -> list[torch.Tensor]:
    bias = None if bias is None else bias.contiguous()
    outputs = raw_ops().qkv_forward(_as_3d(x), in_chunks(weight), bias, args.num_heads)
    shape = args.output_shape(x)
    return [out if out.shape == shape else own_tensor(out.view(shape)) for out in outputs]


def _head_split_4d(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients as ``[B, H, L, Dh]`` sharing one set of chunk-readable strides (copied otherwise,
    e.g. the stride-0 gradient of ``out.sum()``)."""
    grads4 = [g.reshape(-1, *g.shape[-3:]) for g in grads]
    if all(loads_in_chunks(g) and g.stride() == grads4[0].stride() for g in grads4):
        return grads4
    return [in_chunks(g, contiguous=True) for g in grads4]


def backward(
    grads: list[torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    args: QkvProjectionArgs,
    has_bias: bool,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)``; a gradient not asked for is an empty tensor."""
    x3, weight, grads4 = _as_3d(x), in_chunks(weight), _head_split_4d(grads)
    grad_x = raw_ops().qkv_grad_input(grads4, x3, weight).view(x.shape) if needs_grad_x else x.new_empty(0)
    with_bias = has_bias and needs_grad_bias
    grad_weight = grad_bias = x.new_empty(0)
    if needs_grad_weight:
        grad_weight, grad_bias = raw_ops().qkv_grad_weight(grads4, x3, weight, with_bias)
    elif with_bias:  # a frozen weight: the column sums alone
        grad_bias = torch.cat([g.sum((0, 2), dtype=torch.float32).flatten() for g in grads4]).to(x.dtype)
    return grad_x, grad_weight, grad_bias if with_bias else x.new_empty(0)
