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
    are cut into blocks of ``_attention_tiles._CAUSAL_ROW_BLOCK`` rows, each
    seeing only the keys up to its last row's, with an additive ``-inf`` bias
    (a view of one small band) hiding the triangle inside the block; rows that
    see every key form one dense tile.  Rows that see no key get no tile: output 0,
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
  place, see :class:`._attention_probs.HeadBatches`), masks as ``-inf``, a softmax that returns
  0 on rows without any key, an explicit dropout keep-mask.  A large batch runs
  in chunks of sequences whose operands are copied to fold (see
  ``_attention_probs._CHUNK_BYTES_PER_THREAD``), so that each chunk's buffers stay in
  cache from one op to the next.  When autograd will run the
  backward pass (the op's ``needs_backward``), the forward keeps the
  probabilities, as the naive math does, and the backward applies the
  softmax-attention gradient formulas to them; otherwise it keeps nothing.
  The flash path's backward for a float mask's gradient recomputes them from
  the saved log-sum-exp.

The dropout keep-mask is drawn from a ``torch.Generator`` seeded from
``dropout_seed``, so the backward pass regenerates the identical mask.

This module chooses the path per call and holds the backend's entry points;
the tiled path is :mod:`._attention_tiles`, the materialized one
:mod:`._attention_probs`, and what both use :mod:`._attention_common`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.attention import AttentionArgs, empty_lse
from ._attention_probs import (
    HeadBatches, compute_dtype, empty_saved_probs, holds_operands, probs_backward, probs_forward, runs_in_chunks,
)
from ._attention_tiles import flash_backward, flash_forward, plan, uses_flash_tiles

__all__ = ["unsupported_reason", "empty_saved", "grads_contiguous", "forward", "backward"]

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
# materialized path copies to fold, L16 0.86-0.93, L32 0.89, L40 1.06: those stay on flash at one
# thread.  With more, they go to the materialized path too, whose batched ops use every thread where
# the flash kernel's blocks of a short call did not: at 2 threads, L16 views, against the naive
# math, flash 0.67x (slower than at 1 thread), materialized 0.97x.
_INFERENCE_PROBS_MAX_SCORES = 40 * 40


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> Optional[str]:
    """The eager backend serves every call the public function accepts."""
    return None



# ----------------------------------------------------------------------------
# Backend entry points (signatures shared with the triton backend)
# ----------------------------------------------------------------------------


def empty_saved(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool):
    """What :func:`forward` returns for the backward pass besides ``out``: an empty tensor when no
    backward pass will run (whichever path: so that a traced inference call's shapes do not depend
    on the sizes that choose it, and an export with a dynamic length holds for every length); else
    on the tiled flash path (see :func:`_takes_flash_tiles`) the lse
    (:func:`~transformer_kernels.ops.attention.empty_lse`), and on the materialized path the
    probabilities (float32 or wider) and where they are kept the folded operands
    (:func:`._attention_probs.empty_saved_probs`)."""
    if not needs_backward:
        return query.new_empty(0, dtype=compute_dtype(query.dtype))
    if _takes_flash_tiles(query, key, value, args, needs_backward):
        return empty_lse(query)
    return empty_saved_probs(query, key, value, compute_dtype(query.dtype))


def forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` in the layout of :func:`~transformer_kernels.ops.attention.empty_output` and what
    :func:`empty_saved` describes."""
    if not _takes_flash_tiles(query, key, value, args, needs_backward):
        return probs_forward(query, key, value, args, needs_backward)
    out, lse = flash_forward(query, key, value, plan(query, key, args), args.scale)
    return out, lse if needs_backward else empty_saved(query, key, value, args, needs_backward)


def _takes_flash_tiles(query, key, value, args: AttentionArgs, needs_backward: bool) -> bool:
    """Whether the forward runs on the tiled flash path: a call it can serve, unless the call is
    short and its heads match, when the materialized path runs it instead: when autograd will
    differentiate it, keeping its probabilities for the backward pass (see ``_PROBS_MAX_SCORES``),
    else when its operands fold as they are or torch runs more than one thread (see
    ``_INFERENCE_PROBS_MAX_SCORES``)."""
    # The cheap test first: a decoding step's one query row never takes the tiles, and asking how
    # its operands fold cost 3 of its 49 us (greedy decoding of the small preset: 0.97x -> 0.99x).
    if not uses_flash_tiles(query, value, args):
        return False
    scores = query.shape[2] * key.shape[2]
    if key.shape[1] != query.shape[1]:
        return True
    if needs_backward:
        return scores > _PROBS_MAX_SCORES
    if scores > _INFERENCE_PROBS_MAX_SCORES:
        return True
    return torch.get_num_threads() == 1 and not HeadBatches.of(query, key, value).folded


def _backward_on_flash_tiles(query, value, saved: torch.Tensor, args: AttentionArgs, attn_mask_needs_grad) -> bool:
    """Whether :func:`backward` runs on the tiled flash path: the forward's lse saved, and no mask
    gradient asked for; else it runs on the materialized probabilities."""
    return saved.dim() == 3 and not attn_mask_needs_grad and uses_flash_tiles(query, value, args)


# Past this magnitude a float32 lse's rounding (3e-5 at 256) shows in the probabilities that the
# flash backward derives from it as exp(S - lse).
_LSE_EXACT_LIMIT = 256.0


def _lse_is_exact(lse: torch.Tensor) -> bool:
    """Whether the flash backward may derive the probabilities from ``lse``: every finite lse within
    ``_LSE_EXACT_LIMIT``; else the backward recomputes them on the materialized path.  Scores far
    from 0 put it past: a float mask's row of ``finfo.min`` or ``-1e9`` on every key, whose lse has
    lost ``log(sum)`` (its probabilities came out ``Lk`` times too large), or large logits (scores
    of 5e4 erred 50x torch's math in dq, and of 1e30 gave NaN).  torch's CPU flash kernel shares
    the flaw; its math is exact.  One reduction of ``[B, Hq, Lq]`` against the backward's GEMMs."""
    return bool(lse.nan_to_num(posinf=0.0).abs().amax() <= _LSE_EXACT_LIMIT)


def grads_contiguous(query, key, value, saved: torch.Tensor, args: AttentionArgs, attn_mask_needs_grad) -> bool:
    """Whether :func:`backward`'s ``dq, dk, dv`` are contiguous rather than laid out like their
    inputs: on the materialized path with one head count, in batch chunks or on the folded
    operands its forward kept, whose folded matmuls write the gradients in place there.  Storing
    them into ``[B, L, H, D]`` inputs' layout instead cost a copy of each, 4% of the seeds'
    backward at B=128, L=16; the projection's backward before the attention's copies (or
    concatenates) them either way."""
    return (
        not _backward_on_flash_tiles(query, value, saved, args, attn_mask_needs_grad)
        and key.shape[1] == query.shape[1]
        and (runs_in_chunks(query, key, value) or holds_operands(saved))
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
    else empty).  ``saved`` is what the forward saved (:func:`empty_saved`): the probabilities (4-D), or
    with the folded operands (one flat buffer), the lse (3-D: the flash backward's, or, off that path,
    the probabilities are computed again), or nothing (an empty tensor: computed again)."""
    if _backward_on_flash_tiles(query, value, saved, args, attn_mask_needs_grad) and _lse_is_exact(saved):
        tiles = plan(query, key, args)
        dq, dk, dv = flash_backward(grad_out, query, key, value, out, saved, tiles, args.scale)
        return dq, dk, dv, query.new_empty(0, dtype=torch.float32)
    contiguous = grads_contiguous(query, key, value, saved, args, attn_mask_needs_grad)
    return probs_backward(grad_out, query, key, value, saved, args, attn_mask_needs_grad, contiguous)
