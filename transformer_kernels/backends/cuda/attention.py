"""Flash attention on the CUDA extension (``csrc/attention/``), with the Triton backend's
semantics: key padding (bounds and holes), causal top-left and bottom-right, bool and float
``attn_mask`` read through its (broadcast) strides and the float mask's gradient, fully-masked rows
giving 0 and zero gradients, GQA (heads summed in order inside the dK/dV kernel), ``Lq != Lk``,
strided inputs read in place, and dropout dropping the same weights as the Triton backend for the
same ``(seed, offset)``.

Served: float16 and bfloat16; head dims up to 256, forward and backward (``E`` or ``Ev`` not a
multiple of 8 is copied zero-padded).  ``backend="auto"`` never picks it for
attention (no GPU measurement yet); ``backend="cuda"`` does.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.attention import (
    KEY_BOUNDS_MIN_LENGTH, MAX_HEAD_DIM, AttentionArgs, dropout_threshold, empty_grads, empty_lse, empty_output,
)
from ...ops.attention import grads_like_inputs as grads_contiguous
from ._common import dtype_reason, in_chunks, loads_in_chunks, raw_ops

__all__ = ["forward", "backward", "empty_saved", "grads_contiguous", "unsupported_reason"]

# CUDA caps the second grid dimension, which holds batch * query heads.
MAX_BATCH_HEADS = 65535


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> Optional[str]:
    reason = dtype_reason(query.dtype)
    if reason is not None:
        return reason
    if args.attn_mask is not None and args.attn_mask.dtype not in (torch.bool, query.dtype):
        return (f"the cuda attention kernels take a float attn_mask of the query's dtype ({query.dtype}), "
                f"got {args.attn_mask.dtype}")
    head_dim = max(query.shape[-1], value.shape[-1])
    if head_dim > MAX_HEAD_DIM:
        return f"the cuda attention kernels serve head dims up to {MAX_HEAD_DIM}, got {head_dim}"
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


def _writable(target: torch.Tensor, width: int) -> torch.Tensor:
    """Where a kernel writes ``target`` (last dim ``width``): ``target`` itself when it has that
    width and the kernels can address it in chunks, else a contiguous buffer copied into it after."""
    if target.shape[-1] == width and loads_in_chunks(target):
        return target
    return target.new_empty((*target.shape[:-1], width))


def _into(target: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    return target if result is target else target.copy_(result[..., : target.shape[-1]])


def _mask_arguments(args: AttentionArgs) -> tuple:
    """The raw ops' arguments from key_padding_mask to dropout_scale: the key bounds (one launch)
    only past ``KEY_BOUNDS_MIN_LENGTH`` keys (shorter ones, the kernels mask key by key)."""
    padding = args.key_padding_mask
    bounds = None
    if padding is not None and padding.shape[1] >= KEY_BOUNDS_MIN_LENGTH:
        bounds = raw_ops().attention_key_bounds(padding)
    dropout = args.dropout_p > 0.0
    threshold, scale = dropout_threshold(args.dropout_p) if dropout else (0, 1.0)
    seed = args.dropout_seed if dropout else None
    return padding, bounds, args.attn_mask, int(args.causal), args.scale, seed, threshold, scale


def empty_saved(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool):
    """The forward keeps the row log-sum-exps for the backward pass, whether or not one runs."""
    return empty_lse(query)


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool):
    """``out`` and ``lse`` (+inf on rows that see no key) in the layouts of
    :func:`~transformer_kernels.ops.attention.empty_output` and ``empty_lse``."""
    out, lse = empty_output(query, value), empty_lse(query)
    value_in = _padded(value)
    target = out if value_in.shape[-1] == value.shape[-1] else empty_output(query, value_in)
    raw_ops().attention_forward(_padded(query), _padded(key), value_in, *_mask_arguments(args), target, lse)
    return _into(out, target), lse


def backward(grad_out, query, key, value, out, lse, args: AttentionArgs, attn_mask_needs_grad: bool):
    """``dq, dk, dv`` in the layouts of :func:`~transformer_kernels.ops.attention.empty_grads` and
    ``dmask``, the float32 ``[B, Hq, Lq, Lk]`` gradient of the scores when ``attn_mask_needs_grad``
    (else an empty tensor)."""
    grads = empty_grads(query, key, value)
    inputs = [_padded(t) for t in (query, key, value)]
    dq, dk, dv = (_writable(grad, t.shape[-1]) for grad, t in zip(grads, inputs))
    delta = torch.empty_like(lse)  # the kernels' dO . O pre-pass writes it
    grad_scores = None
    if attn_mask_needs_grad:
        # Scores the kernels skip (above the diagonal, outside the key bounds) have dS = 0.
        batch, heads, lq, _ = query.shape
        grad_scores = query.new_zeros((batch, heads, lq, key.shape[2]), dtype=torch.float32)
    raw_ops().attention_backward(
        _padded(grad_out), *inputs, _padded(out), lse, delta, *_mask_arguments(args), dq, dk, dv, grad_scores
    )
    if grad_scores is None:
        grad_scores = query.new_empty(0, dtype=torch.float32)
    return (*(_into(grad, result) for grad, result in zip(grads, (dq, dk, dv))), grad_scores)
