"""Scaled-dot-product attention composed of PyTorch ops: the CPU path.

Two implementations sit behind :func:`forward` / :func:`backward`:

* **Tiled flash path** (CPU, no dropout, equal query/value head dims).  The
  attention is cut into *tiles*, each a rectangle of query rows × key columns
  of a range of sequences, handed to PyTorch's CPU flash-attention kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu``), which returns the
  tile's output and log-sum-exp.  Tiles covering the same rows are merged
  with their log-sum-exps, exactly as FlashAttention merges key blocks.

  - Key padding: keys after a sequence's last non-padding key are cut off.
    When the sequences' lengths differ enough on a large problem, every
    sequence gets its own tiles cut at its own length, so padded keys cost
    nothing; otherwise one set of tiles spans the batch, cut at the longest
    length, with the rest of the padding as an additive ``-inf`` bias
    ``[B, 1, 1, Lk]`` (never ``[B, H, Lq, Lk]``).
  - Causal masks: the kernel computes up to 512 keys as one block, so its own
    causal mask saves nothing there.  The rows with a partial view of the keys
    are cut into blocks of ``_CAUSAL_ROW_BLOCK`` rows, each seeing only the
    keys up to its last row's, with an additive ``-inf`` bias (a view of one
    small band) hiding the triangle inside the block; rows that see every key
    form one dense tile.  Rows that see no key get no tile: output 0,
    log-sum-exp +inf.

  The backward pass re-creates the same tiles and calls the kernel's backward
  with the *merged* output and log-sum-exp, which yields exact per-tile
  gradients (the FlashAttention backward decomposes over key blocks); an
  empty row's +inf log-sum-exp makes its probabilities, hence its gradients,
  exactly 0.

* **Materialized path** (one query row, dropout, different value head dim,
  non-CPU devices, the backward pass whenever the float mask needs a gradient,
  and short calls with one head count that autograd will differentiate, see
  ``_PROBS_MAX_SCORES``): scores materialized by ``bmm`` (one over ``B * H``
  matrices, or one per head that reads ``[B, L, H, D]``-strided inputs in
  place, see :class:`_HeadBatches`), masks as ``-inf``, a softmax that returns
  0 on rows without any key, an explicit dropout keep-mask.  A large batch runs
  in chunks of sequences whose operands are copied to fold (see
  ``_CHUNK_BYTES``), so that each chunk's buffers stay in cache from one op to
  the next.  When autograd will run the
  backward pass (the op's ``needs_backward``), the forward keeps the
  probabilities, as the naive math does, and the backward applies the
  softmax-attention gradient formulas to them; otherwise it keeps nothing.
  The flash path's backward for a float mask's gradient recomputes them from
  the saved log-sum-exp.

The dropout keep-mask is drawn from a ``torch.Generator`` seeded from
``dropout_seed``, so the backward pass regenerates the identical mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from ...ops.attention import AttentionArgs, Causal, empty_grads, empty_lse, empty_output, key_padding_bounds

__all__ = ["unsupported_reason", "empty_saved", "grads_contiguous", "forward", "backward"]

_ATEN = torch.ops.aten
_HAS_CPU_FLASH = hasattr(_ATEN, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    _ATEN, "_scaled_dot_product_flash_attention_for_cpu_backward"
)
_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Cutting every sequence at its own length (one kernel call per sequence) pays when
# the lengths differ by at least _PER_SEQUENCE_MIN_SPREAD keys and a sequence's
# score matrix has at least _PER_SEQUENCE_MIN_SCORES entries; below, one batched
# call with the padding as a bias beats a loop of small calls.
_PER_SEQUENCE_MIN_SPREAD = 128
_PER_SEQUENCE_MIN_SCORES = 64 * 1024
# Rows per block when a causal triangle is cut into blocks (see _segment_tiles): each block
# computes about half a block of hidden scores on its diagonal, and costs one kernel call.
_CAUSAL_ROW_BLOCK = 128
# Up to this many scores per (batch, head), a call that autograd will differentiate, with as many
# key/value heads as query heads, takes the materialized path and keeps its probabilities: the
# backward's four matmuls over B * H matrices beat torch's CPU flash backward, which recomputes
# the scores in five tiny GEMMs per head and zero-fills its gradients.  Measured at 1 thread,
# forward+backward against the naive math (flash -> kept probabilities, in chunks): B128 H8 D64
# on [B, H, L, D]-contiguous inputs (what qkv_projection returns) L16 0.55x -> 1.0-1.1x, L64
# 1.31x -> 1.48x; on [B, L, H, D] views (a projection's output split into heads) L16 0.74x ->
# 1.1-1.4x, L64 1.44x -> 1.38-1.48x; B16 H4 L40 0.73x -> 1.14x; H8 D64 with key padding on
# [B, L, H, D] views, causal: B32 L96 1.03x -> 1.14x, L128 1.04x -> 1.16x (non-causal 1.05x ->
# 1.16x), but B16 L192 1.26x -> 1.21x and L256 3.2x -> 2.1x, where flash skips the hidden half.
_PROBS_MAX_SCORES = 128 * 128
# Up to this many, a call without a backward pass whose operands fold as they are takes the
# materialized path too: torch's CPU flash kernel cuts the queries into blocks of 32 rows and pays
# per block, which the batched matmuls over B * H short score matrices beat.  No-grad forward,
# 1 thread, B128 H8 D64 with key padding, flash time / materialized time, two runs: on
# [B, H, L, D] inputs L16 1.19-1.26, L32 1.00-1.01, L40 1.16; on [B, L, H, D] views, which the
# materialized path copies to fold, L16 0.86-0.93, L32 0.89, L40 1.06: those stay on flash.
_INFERENCE_PROBS_MAX_SCORES = 40 * 40
# The materialized path runs in chunks of sequences of about this many bytes of operands,
# gradients and score-sized buffers (each chunk's operands copied to [B, H, L, D], which folds),
# so that a chunk's buffers stay in cache from one op to the next; one pass over the whole batch
# streams every intermediate through memory (the machine's bandwidth, not its FLOPs, bounds these
# small matmuls).  B128 H8 D64 L16 [B, L, H, D] views, forward+backward, per-round median vs the
# naive math by chunk size: 1 MB 0.79x, 2 MB 0.96x, 4 MB 1.09x, 8 MB 1.03x, whole batch 0.79x.
_CHUNK_BYTES = 4 << 20


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> Optional[str]:
    """The eager backend serves every call the public function accepts."""
    return None


# ----------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------


def _causal_shift(causal: Causal, lq: int, lk: int) -> Optional[int]:
    """``shift`` such that query ``i`` sees key ``j`` iff ``j <= i + shift``; None without causality."""
    if causal == Causal.NONE:
        return None
    return 0 if causal == Causal.TOP_LEFT else lk - lq


def _undo_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Narrow every stride-0 dimension of an ``expand``-ed tensor to size 1 (a view, no copy)."""
    for dim in range(tensor.dim()):
        if tensor.stride(dim) == 0 and tensor.shape[dim] > 1:
            tensor = tensor.narrow(dim, 0, 1)
    return tensor


