"""Greedy and beam-search decoding over an incremental decoder, shared by the seed models.

A model plugs in through :class:`IncrementalDecoder`: ``step`` maps each hypothesis's newest token
and its position to the next token's log-probabilities, updating whatever it caches (keys and
values, rolling convolution states) in a state object, and ``reorder`` gathers that state along its
batch dimension.  The search itself never looks inside the state, so a model's cached ``step`` and a
``step`` that re-runs the whole decoder on the prefix (:class:`RedecodingDecoder`) go through exactly
the same search and therefore pick exactly the same tokens (up to the rounding of their
log-probabilities).

On a GPU, at the seeds' sizes, a step's kernels take microseconds and its host path (hundreds of
small ops) sets the pace.  The search keeps its tensors in place and never reads a value back
within a step, so with a decoder whose step does the same (``capturable = True``) the whole search
step, the decoder's step and the choice of the next tokens, is captured in a CUDA graph at the
second position and replayed for the rest: a replay launches every kernel of the step at once, and
the host only asks, once per step, whether every hypothesis has ended.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch import Tensor

from .._checks import check_int

__all__ = ["IncrementalDecoder", "RedecodingDecoder", "generate", "in_eval_mode"]


class IncrementalDecoder(Protocol):
    """What :func:`generate` needs from a model.

    ``capturable`` (optional, default False): ``step`` may be captured in a CUDA graph: it reads its
    arguments' values only on the device (no ``.item()``, no shape that depends on them), allocates
    its state's tensors before the first step and updates them in place, and ``reorder`` with
    ``same_sources=True`` writes into those same tensors."""

    def step(self, tokens: Tensor, position: Tensor, state: Any) -> Tensor:
        """``tokens`` ``[N]`` (int64), each hypothesis's token at ``position`` (a 0-dim int64 tensor
        on the decoding device; the bos token is at 0) -> the log-probabilities ``[N, V]`` of the
        token after it.  Updates ``state`` in place to hold the prefixes through ``position``."""

    def reorder(self, state: Any, indices: Tensor, *, same_sources: bool = False) -> Any:
        """The state of rows ``indices`` (a LongTensor ``[N']``), in that order.  ``same_sources``:
        each row of ``indices`` holds a hypothesis of the same source as the row it replaces (the
        beams of one sentence trading places), so state that depends on the source alone (encoder
        outputs, cross-attention keys and values) may be kept as it is instead of gathered."""


class RedecodingDecoder:
    """The uncached :class:`IncrementalDecoder`: every step re-runs ``forward(source, prefix)`` ->
    logits ``[N, t, V]`` on the whole prefix and takes its last position.  What cached decoding must
    reproduce, and what it is measured against.  Its state is ``source``, one row per hypothesis,
    which :func:`generate` starts from (``state=source``)."""

    def __init__(self, forward: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.forward = forward

    def step(self, tokens: Tensor, position: Tensor, state: "_Prefixes") -> Tensor:
        state.prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)
        return self.forward(state.source, state.prefix)[:, -1].log_softmax(-1)

    def reorder(self, state: "_Prefixes | Tensor", indices: Tensor, *, same_sources: bool = False) -> "_Prefixes":
        if isinstance(state, Tensor):
            return _Prefixes(state[indices], state.new_empty(len(indices), 0))
        source = state.source if same_sources else state.source[indices]
        return _Prefixes(source, state.prefix[indices])


class _Prefixes:
    """:class:`RedecodingDecoder`'s state: the source rows and the prefixes decoded so far."""

    def __init__(self, source: Tensor, prefix: Tensor) -> None:
        self.source, self.prefix = source, prefix


@contextlib.contextmanager
def in_eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in evaluation mode, then every submodule back in its own mode: ``module.train(
    was_training)`` would set them all to the top's (an encoder frozen in eval mode while the rest
    trains, or a submodule kept training for Monte Carlo dropout, would lose its mode)."""
    modes = [(submodule, submodule.training) for submodule in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for submodule, training in modes:
            submodule.training = training


class _Search:
    """The search's tensors, allocated once and updated in place, and its step: the decoder's step
    for every hypothesis, then the choice of the next tokens (:func:`generate`'s rules).  A step
    reads no value back, so that a capturable decoder's whole search step can be replayed from a
    CUDA graph."""

    def __init__(self, decoder: IncrementalDecoder, state: Any, *, batch_size: int, beam_size: int, max_len: int,
                 bos_index: int, eos_index: int, pad_index: int, device: torch.device) -> None:
        self.decoder, self.batch_size, self.beam_size = decoder, batch_size, beam_size
        self.eos_index, self.pad_index = eos_index, pad_index
        rows = batch_size * beam_size
        self.state = decoder.reorder(state, torch.arange(batch_size, device=device).repeat_interleave(beam_size))
        self.prefixes = torch.full((rows, max_len), pad_index, dtype=torch.long, device=device)
        self.prefixes[:, 0] = bos_index
        self.tokens = self.prefixes[:, 0].clone()  # each row's token at the step's position
        # Only beam 0 is alive at the start, so the first top-k does not pick one token per copy.
        # float64 holds the scores of any search precision exactly.
        self.scores = torch.full((batch_size, beam_size), float("-inf"), dtype=torch.float64, device=device)
        self.scores[:, 0] = 0.0
        self.scores = self.scores.view(rows)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.row_base = torch.arange(batch_size, device=device).repeat_interleave(beam_size) * beam_size

    def step(self, position: Tensor) -> None:
        """Extend every hypothesis by the token at ``position + 1`` (``position``: 0-dim, on the device)."""
        log_probs = self.decoder.step(self.tokens, position, self.state)
        # Search in the decoder's precision, at least float32 (float16 scores would tie too often).
        log_probs = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))
        vocab_size = log_probs.shape[-1]
        if self.pad_index >= vocab_size:  # (a host-side int: nothing read back from the device)
            raise ValueError(f"pad_index must be a token of the decoder's {vocab_size}, got {self.pad_index}")
        # An ended hypothesis continues only with pad, at no cost: its score stays as it was.  (In-place
        # fills: indexing by the mask and a column would read the mask back to the host.)
        log_probs.masked_fill_(self.finished[:, None], float("-inf"))
        log_probs.select(1, self.pad_index).masked_fill_(self.finished, 0.0)
        candidates = (self.scores.to(log_probs.dtype)[:, None] + log_probs).view(self.batch_size,
                                                                                   self.beam_size * vocab_size)
        if self.beam_size == 1:  # the lowest token id of a tie, as argmax (topk's order among ties is unspecified)
            top_scores, top_indices = candidates.max(dim=1, keepdim=True)
        else:
            top_scores, top_indices = candidates.topk(self.beam_size, dim=1)
        tokens = (top_indices % vocab_size).view(-1)
        self.scores.copy_(top_scores.view(-1))
        if self.beam_size > 1:  # greedy rows never move: gathering them would copy them unchanged
            source_rows = self.row_base + (top_indices // vocab_size).view(-1)
            self.finished.copy_(self.finished[source_rows])
            self.prefixes.copy_(self.prefixes[source_rows])
            self.state = self.decoder.reorder(self.state, source_rows, same_sources=True)
        self.finished.logical_or_(tokens.eq(self.eos_index))
        self.prefixes.index_copy_(1, (position + 1).view(1), tokens[:, None])
        self.tokens.copy_(tokens)

    def best(self, length: int) -> Tensor:
        """``[batch_size, length]``: each source's best hypothesis, its first ``length`` tokens."""
        best = self.row_base[:: self.beam_size] + self.scores.view(self.batch_size, self.beam_size).argmax(dim=1)
        return self.prefixes[best, :length]


class _Replayed:
    """``step(position)``, run eagerly at the first position and replayed from a CUDA graph after.

    The first call runs on a side stream, the one the capture will use, so that what it sets up
    lazily (Triton's compilation, cuBLAS's workspace for that stream) exists before the capture.
    The second is captured with this object's static position tensor as its input, then replayed;
    every later call copies its position in and replays.

    A step that cannot be captured (one of its ops reads a value back, as the eager backend's
    attention may) raises during the capture, before anything ran: a warning names the error and
    the steps run eagerly from then on."""

    def __init__(self, step: Callable[[Tensor], None], device: torch.device) -> None:
        self.step = step
        self.stream = torch.cuda.Stream(device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.position: Optional[Tensor] = None
        self.eager = False

    def __call__(self, position: Tensor) -> None:
        if self.eager:
            return self.step(position)
        if self.position is None:
            self.position = position.clone()
            return self._on_side_stream(self.step, position)
        self.position.copy_(position)
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            try:
                self._on_side_stream(self._capture)
            except RuntimeError as error:
                warnings.warn(f"generate: the search step could not be captured in a CUDA graph, so every "
                              f"step runs eagerly ({error})", RuntimeWarning, stacklevel=3)
                self.eager, self.graph = True, None
                return self.step(position)
        self.graph.replay()

    def _capture(self) -> None:
        self.graph.capture_begin()
        try:
            self.step(self.position)
        except BaseException:
            try:
                self.graph.capture_end()
            except RuntimeError:
                pass  # the step's own error is the one to report
            raise
        self.graph.capture_end()

    def _on_side_stream(self, fn: Callable[..., None], *args: Any) -> None:
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fn(*args)
        current.wait_stream(self.stream)


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
    cuda_graph: Optional[bool] = None,
) -> Tensor:
    r"""Decode ``batch_size`` sequences, greedily (``beam_size=1``) or by beam search.

    Every row starts with ``bos_index``.  A hypothesis ends when it emits ``eos_index``; from
    then on it holds ``pad_index`` and keeps its score.  Beam search keeps the ``beam_size``
    prefixes of highest summed log-probability (no length penalty) and returns the best of them.
    Greedy search breaks a tie to the lowest token id, as :func:`torch.argmax` does; beam search
    keeps the candidates :func:`torch.topk` returns, whose order among equal scores torch leaves
    unspecified (the same search serves cached and re-run decoding, so they agree).

    Args:
        decoder: the model's :class:`IncrementalDecoder`.
        state: the decoder's state for the ``batch_size`` source rows (encoder outputs and
            empty caches); :func:`generate` expands it to ``batch_size * beam_size`` rows, beam
            ``j`` of row ``b`` at ``b * beam_size + j``, through ``decoder.reorder``.
        max_len: the longest output, ``bos_index`` included (``>= 1``).
        device: where the search's tensors live: the decoder's device.
        cuda_graph: replay the search's steps from a CUDA graph (see the module's docstring).
            None (the default) does where it can: on a CUDA ``device`` with a ``capturable``
            decoder.  True insists (a ValueError where it cannot); False runs every step eagerly.

    Returns:
        LongTensor ``[batch_size, T]``, ``T <= max_len``: ``T`` is ``max_len``, or one more than
        the step at which the last hypothesis ended.
    """
    check_int("beam_size", beam_size, 1)
    check_int("max_len", max_len, 1)
    check_int("pad_index", pad_index, 0)
    device = torch.device("cpu") if device is None else torch.device(device)
    search = _Search(decoder, state, batch_size=batch_size, beam_size=beam_size, max_len=max_len,
                     bos_index=bos_index, eos_index=eos_index, pad_index=pad_index, device=device)
    step = _Replayed(search.step, device) if _captures(decoder, device, cuda_graph) else search.step
    length = 1
    for position in torch.arange(max_len - 1, device=device):
        step(position)
        length += 1
        if bool(search.finished.all()):
            break
    return search.best(length)


def _captures(decoder: IncrementalDecoder, device: torch.device, cuda_graph: Optional[bool]) -> bool:
    """Whether :func:`generate` replays its steps from a CUDA graph."""
    capturable = getattr(decoder, "capturable", False)
    if cuda_graph is None:
        return capturable and device.type == "cuda"
    if cuda_graph and not (capturable and device.type == "cuda"):
        why = f"the device is {device}" if device.type != "cuda" else f"{type(decoder).__name__} is not capturable"
        raise ValueError(f"cuda_graph=True needs a CUDA device and a capturable decoder, but {why}")
    return cuda_graph
