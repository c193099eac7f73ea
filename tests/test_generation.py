"""The shared search of ``transformer_kernels.models.generate`` against a plain-Python beam search, and
the models' decoders checked on the CPU for what replaying them from a CUDA graph needs."""

import dataclasses

import pytest
import torch
from _helpers import OpRecorder, backend_param, device_for, reads_back, small_seed_model

from transformer_kernels import use_backend
from transformer_kernels.models import generate, generation

VOCAB, PAD, BOS, EOS = 7, 0, 1, 2


class MarkovDecoder:
    """log p(token | prefix) from a fixed table indexed by (source row, position, last token).

    Its state is the source row of each hypothesis, so ``reorder`` is what carries the
    source through the beams, as a model's encoder output is carried."""

    def __init__(self, batch_size: int, max_len: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(batch_size, max_len, VOCAB, VOCAB, generator=g, dtype=torch.float64)
        self.table = self.table.log_softmax(-1)
        self.steps = 0

    def step(self, tokens, position, rows):
        self.steps += 1
        return self.table[rows, position, tokens]

    def reorder(self, rows, indices, *, same_sources=False):
        if same_sources:  # the search's promise: every hypothesis keeps its source row
            assert torch.equal(rows[indices], rows)
        return rows[indices]

    def log_prob(self, row: int, tokens: list[int]) -> float:
        return sum(float(self.table[row, t, tokens[t], tokens[t + 1]]) for t in range(len(tokens) - 1))


def reference_search(decoder: MarkovDecoder, row: int, max_len: int, beam_size: int) -> list[int]:
    """Beam search over lists: expand every live prefix by every token, keep the best."""
    beams = [(0.0, [BOS])]
    for _ in range(max_len - 1):
        candidates = []
        for beam_rank, (score, prefix) in enumerate(beams):
            if EOS in prefix:
                candidates.append((score, beam_rank, PAD, prefix + [PAD]))
                continue
            for token in range(VOCAB):
                step = float(decoder.table[row, len(prefix) - 1, prefix[-1], token])
                candidates.append((score + step, beam_rank, token, prefix + [token]))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [(score, prefix) for score, _, _, prefix in candidates[:beam_size]]
        if all(EOS in prefix for _, prefix in beams):
            break
    return max(beams, key=lambda b: b[0])[1]


@pytest.mark.parametrize("beam_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_search(beam_size, seed):
    batch_size, max_len = 3, 6
    decoder = MarkovDecoder(batch_size, max_len, seed)
    out = generate(decoder, torch.arange(batch_size), batch_size=batch_size, max_len=max_len,
                   bos_index=BOS, eos_index=EOS, pad_index=PAD, beam_size=beam_size)
    assert out.dtype == torch.long and out.shape[0] == batch_size and out.shape[1] <= max_len
    for row in range(batch_size):
        expected = reference_search(decoder, row, max_len, beam_size)
        expected += [PAD] * (out.shape[1] - len(expected))
        assert out[row].tolist() == expected


class TiedDecoder:
    """The same log-probabilities at every step, of a vocabulary of 40 whose tokens 3 to 6 tie for
    the highest (on a CPU, ``topk(1)`` of such a row returned token 5)."""

    def __init__(self):
        logits = torch.zeros(40, dtype=torch.float64)
        logits[3:7] = 1.0
        self.log_probs = logits.log_softmax(-1)

    def step(self, tokens, position, rows):
        return self.log_probs.expand(tokens.shape[0], -1).clone()

    def reorder(self, rows, indices, *, same_sources=False):
        return rows[indices]


@pytest.mark.parametrize("batch_size", [1, 3, 0])
def test_greedy_breaks_ties_to_the_lowest_token_id_and_takes_an_empty_batch(batch_size):
    out = generate(TiedDecoder(), torch.arange(batch_size), batch_size=batch_size, max_len=4, bos_index=BOS,
                   eos_index=EOS, pad_index=PAD)
    assert out.shape[0] == batch_size and out.shape[1] <= 4
    assert out.tolist() == [[BOS, 3, 3, 3]] * batch_size


def test_greedy_is_argmax_and_pads_after_eos():
    batch_size, max_len = 4, 8
    decoder = MarkovDecoder(batch_size, max_len, seed=3)
    out = generate(decoder, torch.arange(batch_size), batch_size=batch_size, max_len=max_len,
                   bos_index=BOS, eos_index=EOS, pad_index=PAD)
    for row in range(batch_size):
        tokens = [BOS]
        while len(tokens) < out.shape[1] and tokens[-1] != EOS:
            tokens.append(int(decoder.table[row, len(tokens) - 1, tokens[-1]].argmax()))
        tokens += [PAD] * (out.shape[1] - len(tokens))
        assert out[row].tolist() == tokens


def test_stops_when_every_hypothesis_ended():
    batch_size, max_len = 2, 10
    decoder = MarkovDecoder(batch_size, max_len, seed=0)
    decoder.table[:, :, :, EOS] = 0.0  # eos is the best first token of every row
    out = generate(decoder, torch.arange(batch_size), batch_size=batch_size, max_len=max_len,
                   bos_index=BOS, eos_index=EOS, pad_index=PAD)
    assert out.tolist() == [[BOS, EOS]] * batch_size
    assert decoder.steps == 1


def ended(tokens: torch.Tensor) -> list[int]:
    """The tokens up to and including the first eos."""
    tokens = tokens.tolist()
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_beam_search_finds_a_better_sequence_than_greedy():
    # Over many random tables, beam search's best score is never below greedy's.
    for seed in range(10):
        decoder = MarkovDecoder(2, 5, seed)
        kwargs = dict(batch_size=2, max_len=5, bos_index=BOS, eos_index=EOS, pad_index=PAD)
        greedy = generate(decoder, torch.arange(2), **kwargs)
        beam = generate(decoder, torch.arange(2), beam_size=4, **kwargs)
        for row in range(2):
            assert decoder.log_prob(row, ended(beam[row])) >= decoder.log_prob(row, ended(greedy[row])) - 1e-12


@pytest.mark.parametrize("kwargs, error, message", [
    ({"beam_size": 0}, ValueError, "beam_size"), ({"max_len": 0}, ValueError, "max_len"),
    ({"beam_size": 2.0}, TypeError, "beam_size must be an int"), ({"beam_size": True}, TypeError, "beam_size"),
    ({"beam_size": None}, TypeError, "beam_size"), ({"pad_index": -1}, ValueError, "pad_index must be >= 0"),
    ({"pad_index": VOCAB}, ValueError, f"pad_index must be a token of the decoder's {VOCAB}"),
])
def test_rejects_bad_arguments(kwargs, error, message):
    decoder = MarkovDecoder(1, 3, seed=0)
    args = dict(batch_size=1, max_len=3, bos_index=BOS, eos_index=EOS, pad_index=PAD) | kwargs
    with pytest.raises(error, match=message):
        generate(decoder, torch.arange(1), **args)


@pytest.mark.parametrize("family", ["transformer", "convs2s"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_models_generate_restores_each_submodules_own_mode(family, training):
    """A model training with its encoder frozen in eval mode (or evaluated with one submodule kept
    training, Monte Carlo dropout) gets every submodule back in its own mode."""
    model = small_seed_model(family).train(training)
    model.encoder.train(not training) if family == "convs2s" else model.transformer.encoder.train(not training)
    modes = {name: module.training for name, module in model.named_modules()}
    model.generate(torch.randint(3, 40, (2, 5)), max_len=4, bos_index=1, eos_index=2, beam_size=2)
    assert {name: module.training for name, module in model.named_modules()} == modes


# ----------------------------------------------------------------------------
# CUDA-graph readiness of the search steps with the models' decoders, checked on the CPU
# ----------------------------------------------------------------------------

def state_tensors(state) -> list[torch.Tensor]:
    """Every tensor a decoder state holds (dataclasses, named tuples and tuples, walked)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if dataclasses.is_dataclass(state):
        state = [getattr(state, field.name) for field in dataclasses.fields(state)]
    if isinstance(state, (tuple, list)):
        return [t for item in state for t in state_tensors(item)]
    return []


class CaptureStandIn:
    """What ``generate`` replays from a CUDA graph (its search step), run eagerly on the CPU and
    checked for what a capture needs: a step reads no value back, and the search's and the decoder
    state's tensors stay the same ones from the first step on (steps and reorders write into them)."""

    def __init__(self, step, device) -> None:
        self.step, self.search = step, step.__self__
        self.storage: list[int] = []
        self.steps = 0

    def tensors(self) -> list[torch.Tensor]:
        search = self.search
        return state_tensors([search.state, search.prefixes, search.tokens, search.scores, search.finished])

    def __call__(self, position):
        storage = [t.data_ptr() for t in self.tensors()]
        assert storage == (self.storage or storage), "the state's tensors were replaced"
        self.storage = storage
        with OpRecorder(reads_back, descend=True) as recorder:
            self.step(position)
        assert recorder.ops == [], f"step {self.steps} read values back: {recorder.ops}"
        assert [t.data_ptr() for t in self.tensors()] == storage, "the step replaced its state's tensors"
        self.steps += 1


def test_readback_recorder_sees_a_readback():
    with OpRecorder(reads_back) as recorder:
        bool(torch.tensor([1.0]).gt(0).all())
    assert recorder.ops


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize(("backend", "impl"), [
    pytest.param("eager", "reference", id="reference"), backend_param("triton", "fused", id="fused-triton"),
])
@pytest.mark.parametrize("family", ["transformer", "convs2s"])
def test_search_steps_with_the_models_decoders_can_be_captured(monkeypatch, family, backend, impl, beam_size):
    """The reference math, and the fused ops on the backend a GPU runs them on: on a CPU Triton
    runs interpreted, on a GPU for real (still without a capture).  The eager backend is left out:
    on a CPU it reads a padding mask back where that saves work (``_every_row_sees_a_key``)."""
    device = device_for(backend)
    model = small_seed_model(family, impl).to(device)
    stand_ins = []
    monkeypatch.setattr(generation, "_captures", lambda decoder, device, cuda_graph: decoder.capturable)
    monkeypatch.setattr(generation, "_Replayed", lambda *a: stand_ins.append(CaptureStandIn(*a)) or stand_ins[-1])
    # Small: interpreted Triton takes seconds per step.
    src = torch.randint(3, 40, (2, 7), device=device)
    src[1, 4:] = PAD
    kwargs = dict(max_len=6, bos_index=BOS, eos_index=EOS, beam_size=beam_size)
    with use_backend(backend):
        captured = model.generate(src, **kwargs)
        assert len(stand_ins) == 1 and stand_ins[0].steps >= 2
        monkeypatch.undo()
        assert torch.equal(captured, model.generate(src, cuda_graph=False, **kwargs))


def test_cuda_graph_needs_a_cuda_device_and_a_capturable_decoder():
    kwargs = dict(batch_size=1, max_len=3, bos_index=BOS, eos_index=EOS, pad_index=PAD, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device.*the device is cpu"):
        generate(MarkovDecoder(1, 3, seed=0), torch.arange(1), **kwargs)
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        small_seed_model("convs2s", "fused").generate(torch.randint(3, 40, (1, 4)), max_len=3, bos_index=BOS,
                                                  eos_index=EOS, cuda_graph=True)
