"""The eager attention's materialized path: scores by batched matmuls, masks as ``-inf``, a softmax
that gives 0 on rows without keys, the probabilities kept for the backward pass, in chunks of
sequences that stay in cache (see :mod:`.attention` for when it runs)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ...ops.attention import AttentionArgs, empty_grads, empty_output
from ._attention_common import causal_shift, in_layout, undo_broadcast

__all__ = ["HeadBatches", "compute_dtype", "empty_saved_probs", "holds_operands", "runs_in_chunks", "probs_forward",
           "probs_backward"]

# The materialized path runs in chunks of sequences of about this many bytes of operands,
# gradients and score-sized buffers (each chunk's operands copied to [B, H, L, D], which folds),
# so that a chunk's buffers stay in cache from one op to the next; one pass over the whole batch
# streams every intermediate through memory (the machine's bandwidth, not its FLOPs, bounds these
# small matmuls).  B128 H8 D64 L16 [B, L, H, D] views, forward+backward, per-round median vs the
# naive math by chunk size: 1 MB 0.79x, 2 MB 0.96x, 4 MB 1.09x, 8 MB 1.03x, whole batch 0.79x.
# The copies are what let a chunk's matmuls read from cache.  A backward takes the copies its
# forward kept (keeps_operands) rather than copying the operands again, and, as they fold, in chunks
# that count the score-sized buffers alone (the whole batch at L16): B128 H8 D64 L16, the backward
# against the naive math's, 0.80x copying each chunk's operands again, 0.90x reading the kept ones
# in the forward's chunks, 0.995x in one piece.
# Those were one thread's: a chunk holds this much per torch thread, each thread's share in its
# core's cache, and the ops of a chunk then have work for every thread (at 2 threads a 4 MB chunk
# held the second one idle much of the time: B128 H8 D64 [B, L, H, D] views with key padding,
# forward+backward vs the naive math, 4 MB -> 8 MB: L16 0.88x -> 0.97x, L64 1.19x -> 1.27x).
_CHUNK_BYTES_PER_THREAD = 4 << 20


def _chunk_bytes() -> int:
    return _CHUNK_BYTES_PER_THREAD * torch.get_num_threads()


def _dropout_keep_mask(
    shape: torch.Size, dropout_p: float, dropout_seed: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Bool keep-mask (True = kept) drawn from a generator seeded by ``(seed, offset)``: the same on every call."""
    seed, offset = (int(x) for x in dropout_seed.tolist())
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 0x9E3779B1 + offset) % (2**63))
    return torch.rand(shape, generator=generator, device=device) >= dropout_p




