"""Every public function under ``torch.autocast`` as the torch op it replaces: ``nn.Linear`` (the QKV
projection), ``F.conv1d`` (the GLU convolution) and SDPA run in the autocast dtype whatever float
dtype their inputs arrive in (float64 aside), and their gradients reach the inputs in the inputs'
dtype; the models and the training command run mixed precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import backend_params, device_for

import transformer_kernels as tk
from transformer_kernels.ops import _autocast
from transformer_kernels.models import ConvSeq2Seq, Transformer
from transformer_kernels.train import logits_of, parse_args, train


def _attention(q, k, v, mask, backend):
    return tk.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)


def _attention_torch(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _glu(x, weight, bias, residual, backend):
    return tk.glu_conv1d(x, weight, bias, padding="causal", residual=residual, residual_scale=0.5, backend=backend)


def _glu_torch(x, weight, bias, residual):
    z = F.conv1d(F.pad(x, (2, 0)), weight, bias)
    return (F.glu(z, 1) + residual.to(z.dtype)) * 0.5


def _qkv(x, weight, bias, backend):
    return torch.cat([t.transpose(1, 2).flatten(2) for t in tk.qkv_projection(x, weight, bias, num_heads=2,
                                                                                backend=backend)], -1)


def _qkv_torch(x, weight, bias):
    return F.linear(x, weight, bias)


def _inputs(op, device):
    make = lambda *shape: torch.randn(*shape, device=device, requires_grad=True)  # noqa: E731 (float32 leaves)
    if op == "attention":
        return make(2, 2, 8, 16), make(2, 2, 8, 16), make(2, 2, 8, 16), make(8, 8)
    if op == "glu_conv":
        return make(2, 16, 6), torch.nn.Parameter(torch.randn(32, 16, 3, device=device) / 8), make(32), make(2, 16, 6)
    return make(2, 5, 32), torch.nn.Parameter(torch.randn(96, 32, device=device) / 8), make(96)


CALLS = {"attention": (_attention, _attention_torch), "glu_conv": (_glu, _glu_torch), "qkv": (_qkv, _qkv_torch)}


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_runs_in_the_autocast_dtype_like_the_torch_op(op, backend, dtype):
    device = device_for(backend)
    if backend == "triton" and device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter computes zeros for bfloat16")
    ours, torchs = CALLS[op]
    inputs = _inputs(op, device)
    with torch.autocast(device.type, dtype=dtype):
        out = ours(*inputs, backend)
        expected = torchs(*inputs)
    assert out.dtype == expected.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    expected_grads = torch.autograd.grad(expected.float().square().sum(), inputs)
    for grad, expected_grad, leaf in zip(grads, expected_grads, inputs):
        assert grad.dtype == leaf.dtype == torch.float32
        torch.testing.assert_close(grad, expected_grad, rtol=5e-2, atol=5e-2)


def test_float64_is_not_cast():
    x = torch.randn(2, 8, 5, dtype=torch.float64)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with torch.autocast("cpu"):
        assert tk.glu_conv1d(x, torch.randn(16, 8, 3, dtype=torch.float64)).dtype == torch.float64
        assert tk.scaled_dot_product_attention(q, q, q, is_causal=True).dtype == torch.float64
        assert tk.qkv_projection(x.transpose(1, 2), torch.randn(24, 8, dtype=torch.float64), num_heads=2)[0].dtype \
            == torch.float64


@pytest.mark.parametrize("device_type", _autocast._DEVICE_TYPES)
def test_autocast_of_every_device_type_is_seen(device_type):
    """The public functions skip their autocast casts where torch._C._is_any_autocast_enabled says
    no autocast is on, except for the device types listed as unseen by it: that list must hold."""
    assert not torch._C._is_any_autocast_enabled()
    torch.set_autocast_enabled(device_type, True)
    try:
        seen = torch._C._is_any_autocast_enabled()
    finally:
        torch.set_autocast_enabled(device_type, False)
    assert seen == (device_type not in _autocast._UNCOVERED_DEVICE_TYPES)


def test_decoding_step_runs_in_the_autocast_dtype():
    x_t, weight = torch.randn(3, 8), torch.randn(16, 8, 3) / 4
    with torch.autocast("cpu"):
        out, state = tk.glu_conv1d_step(x_t, None, weight)
        out, state = tk.glu_conv1d_step(x_t, state, weight)
        expected = F.glu(F.conv1d(torch.stack([torch.zeros_like(x_t), x_t, x_t], 2), weight), 1)[:, :, 0]
    assert out.dtype == state.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


def test_in_place_decoding_step_updates_the_callers_ring_under_autocast():
    """Under autocast the update computes in bfloat16 and writes the new input into the caller's
    float32 ring (autocast casts it to a copy, whose update goes back)."""
    x, weight = torch.randn(3, 8, 5), torch.randn(16, 8, 3) / 4
    ring = torch.zeros(3, 8, 3)
    with torch.no_grad(), torch.autocast("cpu"):
        steps = [tk.glu_conv1d_update(x[:, :, t], ring, weight, position=torch.tensor(t)) for t in range(5)]
        expected = tk.glu_conv1d(x, weight, padding="causal")
    assert steps[0].dtype == torch.bfloat16 and ring.dtype == torch.float32
    torch.testing.assert_close(torch.stack(steps, 2), expected)
    torch.testing.assert_close(ring[:, :, [2, 0, 1]], x[:, :, 2:].bfloat16().float())


def test_conv_seq2seq_cached_steps_track_its_forward_under_autocast():
    """The decoder's rings are made in the autocast dtype, and each cached step's log-probabilities
    are the forward's at that position to bfloat16 rounding."""
    torch.manual_seed(0)
    model = ConvSeq2Seq(30, 25, emb_dim=16, hid_dim=24, num_encoder_layers=2, num_decoder_layers=2, dropout=0.0,
                        max_len=20, pad_index=1).eval()
    src, tgt = torch.randint(2, 30, (4, 7)), torch.randint(2, 25, (4, 6))
    with torch.no_grad(), torch.autocast("cpu"):
        expected = model(src, tgt)[0].float().log_softmax(-1)
        state = model.decoder.initial_state(model.encode(src))
        steps = torch.stack([model.decoder.step(tgt[:, t], torch.tensor(t), state).float() for t in range(6)], 1)
    assert all(ring.dtype == torch.bfloat16 for ring in state.conv_states)
    torch.testing.assert_close(steps, expected, atol=0.05, rtol=0)