def _dropout_keep_mask(
    shape: torch.Size, dropout_p: float, dropout_seed: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Bool keep-mask (True = kept) drawn from a generator seeded by ``(seed, offset)``: the same on every call."""
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


def _in_layout(tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``tensor`` with ``target``'s dtype and strides: itself, restrided as a view where only the
    strides of size-1 dimensions differ (they address nothing: one query row, one head), else
    ``target`` filled with a copy (a new tensor laid out like ``target`` when that is a meta
    tensor, which describes the layout without allocating it)."""
    if tensor.dtype == target.dtype:
        if tensor.stride() == target.stride():
            return tensor
        if all(a == b for a, b, size in zip(tensor.stride(), target.stride(), tensor.shape) if size > 1):
            return tensor.as_strided(target.shape, target.stride())
    if target.is_meta:
        target = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype, device=tensor.device)
    return target.copy_(tensor)


def _kernel_layout(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU flash kernel reads any strides except along the head dim, which must be 1."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _uses_flash_tiles(query: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> bool:
    return (
        _HAS_CPU_FLASH
        # One query row (a decoding step): planning and merging tiles costs more than the math path's
        # one small score row (measured 1.7-1.8x faster at 16-128 sequences x 8 heads x 40 keys).
        and query.shape[-2] > 1
        and query.device.type == "cpu"
        and args.dropout_p == 0.0
        # With a causal mask, torch's CPU flash kernel gives NaN rows for a scale of 0 or below.
        and args.scale > 0.0
        and query.shape[-1] == value.shape[-1]
        and query.dtype in _FLASH_DTYPES
    )


# ----------------------------------------------------------------------------
# Tiled flash path
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Tile:
    """Query rows × key columns of a range of batch elements, run as one kernel call.

    ``causal``: top-left causal inside the tile (row ``i`` of the tile sees
    tile keys ``0..i``).  ``bias``: additive float mask broadcastable to
    ``[batch, heads, rows, keys]`` (``-inf`` = excluded), or None.
    """

    batch: slice
    rows: slice
    keys: slice
    causal: bool
    bias: Optional[torch.Tensor]


def _slice_bias(bias: torch.Tensor, batch: slice, rows: slice, keys: slice) -> torch.Tensor:
    """Cut a broadcastable ``[b|1, h|1, Lq|1, Lk]`` bias to one tile, leaving size-1 dims alone."""
    if bias.shape[0] != 1:
        bias = bias[batch]
    if bias.shape[2] != 1:
        bias = bias[:, :, rows]
    return bias[..., keys]


def _slice_bias_or_none(
    bias: Optional[torch.Tensor], batch: slice, rows: slice, keys: slice
) -> Optional[torch.Tensor]:
    return None if bias is None else _slice_bias(bias, batch, rows, keys)


def _causal_band(lk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[_CAUSAL_ROW_BLOCK, Lk + _CAUSAL_ROW_BLOCK]``: ``-inf`` where column ``x > row + Lk``, else 0.

    Every causal block's bias is a view of it (:func:`_causal_bias`), so no block allocates one.
    """
    band = torch.full((_CAUSAL_ROW_BLOCK, lk + _CAUSAL_ROW_BLOCK), float("-inf"), dtype=dtype, device=device)
    return band.triu_(lk + 1)


def _causal_bias(band: torch.Tensor, rows: slice, keys: slice, shift: int) -> torch.Tensor:
    """``[rows, keys]`` bias hiding key ``j > i + shift`` from row ``i`` (``keys`` starts at 0, ``rows`` at
    ``r0 >= -shift``): column ``j`` of the view is column ``j + Lk - r0 - shift`` of ``band``."""
    offset = band.shape[1] - _CAUSAL_ROW_BLOCK - (rows.start + shift)
    return band[: rows.stop - rows.start, offset : offset + keys.stop]


def _segment_tiles(
    batch: slice,
    end: int,
    lq: int,
    shift: Optional[int],
    bias_for: Callable[[slice, slice, slice], Optional[torch.Tensor]],
    causal_band: Optional[torch.Tensor],
) -> list[_Tile]:
    """Tiles for the sequences ``batch``, which attend to keys ``[0, end)``.

    Without causality that is one tile.  With it, row ``i`` sees keys
    ``[0, min(i + shift + 1, end))``: rows before ``first_row`` see none (no
    tile), rows from ``full_row`` on see every key (one dense tile), and the
    rows between are cut into blocks of ``_CAUSAL_ROW_BLOCK`` rows, each
    seeing the keys up to its last row's, with ``causal_bias`` (``-inf`` above
    the diagonal, see :func:`_causal_band`) hiding the triangle inside the block; a block
    that is top-left causal in tile coordinates uses the kernel's own causal
    mask instead.  The kernel computes a block of up to 512 keys whole, so
    without the cut a causal tile would cost as much as a dense one.
    """
    if end <= 0:
        return []

    def tile(rows: slice, keys: slice, causal: bool, extra_bias: Optional[torch.Tensor] = None) -> _Tile:
        bias = bias_for(batch, rows, keys)
        if extra_bias is not None:
            bias = extra_bias if bias is None else bias + extra_bias
        return _Tile(batch, rows, keys, causal, bias)

    if shift is None:
        return [tile(slice(0, lq), slice(0, end), False)]
    first_row = max(0, -shift)
    if first_row >= lq:
        return []
    full_row = max(first_row, min(lq, end - shift - 1))
    if lq - full_row < _CAUSAL_ROW_BLOCK:
        # Too few rows see every key to pay for their own tile: the last block takes them.
        full_row = lq
    tiles = []
    for start in range(first_row, full_row, _CAUSAL_ROW_BLOCK):
        stop = min(start + _CAUSAL_ROW_BLOCK, full_row)
        rows, keys = slice(start, stop), slice(0, min(stop + shift, end))
        if start + shift == 0:
            tiles.append(tile(rows, keys, True))
        elif start + shift + 1 >= end:  # a last block whose rows all see every key
            tiles.append(tile(rows, keys, False))
        else:
            tiles.append(tile(rows, keys, False, _causal_bias(causal_band, rows, keys, shift)))
    if full_row < lq:
        tiles.append(tile(slice(full_row, lq), slice(0, end), False))
    return tiles


def _plan(query: torch.Tensor, key: torch.Tensor, args: AttentionArgs) -> list[_Tile]:
    """Cut the attention into tiles that skip padded keys and rows without keys.

    Sequence ``b`` attends to keys ``[0, end_b)`` (its last non-padding key + 1); padding before that
    end (left padding, holes) goes into an additive bias.  When the ends differ enough on a large
    problem, every sequence gets its own tiles cut at its own end; otherwise the tiles span the
    batch, cut at the longest end, with the shorter sequences' padding in the bias.
    """
    batch_size, _, lq, _ = query.shape
    lk = key.shape[2]
    dtype, device = query.dtype, query.device
    key_padding_mask, attn_mask = args.key_padding_mask, args.attn_mask
    shift = _causal_shift(args.causal, lq, lk)
    causal_band = None if shift is None else _causal_band(lk, dtype, device)

    mask_bias = None
    if attn_mask is not None:
        mask_bias = _undo_broadcast(attn_mask)
        if mask_bias.dtype == torch.bool:
            mask_bias = torch.zeros(mask_bias.shape, dtype=dtype, device=device).masked_fill_(
                ~mask_bias, float("-inf")
            )
        elif mask_bias.dtype != dtype and dtype not in (torch.float16, torch.bfloat16):
            # torch's CPU flash kernel takes a float32 mask with 16-bit inputs, else only the inputs' dtype.
            mask_bias = mask_bias.to(dtype)
    if key_padding_mask is None:
        bias_for = functools.partial(_slice_bias_or_none, mask_bias)
        return _segment_tiles(slice(0, batch_size), lk, lq, shift, bias_for, causal_band)

    ends = [end for _, end in key_padding_bounds(key_padding_mask).tolist()]
    padded_inside = [end > count for end, count in zip(ends, (~key_padding_mask).sum(1).tolist())]
    pad_bias = torch.zeros(batch_size, 1, 1, lk, dtype=dtype, device=device).masked_fill_(
        key_padding_mask[:, None, None, :], float("-inf")
    )

    def bias_for(batch: slice, rows: slice, keys: slice) -> Optional[torch.Tensor]:
        bias = _slice_bias_or_none(mask_bias, batch, rows, keys)
        if any(padded_inside[batch]):
            padding = _slice_bias(pad_bias, batch, rows, keys)
            bias = padding if bias is None else bias + padding
        return bias

    spread = max(ends) - min(ends)
    if batch_size > 1 and spread >= _PER_SEQUENCE_MIN_SPREAD and lq * lk >= _PER_SEQUENCE_MIN_SCORES:
        return [
            tile
            for b in range(batch_size)
            for tile in _segment_tiles(slice(b, b + 1), ends[b], lq, shift, bias_for, causal_band)
        ]
    if spread > 0:
        # One cut at the longest end: the shorter sequences' tails become padding inside the tiles.
        padded_inside = [True] * batch_size
    return _segment_tiles(slice(0, batch_size), max(ends), lq, shift, bias_for, causal_band)


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


def _covers_all_rows(tile: _Tile, batch_size: int, lq: int) -> bool:
    return (tile.batch.start, tile.batch.stop, tile.rows.start, tile.rows.stop) == (0, batch_size, 0, lq)


def _flash_forward(query, key, value, tiles: list[_Tile], scale):
    batch_size, num_heads, lq, _ = query.shape
    value_head_dim = value.shape[-1]
    query = _kernel_layout(query)
    key_x = _kernel_layout(_repeat_kv_heads(key, num_heads))
    value_x = _kernel_layout(_repeat_kv_heads(value, num_heads))
    # The results' layouts, as meta tensors: allocating them where the kernel's results already
    # have those layouts cost fresh pages on every call (1025 page faults per call at B=128, L=16,
    # a fifth of the forward).
    query_meta = query.to("meta")
    out_target, lse_target = empty_output(query_meta, value.to("meta")), empty_lse(query_meta)

    def run(tile: _Tile) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
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
        return tile_out, tile_lse.to(lse_target.dtype), empty if empty is not None and empty.any() else None

    def run_whole(tile: _Tile) -> tuple[torch.Tensor, torch.Tensor]:
        tile_out, tile_lse, empty = run(tile)
        if empty is not None:
            tile_out = tile_out.masked_fill(empty.unsqueeze(-1), 0.0)
            tile_lse = tile_lse.masked_fill(empty, float("inf"))
        return tile_out, tile_lse

    if len(tiles) == 1 and _covers_all_rows(tiles[0], batch_size, lq):
        # One tile for everything: keep the kernel's output, no assembly.
        out, lse = run_whole(tiles[0])
        return _in_layout(out, out_target), _in_layout(lse, lse_target)

    in_order = all(a.batch.stop <= b.batch.start for a, b in zip(tiles, tiles[1:]))
    if in_order and all(tile.rows == slice(0, lq) for tile in tiles):
        # Each tile covers all rows of its sequences (one tile per sequence): concatenate, with
        # zeros for the sequences that attend to nothing.
        outs, lses, covered = [], [], 0
        for tile in tiles:
            if tile.batch.start > covered:
                outs.append(query.new_zeros(tile.batch.start - covered, num_heads, lq, value_head_dim))
                missing = lse_target[covered : tile.batch.start]
                lses.append(torch.full_like(missing, float("inf"), device=query.device))
            tile_out, tile_lse = run_whole(tile)
            outs.append(tile_out)
            lses.append(tile_lse)
            covered = tile.batch.stop
        if covered < batch_size:
            outs.append(query.new_zeros(batch_size - covered, num_heads, lq, value_head_dim))
            lses.append(torch.full_like(lse_target[covered:], float("inf"), device=query.device))
        return _in_layout(torch.cat(outs), out_target), _in_layout(torch.cat(lses), lse_target)

    accumulate_dtype = torch.promote_types(query.dtype, torch.float32)
    out = empty_output(query, value, accumulate_dtype)
    lse = torch.full_like(lse_target, float("-inf"), device=query.device)
    # Tiles either cover the same (batch, rows) region or disjoint ones; the first tile of a region is
    # written, later ones are merged in by their log-sum-exps.
    written = set()
    for tile in tiles:
        tile_out, tile_lse, empty = run(tile)
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
        new_lse = torch.logaddexp(lse_region, tile_lse)
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
    return _in_layout(out, out_target), _in_layout(lse, lse_target)


def _flash_backward(grad_out, query, key, value, out, lse, tiles: list[_Tile], scale):
    batch_size, num_heads, lq, _ = query.shape
    targets = empty_grads(query.to("meta"), key.to("meta"), value.to("meta"))  # layouts, as in _flash_forward
    query_k = _kernel_layout(query)
    key_x = _kernel_layout(_repeat_kv_heads(key, num_heads))
    value_x = _kernel_layout(_repeat_kv_heads(value, num_heads))
    single = (
        len(tiles) == 1 and _covers_all_rows(tiles[0], batch_size, lq) and tiles[0].keys == slice(0, key.shape[2])
    )
    accumulate_dtype = torch.promote_types(query.dtype, torch.float32)
    # Accumulate in the layout of the result when the shapes allow, so that no copy is left at the end.
    grads = [] if single else [
        torch.zeros_like(target, dtype=accumulate_dtype, device=query.device) if target.shape == kernel_input.shape
        else torch.zeros(kernel_input.shape, dtype=accumulate_dtype, device=kernel_input.device)
        for target, kernel_input in zip(targets, (query_k, key_x, value_x))
    ]
    for tile in tiles:
        tile_grads = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out[tile.batch, :, tile.rows],
            query_k[tile.batch, :, tile.rows],
            key_x[tile.batch, :, tile.keys],
            value_x[tile.batch, :, tile.keys],
            out[tile.batch, :, tile.rows],
            lse[tile.batch, :, tile.rows],
            0.0,
            tile.causal,
            attn_mask=tile.bias,
            scale=scale,
        )
        if single:
            # One tile for everything: the kernel's gradients are the gradients.
            grads = list(tile_grads)
            break
        for grad, tile_grad, index in zip(grads, tile_grads, (tile.rows, tile.keys, tile.keys)):
            grad[tile.batch, :, index] += tile_grad
    num_kv_heads = key.shape[1]
    grads[1] = _sum_kv_heads(grads[1], num_kv_heads)
    grads[2] = _sum_kv_heads(grads[2], num_kv_heads)
    return tuple(_in_layout(grad, target) for grad, target in zip(grads, targets))


# ----------------------------------------------------------------------------
# Materialized-probabilities path
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _HeadBatches:
    """How every (batch, head) pair's matmul runs: as one ``bmm`` over ``B * H`` matrices when
    query, key, value and grad_out all fold ``[B, H]`` into one dimension as views (a
    ``[B, H, L, X]``-contiguous layout, or one query row), else as one ``bmm`` per head.

    A ``bmm`` writes in place only into a contiguous output (any other one is filled matrix by
    matrix); so the buffers this path allocates follow the order of its loop: batch-major when
    folded, head-major (``[H, B, rows, cols]`` memory, seen as ``[B, H, rows, cols]``) per head.
    (A ``bmm`` into one head of a ``[B, H, L, L]`` buffer measured 2.8 ms against 0.8 ms into a
    contiguous one, at B=128, H=8, L=16.)  Per-head loops read ``[B, L, H, D]``-strided inputs, the
    layout of a projection's output, in place.
    """

    folded: bool

    @classmethod
    def of(cls, *tensors: torch.Tensor) -> "_HeadBatches":
        heads = tensors[0].shape[1]
        return cls(all(t.shape[1] == heads and _folds(t) for t in tensors))

    def empty(self, batch: int, heads: int, rows: int, cols: int, like: torch.Tensor, dtype: torch.dtype):
        if self.folded:
            return like.new_empty((batch, heads, rows, cols), dtype=dtype)
        return like.new_empty((heads, batch, rows, cols), dtype=dtype).transpose(0, 1)

    def last_dim_op(self, op: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        """``op`` (a softmax or its backward over the last dimension, which returns a contiguous
        result) applied to this layout's buffers as the contiguous tensors they are."""
        if self.folded:
            return op(*tensors)
        return op(*(t.transpose(0, 1) for t in tensors)).transpose(0, 1)

    def matmul(
        self,
        a,
        b,
        alpha: float = 1.0,
        bias: Optional[torch.Tensor] = None,
        heads: Optional[int] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``alpha * a @ b (+ bias)`` for ``a [B, H, rows, k]`` and ``b [B, Hb, k, cols]`` (head ``h``
        of ``a`` with head ``h // (H / Hb)`` of ``b``; ``bias`` broadcastable to the result, ``-inf``
        excluding an entry), as ``[B, heads or H, rows, cols]`` in this layout.  With ``heads`` < H
        (the key/value heads of grouped-query attention), a result head sums its group's products.
        ``out``: a contiguous buffer the folded product is written into (None: a new one).

        Folded, ``torch.matmul`` views ``[B, H]`` as one dimension itself: fewer host-side ops than
        flattening every operand for a ``bmm`` (a decoding step's attention pays per op)."""
        batch_size, num_heads, rows, _ = a.shape
        if self.folded:
            product = torch.matmul(a, b, out=out)
            if alpha != 1.0:
                product.mul_(alpha)
            return product if bias is None else product.add_(bias)
        out = self.empty(batch_size, heads or num_heads, rows, b.shape[-1], a, a.dtype)
        b_group, out_group = num_heads // b.shape[1], num_heads // out.shape[1]
        # Without a bias, one pass scales the whole result: a bmm with alpha measured 1.6x slower.
        head_alpha = 1.0 if bias is None else alpha
        for head in range(num_heads):
            head_bias = None if bias is None else bias[:, head if bias.shape[1] > 1 else 0]
            accumulate = head % out_group > 0
            _baddbmm(a[:, head], b[:, head // b_group], out[:, head // out_group], head_alpha, head_bias, accumulate)
        return out if head_alpha == alpha else out.mul_(alpha)


def _folds(tensor: torch.Tensor) -> bool:
    """Whether ``[B, H, ...]`` flattens to ``[B * H, ...]`` as a view."""
    batch, heads = tensor.shape[:2]
    return heads == 1 or batch == 1 or tensor.stride(0) == heads * tensor.stride(1)


def _small(tensor: torch.Tensor) -> bool:
    """At most ``_CHUNK_BYTES``: a copy costs less than a per-head loop's host time (one query
    row of a decoding step: one copy of ``q`` ran its attention in 37 against 67 us over 4 heads)."""
    return tensor.numel() * tensor.element_size() <= _CHUNK_BYTES


def _whole_call_folds(*tensors: torch.Tensor) -> bool:
    """Whether :meth:`_BatchChunk.operands` hands a whole call's operands over folding: with one
    head count, each folding as it is or copied when :func:`_small` (a larger one is read in
    place per head, where a copy would cost as much memory traffic as the matmul)."""
    heads = tensors[0].shape[1]
    return all(t.shape[1] == heads and (_folds(t) or _small(t)) for t in tensors)


def _baddbmm(a, b, out, alpha: float, bias: Optional[torch.Tensor], accumulate: bool) -> None:
    if accumulate:
        out.baddbmm_(a, b, alpha=alpha)
    elif bias is not None:
        torch.baddbmm(bias, a, b, alpha=alpha, out=out)
    elif alpha != 1.0:
        torch.baddbmm(out, a, b, beta=0.0, alpha=alpha, out=out)
    else:
        torch.bmm(a, b, out=out)


def _excluded_keys(query: torch.Tensor, key: torch.Tensor, args: AttentionArgs) -> Optional[torch.Tensor]:
    """Bool, True where a bool ``attn_mask``, the causal mask or key padding excludes a key, in the
    smallest shape that broadcasts to ``[B, Hq, Lq, Lk]``; None when none applies."""
    lq, lk = query.shape[2], key.shape[2]
    excluded = None
    if args.attn_mask is not None and args.attn_mask.dtype == torch.bool:
        excluded = ~_undo_broadcast(args.attn_mask)
    shift = _causal_shift(args.causal, lq, lk)
    if shift is not None and shift < lk - 1:  # else every row sees every key (a decoding step)
        hidden = torch.ones(lq, lk, dtype=torch.bool, device=query.device).triu_(shift + 1)
        excluded = hidden if excluded is None else excluded | hidden
    if args.key_padding_mask is not None:
        padding = args.key_padding_mask.view(args.key_padding_mask.shape[0], 1, 1, lk)
        excluded = padding if excluded is None else excluded | padding
    return excluded


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` without its host time when the dtype already matches (the usual call)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _scores(query, key, args: AttentionArgs, batches: _HeadBatches) -> tuple[torch.Tensor, bool]:
    """Scaled, masked scores ``[B, Hq, Lq, Lk]`` (``-inf`` where a mask excludes the key) in
    :func:`_compute_dtype`, in ``batches``' layout, and whether any mask applies.  A float mask is
    the matmul's addend; the others fill ``-inf`` in one ``masked_fill_`` (fewer ops than an
    additive bias built from them: a decoding step's attention pays per op)."""
    dtype = _compute_dtype(query.dtype)
    bias = None
    if args.attn_mask is not None and args.attn_mask.dtype != torch.bool:
        bias = _as_dtype(_undo_broadcast(args.attn_mask), dtype)
    scores = batches.matmul(_as_dtype(query, dtype), _as_dtype(key, dtype).transpose(-1, -2), args.scale, bias)
    excluded = _excluded_keys(query, key, args)
    if excluded is not None:
        scores.masked_fill_(excluded, float("-inf"))
    return scores, bias is not None or excluded is not None


def _softmax(scores: torch.Tensor, masked: bool, batches: _HeadBatches) -> torch.Tensor:
    """Softmax over the keys; 0 on rows whose keys are all excluded (``-inf``) when ``masked``.
    (``aten._safe_softmax`` does the same in one op, measured 3x slower than these at a decoding
    step's size.)"""
    probs = batches.last_dim_op(lambda s: torch.softmax(s, -1), scores)
    if masked:
        probs.masked_fill_(torch.isneginf(scores.amax(-1, keepdim=True)), 0.0)
    return probs


def _dropout_scale(shape, args: AttentionArgs, device, dtype) -> torch.Tensor:
    """Per-weight dropout factor ``[B, Hq, Lq, Lk]``: ``1 / (1 - p)`` where kept, 0 where dropped."""
    keep = _dropout_keep_mask(shape, args.dropout_p, args.dropout_seed, device)
    return keep.to(dtype) * (1.0 / (1.0 - args.dropout_p))


class _ChunkBuffers:
    """Chunk-sized buffers, one per use, that every chunk of a call reuses: the operands' folding
    copies and the gradients before they are stored.  (Fresh tensors per chunk ran the seeds'
    backward at B=128, L=16 13% slower: new memory to touch, and more ops per chunk.)"""

    def __init__(self, step: int):
        self.step = step
        self.buffers: dict[str, torch.Tensor] = {}

    def like(self, use: str, chunk: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The buffer for ``use``, shaped as ``chunk`` (contiguous), of ``chunk``'s dtype or ``dtype``."""
        buffer = self.buffers.get(use)
        if buffer is None:
            buffer = chunk.new_empty((self.step, *chunk.shape[1:]), dtype=dtype)
            self.buffers[use] = buffer
        return buffer[: chunk.shape[0]]


@dataclasses.dataclass(frozen=True)
class _BatchChunk:
    """One range of sequences of the materialized path, with the call's masks and dropout factor
    cut to it."""

    batch: Optional[slice]  # None: the whole call
    args: AttentionArgs
    dropout: Optional[torch.Tensor]
    buffers: Optional[_ChunkBuffers] = None  # shared by the call's chunks (None: the whole call)

    def operands(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], _HeadBatches]:
        """The chunk of each ``[B, H, L, X]`` operand, and how their matmuls run.  When their heads
        match they fold (``[B, L, H, X]`` views would take per-head matmuls): a chunk's copied into
        the chunk buffers where they are not contiguous; the whole call's copied where they do not
        fold and are :func:`_small`, else all read in place per head."""
        heads = tensors[0].shape[1]
        if any(t.shape[1] != heads for t in tensors):
            return [self.of(t) for t in tensors], _HeadBatches(False)
        if self.batch is None:
            folds = [_folds(t) for t in tensors]
            if all(folds):
                return list(tensors), _HeadBatches(True)
            if all(f or _small(t) for f, t in zip(folds, tensors)):
                return [t if f else t.contiguous() for f, t in zip(folds, tensors)], _HeadBatches(True)
            return list(tensors), _HeadBatches(False)
        chunks = [t[self.batch] for t in tensors]
        chunks = [t if t.is_contiguous() else self.buffers.like(f"operand{index}", t).copy_(t)
                  for index, t in enumerate(chunks)]
        return chunks, _HeadBatches(True)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.batch is None else tensor[self.batch]

    def destination(self, target: torch.Tensor, use: str, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Where a folded matmul computing in ``dtype`` writes the chunk's part of ``target``: that
        part when it is contiguous and of ``dtype`` (a decoding step's one query row: the output
        itself), else the chunk buffer for ``use``, or for the whole call None, a new tensor
        (:meth:`store` copies either over)."""
        part = target if self.batch is None else target[self.batch]
        if part.is_contiguous() and part.dtype == dtype:
            return part
        return None if self.batch is None else self.buffers.like(use, part, dtype)

    def store(self, result: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``target`` holding ``result``, the chunk's slice of it (unless ``result`` was written in
        place, see :meth:`destination`).  The whole call's result stands in for ``target`` where
        the layouts agree (:func:`_in_layout`)."""
        if self.batch is None:
            return _in_layout(result, target)
        part = target[self.batch]
        if part.data_ptr() != result.data_ptr():
            part.copy_(result)
        return target


def _chunk_size(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Sequences per chunk of the materialized path: about ``_CHUNK_BYTES`` of score-sized buffers
    and, where the operands must be copied to fold, of operands and gradients; the whole batch for
    one query row (a decoding step's one score row per head leaves nothing to keep in cache
    between ops, and a loop would cost host time).  Operands that fold as they are are read once
    per matmul, where a chunk keeps nothing in cache for a later op: they do not count (ConvSeq2Seq's
    decoder attention at B128, L40, one head of 256, forward+backward: 0.95x -> 1.02x the naive
    math, whole rather than in 11 chunks)."""
    batch_size, num_heads, lq, head_dim = query.shape
    if lq == 1:
        return batch_size
    num_kv_heads, lk, value_head_dim = key.shape[1], key.shape[2], value.shape[-1]
    per_sequence = 3 * num_heads * lq * lk
    if not _HeadBatches.of(query, key, value).folded:
        per_sequence += 2 * (head_dim + value_head_dim) * (num_heads * lq + num_kv_heads * lk)
    return max(1, _CHUNK_BYTES // (_compute_dtype(query.dtype).itemsize * per_sequence))


def _runs_in_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the materialized path cuts the batch into several chunks (:func:`_batch_chunks`)."""
    return _chunk_size(query, key, value) < query.shape[0]


def _batch_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, dtype):
    """The materialized path's work cut into ranges of sequences (see ``_CHUNK_BYTES``), each with
    the masks and dropout factor cut to it; one chunk, over the operands as they are, when the
    batch fits."""
    batch_size, num_heads, lq, _ = query.shape
    dropout = None
    if args.dropout_p > 0.0:
        dropout = _dropout_scale((batch_size, num_heads, lq, key.shape[2]), args, query.device, dtype)
    step = _chunk_size(query, key, value)
    if step >= batch_size:
        return [_BatchChunk(None, args, dropout)]
    attn_mask = None if args.attn_mask is None else _undo_broadcast(args.attn_mask)
    buffers = _ChunkBuffers(step)
    chunks = []
    for start in range(0, batch_size, step):
        batch = slice(start, start + step)
        chunk_args = dataclasses.replace(
            args,
            key_padding_mask=None if args.key_padding_mask is None else args.key_padding_mask[batch],
            attn_mask=attn_mask if attn_mask is None or attn_mask.shape[0] == 1 else attn_mask[batch],
        )
        chunks.append(_BatchChunk(batch, chunk_args, None if dropout is None else dropout[batch], buffers))
    return chunks


def _every_row_sees_a_key(lq: int, lk: int, args: AttentionArgs, may_sync: bool) -> bool:
    """Whether no mask can leave a query row without keys, so that its softmax needs no zeroing
    (a reduction over the scores and a fill of the probabilities: 5% of the seeds' B=128, L=16
    forward+backward, 15% of a small model's forward at B=16, L=40, H=4, D=32): no ``attn_mask``
    (unknown without a pass over it), no causal mask hiding every key from the first rows, and each
    sequence keeps a key that its first row sees (row ``i`` sees the keys up to ``i + shift``, so
    every row sees those of row 0).  That last test is a reduction over the padding mask and a host
    sync; without ``may_sync`` (a GPU call in one piece, which CUDA graphs may capture) it is not
    made, and the answer is False."""
    if args.attn_mask is not None:
        return False
    shift = _causal_shift(args.causal, lq, lk)
    if shift is not None and shift < 0:
        return False
    if args.key_padding_mask is None:
        return True
    if not may_sync:
        return False
    seen_by_every_row = lk if shift is None else min(lk, shift + 1)
    return not bool(args.key_padding_mask[:, :seen_by_every_row].all(1).any())


def _probs_forward(query, key, value, args: AttentionArgs, needs_backward: bool):
    """``out`` and, when a backward pass will run, the probabilities (else an empty tensor)."""
    dtype = _compute_dtype(query.dtype)
    out = empty_output(query, value)
    saved = _empty_probs(query, key, value, dtype) if needs_backward else query.new_empty(0, dtype=dtype)
    chunks = _batch_chunks(query, key, value, args, dtype)
    # On a GPU, a call in chunks is long enough for one host sync to cost nothing.
    may_sync = query.device.type == "cpu" or len(chunks) > 1
    zero_empty_rows = not _every_row_sees_a_key(query.shape[2], key.shape[2], args, may_sync)
    for chunk in chunks:
        (q, k, v), batches = chunk.operands(query, key, value)
        scores, masked = _scores(q, k, chunk.args, batches)
        probs = _softmax(scores, masked and zero_empty_rows, batches)
        dropped = probs if chunk.dropout is None else probs * chunk.dropout
        product = batches.matmul(dropped, _as_dtype(v, dtype), out=chunk.destination(out, "out", dtype))
        out = chunk.store(product, out)
        if needs_backward:
            saved = chunk.store(probs, saved)
    return out, saved


def _recomputed_probs(query, key, args: AttentionArgs) -> torch.Tensor:
    """The forward's probabilities again, as the softmax of the scores: not ``exp(S - lse)`` from a
    saved lse, which a row of large scores (a float mask of ``finfo.min`` or ``-1e9`` on every key
    of a row) rounds to its largest score, losing ``log(sum)``: that row's probabilities came out
    ``Lk`` times too large."""
    batches = _HeadBatches.of(query, key)
    scores, masked = _scores(query, key, args, batches)
    return _softmax(scores, masked, batches)


def _probs_backward(grad_out, query, key, value, saved, args: AttentionArgs, attn_mask_needs_grad):
    """Softmax-attention backward on the materialized probabilities ``P`` (``saved`` when it holds
    them, else recomputed as the scores' softmax, see :func:`_recomputed_probs`):
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(P * dP))``, ``dQ = dS K``,
    ``dK = dS^T Q`` (the last two scaled)."""
    dtype = _compute_dtype(query.dtype)
    num_kv_heads = key.shape[1]
    contiguous = grads_contiguous(query, key, value, saved, args, attn_mask_needs_grad)
    grads = list(empty_grads(query, key, value, contiguous))
    dmask = query.new_empty(0, dtype=torch.float32)
    if attn_mask_needs_grad:
        dmask = query.new_empty((*query.shape[:3], key.shape[2]), dtype=dtype)
    for chunk in _batch_chunks(query, key, value, args, dtype):
        operands, batches = chunk.operands(grad_out, query, key, value)
        d_out, q, k, v = (_as_dtype(t, dtype) for t in operands)
        if saved.dim() == 4:
            probs = chunk.of(saved)
        else:
            probs = _recomputed_probs(q, k, chunk.args)
        d_probs = batches.matmul(d_out, v.transpose(-1, -2))
        dropped = probs
        if chunk.dropout is not None:
            dropped = probs * chunk.dropout
            d_probs.mul_(chunk.dropout)
        grad_value = batches.matmul(
            dropped.transpose(-1, -2), d_out, heads=num_kv_heads, out=chunk.destination(grads[2], "grad_value", dtype)
        )
        d_scores = batches.last_dim_op(lambda dp, p: torch._softmax_backward_data(dp, p, -1, dtype), d_probs, probs)
        if attn_mask_needs_grad:
            dmask = chunk.store(d_scores, dmask)
            d_scores = d_scores * args.scale
        else:  # the scale applied once to dS, not to both of its products
            d_scores.mul_(args.scale)
        grad_query = batches.matmul(d_scores, k, out=chunk.destination(grads[0], "grad_query", dtype))
        grad_key = batches.matmul(
            d_scores.transpose(-1, -2), q, heads=num_kv_heads, out=chunk.destination(grads[1], "grad_key", dtype)
        )
        for index, grad in enumerate((grad_query, grad_key, grad_value)):
            grads[index] = chunk.store(grad, grads[index])
    return (*grads, dmask)


# ----------------------------------------------------------------------------
# Backend entry points (signatures shared with the triton backend)
# ----------------------------------------------------------------------------


def empty_saved(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool):
    """What :func:`forward` returns for the backward pass besides ``out``: on the tiled flash path
    (see :func:`_takes_flash_tiles`), the lse (:func:`~transformer_kernels.ops.attention.empty_lse`);
    on the materialized path, the probabilities (float32 or wider, :func:`_empty_probs`), or an
    empty tensor when no backward pass will run."""
    if _takes_flash_tiles(query, key, value, args, needs_backward):
        return empty_lse(query)
    dtype = _compute_dtype(query.dtype)
    return _empty_probs(query, key, value, dtype) if needs_backward else query.new_empty(0, dtype=dtype)


def _empty_probs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The materialized path's probabilities ``[B, Hq, Lq, Lk]``: batch-major where the operands
    fold as :meth:`_BatchChunk.operands` hands them over (always when the batch runs in chunks),
    else head-major, as :class:`_HeadBatches` lays out per-head products."""
    batch_size, num_heads, lq, _ = query.shape
    batches = _HeadBatches(_runs_in_chunks(query, key, value) or _whole_call_folds(query, key, value))
    return batches.empty(batch_size, num_heads, lq, key.shape[2], query, dtype)


def forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` in the layout of :func:`~transformer_kernels.ops.attention.empty_output` and what
    :func:`empty_saved` describes."""
    if _takes_flash_tiles(query, key, value, args, needs_backward):
        return _flash_forward(query, key, value, _plan(query, key, args), args.scale)
    return _probs_forward(query, key, value, args, needs_backward)


def _takes_flash_tiles(query, key, value, args: AttentionArgs, needs_backward: bool) -> bool:
    """Whether the forward runs on the tiled flash path: a call it can serve, unless the call is
    short and its heads match, when the materialized path runs it instead: when autograd will
    differentiate it, keeping its probabilities for the backward pass (see ``_PROBS_MAX_SCORES``),
    else when its operands fold as they are (see ``_INFERENCE_PROBS_MAX_SCORES``)."""
    # The cheap test first: a decoding step's one query row never takes the tiles, and asking how
    # its operands fold cost 3 of its 49 us (greedy decoding of the small preset: 0.97x -> 0.99x).
    if not _uses_flash_tiles(query, value, args):
        return False
    scores = query.shape[2] * key.shape[2]
    if key.shape[1] != query.shape[1]:
        return True
    if needs_backward:
        return scores > _PROBS_MAX_SCORES
    return scores > _INFERENCE_PROBS_MAX_SCORES or not _HeadBatches.of(query, key, value).folded


def _backward_on_flash_tiles(query, value, saved: torch.Tensor, args: AttentionArgs, attn_mask_needs_grad) -> bool:
    """Whether :func:`backward` runs on the tiled flash path: the forward's lse saved, and no mask
    gradient asked for; else it runs on the materialized probabilities."""
    return saved.dim() == 3 and not attn_mask_needs_grad and _uses_flash_tiles(query, value, args)


# Past this magnitude a float32 lse's rounding (3e-5 at 256) shows in the probabilities that the
# flash backward derives from it as exp(S - lse).
_LSE_EXACT_LIMIT = 256.0


def _lse_is_exact(lse: torch.Tensor, args: AttentionArgs) -> bool:
    """Whether the flash backward may derive the probabilities from ``lse``: no float mask (only a
    mask puts scores far from 0: a row of ``finfo.min`` or ``-1e9`` on every key, whose lse has lost
    ``log(sum)``), or every finite lse within ``_LSE_EXACT_LIMIT``; else the backward recomputes
    them on the materialized path.  (torch's flash backends share the flaw; its math is exact.)"""
    if args.attn_mask is None or args.attn_mask.dtype == torch.bool:
        return True
    return bool(lse.nan_to_num(posinf=0.0).abs().amax() <= _LSE_EXACT_LIMIT)


def grads_contiguous(query, key, value, saved: torch.Tensor, args: AttentionArgs, attn_mask_needs_grad) -> bool:
    """Whether :func:`backward`'s ``dq, dk, dv`` are contiguous rather than laid out like their
    inputs: on the materialized path in batch chunks with one head count, whose folded matmuls
    write each chunk's gradients in place there.  Storing them into ``[B, L, H, D]`` inputs'
    layout instead cost a copy of each, 4% of the seeds' backward at B=128, L=16; the
    projection's backward before the attention's copies (or concatenates) them either way."""
    return (
        not _backward_on_flash_tiles(query, value, saved, args, attn_mask_needs_grad)
        and key.shape[1] == query.shape[1]
        and _runs_in_chunks(query, key, value)
    )


def backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    saved: torch.Tensor,
    args: AttentionArgs,
    attn_mask_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` (contiguous where :func:`grads_contiguous` says so, else laid out like their
    inputs) and ``dmask`` (``[B, Hq, Lq, Lk]``, at least float32, when ``attn_mask_needs_grad``,
    else empty).  ``saved`` is what the forward saved (:func:`empty_saved`): the probabilities (4-D), the lse
    (3-D: the flash backward's, or, off that path, the probabilities are computed again), or nothing (an
    empty tensor: computed again)."""
    if _backward_on_flash_tiles(query, value, saved, args, attn_mask_needs_grad) and _lse_is_exact(saved, args):
        tiles = _plan(query, key, args)
        dq, dk, dv = _flash_backward(grad_out, query, key, value, out, saved, tiles, args.scale)
        return dq, dk, dv, query.new_empty(0, dtype=torch.float32)
    return _probs_backward(grad_out, query, key, value, saved, args, attn_mask_needs_grad)
