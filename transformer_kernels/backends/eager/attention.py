"""Scaled-dot-product attention composed of PyTorch ops: the CPU path.

Two implementations sit behind :func:`forward` / :func:`backward`:

* **Tiled flash path** (CPU, no dropout, equal query/value head dims).  The
  attention of every batch element is cut into *tiles*, each a rectangle of
  query rows × key columns handed to PyTorch's CPU flash-attention kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu``), which returns the
  tile's output and log-sum-exp.  Tiles covering the same rows are merged with
  their log-sum-exps, exactly as FlashAttention merges key blocks.  The tiling
  is where the savings come from:

  - key padding: each sequence's keys are cut to its ``key_bounds``, so padded
    keys cost nothing (one segment per batch element when that pays, else one
    segment for the whole batch with the padding as an additive bias);
  - causal masks: the kernel only skips work at 512-key granularity, so the
    causal triangle is cut into a *staircase* of row blocks, each a dense
    rectangle (keys every row of the block sees, no mask) plus a small
    top-left-causal square on the diagonal;
  - rows that see no key at all get no tile; their output is 0 and their
    log-sum-exp is set to +inf.

  The backward pass re-creates the same tiles and calls the kernel's backward
  with the *merged* output and log-sum-exp, which yields exact per-tile
  gradients (the FlashAttention backward decomposes over key blocks); an
  empty row's +inf log-sum-exp makes its probabilities, hence its gradients,
  exactly 0.

* **Math path** (dropout, different value head dim, non-CPU devices, and the
  backward pass whenever the float mask needs a gradient): materialized
  scores, masks as ``-inf``, a softmax that returns 0 on rows without any
  key, an explicit dropout keep-mask; the backward pass recomputes the
  probabilities and applies the softmax-attention gradient formulas.

The dropout keep-mask is drawn from a ``torch.Generator`` seeded from
``dropout_seed``, so the backward pass regenerates the identical mask.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["unsupported_reason", "forward", "backward", "lse_dtype"]

_ATEN = torch.ops.aten
_HAS_CPU_FLASH = hasattr(_ATEN, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    _ATEN, "_scaled_dot_product_flash_attention_for_cpu_backward"
)
_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Row-block height of the causal staircase.  Smaller blocks skip more of the
# masked triangle but make more, smaller kernel calls.
_STAIRCASE_BLOCK = 128


def unsupported_reason(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    dropout_p: float,
) -> Optional[str]:
    """The eager backend serves every call the public function accepts."""
    return None


def lse_dtype(query_dtype: torch.dtype) -> torch.dtype:
    """dtype of the log-sum-exp this backend returns: float64 for float64 queries, else float32."""
    return torch.float64 if query_dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------


def _causal_shift(causal: int, lq: int, lk: int) -> Optional[int]:
    """``shift`` such that query ``i`` sees key ``j`` iff ``j <= i + shift``; None without causality."""
    if causal == 0:
        return None
    return 0 if causal == 1 else lk - lq


def _undo_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Narrow every stride-0 dimension of an ``expand``-ed tensor to size 1 (a view, no copy)."""
    for dim in range(tensor.dim()):
        if tensor.stride(dim) == 0 and tensor.shape[dim] > 1:
            tensor = tensor.narrow(dim, 0, 1)
    return tensor


def _dropout_keep_mask(shape: torch.Size, dropout_p: float, dropout_seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    seed, offset = (int(x) for x in dropout_seed.tolist())
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 0x9E3779B1 + offset) % (2**63))
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