@dataclasses.dataclass(frozen=True)
class HeadBatches:
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
    def of(cls, *tensors: torch.Tensor) -> "HeadBatches":
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

        Folded, one ``bmm`` over the ``[B * H]``-flattened views, scaled by ``baddbmm``'s alpha: at a
        decoding step's size (B16 H4, one query row, 20 keys, 1 thread) the scores took 11 us against
        14 us as ``torch.matmul`` on the 4-D operands, whose reshapes cost more host time than the
        views, then ``mul_``; the seeds' B128 H8 L16 level or faster, at 1 and 2 threads."""
        batch_size, num_heads, rows, _ = a.shape
        if self.folded:
            if out is None:
                out = a.new_empty((batch_size, num_heads, rows, b.shape[-1]))
            flat_out = out.view(batch_size * num_heads, rows, b.shape[-1])
            if alpha != 1.0:
                torch.baddbmm(flat_out, a.flatten(0, 1), b.flatten(0, 1), beta=0.0, alpha=alpha, out=flat_out)
            else:
                torch.bmm(a.flatten(0, 1), b.flatten(0, 1), out=flat_out)
            return out if bias is None else out.add_(bias)
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
    """At most a chunk's bytes: a copy costs less than a per-head loop's host time (one query
    row of a decoding step: one copy of ``q`` ran its attention in 37 against 67 us over 4 heads)."""
    return tensor.numel() * tensor.element_size() <= _chunk_bytes()


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
        excluded = ~undo_broadcast(args.attn_mask)
    shift = causal_shift(args.causal, lq, lk)
    if shift is not None and shift < lk - 1:  # else every row sees every key (a decoding step)
        hidden = torch.ones(lq, lk, dtype=torch.bool, device=query.device).triu_(shift + 1)
        excluded = hidden if excluded is None else excluded | hidden
    if args.key_padding_mask is not None:
        padding = args.key_padding_mask.view(args.key_padding_mask.shape[0], 1, 1, lk)
        excluded = padding if excluded is None else excluded | padding
    return excluded


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` without its host time when the dtype already matches (the usual call)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _scores(query, key, args: AttentionArgs, batches: HeadBatches) -> tuple[torch.Tensor, bool]:
    """Scaled, masked scores ``[B, Hq, Lq, Lk]`` (``-inf`` where a mask excludes the key) in
    :func:`compute_dtype`, in ``batches``' layout, and whether any mask applies.  A float mask is
    the matmul's addend; the others fill ``-inf`` in one ``masked_fill_`` (fewer ops than an
    additive bias built from them: a decoding step's attention pays per op)."""
    dtype = compute_dtype(query.dtype)
    bias = None
    if args.attn_mask is not None and args.attn_mask.dtype != torch.bool:
        bias = _as_dtype(undo_broadcast(args.attn_mask), dtype)
    scores = batches.matmul(_as_dtype(query, dtype), _as_dtype(key, dtype).transpose(-1, -2), args.scale, bias)
    excluded = _excluded_keys(query, key, args)
    if excluded is not None:
        scores.masked_fill_(excluded, float("-inf"))
    return scores, bias is not None or excluded is not None


def _softmax(scores: torch.Tensor, masked: bool, batches: HeadBatches) -> torch.Tensor:
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

    def operands(self, *tensors: torch.Tensor, into: Optional[Sequence[torch.Tensor]] = None
                 ) -> tuple[list[torch.Tensor], HeadBatches]:
        """The chunk of each ``[B, H, L, X]`` operand, and how their matmuls run.  When their heads
        match they fold (``[B, L, H, X]`` views would take per-head matmuls): a chunk's copied into
        the chunk buffers where they are not contiguous; the whole call's copied where they do not
        fold and are :func:`_small`, else all read in place per head.  ``into``: contiguous
        whole-call tensors, one per operand, that take the copies instead (the forward's kept for
        the backward pass, see :func:`keeps_operands`)."""
        heads = tensors[0].shape[1]
        if any(t.shape[1] != heads for t in tensors):
            return [self.of(t) for t in tensors], HeadBatches(False)
        if self.batch is None:
            folds = [_folds(t) for t in tensors]
            if all(folds):
                return list(tensors), HeadBatches(True)
            if all(f or _small(t) for f, t in zip(folds, tensors)):
                return [t if f else self._folded_copy(index, t, into)
                        for index, (f, t) in enumerate(zip(folds, tensors))], HeadBatches(True)
            return list(tensors), HeadBatches(False)
        chunks = [t[self.batch] for t in tensors]
        return [t if t.is_contiguous() else self._folded_copy(index, t, into)
                for index, t in enumerate(chunks)], HeadBatches(True)

    def _folded_copy(self, index: int, part: torch.Tensor, into: Optional[Sequence[torch.Tensor]]) -> torch.Tensor:
        """A contiguous copy of operand ``index``'s ``part`` (this chunk's, or the whole call's): in
        ``into[index]`` (its part of it) where given, else in the chunk buffer, or a new tensor for
        the whole call."""
        if into is not None:
            return (into[index] if self.batch is None else into[index][self.batch]).copy_(part)
        return part.contiguous() if self.batch is None else self.buffers.like(f"operand{index}", part).copy_(part)

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
        the layouts agree (:func:`in_layout`)."""
        if self.batch is None:
            return in_layout(result, target)
        part = target[self.batch]
        if part.data_ptr() != result.data_ptr():
            part.copy_(result)
        return target


def _chunk_size(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, needs_backward: bool) -> int:
    """Sequences per chunk of the materialized path: about a chunk's bytes of score-sized buffers
    (with a backward pass three: the probabilities and the gradients of probabilities and scores;
    without one two: scores and probabilities) and, where the operands must be copied to fold, of
    operands and, with a backward pass, their gradients; the whole batch for one query row (a
    decoding step's one score row per head leaves nothing to keep in cache between ops, and a loop
    would cost host time).  A forward without a backward pass counts only the buffers it has (B128
    H8 D64 [B, L, H, D] views with key padding, 2 threads, against the naive math: L16 0.97-1.03x
    -> 0.99-1.07x over four runs, L32 1.31x -> 1.36x, L40 1.31x -> 1.39x, where it counted those of
    a backward pass).  Operands that fold as they are are read once per matmul, where a chunk keeps
    nothing in cache for a later op: they do not count (ConvSeq2Seq's decoder attention at B128,
    L40, one head of 256, forward+backward: 0.95x -> 1.02x the naive math, whole rather than in 11
    chunks)."""
    batch_size, num_heads, lq, head_dim = query.shape
    if lq == 1:
        return batch_size
    num_kv_heads, lk, value_head_dim = key.shape[1], key.shape[2], value.shape[-1]
    per_sequence = (3 if needs_backward else 2) * num_heads * lq * lk
    if not HeadBatches.of(query, key, value).folded:
        copies = 2 if needs_backward else 1
        per_sequence += copies * (head_dim + value_head_dim) * (num_heads * lq + num_kv_heads * lk)
    return max(1, _chunk_bytes() // (compute_dtype(query.dtype).itemsize * per_sequence))


def runs_in_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the materialized path cuts the batch of a call with a backward pass into several
    chunks (:func:`_batch_chunks`)."""
    return _chunk_size(query, key, value, needs_backward=True) < query.shape[0]


def _batch_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, dtype,
                  needs_backward: bool):
    """The materialized path's work cut into ranges of sequences (see ``_CHUNK_BYTES_PER_THREAD``),
    each with the masks and dropout factor cut to it; one chunk, over the operands as they are, when
    the batch fits."""
    batch_size, num_heads, lq, _ = query.shape
    dropout = None
    if args.dropout_p > 0.0:
        dropout = _dropout_scale((batch_size, num_heads, lq, key.shape[2]), args, query.device, dtype)
    step = _chunk_size(query, key, value, needs_backward)
    if step >= batch_size:
        return [_BatchChunk(None, args, dropout)]
    attn_mask = None if args.attn_mask is None else undo_broadcast(args.attn_mask)
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
    shift = causal_shift(args.causal, lq, lk)
    if shift is not None and shift < 0:
        return False
    if args.key_padding_mask is None:
        return True
    if not may_sync:
        return False
    padding = args.key_padding_mask
    if shift is not None and shift + 1 < lk:
        padding = padding[:, :shift + 1]
    return not bool(padding.all(1).any())


def probs_forward(query, key, value, args: AttentionArgs, needs_backward: bool):
    """``out`` and, when a backward pass will run, the probabilities (else an empty tensor)."""
    dtype = compute_dtype(query.dtype)
    if query.shape[2] == 1 and not needs_backward and args.dropout_p == 0.0 and query.dtype == dtype:
        batches = HeadBatches.of(query, key, value)
        if batches.folded:
            return _one_query_row(query, key, value, args, batches), query.new_empty(0, dtype=dtype)
    out = empty_output(query, value)
    saved = empty_saved_probs(query, key, value, dtype) if needs_backward else query.new_empty(0, dtype=dtype)
    kept = _kept_for_backward(saved, query, key, value)  # views of saved: made once, read by the chunks
    chunks = _batch_chunks(query, key, value, args, dtype, needs_backward)
    # On a GPU, a call in chunks is long enough for one host sync to cost nothing.
    may_sync = query.device.type == "cpu" or len(chunks) > 1
    zero_empty_rows = not _every_row_sees_a_key(query.shape[2], key.shape[2], args, may_sync)
    for chunk in chunks:
        (q, k, v), batches = chunk.operands(query, key, value, into=kept.operands)
        scores, masked = _scores(q, k, chunk.args, batches)
        probs = _softmax(scores, masked and zero_empty_rows, batches)
        dropped = probs if chunk.dropout is None else probs * chunk.dropout
        product = batches.matmul(dropped, _as_dtype(v, dtype), out=chunk.destination(out, "out", dtype))
        out = chunk.store(product, out)
        if kept.operands is not None:
            chunk.of(kept.probs).copy_(probs)  # into the one buffer saved, wherever softmax wrote it
        elif needs_backward:
            saved = chunk.store(probs, saved)
    return out, saved


def _one_query_row(query, key, value, args: AttentionArgs, batches: HeadBatches) -> torch.Tensor:
    """:func:`probs_forward` of a decoding step: one query row per head, operands that fold, of the
    dtype it computes in, no dropout, no backward pass.  Its ops on the whole batch, without the
    chunks, copies and saved buffers that it would find unneeded at the cost of a few microseconds
    each, which a step pays per layer and token (greedy decoding of the small Transformer preset:
    four attention calls a token)."""
    scores, masked = _scores(query, key, args, batches)
    may_sync = query.device.type == "cpu"  # as for a call in one chunk
    probs = _softmax(scores, masked and not _every_row_sees_a_key(1, key.shape[2], args, may_sync), batches)
    out = empty_output(query, value)  # one row: [B, H, 1, Ev] contiguous, which the product fills in place
    return batches.matmul(probs, value, out=out)


def _recomputed_probs(query, key, args: AttentionArgs) -> torch.Tensor:
    """The forward's probabilities again, as the softmax of the scores: not ``exp(S - lse)`` from a
    saved lse, which a row of large scores (a float mask of ``finfo.min`` or ``-1e9`` on every key
    of a row) rounds to its largest score, losing ``log(sum)``: that row's probabilities came out
    ``Lk`` times too large."""
    batches = HeadBatches.of(query, key)
    scores, masked = _scores(query, key, args, batches)
    return _softmax(scores, masked, batches)


def probs_backward(grad_out, query, key, value, saved, args: AttentionArgs, attn_mask_needs_grad, contiguous: bool):
    """Softmax-attention backward on the materialized probabilities ``P`` (``saved`` when it holds
    them, with the folded operands where the forward kept them, else recomputed as the scores'
    softmax, see :func:`_recomputed_probs`):
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(P * dP))``, ``dQ = dS K``,
    ``dK = dS^T Q`` (the last two scaled); ``dq, dk, dv`` contiguous or laid out like their
    inputs as ``contiguous`` says (the backend's ``grads_contiguous``)."""
    dtype = compute_dtype(query.dtype)
    num_kv_heads = key.shape[1]
    grads = list(empty_grads(query, key, value, contiguous))
    dmask = query.new_empty(0, dtype=torch.float32)
    if attn_mask_needs_grad:
        dmask = query.new_empty((*query.shape[:3], key.shape[2]), dtype=dtype)
    kept = _kept_for_backward(saved, query, key, value)
    query, key, value = kept.operands or (query, key, value)
    for chunk in _batch_chunks(query, key, value, args, dtype, needs_backward=True):
        operands, batches = chunk.operands(grad_out, query, key, value)
        d_out, q, k, v = (_as_dtype(t, dtype) for t in operands)
        probs = _recomputed_probs(q, k, chunk.args) if kept.probs is None else chunk.of(kept.probs)
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



def keeps_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the forward of a call with a backward pass keeps the folded copies it makes of query,
    key and value (beside the probabilities, :func:`empty_saved_probs`), so that its backward reads
    them rather than copying the operands again: float32 or float64 operands (computed in their own
    dtype) with one head count, none of which folds as it is, all copied by :meth:`_BatchChunk.operands`
    (in chunks, or whole where :func:`_small`).  They take as much memory as the naive math's
    autograd keeps of its own copies.  B128 H8 D64 [B, L, H, D] views with key padding, 2 threads,
    forward+backward against the naive math, copying the operands again -> reading the kept ones:
    L16 0.85x -> 0.93x (the backward alone 0.80x -> 0.995x), L32 1.09x -> 1.11x, L64 1.15x -> 1.17x."""
    tensors = (query, key, value)
    heads = query.shape[1]
    return (query.dtype == compute_dtype(query.dtype)
            and all(t.shape[1] == heads and not _folds(t) for t in tensors)
            and (runs_in_chunks(*tensors) or all(_small(t) for t in tensors)))


def holds_operands(saved: torch.Tensor) -> bool:
    """Whether ``saved``, what a forward saved for its backward pass, holds its folded operands
    (see :func:`keeps_operands`): the one flat buffer of :func:`empty_saved_probs`, which no other
    saved tensor is (the probabilities are 4-D, the tiled path's lse 3-D, nothing saved empty)."""
    return saved.dim() == 1 and saved.numel() > 0


class _KeptForBackward(NamedTuple):
    """What a forward saved for its backward pass, as views: the probabilities ``[B, Hq, Lq, Lk]``
    (None: recompute them) and, where :func:`keeps_operands`, the folded copies of query, key and
    value (contiguous ``[B, H, L, X]``; else None)."""

    probs: Optional[torch.Tensor]
    operands: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _kept_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes in the one buffer of :func:`empty_saved_probs` that keeps the operands: the
    probabilities, then query, key and value."""
    return [(*query.shape[:3], key.shape[2]), tuple(query.shape), tuple(key.shape), tuple(value.shape)]


def _kept_for_backward(saved: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor) -> _KeptForBackward:
    """``saved`` (:func:`empty_saved_probs`; or an empty tensor, or the tiled path's lse, whose
    backward the materialized path runs where a float mask's gradient is asked for) seen as what
    it holds."""
    if saved.dim() == 4:
        return _KeptForBackward(saved, None)
    if not holds_operands(saved):
        return _KeptForBackward(None, None)
    views, start = [], 0
    for shape in _kept_shapes(query, key, value):
        size = math.prod(shape)
        views.append(saved[start:start + size].view(shape))
        start += size
    return _KeptForBackward(views[0], tuple(views[1:]))


def empty_saved_probs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype
                      ) -> torch.Tensor:
    """What the materialized path saves for a backward pass: where :func:`keeps_operands`, one flat
    buffer of ``dtype`` holding the probabilities and the folded operands (all contiguous, see
    :func:`_kept_for_backward`); else the probabilities ``[B, Hq, Lq, Lk]``, batch-major where the
    operands fold as :meth:`_BatchChunk.operands` hands them over (always when the batch runs in
    chunks), else head-major, as :class:`HeadBatches` lays out per-head products."""
    if keeps_operands(query, key, value):
        return query.new_empty(sum(math.prod(shape) for shape in _kept_shapes(query, key, value)), dtype=dtype)
    batch_size, num_heads, lq, _ = query.shape
    batches = HeadBatches(runs_in_chunks(query, key, value) or _whole_call_folds(query, key, value))
    return batches.empty(batch_size, num_heads, lq, key.shape[2], query, dtype)
