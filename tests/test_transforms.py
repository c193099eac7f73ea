"""The ops under torch.func's transforms, as torch's own ops work there: ``grad``, ``jacrev``,
``vmap``, per-sample gradients (``vmap(grad)``) and ``grad`` of a vmapped function, on every
backend, against the same backend differentiated by plain autograd sample by sample (the transforms'
plumbing, not the kernels, is what is tested here) and, on eager in float64, against torch's ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.flop_counter import FlopCounterMode
from _helpers import backend_params, device_for, precise_dtype

import transformer_kernels as tk
import transformer_kernels.nn as tknn


@dataclasses.dataclass(frozen=True)
class Case:
    """``loss(params, sample, backend)`` of one sample, ``make(dtype, device)`` giving ``(params,
    samples)``: the weights (not batched) and a batch of 3 samples."""

    loss: Callable
    make: Callable


def _attention_loss(params, sample, backend):
    (query_weight,) = params
    x, padding = sample
    q = x @ query_weight
    out = tk.scaled_dot_product_attention(q, x, x, is_causal=True, key_padding_mask=padding, backend=backend)
    return out.square().sum()


def _attention_samples(dtype, device):
    x = torch.randn(3, 2, 2, 8, 16, dtype=dtype, device=device)  # [samples, B, H, L, D]
    padding = torch.arange(8, device=device) >= torch.tensor([[8, 5], [3, 8], [6, 6]], device=device)[..., None]
    return (torch.randn(16, 16, dtype=dtype, device=device) / 4,), (x, padding)


def _qkv_loss(params, sample, backend):
    weight, bias = params
    return sum(t.square().sum() for t in tk.qkv_projection(sample, weight, bias, num_heads=4, backend=backend))


def _qkv_samples(dtype, device):
    weight = torch.randn(96, 32, dtype=dtype, device=device) / 8
    return (weight, torch.randn(96, dtype=dtype, device=device)), torch.randn(3, 2, 5, 32, dtype=dtype, device=device)


def _glu_loss(params, sample, backend):
    weight, bias = params
    out = tk.glu_conv1d(sample, weight, bias, padding="causal", residual=sample, residual_scale=0.5, backend=backend)
    return out.square().sum()


def _glu_samples(dtype, device):
    weight = torch.randn(16, 8, 3, dtype=dtype, device=device) / 4
    return (weight, torch.randn(16, dtype=dtype, device=device)), torch.randn(3, 2, 8, 6, dtype=dtype, device=device)


CASES = {
    "attention": Case(_attention_loss, _attention_samples),
    "qkv": Case(_qkv_loss, _qkv_samples),
    "glu_conv": Case(_glu_loss, _glu_samples),
}


def _sample(samples, index):
    return tuple(s[index] for s in samples) if isinstance(samples, tuple) else samples[index]


def _tolerance(dtype: torch.dtype) -> dict:
    """The same kernels on the same samples either way; float16 (the CUDA extension) leaves room for
    an accumulation order that differs from call to call."""
    return dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)


def _autograd_grads(case, params, samples, backend):
    """Each sample's gradients of its loss for ``params``, by plain autograd, stacked."""
    params = [p.detach().requires_grad_() for p in params]
    per_sample = [torch.autograd.grad(case.loss(params, _sample(samples, i), backend), params) for i in range(3)]
    return [torch.stack(grads) for grads in zip(*per_sample)]


@pytest.fixture(params=list(CASES))
def case(request):
    return request.param, CASES[request.param]


@pytest.mark.parametrize("backend", backend_params())
def test_per_sample_grads_equal_autograd_sample_by_sample(case, backend):
    op, case = case
    params, samples = case.make(precise_dtype(backend), device_for(backend))
    tolerance = _tolerance(precise_dtype(backend))
    expected = _autograd_grads(case, params, samples, backend)
    grads = torch.func.vmap(torch.func.grad(case.loss), in_dims=(None, 0, None))(params, samples, backend)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, **tolerance)
    # One sample's grad alone, and the grad of the sum over the vmapped samples.
    first = torch.func.grad(case.loss)(params, _sample(samples, 0), backend)
    for got, want in zip(first, expected):
        torch.testing.assert_close(got, want[0], **tolerance)
    summed = torch.func.grad(
        lambda p: torch.func.vmap(case.loss, in_dims=(None, 0, None))(p, samples, backend).sum()
    )(params)
    for got, want in zip(summed, expected):
        torch.testing.assert_close(got, want.sum(0), **tolerance)


