"""Call plans (``ops/_call_plans.py``): a public function's checked decisions, kept per call layout.

The test suite runs with ``CallPlans.verify`` set, so every call that finds a plan is also checked
against the checked route; these tests switch it off where they count what a call does, and check
that a plan is taken, that it runs each call on that call's own tensors, and that what changes the
decision (the layout, the backend asked for, the registry) changes the plan.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import transformer_kernels as tk
from transformer_kernels import _backend
from transformer_kernels.ops import attention as attention_op
from transformer_kernels.ops._call_plans import CallPlans
from transformer_kernels.reference.attention import attention as reference_attention

from _helpers import assert_close_to_reference


@pytest.fixture
def normalized(monkeypatch):
    """Counts the calls that take the checked route (``_normalize``), plans switched on and
    unchecked, starting from no plan."""
    monkeypatch.setattr(CallPlans, "verify", False)
    monkeypatch.setattr(attention_op, "_PLANS", CallPlans())
    calls = []
    real = attention_op._normalize
    monkeypatch.setattr(attention_op, "_normalize", lambda *args: calls.append(1) or real(*args))
    return calls


def _inputs(batch=2, heads=2, length=8, head_dim=16, requires_grad=False):
    return [torch.randn(batch, heads, length, head_dim, dtype=torch.float64, requires_grad=requires_grad)
            for _ in range(3)]


def _expected(q, k, v, padding=None, causal=False):
    return reference_attention(q, k, v, is_causal=causal, key_padding_mask=padding, masked_value=float("-inf"))


def test_a_layout_is_checked_once_and_each_call_runs_on_its_own_tensors(normalized):
    padding_a = torch.arange(8) >= torch.tensor([[8], [5]])
    padding_b = torch.arange(8) >= torch.tensor([[3], [7]])
    for padding in (padding_a, padding_b, padding_a):
        q, k, v = _inputs()
        out = tk.scaled_dot_product_attention(q, k, v, key_padding_mask=padding, is_causal=True, backend="eager")
        assert_close_to_reference(out, _expected(q, k, v, padding, causal=True), tol=1e-12)
    assert len(normalized) == 1


def test_gradients_through_a_plan(normalized):
    for _ in range(2):
        q, k, v = _inputs(requires_grad=True)
        out = tk.scaled_dot_product_attention(q, k, v, backend="eager")
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected = torch.autograd.grad(_expected(q, k, v).sum(), (q, k, v))
        for grad, reference in zip(grads, expected):
            assert_close_to_reference(grad, reference, tol=1e-12)
    assert len(normalized) == 1


@pytest.mark.parametrize("change", ["length", "strides", "dtype", "causal", "scale", "padding", "backend", "gqa"])
def test_what_changes_the_decision_changes_the_plan(normalized, change):
    q, k, v = _inputs()
    tk.scaled_dot_product_attention(q, k, v, backend="eager")
    kwargs = dict(backend="eager")
    if change == "length":
        q, k, v = _inputs(length=9)
    elif change == "strides":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "dtype":
        q, k, v = (t.float() for t in (q, k, v))
    elif change == "causal":
        kwargs["is_causal"] = True
    elif change == "scale":
        kwargs["scale"] = 0.5
    elif change == "padding":
        kwargs["key_padding_mask"] = torch.zeros(2, 8, dtype=torch.bool)
    elif change == "backend":
        kwargs = {}
    elif change == "gqa":
        kwargs["enable_gqa"] = True
    tk.scaled_dot_product_attention(q, k, v, **kwargs)
    assert len(normalized) == 2


def test_use_backend_and_a_new_registry_are_decisions_too(normalized, monkeypatch):
    q, k, v = _inputs()
    tk.scaled_dot_product_attention(q, k, v)
    with tk.use_backend("eager"):
        tk.scaled_dot_product_attention(q, k, v)
    assert len(normalized) == 2
    monkeypatch.setattr(_backend, "_registry", dict(_backend._registry))
    tk.scaled_dot_product_attention(q, k, v)
    assert len(normalized) == 3


def test_calls_that_are_not_run_as_given_keep_no_plan(normalized):
    """Broadcast inputs (3-D ones of different batch sizes among them), and a key padding mask that
    is broadcast: the checked route runs on expanded views, so every call takes it."""
    q, k, v = _inputs()
    for call in (
        lambda: tk.scaled_dot_product_attention(q, k[:1], v[:1]),
        lambda: tk.scaled_dot_product_attention(q[0], k[0, :1], v[0, :1]),
        lambda: tk.scaled_dot_product_attention(q, k, v, key_padding_mask=torch.zeros(8, dtype=torch.bool)),
    ):
        call()
        call()
    assert len(normalized) == 6


def test_three_dimensional_inputs_run_as_one_head_through_a_plan(normalized):
    """``[N, L, E]`` inputs of one batch size (a decoder's one-head attention): a plan runs them as
    ``unsqueeze(1)``, as the checked route does, with each call's own padding, and gradients reach
    the 3-D inputs."""
    for lengths in ([8, 5], [3, 7], [8, 5]):
        q, k, v = (t[:, 0].requires_grad_() for t in _inputs())
        padding = torch.arange(8) >= torch.tensor(lengths)[:, None]
        out = tk.scaled_dot_product_attention(q, k, v, key_padding_mask=padding, scale=1.0, backend="eager")
        expected = reference_attention(q, k, v, scale=1.0, key_padding_mask=padding, masked_value=float("-inf"))
        assert out.shape == (2, 8, 16)
        assert_close_to_reference(out, expected, tol=1e-12)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
        for grad, expected_grad in zip(grads, expected_grads):
            assert_close_to_reference(grad, expected_grad, tol=1e-10)
    assert len(normalized) == 1


def test_dropout_through_a_plan_draws_a_new_mask_each_call(normalized):
    q, k, v = _inputs(length=32)
    outs = [tk.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="eager") for _ in range(2)]
    assert not torch.equal(*outs)
    torch.manual_seed(3)
    again = tk.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="eager")
    torch.manual_seed(3)
    assert torch.equal(again, tk.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="eager"))
    assert len(normalized) == 1


def test_verify_fails_a_plan_that_decides_otherwise(monkeypatch):
    """What the test suite relies on: under ``verify``, a kept plan that the checks would not make
    fails the call instead of running it."""
    monkeypatch.setattr(attention_op, "_PLANS", CallPlans())
    q, k, v = _inputs()
    tk.scaled_dot_product_attention(q, k, v, backend="eager")
    ((key, (version, plan)),) = attention_op._PLANS._plans.items()
    stale = dataclasses.replace(plan, args=attention_op.AttentionArgs(None, None, attention_op.Causal.TOP_LEFT,
                                                                       plan.args.scale, 0.0, None))
    attention_op._PLANS._plans[key] = (version, stale)
    with pytest.raises(AssertionError, match="the attention plan kept for this call's layout"):
        tk.scaled_dot_product_attention(q, k, v, backend="eager")


@pytest.mark.parametrize("op", ["glu_conv1d", "glu_conv1d_step", "qkv_projection"])
def test_the_other_ops_check_a_layout_once(monkeypatch, op):
    """glu_conv1d, its decoding step (the first step, without a state, is a layout of its own) and
    qkv_projection: one check per layout, each call on its own tensors."""
    from transformer_kernels.ops import glu_conv as glu_op, qkv as qkv_op
    from transformer_kernels.reference.glu_conv import glu_conv1d as reference_glu
    from transformer_kernels.reference.qkv import qkv_projection as reference_qkv

    monkeypatch.setattr(CallPlans, "verify", False)
    module = qkv_op if op == "qkv_projection" else glu_op
    monkeypatch.setattr(module, "_PLANS", CallPlans())
    checks = []
    name = "_check_arguments" if op == "qkv_projection" else "_check_weight_and_bias"
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: checks.append(1) or real(*args))
    for _ in range(3):
        if op == "qkv_projection":
            x, weight, bias = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(24, 8, dtype=torch.float64), None
            outs = tk.qkv_projection(x, weight, bias, num_heads=2, backend="eager")
            assert_close_to_reference(outs, reference_qkv(x, weight, bias, 2), tol=1e-12)
            continue
        x, weight = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(8, 4, 3, dtype=torch.float64)
        expected = reference_glu(x, weight, None, padding="causal")
        if op == "glu_conv1d":
            out = tk.glu_conv1d(x, weight, padding="causal", backend="eager")
        else:
            state, outs = None, []
            for t in range(x.shape[2]):
                out_t, state = tk.glu_conv1d_step(x[:, :, t], state, weight, backend="eager")
                outs.append(out_t)
            out = torch.stack(outs, dim=2)
        assert_close_to_reference(out, expected, tol=1e-12)
    assert len(checks) == (2 if op == "glu_conv1d_step" else 1)


def test_a_sparse_tensor_never_takes_the_plan_of_a_dense_one(normalized):
    """A sparse tensor reports strides of 0, as an expanded dense one does: its layout must not
    find that one's plan, but the checks, which refuse it."""
    q, k, v = (torch.randn(1, 1, 1, 1, dtype=torch.float64).expand(2, 2, 8, 16) for _ in range(3))
    tk.scaled_dot_product_attention(q, k, v, backend="eager")
    sparse = torch.randn(2, 2, 8, 16, dtype=torch.float64).to_sparse()
    assert sparse.stride() == q.stride()
    with pytest.raises(TypeError, match="query must be a dense"):
        tk.scaled_dot_product_attention(sparse, k, v, backend="eager")
