"""A training step of the fused ops captured in one CUDA graph and replayed (issue 9), and the seed
models' decoding steps, which ``generate`` replays from a graph.

At the seeds' short sequences the host path, not the kernels, sets a step's wall-clock; a CUDA graph
removes it.  That works only if no call syncs with the host, reads a value back, or takes anything
from the host that must change between steps: dropout draws its (seed, offset) as a device tensor
from the CUDA generator, whose offset a captured graph advances on every replay, so replays draw
new masks.  The step here is the seeds' layer on the fused ops: the packed QKV projection, attention
with key padding, a GLU convolution with a residual, and the gradients of every weight.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from transformer_kernels import use_backend
from transformer_kernels.bench.graphs import SeedLayer, captured
from transformer_kernels.models import ConvSeq2Seq, Transformer

from _helpers import backend_params
from conftest import CUDA

pytestmark = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
NAMES = ("loss", "d qkv weight", "d qkv bias", "d conv weight", "d conv bias")


def _layer(dropout_p: float) -> SeedLayer:
    return SeedLayer(4, 24, 64, 4, min_length=12, device=torch.device("cuda"), dtype=torch.float16,
                     dropout_p=dropout_p)


@pytest.mark.parametrize("backend", backend_params(names=("triton", "cuda")))
def test_replayed_step_equals_the_eager_step(backend):
    layer = _layer(dropout_p=0.0)
    layer.set_inputs(seed=1)
    graph, replayed = captured(lambda: layer.step("ours", backend))
    for seed in (2, 3):  # each replay reads what the static inputs hold then
        layer.set_inputs(seed)
        graph.replay()
        eager = layer.step("ours", backend)
        for name, got, expected in zip(NAMES, replayed, eager):
            torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", backend_params(names=("triton", "cuda")))
def test_replays_draw_new_dropout_masks(backend):
    layer = _layer(dropout_p=0.3)
    layer.set_inputs(seed=1)
    graph, replayed = captured(lambda: layer.step("ours", backend))
    losses = []
    for _ in range(3):
        graph.replay()
        losses.append(replayed[0].item())
    assert len(set(losses)) == 3, f"replays of one input drew the same dropout masks: losses {losses}"


@pytest.mark.parametrize("beam_size", [1, 2])
@pytest.mark.parametrize("family", ["transformer", "convs2s"])
@pytest.mark.parametrize("backend", backend_params(names=("triton", "cuda")))
def test_generation_replayed_from_a_graph_gives_the_eager_tokens(monkeypatch, backend, family, beam_size):
    """``generate`` captures its second search step and replays it for the rest (no fallback warning),
    with the tokens of eager steps."""
    torch.manual_seed(0)
    if family == "transformer":
        model = Transformer(64, 64, d_model=64, nhead=4, num_encoder_layers=1, num_decoder_layers=2,
                            dim_feedforward=128, dropout=0.0, max_len=16, pad_index=0)
    else:
        model = ConvSeq2Seq(64, 64, emb_dim=32, hid_dim=64, num_encoder_layers=1, num_decoder_layers=2, dropout=0.0,
                            max_len=16, pad_index=0)
    model = model.cuda().half().eval()  # float16: what both backends serve
    src = torch.randint(3, 64, (5, 9), device="cuda")
    src[2, 5:] = 0
    replays = []
    real_replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or real_replay(graph))
    kwargs = dict(max_len=12, bos_index=1, eos_index=2, beam_size=beam_size)
    with use_backend(backend), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        replayed = model.generate(src, cuda_graph=True, **kwargs)
        eager = model.generate(src, cuda_graph=False, **kwargs)
    assert len(replays) == replayed.shape[1] - 2  # every step after the first
    assert torch.equal(replayed, eager)
