"""Flash-attention forward on the CUDA extension (``csrc/attention/``), with the Triton backend's
semantics: key padding (bounds and holes), causal top-left and bottom-right, bool and float
``attn_mask`` read through its (broadcast) strides, fully-masked rows giving 0, GQA, ``Lq != Lk``,
strided inputs read in place, and dropout dropping the same weights as the Triton backend for the
same ``(seed, offset)``.

Served: float16 and bfloat16, head dims up to 256 (``E`` or ``Ev`` not a multiple of 8 is copied
zero-padded), forward only: a call that needs gradients goes to another backend, since the CUDA
backward kernels are not built yet.  ``backend="auto"`` never picks it for attention (no GPU
measurement yet); ``backend="cuda"`` does.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.attention import AttentionArgs, dropout_threshold, empty_lse, empty_output, key_padding_bounds
from ._common import dtype_reason, in_chunks, raw_ops

__all__ = ["forward", "backward", "unsupported_reason"]

# CUDA caps the second grid dimension, which holds batch * query heads.
MAX_BATCH_HEADS = 65535


def _needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> bool:
    tensors = (query, key, value, args.attn_mask)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> Optional[str]:
    reason = dtype_reason(query.dtype)
    if reason is not None:
        return reason
    if _needs_grad(query, key, value, args):
        return "the cuda backend has no attention backward yet (forward only): inputs that require grad go to triton"
    batch_heads = query.shape[0] * query.shape[1]
    if batch_heads > MAX_BATCH_HEADS:
        return f"the cuda attention kernels take B * Hq up to {MAX_BATCH_HEADS}, got {batch_heads}"
    return None


def _padded(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` readable in 16-byte chunks, its last dim zero-padded to a multiple of 8 if needed
    (zero columns change no dot product; padded output columns are cut off)."""
    width = tensor.shape[-1]
    if width % 8 == 0:
        return in_chunks(tensor)
    padded = tensor.new_zeros((*tensor.shape[:-1], -(-width // 8) * 8))
    padded[..., :width] = tensor
    return padded


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs):
    """``out`` and ``lse`` (+inf on rows that see no key) in the layouts of
    :func:`~transformer_kernels.ops.attention.empty_output` and ``empty_lse``."""
    out, lse = empty_output(query, value), empty_lse(query)
    value_in = _padded(value)
    target = out if value_in.shape[-1] == value.shape[-1] else empty_output(query, value_in)
    padding = args.key_padding_mask
    bounds = None if padding is None else key_padding_bounds(padding)
    threshold, scale = dropout_threshold(args.dropout_p) if args.dropout_p > 0.0 else (0, 1.0)
    raw_ops().attention_forward(
        _padded(query), _padded(key), value_in, padding, bounds, args.attn_mask, int(args.causal), args.scale,
        args.dropout_seed if args.dropout_p > 0.0 else None, threshold, scale, target, lse,
    )
    if target is not out:
        out.copy_(target[..., : value.shape[-1]])
    return out, lse


def backward(grad_out, query, key, value, out, lse, args: AttentionArgs, attn_mask_needs_grad: bool):
    # unsupported_reason sends every call that needs gradients elsewhere.
    raise NotImplementedError("the cuda backend has no attention backward yet")
