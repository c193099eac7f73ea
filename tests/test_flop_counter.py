"""``torch.utils.flop_counter.FlopCounterMode`` counts every op as torch counts the ops it replaces
(what training loops compute their model FLOP utilization from): SDPA's forward and backward,
``F.linear`` for the QKV projection and ``F.conv1d`` for the GLU convolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import transformer_kernels as tk


def _flops(forward, leaves) -> tuple[int, int]:
    """(forward flops, backward flops) counted by FlopCounterMode."""
    with FlopCounterMode(display=False) as counter:
        out = forward()
    forward_flops = counter.get_total_flops()
    outputs = out if isinstance(out, (list, tuple)) else [out]
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves)
    return forward_flops, counter.get_total_flops()


@pytest.mark.parametrize("masks", [{}, {"is_causal": True}, {"key_padding_mask": "padding"}])
def test_attention_counts_like_sdpa(masks):
    q = torch.randn(2, 4, 10, 16, requires_grad=True)
    k, v = torch.randn(2, 4, 12, 16, requires_grad=True), torch.randn(2, 4, 12, 8, requires_grad=True)
    if masks.get("key_padding_mask") == "padding":
        masks = {"key_padding_mask": torch.arange(12) >= torch.tensor([[12], [5]])}
    flops = _flops(lambda: tk.scaled_dot_product_attention(q, k, v, **masks), (q, k, v))
    assert flops == (sdpa_flop_count(q.shape, k.shape, v.shape),
                     sdpa_backward_flop_count((2, 4, 10, 8), q.shape, k.shape, v.shape)) != (0, 0)


def test_qkv_projection_counts_like_linear():
    x, weight, bias = torch.randn(2, 5, 32, requires_grad=True), torch.randn(96, 32, requires_grad=True), \
        torch.randn(96, requires_grad=True)
    ours = _flops(lambda: tk.qkv_projection(x, weight, bias, num_heads=4), (x, weight, bias))
    assert ours == _flops(lambda: F.linear(x, weight, bias), (x, weight, bias)) != (0, 0)
    # Only the weight's gradient: one GEMM backward, as torch counts it.
    frozen_x = x.detach()
    assert _flops(lambda: tk.qkv_projection(frozen_x, weight, num_heads=4), (weight,)) \
        == _flops(lambda: F.linear(frozen_x, weight), (weight,))


@pytest.mark.parametrize("padding", ["same", "causal"])
def test_glu_conv1d_counts_like_conv1d(padding):
    x, weight = torch.randn(2, 8, 6, requires_grad=True), torch.randn(16, 8, 3, requires_grad=True)

    def torchs():
        return F.glu(F.conv1d(F.pad(x, (2, 0)) if padding == "causal" else x, weight,
                              padding=1 if padding == "same" else 0), 1)

    ours = _flops(lambda: tk.glu_conv1d(x, weight, padding=padding), (x, weight))
    assert ours == _flops(torchs, (x, weight)) != (0, 0)
