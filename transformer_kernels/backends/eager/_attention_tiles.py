"""The eager attention's tiled flash path: tiles of query rows x key columns run on torch's CPU
flash-attention kernel and merged by their log-sum-exps (see :mod:`.attention` for when it runs)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from ...ops.attention import AttentionArgs, empty_grads, empty_lse, empty_output, key_padding_bounds
from ._attention_common import causal_shift, in_layout, undo_broadcast

__all__ = ["uses_flash_tiles", "plan", "flash_forward", "flash_backward"]

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


def _repeat_kv_heads(tensor: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    group = num_query_heads // tensor.shape[1]
    return tensor if group == 1 else tensor.repeat_interleave(group, dim=1)


def _sum_kv_heads(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    group = grad.shape[1] // num_kv_heads
    return grad if group == 1 else grad.unflatten(1, (num_kv_heads, group)).sum(2)



def _kernel_layout(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU flash kernel reads any strides except along the head dim, which must be 1."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def uses_flash_tiles(query: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> bool:
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




@dataclasses.dataclass
class _Tile:
    """Query rows × key columns of a range of batch elements, run as one kernel call.

    ``causal``: top-left causal inside the tile (row ``i`` of the tile sees
    tile keys ``0..i``).  ``bias``: additive float mask broadcastable to
    ``[batch, heads, rows, keys]`` (``-inf`` = excluded), or None.
    ``may_hide_rows``: whether ``bias`` may exclude every key of a row (it holds
    ``attn_mask`` or key padding; the causal band alone leaves every row its first key).
    """

    batch: slice
    rows: slice
    keys: slice
    causal: bool
    bias: Optional[torch.Tensor]
    may_hide_rows: bool


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
        bias = masks = bias_for(batch, rows, keys)
        if extra_bias is not None:
            bias = extra_bias if bias is None else bias + extra_bias
        return _Tile(batch, rows, keys, causal, bias, masks is not None)

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


def plan(query: torch.Tensor, key: torch.Tensor, args: AttentionArgs) -> list[_Tile]:
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
    shift = causal_shift(args.causal, lq, lk)
    causal_band = None if shift is None else _causal_band(lk, dtype, device)

    mask_bias = None
    if attn_mask is not None:
        mask_bias = undo_broadcast(attn_mask)
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

    bounds = key_padding_bounds(key_padding_mask).tolist()
    ends = [end for _, end, _ in bounds]
    padded_inside = [end > count for _, end, count in bounds]
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
    """Rows of ``tile`` whose every visible key is ``-inf`` in its bias (the kernel returns lse 0 there);
    None where none can be."""
    if not tile.may_hide_rows:
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


def flash_forward(query, key, value, tiles: list[_Tile], scale):
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
        return in_layout(out, out_target), in_layout(lse, lse_target)

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
        return in_layout(torch.cat(outs), out_target), in_layout(torch.cat(lses), lse_target)

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
    return in_layout(out, out_target), in_layout(lse, lse_target)


def flash_backward(grad_out, query, key, value, out, lse, tiles: list[_Tile], scale):
    batch_size, num_heads, lq, _ = query.shape
    targets = empty_grads(query.to("meta"), key.to("meta"), value.to("meta"))  # layouts, as in flash_forward
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
    return tuple(in_layout(grad, target) for grad, target in zip(grads, targets))
