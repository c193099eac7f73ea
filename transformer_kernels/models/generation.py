"""Greedy and beam-search decoding over an incremental decoder, shared by the seed models.

A model plugs in through :class:`IncrementalDecoder`: ``step`` maps the prefixes decoded so far
to the next token's log-probabilities, carrying whatever it caches (keys and values, rolling
convolution states) in a state object, and ``reorder`` gathers that state along its batch
dimension.  The search itself never looks inside the state, so a model's cached ``step`` and a
``step`` that re-runs the whole decoder on the prefix go through exactly the same search and
therefore pick exactly the same tokens (up to the rounding of their log-probabilities).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["IncrementalDecoder", "generate"]


class IncrementalDecoder(Protocol):
    """What :func:`generate` needs from a model."""

    def step(self, prefix: Tensor, state: Any) -> tuple[Tensor, Any]:
        """``prefix`` ``[N, t]`` (``t >= 1``, starting with the bos token) -> the log-probabilities
        ``[N, V]`` of token ``t`` and the state for the next call."""

    def reorder(self, state: Any, indices: Tensor, *, same_sources: bool = False) -> Any:
        """The state of rows ``indices`` (a LongTensor ``[N']``), in that order.  ``same_sources``:
        each row of ``indices`` holds a hypothesis of the same source as the row it replaces (the
        beams of one sentence trading places), so state that depends on the source alone (encoder
        outputs, cross-attention keys and values) may be kept as it is instead of gathered."""


@torch.no_grad()
def generate(
    decoder: IncrementalDecoder,
    state: Any,
    *,
    batch_size: int,
    max_len: int,
    bos_index: int,
    eos_index: int,
    pad_index: int,
    beam_size: int = 1,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""Decode ``batch_size`` sequences, greedily (``beam_size=1``) or by beam search.

    Every row starts with ``bos_index``.  A hypothesis ends when it emits ``eos_index``; from
    then on it holds ``pad_index`` and keeps its score.  Beam search keeps the ``beam_size``
    prefixes of highest summed log-probability (no length penalty) and returns the best of them;
    ties go to the lower beam, then the lower token id, as :func:`torch.topk` orders them.

    Args:
        decoder: the model's :class:`IncrementalDecoder`.
        state: the decoder's state for the ``batch_size`` source rows (encoder outputs and
            empty caches); :func:`generate` expands it to ``batch_size * beam_size`` rows, beam
            ``j`` of row ``b`` at ``b * beam_size + j``, through ``decoder.reorder``.
        max_len: the longest output, ``bos_index`` included (``>= 1``).

    Returns:
        LongTensor ``[batch_size, T]``, ``T <= max_len``: ``T`` is ``max_len``, or one more than
        the step at which the last hypothesis ended.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    rows = batch_size * beam_size
    state = decoder.reorder(state, torch.arange(batch_size, device=device).repeat_interleave(beam_size))
    prefix = torch.full((rows, 1), bos_index, dtype=torch.long, device=device)
    # Only beam 0 is alive at the start, so the first top-k does not pick one token per copy.
    scores = torch.full((batch_size, beam_size), float("-inf"), device=device)
    scores[:, 0] = 0.0
    scores = scores.view(rows)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    row_base = torch.arange(batch_size, device=device).repeat_interleave(beam_size) * beam_size
    for _ in range(max_len - 1):
        log_probs, state = decoder.step(prefix, state)
        # Search in the decoder's precision, at least float32 (float16 scores would tie too often).
        log_probs = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))
        vocab_size = log_probs.shape[-1]
        # An ended hypothesis continues only with pad, at no cost: its score stays as it was.
        log_probs[finished] = float("-inf")
        log_probs[finished, pad_index] = 0.0
        candidates = (scores.to(log_probs.dtype)[:, None] + log_probs).view(batch_size, beam_size * vocab_size)
        top_scores, top_indices = candidates.topk(beam_size, dim=1)
        source_rows = row_base + (top_indices // vocab_size).view(rows)
        tokens = (top_indices % vocab_size).view(rows)
        scores = top_scores.view(rows)
        finished = finished[source_rows] | tokens.eq(eos_index)
        prefix = torch.cat([prefix[source_rows], tokens[:, None]], dim=1)
        if bool(finished.all()):
            break
        if beam_size > 1:  # greedy rows never move: gathering every cache again would copy it unchanged
            state = decoder.reorder(state, source_rows, same_sources=True)
    best = row_base[::beam_size] + scores.view(batch_size, beam_size).argmax(dim=1)
    return prefix[best]