@pytest.mark.parametrize("model_class", [ConvSeq2Seq, Transformer])
def test_fused_models_match_the_reference_under_autocast(model_class):
    src, tgt = torch.randint(2, 30, (3, 9)), torch.randint(2, 30, (3, 7))
    src[1, 6:] = src[2, 4:] = 1  # padding
    sizes = (dict(emb_dim=16, hid_dim=32, num_encoder_layers=2, num_decoder_layers=2) if model_class is ConvSeq2Seq
             else dict(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32))
    outputs = []
    for impl in ("fused", "reference"):
        torch.manual_seed(0)
        model = model_class(30, 30, pad_index=1, dropout=0.0, impl=impl, **sizes)
        with torch.autocast("cpu"):
            logits = logits_of(model, src, tgt)
        assert logits.dtype == torch.bfloat16
        logits.float().square().mean().backward()
        outputs.append((logits.float(), [p.grad for p in model.parameters()]))
    (fused, fused_grads), (reference, reference_grads) = outputs
    torch.testing.assert_close(fused, reference, rtol=5e-2, atol=5e-2)
    for fused_grad, reference_grad in zip(fused_grads, reference_grads):
        torch.testing.assert_close(fused_grad, reference_grad, rtol=0.1, atol=5e-2)


def test_the_training_command_runs_in_bfloat16():
    summary = train(parse_args(["--model", "convs2s", "--preset", "tiny", "--steps", "3", "--batch-size", "8",
                                "--dtype", "bfloat16", "--device", "cpu", "--examples", "1"]))
    assert all(torch.isfinite(torch.tensor(summary[key])) for key in ("first_loss", "final_loss"))
