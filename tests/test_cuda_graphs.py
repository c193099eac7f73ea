"""A training step of the fused ops captured in one CUDA graph and replayed (issue 9).

At the seeds' short sequences the host path, not the kernels, sets a step's wall-clock; a CUDA graph
removes it.  That works only if no call syncs with the host, reads a value back, or takes anything
from the host that must change between steps: dropout draws its (seed, offset) as a device tensor
from the CUDA generator, whose offset a captured graph advances on every replay, so replays draw
new masks.  The step here is the seeds' layer on the fused ops: the packed QKV projection, attention
with key padding, a GLU convolution with a residual, and the gradients of every weight.
"""

from __future__ import annotations

import pytest
import torch

import transformer_kernels as tk
from transformer_kernels.bench.graphs import captured

from _helpers import backend_params
from conftest import CUDA

pytestmark = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")

BATCH, LENGTH, EMBED, HEADS = 4, 24, 64, 4


class _Layer:
    """Static inputs and weights of one layer, and its training step on ``backend``."""

    def __init__(self, backend: str, dropout_p: float) -> None:
        self.backend, self.dropout_p = backend, dropout_p
        options = dict(device="cuda", dtype=torch.float16)
        self.x = torch.randn(BATCH, LENGTH, EMBED, **options)
        self.padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool, device="cuda")
        self.weights = [
            (torch.randn(3 * EMBED, EMBED, **options) / EMBED**0.5).requires_grad_(),
            (torch.randn(2 * EMBED, EMBED, 3, **options) / (3 * EMBED) ** 0.5).requires_grad_(),
            torch.zeros(2 * EMBED, **options).requires_grad_(),
        ]

    def set_inputs(self, seed: int) -> None:
        """New values in the static inputs, as a training loop copies each batch in."""
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.x.copy_(torch.randn(self.x.shape, generator=generator, device="cuda"))
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (BATCH,), generator=generator, device="cuda")
        self.padding.copy_(torch.arange(LENGTH, device="cuda")[None, :] >= lengths[:, None])

    def step(self) -> list[torch.Tensor]:
        """The loss and the gradient of every weight."""
        qkv_weight, conv_weight, conv_bias = self.weights
        query, key, value = tk.qkv_projection(self.x, qkv_weight, num_heads=HEADS, backend=self.backend)
        attended = tk.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout_p, key_padding_mask=self.padding, backend=self.backend
        )
        h = attended.transpose(1, 2).reshape(BATCH, LENGTH, EMBED).transpose(1, 2)  # [B, E, L] channel-last
        y = tk.glu_conv1d(h, conv_weight, conv_bias, residual=h, residual_scale=0.5**0.5, backend=self.backend)
        loss = y.float().square().mean()
        return [loss, *torch.autograd.grad(loss, self.weights)]

    def captured(self) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
        """The step captured in a graph, and the static tensors its replays write."""
        return captured(self.step)


@pytest.mark.parametrize("backend", backend_params(names=("triton", "cuda")))
def test_replayed_step_equals_the_eager_step(backend):
    layer = _Layer(backend, dropout_p=0.0)
    layer.set_inputs(seed=1)
    graph, replayed = layer.captured()
    for seed in (2, 3):  # each replay reads what the static inputs hold then
        layer.set_inputs(seed)
        graph.replay()
        eager = layer.step()
        for name, got, expected in zip(("loss", "d qkv weight", "d conv weight", "d conv bias"), replayed, eager):
            torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", backend_params(names=("triton", "cuda")))
def test_replays_draw_new_dropout_masks(backend):
    layer = _Layer(backend, dropout_p=0.3)
    layer.set_inputs(seed=1)
    graph, replayed = layer.captured()
    losses = []
    for _ in range(3):
        graph.replay()
        losses.append(replayed[0].item())
    assert len(set(losses)) == 3, f"replays of one input drew the same dropout masks: losses {losses}"