@pytest.mark.parametrize("backend", backend_params())
def test_gradients_recorded_by_autograd_equal_plain_ones_and_refuse_a_second_derivative(case, backend):
    """``create_graph=True`` (a gradient penalty, MAML) and ``torch.func.grad`` of parameters that
    themselves require grad run the backward with grad mode on: the first derivative is the one plain
    autograd gives, and differentiating it again raises rather than giving zero, since no op is
    twice differentiable."""
    op, case = case
    params, samples = case.make(precise_dtype(backend), device_for(backend))
    sample = _sample(samples, 0)
    params = [p.requires_grad_() for p in params]
    expected = torch.autograd.grad(case.loss(params, sample, backend), params)
    recorded = torch.autograd.grad(case.loss(params, sample, backend), params, create_graph=True)
    for got, want in zip(recorded, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        sum(grad.sum() for grad in recorded).backward()
    for got, want in zip(torch.func.grad(case.loss)(params, sample, backend), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.func.grad(lambda p: sum(g.sum() for g in torch.func.grad(case.loss)(p, sample, backend)))(params)


@pytest.mark.parametrize("route", ["checkpoint", "dispatch_mode"])
def test_recorded_gradients_through_a_checkpoint_or_a_dispatch_mode(case, route):
    """A non-reentrant checkpoint unpacks each saved tensor once; a dispatch mode (FlopCounterMode)
    routes the call through the registered op, which hands a ``Tensor[]`` output's gradients over
    as one list.  Either way the first derivative is plain autograd's and a second one raises, with
    only the bias requiring grad (what ties it to the graph is the incoming gradient alone)."""
    op, case = case
    params, samples = case.make(torch.float64, torch.device("cpu"))
    sample = _sample(samples, 0)
    weight, bias = (params[0], params[1].requires_grad_()) if op != "attention" else (params[0].requires_grad_(), None)
    leaf = bias if bias is not None else weight

    def loss(leaf):
        p = (weight, leaf) if bias is not None else (leaf,)
        return case.loss(p, sample, "eager")

    expected = torch.autograd.grad(loss(leaf), leaf)[0]
    if route == "checkpoint":
        context, run = contextlib.nullcontext(), lambda: torch.utils.checkpoint.checkpoint(loss, leaf,
                                                                                           use_reentrant=False)
    else:
        context, run = FlopCounterMode(display=False), lambda: loss(leaf)
    with context:
        (grad,) = torch.autograd.grad(run(), leaf, create_graph=True)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="not twice differentiable"):
            grad.square().sum().backward()


def _forward(op, params, sample, backend):
    """The op's outputs for one sample (the losses' forward, without the loss)."""
    if op == "attention":
        x, padding = sample
        return tk.scaled_dot_product_attention(x @ params[0], x, x, is_causal=True, key_padding_mask=padding,
                                               backend=backend)
    if op == "qkv":
        return tk.qkv_projection(sample, *params, num_heads=4, backend=backend)
    return tk.glu_conv1d(sample, *params, padding="causal", residual=sample, residual_scale=0.5, backend=backend)


@pytest.mark.parametrize("backend", backend_params())
def test_vmap_equals_a_loop(case, backend):
    op, case = case
    params, samples = case.make(precise_dtype(backend), device_for(backend))
    with torch.no_grad():
        got = torch.func.vmap(_forward, in_dims=(None, None, 0, None))(op, params, samples, backend)
        expected = [_forward(op, params, _sample(samples, i), backend) for i in range(3)]
    got = got if isinstance(got, (list, tuple)) else [got]
    expected = [torch.stack(outs) for outs in zip(*expected)] if op == "qkv" else [torch.stack(expected)]
    for got_output, expected_output in zip(got, expected, strict=True):
        torch.testing.assert_close(got_output, expected_output, **_tolerance(precise_dtype(backend)))


@pytest.mark.parametrize("backend", backend_params())
def test_vmap_and_per_sample_grads_over_no_samples(case, backend):
    """A vmapped dimension of size 0 gives empty results and empty per-sample gradients, as torch's
    ops give them, of the shapes that the samples' would have."""
    op, case = case
    params, samples = case.make(precise_dtype(backend), device_for(backend))
    no_samples = tuple(s[:0] for s in samples) if isinstance(samples, tuple) else samples[:0]
    with torch.no_grad():
        got = torch.func.vmap(_forward, in_dims=(None, None, 0, None))(op, params, no_samples, backend)
        expected = torch.func.vmap(_forward, in_dims=(None, None, 0, None))(op, params, samples, backend)
    for got_output, expected_output in zip(*(t if isinstance(t, (list, tuple)) else [t] for t in (got, expected))):
        assert got_output.shape == (0, *expected_output.shape[1:])

    def loss(params, sample, backend):  # no Python sum(): torch's own 0 + tensor fails over no samples
        outputs = _forward(op, params, sample, backend)
        return (outputs[0] if isinstance(outputs, (list, tuple)) else outputs).square().sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(params, no_samples, backend)
    assert [tuple(g.shape) for g in grads] == [(0, *p.shape) for p in params]


def test_grad_and_jacrev_equal_torch():
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(5, 5, dtype=torch.float64)

    def ours(q):
        return tk.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def torchs(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch.testing.assert_close(torch.func.jacrev(ours)(q[:1, :1]), torch.func.jacrev(torchs)(q[:1, :1]))
    torch.testing.assert_close(
        torch.func.grad(lambda q: ours(q).sin().sum())(q), torch.func.grad(lambda q: torchs(q).sin().sum())(q)
    )


def test_vmap_over_inputs_and_masks_equals_torch():
    q = torch.randn(4, 2, 3, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, 7, 8, dtype=torch.float64), torch.randn(2, 3, 7, 8, dtype=torch.float64)
    padding = torch.rand(4, 2, 7) < 0.3
    padding[..., 0] = False  # every row keeps a key: torch gives NaN where ours gives 0
    got = torch.func.vmap(
        lambda q, padding: tk.scaled_dot_product_attention(q, k, v, key_padding_mask=padding), in_dims=(0, 0)
    )(q, padding)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~padding[:, :, None, None, :])
    torch.testing.assert_close(got, expected)


def test_vmap_dropout_follows_the_randomness_option():
    q = torch.randn(2, 3, 8, 8, dtype=torch.float64).expand(3, 2, 3, 8, 8)  # three equal samples

    def attend(q):
        return tk.scaled_dot_product_attention(q, q, q, dropout_p=0.5)

    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(attend)(q)  # torch's default refuses random ops under vmap, as for its own dropout
    same = torch.func.vmap(attend, randomness="same")(q)
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], same[2])
    different = torch.func.vmap(attend, randomness="different")(q)
    assert not torch.equal(different[0], different[1])


def test_per_sample_grads_of_multihead_attention_equal_torch_modules():
    torch_mha = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    ours = tknn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    ours.load_state_dict(torch_mha.state_dict())
    x = torch.randn(3, 1, 6, 16, dtype=torch.float64)
    padding = torch.zeros(3, 1, 6, dtype=torch.bool)
    padding[1, :, 4:] = True

    def per_sample_grads(module):
        params = {name: p.detach() for name, p in module.named_parameters()}

        def loss(params, x, padding):
            out, _ = torch.func.functional_call(module, params, (x, x, x), {"key_padding_mask": padding,
                                                                           "need_weights": False})
            return out.square().sum()

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, padding)

    expected = per_sample_grads(torch_mha)
    for name, grad in per_sample_grads(ours).items():
        torch.testing.assert_close(grad, expected[name], msg=lambda m: f"{name}: {m}")