def _repeat_kv_heads(tensor: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    group = num_query_heads // tensor.shape[1]
    return tensor if group == 1 else tensor.repeat_interleave(group, dim=1)


def _sum_kv_heads(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    group = grad.shape[1] // num_kv_heads
    return grad if group == 1 else grad.unflatten(1, (num_kv_heads, group)).sum(2)


def _unit_stride_head_dim(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU flash kernel assumes a unit stride along the head dim (other strides are fine)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _uses_flash_tiles(query: torch.Tensor, value: torch.Tensor, dropout_p: float) -> bool:
    return (
        _HAS_CPU_FLASH
        and query.device.type == "cpu"
        and dropout_p == 0.0
        and query.shape[-1] == value.shape[-1]
        and query.dtype in _FLASH_DTYPES
    )


# ----------------------------------------------------------------------------
# Tiled flash path
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Tile:
    """Query rows × key columns of a range of (reordered) batch elements, run as one kernel call.

    ``causal``: top-left causal inside the tile (row ``i`` of the tile sees
    tile keys ``0..i``).  ``bias``: additive float mask broadcastable to
    ``[batch, heads, rows, keys]`` (``-inf`` = excluded), or None.
    """

    batch: slice
    rows: slice
    keys: slice
    causal: bool
    bias: Optional[torch.Tensor]


@dataclasses.dataclass
class _Plan:
    """Tiles over the batch taken in ``order`` (a permutation, or None for the given order)."""

    order: Optional[torch.Tensor]
    tiles: list[_Tile]


def _slice_bias(bias: torch.Tensor, batch: slice, rows: slice, keys: slice) -> torch.Tensor:
    """Cut a broadcastable ``[b|1, h|1, Lq|1, Lk]`` bias to one tile, leaving size-1 dims alone."""
    if bias.shape[0] != 1:
        bias = bias[batch]
    if bias.shape[2] != 1:
        bias = bias[:, :, rows]
    return bias[..., keys]


def _staircase_block(num_rows: int) -> int:
    """Row-block height: at least _STAIRCASE_BLOCK, at most ~8 blocks, one block for short triangles."""
    if num_rows <= 2 * _STAIRCASE_BLOCK:
        return num_rows
    return max(_STAIRCASE_BLOCK, -(-num_rows // 8))


def _plan(
    query: torch.Tensor,
    key: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    key_bounds: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    causal: int,
) -> _Plan:
    """Cut the attention into tiles that skip padded keys and the hidden part of a causal mask.

    Sequence ``b`` attends to keys ``[0, ends[b])`` (its last non-padding key + 1); padding before
    that end (left padding, holes) goes into an additive bias.  When the ends differ by at least a
    block, the batch is sorted by end (longest first), so that every group of sequences sharing a
    tile geometry is a contiguous batch range and one kernel call serves it.
    """
    batch_size, _, lq, _ = query.shape
    lk = key.shape[2]
    dtype, device = query.dtype, query.device
    shift = _causal_shift(causal, lq, lk)

    mask_bias = None
    if attn_mask is not None:
        mask_bias = _undo_broadcast(attn_mask)
        if mask_bias.dtype == torch.bool:
            mask_bias = torch.zeros(mask_bias.shape, dtype=dtype, device=device).masked_fill_(~mask_bias, float("-inf"))

    first_row = 0 if shift is None else max(0, -shift)
    block = _staircase_block(lq - first_row) if shift is not None else _STAIRCASE_BLOCK
    order = None
    pad_bias = None
    pad_everywhere = False
    if key_padding_mask is None:
        ends = [lk] * batch_size
    else:
        ends = [hi for _, hi in key_bounds.tolist()]
        valid_counts = (~key_padding_mask).sum(1).tolist()
        pad_everywhere = any(end > count for end, count in zip(ends, valid_counts))
        pad_bias = torch.zeros(batch_size, 1, 1, lk, dtype=dtype, device=device).masked_fill_(
            key_padding_mask[:, None, None, :], float("-inf")
        )
        if any(a < b for a, b in zip(ends, ends[1:])):
            if max(ends) - min(ends) >= block:
                permutation = sorted(range(batch_size), key=lambda b: -ends[b])
                order = torch.tensor(permutation, device=device)
                ends = [ends[b] for b in permutation]
                pad_bias = pad_bias.index_select(0, order)
                if mask_bias is not None and mask_bias.shape[0] != 1:
                    mask_bias = mask_bias.index_select(0, order)
            else:
                # Unsorted ends within one block of each other: cut every sequence at the longest end.
                pad_everywhere = True
                ends = [max(ends)] * batch_size

    def tile(batch: slice, rows: slice, keys: slice, is_causal: bool) -> _Tile:
        # ends are non-increasing over the batch range: padding lies inside the tile's keys when the
        # shortest sequence ends before them, or padding sits before some end.
        bias = None if mask_bias is None else _slice_bias(mask_bias, batch, rows, keys)
        if pad_bias is not None and (pad_everywhere or ends[batch.stop - 1] < keys.stop):
            padding = _slice_bias(pad_bias, batch, rows, keys)
            bias = padding if bias is None else bias + padding
        return _Tile(batch, rows, keys, is_causal, bias)

    num_attending = sum(end > 0 for end in ends)  # all-padding sequences (end 0) sort last and get no tile
    tiles: list[_Tile] = []
    if shift is None:
        # Every row sees all of a sequence's keys: one tile per group of sequences ending in the same key block.
        start = 0
        while start < num_attending:
            stop = start + 1
            while stop < num_attending and -(-ends[stop] // block) == -(-ends[start] // block):
                stop += 1
            tiles.append(tile(slice(start, stop), slice(0, lq), slice(0, ends[start]), False))
            start = stop
        return _Plan(order, tiles)

    # Causal: row i of sequence b sees keys [0, min(i + shift + 1, ends[b])).  Rows are cut into blocks;
    # a block's rows all see keys [0, start + shift) (one dense tile) and, on the diagonal, a top-left
    # causal square.  Once a sequence's rows see all of its keys (ends[b] <= start + shift + 1) its
    # remaining rows form one dense tile, shared with the sequences that finish at the same block.
    if first_row >= lq:
        return _Plan(order, tiles)
    in_triangle = num_attending
    for start in range(first_row, lq, block):
        stop = min(start + block, lq)
        still_in_triangle = sum(end > start + shift + 1 for end in ends[:in_triangle])
        if still_in_triangle < in_triangle:
            finished = slice(still_in_triangle, in_triangle)
            tiles.append(tile(finished, slice(start, lq), slice(0, ends[still_in_triangle]), False))
        in_triangle = still_in_triangle
        if in_triangle == 0:
            break
        rows, batch = slice(start, stop), slice(0, in_triangle)
        if start + shift > 0:
            tiles.append(tile(batch, rows, slice(0, start + shift), False))
        tiles.append(tile(batch, rows, slice(start + shift, min(stop + shift, ends[0])), True))
    return _Plan(order, tiles)


def _rows_without_keys(tile: _Tile) -> Optional[torch.Tensor]:
    """Rows of ``tile`` whose every visible key is ``-inf`` in its bias (the kernel returns lse 0 there)."""
    if tile.bias is None:
        return None
    visible = ~torch.isneginf(tile.bias)
    if not tile.causal:
        return ~visible.any(-1)
    num_rows = tile.rows.stop - tile.rows.start
    num_keys = visible.shape[-1]
    key_index = torch.arange(num_keys, device=visible.device)
    first_visible = torch.where(visible, key_index, num_keys).amin(-1)
    row_index = torch.arange(num_rows, device=visible.device)
    return first_visible > row_index


def _in_order(tensor: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    return tensor if order is None else tensor.index_select(0, order)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _flash_forward(query, key, value, plan: _Plan, scale):
    batch_size, num_heads, lq, _ = query.shape
    query = _unit_stride_head_dim(_in_order(query, plan.order))
    key_x = _unit_stride_head_dim(_repeat_kv_heads(_in_order(key, plan.order), num_heads))
    value_x = _unit_stride_head_dim(_repeat_kv_heads(_in_order(value, plan.order), num_heads))
    accumulate_dtype = torch.promote_types(query.dtype, torch.float32)
    out = torch.empty(batch_size, num_heads, lq, value.shape[-1], dtype=accumulate_dtype, device=query.device)
    lse = torch.full((batch_size, num_heads, lq), float("-inf"), dtype=lse_dtype(query.dtype), device=query.device)
    # Tiles either cover the same (batch, rows) region or disjoint ones; the first tile of a region is
    # written, later ones are merged in by their log-sum-exps.
    written = set()
    for tile in plan.tiles:
        tile_out, tile_lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(
            query[tile.batch, :, tile.rows],
            key_x[tile.batch, :, tile.keys],
            value_x[tile.batch, :, tile.keys],
            0.0,
            tile.causal,
            attn_mask=tile.bias,
            scale=scale,
        )
        empty = _rows_without_keys(tile)
        if empty is not None:
            tile_lse = tile_lse.masked_fill(empty, float("-inf"))
        region = (tile.batch.start, tile.batch.stop, tile.rows.start, tile.rows.stop)
        out_region = out[tile.batch, :, tile.rows]
        lse_region = lse[tile.batch, :, tile.rows]
        if region not in written:
            written.add(region)
            out_region.copy_(tile_out)
            lse_region.copy_(tile_lse)
            continue
        new_lse = torch.logaddexp(lse_region, tile_lse.to(lse.dtype))
        # Rows still without any key keep -inf; subtracting 0 there keeps both weights at exp(-inf) = 0.
        reference = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
        old_weight = torch.exp(lse_region - reference).unsqueeze(-1).to(accumulate_dtype)
        tile_weight = torch.exp(tile_lse - reference).unsqueeze(-1).to(accumulate_dtype)
        out_region.mul_(old_weight).addcmul_(tile_out, tile_weight)
        lse_region.copy_(new_lse)
    empty = torch.isneginf(lse)
    if empty.any():
        out.masked_fill_(empty.unsqueeze(-1), 0.0)
        lse.masked_fill_(empty, float("inf"))
    out = out.to(query.dtype)
    if plan.order is not None:
        inverse = _inverse(plan.order)
        out, lse = out.index_select(0, inverse), lse.index_select(0, inverse)
    return out, lse


def _flash_backward(grad_out, query, key, value, out, lse, plan: _Plan, scale):
    num_heads = query.shape[1]
    order = plan.order
    grad_out, out, lse = _in_order(grad_out, order), _in_order(out, order), _in_order(lse, order)
    query = _unit_stride_head_dim(_in_order(query, order))
    key_x = _unit_stride_head_dim(_repeat_kv_heads(_in_order(key, order), num_heads))
    value_x = _unit_stride_head_dim(_repeat_kv_heads(_in_order(value, order), num_heads))
    accumulate_dtype = torch.promote_types(query.dtype, torch.float32)
    grad_query = torch.zeros(query.shape, dtype=accumulate_dtype, device=query.device)
    grad_key = torch.zeros(key_x.shape, dtype=accumulate_dtype, device=query.device)
    grad_value = torch.zeros(value_x.shape, dtype=accumulate_dtype, device=query.device)
    kernel_lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    for tile in plan.tiles:
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out[tile.batch, :, tile.rows],
            query[tile.batch, :, tile.rows],
            key_x[tile.batch, :, tile.keys],
            value_x[tile.batch, :, tile.keys],
            out[tile.batch, :, tile.rows],
            lse[tile.batch, :, tile.rows].to(kernel_lse_dtype),
            0.0,
            tile.causal,
            attn_mask=tile.bias,
            scale=scale,
        )
        grad_query[tile.batch, :, tile.rows] += dq
        grad_key[tile.batch, :, tile.keys] += dk
        grad_value[tile.batch, :, tile.keys] += dv
    num_kv_heads = key.shape[1]
    grad_key = _sum_kv_heads(grad_key, num_kv_heads)
    grad_value = _sum_kv_heads(grad_value, num_kv_heads)
    if order is not None:
        inverse = _inverse(order)
        grad_query, grad_key, grad_value = (g.index_select(0, inverse) for g in (grad_query, grad_key, grad_value))
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


# ----------------------------------------------------------------------------
# Math path
# ----------------------------------------------------------------------------


def _math_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    causal: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialized softmax probabilities ``[B, Hk, G, Lq, Lk]`` and lse ``[B, Hq, Lq]`` (+inf on rows
    without keys, whose probabilities are 0), in float32 or wider.

    Grouped-query heads are handled as ``[B, Hk, G, ...]`` so keys and values are never copied.
    """
    batch_size, num_heads, lq, _ = query.shape
    num_kv_heads, lk = key.shape[1], key.shape[2]
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    q = query.to(compute_dtype).unflatten(1, (num_kv_heads, num_heads // num_kv_heads))
    k = key.to(compute_dtype).unsqueeze(2)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)

    excluded = None
    if attn_mask is not None:
        mask = attn_mask.unflatten(1, q.shape[1:3])
        if mask.dtype == torch.bool:
            excluded = ~mask
        else:
            scores += mask
    shift = _causal_shift(causal, lq, lk)
    if shift is not None:
        row_index = torch.arange(lq, device=query.device)[:, None]
        key_index = torch.arange(lk, device=query.device)[None, :]
        hidden = key_index > row_index + shift
        excluded = hidden if excluded is None else excluded | hidden
    if key_padding_mask is not None:
        padding = key_padding_mask[:, None, None, None, :]
        excluded = padding if excluded is None else excluded | padding
    if excluded is not None:
        scores.masked_fill_(excluded, float("-inf"))

    empty = torch.isneginf(scores).all(-1, keepdim=True)
    scores.masked_fill_(empty, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill_(empty.squeeze(-1), float("inf"))
    probs = torch.softmax(scores, -1).masked_fill_(empty, 0.0)
    return probs, lse.flatten(1, 2)


def _dropout_scale(probs_shape, dropout_p, dropout_seed, device, dtype) -> torch.Tensor:
    """Per-weight dropout factor: ``1 / (1 - p)`` where kept, 0 where dropped, shaped like the probabilities."""
    batch_size, num_kv_heads, group, lq, lk = probs_shape
    keep = _dropout_keep_mask((batch_size, num_kv_heads * group, lq, lk), dropout_p, dropout_seed, device)
    return (keep.to(dtype) * (1.0 / (1.0 - dropout_p))).unflatten(1, (num_kv_heads, group))


def _math_forward(query, key, value, key_padding_mask, attn_mask, causal, scale, dropout_p, dropout_seed):
    probs, lse = _math_probs(query, key, key_padding_mask, attn_mask, causal, scale)
    if dropout_p > 0.0:
        probs = probs * _dropout_scale(probs.shape, dropout_p, dropout_seed, query.device, probs.dtype)
    out = torch.matmul(probs, value.to(probs.dtype).unsqueeze(2)).flatten(1, 2)
    return out.to(query.dtype), lse.to(lse_dtype(query.dtype))


def _math_backward(
    grad_out, query, key, value, key_padding_mask, attn_mask, causal, scale, dropout_p, dropout_seed, attn_mask_needs_grad
):
    """Softmax-attention backward on materialized probabilities: dS = P * (dP - rowsum(P * dP))."""
    probs, _ = _math_probs(query, key, key_padding_mask, attn_mask, causal, scale)
    compute_dtype = probs.dtype
    group_shape = probs.shape[1:3]
    q = query.to(compute_dtype).unflatten(1, group_shape)
    k = key.to(compute_dtype).unsqueeze(2)
    v = value.to(compute_dtype).unsqueeze(2)
    d_out = grad_out.to(compute_dtype).unflatten(1, group_shape)

    dropped = probs
    d_probs = torch.matmul(d_out, v.transpose(-1, -2))
    if dropout_p > 0.0:
        factor = _dropout_scale(probs.shape, dropout_p, dropout_seed, query.device, compute_dtype)
        dropped = probs * factor
        d_probs = d_probs * factor
    grad_value = torch.matmul(dropped.transpose(-1, -2), d_out).sum(2)
    d_scores = probs * (d_probs - (probs * d_probs).sum(-1, keepdim=True))
    grad_query = torch.matmul(d_scores, k).mul_(scale).flatten(1, 2)
    grad_key = torch.matmul(d_scores.transpose(-1, -2), q).mul_(scale).sum(2)
    dmask = d_scores.flatten(1, 2) if attn_mask_needs_grad else query.new_empty(0, dtype=torch.float32)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), dmask


# ----------------------------------------------------------------------------
# Backend entry points (signatures shared with the triton backend)
# ----------------------------------------------------------------------------


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    key_bounds: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    causal: int,
    scale: float,
    dropout_p: float,
    dropout_seed: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out`` ``[B, Hq, Lq, Dv]`` (contiguous, query's dtype) and ``lse`` ``[B, Hq, Lq]``.

    ``lse`` is float32 (float64 for float64 queries), natural-log, +inf on
    rows that see no key.
    """
    if _uses_flash_tiles(query, value, dropout_p):
        plan = _plan(query, key, key_padding_mask, key_bounds, attn_mask, causal)
        out, lse = _flash_forward(query, key, value, plan, scale)
    else:
        out, lse = _math_forward(
            query, key, value, key_padding_mask, attn_mask, causal, scale, dropout_p, dropout_seed
        )
    return out.contiguous(), lse


def backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    key_bounds: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    causal: int,
    scale: float,
    dropout_p: float,
    dropout_seed: Optional[torch.Tensor],
    attn_mask_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``dq, dk, dv`` and ``dmask`` (``[B, Hq, Lq, Lk]`` in the float mask's dtype promoted
    to at least float32 when ``attn_mask_needs_grad``, else an empty tensor)."""
    if not attn_mask_needs_grad and _uses_flash_tiles(query, value, dropout_p):
        plan = _plan(query, key, key_padding_mask, key_bounds, attn_mask, causal)
        dq, dk, dv = _flash_backward(grad_out, query, key, value, out, lse, plan, scale)
        return dq, dk, dv, query.new_empty(0, dtype=torch.float32)

    return _math_backward(
        grad_out, query, key, value, key_padding_mask, attn_mask, causal, scale, dropout_p, dropout_seed,
        attn_mask_needs_grad,
    )
