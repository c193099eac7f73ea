"""transformer_kernels.nn: MultiheadAttention against torch.nn.MultiheadAttention (outputs, attention
weights and every gradient; masks, layouts, dropout, state_dict), replace_modules on torch's
Transformer models and the seeds' toy seq2seq, GLUConv1d against nn.Conv1d + F.glu, and
torch.compile of the modules.

torch's module is the oracle throughout: both modules hold the same parameters and get the same
inputs.  Rows whose keys are all masked are excluded from the parity cases (torch gives NaN there on
some paths) and tested on their own.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from _helpers import OpRecorder
from conftest import CUDA

import transformer_kernels.nn as tknn

TOL = {"atol": 1e-5, "rtol": 1e-5}
EMBED, HEADS, BATCH, LQ, LK = 8, 2, 3, 5, 6
KDIM, VDIM = 5, 7


# ----------------------------------------------------------------------------
# The comparison: same parameters, same inputs, outputs and every gradient
# ----------------------------------------------------------------------------


def module_pair(backend: Optional[str] = None, **kwargs) -> tuple[torch.nn.MultiheadAttention, tknn.MultiheadAttention]:
    """torch's module and ours with the same parameters (ours loads torch's state_dict, strict)."""
    reference = torch.nn.MultiheadAttention(EMBED, HEADS, **kwargs)
    ours = tknn.MultiheadAttention(EMBED, HEADS, **kwargs, backend=backend)
    ours.load_state_dict(reference.state_dict())
    with torch.no_grad():  # biases start at 0: make them count
        for name, parameter in reference.named_parameters():
            if "bias" in name:
                parameter.normal_()
                ours.get_parameter(name).copy_(parameter)
    return reference, ours


def leaves(tensors: dict) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]


def assert_same_outputs_and_grads(reference, ours, inputs: dict, kwargs: dict) -> None:
    """Forward both modules on ``inputs`` (name -> tensor, leaves shared) and ``kwargs``, then compare
    the outputs, the attention weights and the gradients of every parameter and of every input and mask
    that requires one."""
    expected = reference(**inputs, **kwargs)
    actual = ours(**inputs, **kwargs)
    assert (actual[1] is None) == (expected[1] is None)
    outputs = [(actual[0], expected[0])] + ([] if actual[1] is None else [(actual[1], expected[1])])
    for a, e in outputs:
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, **TOL)

    grad_outputs = [torch.randn_like(e) for _, e in outputs]
    inputs_needing_grad = leaves(inputs) + leaves(kwargs)  # float masks too
    grads = {}
    for module, index in ((reference, 1), (ours, 0)):
        targets = [t for _, t in inputs_needing_grad] + list(module.parameters())
        results = torch.autograd.grad([pair[index] for pair in outputs], targets, grad_outputs, allow_unused=True)
        names = [n for n, _ in inputs_needing_grad] + [n for n, _ in module.named_parameters()]
        grads[module] = dict(zip(names, results))
    assert grads[ours].keys() == grads[reference].keys()
    for name, expected_grad in grads[reference].items():
        actual_grad = grads[ours][name]
        if expected_grad is None:
            assert actual_grad is None or not actual_grad.any(), name
            continue
        torch.testing.assert_close(actual_grad, expected_grad, **TOL, msg=lambda m: f"grad of {name}: {m}")


# ----------------------------------------------------------------------------
# Cases: module configuration x attention kind x masks x need_weights
# ----------------------------------------------------------------------------


def bool_pairs_not_allowed(*shape) -> torch.Tensor:
    """torch's MHA convention (True = not allowed), key 0 always allowed so no row is empty."""
    mask = torch.rand(*shape) < 0.4
    mask[..., 0] = False
    return mask


def float_pairs(*shape) -> torch.Tensor:
    """An additive mask with some -inf (never at key 0), requiring a gradient."""
    mask = torch.randn(*shape).masked_fill(bool_pairs_not_allowed(*shape), float("-inf"))
    return mask.requires_grad_()


def causal_not_allowed(lq: int, lk: int) -> torch.Tensor:
    return torch.ones(lq, lk, dtype=torch.bool).triu(1)


MASKS = [
    "none",
    "attn_bool_2d",
    "attn_float_2d",
    "attn_bool_3d",
    "attn_float_3d",
    "causal_bool",
    "causal_float",
    "padding_bool",
    "padding_float",
    "attn_bool_2d+padding_bool",
    "attn_float_3d+padding_float",
    "causal_bool+padding_bool",
    "causal_float+padding_float",
]


def mask_kwargs(kind: str, batch: Optional[int], lq: int, lk: int) -> dict:
    """forward's mask arguments for ``kind``; ``batch`` None for unbatched inputs."""
    kwargs: dict = {}
    heads_batch = HEADS if batch is None else batch * HEADS
    for part in kind.split("+"):
        if part == "none":
            pass
        elif part == "attn_bool_2d":
            kwargs["attn_mask"] = bool_pairs_not_allowed(lq, lk)
        elif part == "attn_float_2d":
            kwargs["attn_mask"] = float_pairs(lq, lk)
        elif part == "attn_bool_3d":
            kwargs["attn_mask"] = bool_pairs_not_allowed(heads_batch, lq, lk)
        elif part == "attn_float_3d":
            kwargs["attn_mask"] = float_pairs(heads_batch, lq, lk)
        elif part == "causal_bool":
            kwargs.update(attn_mask=causal_not_allowed(lq, lk), is_causal=True)
        elif part == "causal_float":
            causal = torch.zeros(lq, lk).masked_fill(causal_not_allowed(lq, lk), float("-inf"))
            kwargs.update(attn_mask=causal, is_causal=True)
        elif part == "padding_bool":
            kwargs["key_padding_mask"] = bool_pairs_not_allowed(*([] if batch is None else [batch]), lk)
        elif part == "padding_float":
            kwargs["key_padding_mask"] = float_pairs(*([] if batch is None else [batch]), lk)
        else:
            raise AssertionError(part)
    return kwargs


ATTENTION_KINDS = ["self", "cross", "distinct", "kdim_vdim"]


def make_inputs(kind: str, batch_first: bool, batch: Optional[int]) -> dict:
    """query/key/value for ``kind`` with the identities torch's MHA keys on: self-attention passes one
    tensor three times, cross-attention one key/value tensor."""

    def sequence(length: int, features: int) -> torch.Tensor:
        if batch is None:
            shape = (length, features)
        else:
            shape = (batch, length, features) if batch_first else (length, batch, features)
        return torch.randn(shape, requires_grad=True)

    query = sequence(LQ if kind != "self" else LK, EMBED)
    if kind == "self":
        return {"query": query, "key": query, "value": query}
    if kind == "cross":
        memory = sequence(LK, EMBED)
        return {"query": query, "key": memory, "value": memory}
    if kind == "distinct":
        return {"query": query, "key": sequence(LK, EMBED), "value": sequence(LK, EMBED)}
    return {"query": query, "key": sequence(LK, KDIM), "value": sequence(LK, VDIM)}


def module_kwargs(kind: str, batch_first: bool, **extra) -> dict:
    kwargs = {"batch_first": batch_first, **extra}
    if kind == "kdim_vdim":
        kwargs.update(kdim=KDIM, vdim=VDIM)
    return kwargs


NEED_WEIGHTS = [
    {"need_weights": False},
    {"need_weights": True},
    {"need_weights": True, "average_attn_weights": False},
]


def _run_case(kind, batch_first, mask, weights, batch=BATCH, **module_extra):
    reference, ours = module_pair(**module_kwargs(kind, batch_first, **module_extra))
    inputs = make_inputs(kind, batch_first, batch)
    lq = LK if kind == "self" else LQ
    forward_kwargs = {**mask_kwargs(mask, batch, lq, LK), **weights}
    assert_same_outputs_and_grads(reference, ours, inputs, forward_kwargs)


@pytest.mark.parametrize("weights", NEED_WEIGHTS, ids=["fused", "weights_avg", "weights_per_head"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_matches_torch(batch_first, kind, mask, weights):
    _run_case(kind, batch_first, mask, weights)


@pytest.mark.parametrize("weights", NEED_WEIGHTS, ids=["fused", "weights_avg", "weights_per_head"])
@pytest.mark.parametrize("mask", ["none", "attn_bool_3d", "causal_bool", "padding_bool", "attn_float_2d+padding_float"])
@pytest.mark.parametrize("kind", ["self", "cross", "kdim_vdim"])
@pytest.mark.parametrize(
    "extra",
    [{"add_bias_kv": True}, {"add_zero_attn": True}, {"add_bias_kv": True, "add_zero_attn": True}],
    ids=["bias_kv", "zero_attn", "bias_kv+zero_attn"],
)
def test_extra_keys_match_torch(extra, kind, mask, weights):
    _run_case(kind, True, mask, weights, **extra)


@pytest.mark.parametrize("weights", NEED_WEIGHTS, ids=["fused", "weights_avg", "weights_per_head"])
@pytest.mark.parametrize("mask", ["none", "attn_bool_2d", "attn_float_3d", "causal_bool", "padding_bool",
                                  "padding_float", "causal_float+padding_float"])
@pytest.mark.parametrize("kind", ["self", "cross", "kdim_vdim"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])  # ignored when unbatched
def test_unbatched_matches_torch(batch_first, kind, mask, weights):
    _run_case(kind, batch_first, mask, weights, batch=None)


@pytest.mark.parametrize("weights", NEED_WEIGHTS[:2], ids=["fused", "weights_avg"])
@pytest.mark.parametrize(("batch", "lq", "lk"), [(0, 5, 7), (2, 0, 7), (2, 5, 0), (2, 0, 0)],
                         ids=["no_batch", "no_query", "no_key", "nothing"])
def test_zero_sized_inputs_match_torch(batch, lq, lk, weights):
    """Empty batches and sequences, as torch's module takes them (no key: the output projection's
    bias)."""
    reference, ours = module_pair(batch_first=True)
    query = torch.randn(batch, lq, EMBED, requires_grad=True)
    key = torch.randn(batch, lk, EMBED, requires_grad=True)
    assert_same_outputs_and_grads(reference, ours, {"query": query, "key": key, "value": key}, weights)


@pytest.mark.parametrize("weights", NEED_WEIGHTS[:2], ids=["fused", "weights_avg"])
def test_head_dims_past_the_fused_kernels_match_torch(weights):
    """A head dim past 256 runs on eager (the fused GPU kernels serve up to 256)."""
    reference = torch.nn.MultiheadAttention(300, 1, batch_first=True)
    ours = tknn.MultiheadAttention(300, 1, batch_first=True)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5, 300, requires_grad=True)
    assert_same_outputs_and_grads(reference, ours, {"query": x, "key": x, "value": x}, weights)


@pytest.mark.parametrize("batch_first", [True, False])
def test_no_bias_matches_torch(batch_first):
    _run_case("self", batch_first, "padding_bool", {"need_weights": False}, bias=False)
    _run_case("cross", batch_first, "attn_bool_2d", {"need_weights": True}, bias=False)


def test_query_is_key_but_not_value_matches_torch():
    reference, ours = module_pair(batch_first=True)
    x = torch.randn(BATCH, LK, EMBED, requires_grad=True)
    value = torch.randn(BATCH, LK, EMBED, requires_grad=True)
    inputs = {"query": x, "key": x, "value": value}
    assert_same_outputs_and_grads(reference, ours, inputs, mask_kwargs("padding_bool", BATCH, LK, LK))


def test_float64_matches_torch():
    reference, ours = module_pair(batch_first=True, dtype=torch.float64)
    x = torch.randn(BATCH, LK, EMBED, dtype=torch.float64, requires_grad=True)
    padding = bool_pairs_not_allowed(BATCH, LK)
    assert_same_outputs_and_grads(reference, ours, {"query": x, "key": x, "value": x},
                                  {"key_padding_mask": padding, "need_weights": False})


@pytest.mark.parametrize("need_weights", [False, True])
def test_out_proj_is_read_as_parameters_like_torch(need_weights):
    """torch's forward reads out_proj's weight and bias; it never calls the module, so a hook on it
    (an observer, a pruning hook) changes neither model's output."""
    reference, ours = module_pair(batch_first=True)
    calls = []
    for module in (reference, ours):
        module.out_proj.register_forward_hook(lambda module, args, out: calls.append(module) or out * 2)
    x = torch.randn(BATCH, LK, EMBED)
    torch.testing.assert_close(ours(x, x, x, need_weights=need_weights)[0],
                               reference(x, x, x, need_weights=need_weights)[0])
    torch.testing.assert_close(ours(x[0], x[0], x[0], need_weights=need_weights)[0],
                               reference(x[0], x[0], x[0], need_weights=need_weights)[0])
    assert calls == []


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("inputs", ["self", "shared_key_value", "cross", "unbatched"])
def test_every_parameter_is_read_once_per_call(need_weights, inputs):
    """A parametrization runs on every read of its parameter (spectral_norm steps its power
    iteration): each of the module's parameters is read once per call, as torch reads out_proj.weight
    and bias_k (its self-attention reads in_proj_weight and in_proj_bias three times)."""
    reads = collections.Counter()

    class Counted(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def forward(self, value):
            reads[self.name] += 1
            return value

    ours = tknn.MultiheadAttention(EMBED, HEADS, batch_first=True, add_bias_kv=True)
    for owner, name in ((ours, "in_proj_weight"), (ours, "in_proj_bias"), (ours, "bias_k"), (ours, "bias_v"),
                        (ours.out_proj, "weight")):
        torch.nn.utils.parametrize.register_parametrization(owner, name, Counted(name))
    x, memory = torch.randn(BATCH, LQ, EMBED), torch.randn(BATCH, LK, EMBED)
    arguments = {"self": (x, x, x), "shared_key_value": (x, memory, memory), "cross": (x, memory, memory.clone()),
                 "unbatched": (x[0], x[0], x[0])}[inputs]
    reads.clear()
    ours(*arguments, need_weights=need_weights)
    assert dict(reads) == {name: 1 for name in ("in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "weight")}


@pytest.mark.parametrize("need_weights", [False, True])
def test_meta_inputs_give_torchs_shapes(need_weights):
    reference, ours = module_pair(batch_first=True)
    reference, ours = reference.to("meta"), ours.to("meta")
    x = torch.randn(BATCH, LK, EMBED, device="meta")
    for got, want in zip(ours(x, x, x, need_weights=need_weights), reference(x, x, x, need_weights=need_weights)):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("weights", NEED_WEIGHTS[:2], ids=["fused", "weights"])
@pytest.mark.parametrize("mask", ["padding_bool", "attn_float_2d", "causal_float", "attn_float_3d+padding_float"])
def test_autocast_matches_torch(mask, weights):
    """Under torch.autocast the projections run in bfloat16 and torch casts float masks to it: so does ours."""
    reference, ours = module_pair(batch_first=True)
    x = torch.randn(BATCH, LK, EMBED, requires_grad=True)
    kwargs = {**mask_kwargs(mask, BATCH, LK, LK), **weights}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = reference(x, x, x, **kwargs), ours(x, x, x, **kwargs)
    bf16_tol = {"atol": 2e-2, "rtol": 2e-2}
    for a, e in zip(actual, expected):
        if e is not None:
            assert a.dtype == e.dtype == torch.bfloat16
            torch.testing.assert_close(a, e, **bf16_tol)
    grad = torch.randn_like(expected[0])
    (expected_grad,) = torch.autograd.grad(expected[0], x, grad)
    (actual_grad,) = torch.autograd.grad(actual[0], x, grad)
    torch.testing.assert_close(actual_grad, expected_grad, **bf16_tol)


def test_mismatched_mask_dtypes_warn_like_torch():
    reference, ours = module_pair(batch_first=True)
    x = torch.randn(BATCH, LK, EMBED)
    kwargs = {"attn_mask": bool_pairs_not_allowed(LK, LK), "key_padding_mask": float_pairs(BATCH, LK).detach(),
              "need_weights": False}
    with pytest.warns(UserWarning, match="Support for mismatched key_padding_mask and attn_mask"):
        expected = reference(x, x, x, **kwargs)[0]
    with pytest.warns(UserWarning, match="Support for mismatched key_padding_mask and attn_mask"):
        actual = ours(x, x, x, **kwargs)[0]
    torch.testing.assert_close(actual, expected, **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("mask_name", ["attn_mask", "key_padding_mask"])
def test_float32_masks_of_other_dtypes_inputs_follow_torch(dtype, mask_name):
    """torch's SDPA path (``need_weights=False``) takes a float32 mask with float16 or float64 inputs
    (``nn.Transformer.generate_square_subsequent_mask`` makes float32 ones); its weights path refuses it."""
    reference, ours = module_pair(batch_first=True, dtype=dtype)
    x = torch.randn(BATCH, LK, EMBED, dtype=dtype)
    mask = (torch.nn.Transformer.generate_square_subsequent_mask(LK) if mask_name == "attn_mask"
            else float_pairs(BATCH, LK).detach().float())
    assert mask.dtype == torch.float32
    expected = reference(x, x, x, need_weights=False, **{mask_name: mask})[0]
    actual = ours(x, x, x, need_weights=False, **{mask_name: mask})[0]
    tolerance = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(actual, expected, **tolerance)
    for module in (reference, ours):
        with pytest.raises(RuntimeError):
            module(x, x, x, need_weights=True, **{mask_name: mask})


# ----------------------------------------------------------------------------
# What reaches the fused ops
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Recorded:
    projections: list
    attention: list


@pytest.fixture
def recorded(monkeypatch):
    """Records the weights' row counts of every qkv_projection call and the mask arguments of every
    scaled_dot_product_attention call the module makes."""
    from transformer_kernels.nn import attention as module

    calls = Recorded([], [])
    projection, attention = module.qkv_projection, module.scaled_dot_product_attention

    def record_projection(x, weight, bias=None, **kwargs):
        calls.projections.append(weight.shape[0] // weight.shape[1])
        return projection(x, weight, bias, **kwargs)

    def record_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.attention.append({"attn_mask": attn_mask, "is_causal": is_causal, **kwargs})
        return attention(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(module, "qkv_projection", record_projection)
    monkeypatch.setattr(module, "scaled_dot_product_attention", record_attention)
    return calls


@pytest.mark.parametrize(("kind", "projections"), [("self", [3]), ("cross", [1, 2]), ("distinct", [1, 1, 1])])
def test_projections_are_packed_by_input_identity(recorded, kind, projections):
    _, ours = module_pair(batch_first=True)
    ours(**make_inputs(kind, True, BATCH), need_weights=False)
    assert recorded.projections == projections


@pytest.mark.parametrize("kind", ["self", "cross", "distinct"])
def test_packed_projection_gradients_gather_without_zero_filled_copies(kind):
    """The packed in_proj_weight's parts come from one split (or the whole parameter), so backward
    joins their gradients in one op, never a zero gradient of the whole weight per part (a slice's)."""
    _, ours = module_pair(batch_first=True)
    inputs = make_inputs(kind, True, BATCH)
    with OpRecorder() as recorder:
        out, _ = ours(**inputs, need_weights=False)
        torch.autograd.grad(out.sum(), list(ours.parameters()))
    assert "slice_backward" not in recorder.ops


def test_bool_key_padding_mask_reaches_attention_unexpanded(recorded):
    _, ours = module_pair(batch_first=True)
    inputs = make_inputs("self", True, BATCH)
    padding = bool_pairs_not_allowed(BATCH, LK)
    ours(**inputs, key_padding_mask=padding, attn_mask=bool_pairs_not_allowed(LK, LK), need_weights=False)
    (call,) = recorded.attention
    assert call["key_padding_mask"] is padding
    assert call["attn_mask"].shape == (LK, LK)  # a 2-D mask stays 2-D: read broadcast


def test_float_key_padding_mask_is_a_broadcast_view(recorded):
    _, ours = module_pair(batch_first=True)
    inputs = make_inputs("self", True, BATCH)
    padding = float_pairs(BATCH, LK)
    ours(**inputs, key_padding_mask=padding, need_weights=False)
    (call,) = recorded.attention
    assert call["key_padding_mask"] is None
    assert call["attn_mask"].shape == (BATCH, 1, 1, LK)
    assert call["attn_mask"].data_ptr() == padding.data_ptr()


def test_causal_hint_without_padding_builds_no_mask(recorded):
    _, ours = module_pair(batch_first=True)
    inputs = make_inputs("self", True, BATCH)
    ours(**inputs, attn_mask=causal_not_allowed(LK, LK), is_causal=True, need_weights=False)
    ours(**inputs, attn_mask=causal_not_allowed(LK, LK), is_causal=True, key_padding_mask=torch.zeros(BATCH, LK,
         dtype=torch.bool), need_weights=False)
    assert recorded.attention[0]["is_causal"] and recorded.attention[0]["attn_mask"] is None
    # With key padding torch applies the mask and ignores the hint; so does ours.
    assert not recorded.attention[1]["is_causal"] and recorded.attention[1]["attn_mask"] is not None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensor_inputs_run_torchs_forward():
    reference, ours = module_pair(batch_first=True)
    reference.eval()
    ours.eval()
    nested = torch.nested.nested_tensor([torch.randn(4, EMBED), torch.randn(6, EMBED)])
    with torch.no_grad():
        expected, _ = reference(nested, nested, nested, need_weights=False)
        actual, _ = ours(nested, nested, nested, need_weights=False)
    assert actual.is_nested
    torch.testing.assert_close(actual.to_padded_tensor(0.0), expected.to_padded_tensor(0.0), **TOL)


def test_fused_output_layouts():
    """batch_first: a contiguous [N, L, E]; seq-first: torch's contiguous [L, N, E]."""
    for batch_first in (True, False):
        _, ours = module_pair(batch_first=batch_first)
        inputs = make_inputs("self", batch_first, BATCH)
        out, _ = ours(**inputs, need_weights=False)
        assert out.is_contiguous() and out.shape == inputs["query"].shape


# ----------------------------------------------------------------------------
# Rows without keys, errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("weights", NEED_WEIGHTS, ids=["fused", "weights_avg", "weights_per_head"])
@pytest.mark.parametrize("padding_dtype", [torch.bool, torch.float32])
def test_rows_without_keys_give_out_proj_bias_and_zero_gradient(weights, padding_dtype):
    reference, ours = module_pair(batch_first=True)
    x = torch.randn(BATCH, LK, EMBED, requires_grad=True)
    padding = bool_pairs_not_allowed(BATCH, LK)
    padding[1] = True  # sequence 1 is all padding
    if padding_dtype != torch.bool:
        padding = torch.zeros(BATCH, LK).masked_fill(padding, float("-inf"))
    out, attn_weights = ours(x, x, x, key_padding_mask=padding, **weights)
    expected_out, expected_weights = reference(x, x, x, key_padding_mask=padding, **weights)
    torch.testing.assert_close(out[1], ours.out_proj.bias.expand(LK, EMBED), **TOL)
    others = [0, 2]
    torch.testing.assert_close(out[others], expected_out[others], **TOL)
    if attn_weights is not None:
        assert not attn_weights[1].any()
        torch.testing.assert_close(attn_weights[others], expected_weights[others], **TOL)
    (grad_x,) = torch.autograd.grad(out.sum(), x)
    assert torch.isfinite(grad_x).all()
    # Sequence 1 reaches its output only through attention, which it has none of.
    assert not grad_x[1].any()


BAD_INPUTS = [
    ("4d_query", {"query": (1, 2, LK, EMBED)}, AssertionError, "query should be unbatched 2D or batched 3D"),
    ("2d_key_3d_query", {"key": (LK, EMBED)}, AssertionError, "expected `key` and `value` to be 3-D"),
    ("query_features", {"query": (BATCH, LK, EMBED + 1)}, AssertionError, "query must have 8 features"),
    ("value_length", {"value": (BATCH, LK + 1, EMBED)}, AssertionError, "key and value must have the same"),
    ("key_batch", {"key": (BATCH + 1, LK, EMBED), "value": (BATCH + 1, LK, EMBED)}, RuntimeError,
     "key must have query's batch size"),
    ("padding_shape", {"key_padding_mask": torch.zeros(BATCH, LK + 1, dtype=torch.bool)}, AssertionError,
     r"key_padding_mask must have shape \(N, S\)"),
    ("padding_dim", {"key_padding_mask": torch.zeros(LK, dtype=torch.bool)}, AssertionError,
     "expected `key_padding_mask` to be `None` or 2-D"),
    ("padding_int", {"key_padding_mask": torch.zeros(BATCH, LK, dtype=torch.int64)}, AssertionError,
     "only bool and floating types of key_padding_mask"),
    ("mask_float64", {"attn_mask": torch.zeros(LK, LK, dtype=torch.float64)}, RuntimeError,
     "float attn_mask must have query's dtype"),
    ("mask_2d_shape", {"attn_mask": torch.zeros(LK, LK + 1, dtype=torch.bool)}, RuntimeError,
     "The shape of the 2D attn_mask is"),
    ("mask_3d_shape", {"attn_mask": torch.zeros(HEADS, LK, LK, dtype=torch.bool)}, RuntimeError,
     "The shape of the 3D attn_mask is"),
    ("mask_4d", {"attn_mask": torch.zeros(1, 1, LK, LK, dtype=torch.bool)}, AssertionError,
     "attn_mask must be 2-D"),
    ("causal_without_mask", {"is_causal": True}, RuntimeError, "Need attn_mask if specifying the is_causal hint"),
    ("query_dtype", {"query": torch.zeros(BATCH, LK, EMBED, dtype=torch.float64)}, RuntimeError,
     "query must have the module's parameters' dtype torch.float32, got torch.float64"),
    ("value_dtype", {"value": torch.zeros(BATCH, LK, EMBED, dtype=torch.float64)}, RuntimeError,
     "value must have the module's parameters' dtype torch.float32, got torch.float64"),
]


@pytest.mark.parametrize(("overrides", "error", "match"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_torchs_exception_types(overrides, error, match):
    reference, ours = module_pair(batch_first=True)
    arguments = {"query": (BATCH, LK, EMBED), "key": (BATCH, LK, EMBED), "value": (BATCH, LK, EMBED),
                 "need_weights": False}
    arguments.update(overrides)
    arguments = {k: torch.randn(v) if isinstance(v, tuple) else v for k, v in arguments.items()}
    with pytest.raises(error, match=match):
        ours(**arguments)
    with pytest.raises(error):  # torch rejects the same input with the same exception type
        reference(**arguments)


@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("not_a_tensor", [None, [[0.0] * EMBED] * LK])
def test_inputs_that_are_not_tensors_raise_type_errors_naming_them(name, not_a_tensor):
    _, ours = module_pair(batch_first=True)
    arguments = {key: torch.randn(BATCH, LK, EMBED) for key in ("query", "key", "value")}
    arguments[name] = not_a_tensor
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got {type(not_a_tensor).__name__}"):
        ours(**arguments)


def test_constructor_checks_backend():
    with pytest.raises(ValueError, match="backend must be None or one of"):
        tknn.MultiheadAttention(EMBED, HEADS, backend="cudnn")
    with pytest.raises(AssertionError, match="embed_dim must be divisible by num_heads"):
        tknn.MultiheadAttention(EMBED, 3)


# ----------------------------------------------------------------------------
# state_dict, parameters
# ----------------------------------------------------------------------------

STATE_DICT_CONFIGS = [
    {},
    {"bias": False},
    {"kdim": KDIM, "vdim": VDIM},
    {"add_bias_kv": True},
    {"add_bias_kv": True, "kdim": KDIM, "bias": False},
]


@pytest.mark.parametrize("config", STATE_DICT_CONFIGS, ids=[str(c) for c in STATE_DICT_CONFIGS])
def test_state_dict_loads_both_ways(config):
    reference = torch.nn.MultiheadAttention(EMBED, HEADS, **config)
    ours = tknn.MultiheadAttention(EMBED, HEADS, **config)
    assert list(ours.state_dict()) == list(reference.state_dict())
    for name, tensor in ours.state_dict().items():
        assert tensor.shape == reference.state_dict()[name].shape, name
    ours.load_state_dict(reference.state_dict(), strict=True)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.add_(1.0)
    reference.load_state_dict(ours.state_dict(), strict=True)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(reference.state_dict()[name], tensor), name


def test_initialization_is_torchs():
    torch.manual_seed(5)
    reference = torch.nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True, kdim=KDIM)
    torch.manual_seed(5)
    ours = tknn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True, kdim=KDIM)
    for (name, expected), (_, actual) in zip(reference.named_parameters(), ours.named_parameters()):
        assert torch.equal(actual, expected), name
    assert isinstance(ours, torch.nn.MultiheadAttention)


# ----------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------


def _dropout_probe(module: torch.nn.MultiheadAttention, batch: int, need_weights: bool) -> torch.Tensor:
    """The dropped attention weights of a self-attention whose weights are all 1/S: queries and keys
    project to 0, the values of the S = EMBED keys are the one-hot rows of the identity, and the output
    projection is the identity, so output row i *is* the row i of dropout(P)."""
    with torch.no_grad():
        module.in_proj_weight.zero_()
        module.in_proj_weight[2 * EMBED:] = torch.eye(EMBED)
        module.in_proj_bias.zero_()
        module.out_proj.weight.copy_(torch.eye(EMBED))
        module.out_proj.bias.zero_()
    x = torch.eye(EMBED).expand(batch, EMBED, EMBED)
    out, weights = module(x, x, x, need_weights=need_weights, average_attn_weights=False)
    return out if weights is None else weights


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_dropout_statistics_match_torch(need_weights):
    """Both modules drop each weight independently with probability p and scale the rest by
    1 / (1 - p): the kept fraction of 8 * 8 * 128 (* 2 heads) weights is within 5 sigma of 1 - p."""
    p, batch = 0.3, 128
    reference, ours = module_pair(batch_first=True, dropout=p)
    for module in (reference, ours):
        dropped = _dropout_probe(module, batch, need_weights)
        kept = dropped != 0
        sigma = math.sqrt(p * (1 - p) / kept.numel())
        assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma, type(module)
        torch.testing.assert_close(dropped[kept], torch.full_like(dropped[kept], 1 / EMBED / (1 - p)))
    ours.eval()
    torch.testing.assert_close(_dropout_probe(ours, 2, need_weights), torch.full((2, EMBED, EMBED), 1 / EMBED)
                               if not need_weights else torch.full((2, HEADS, EMBED, EMBED), 1 / EMBED))


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_dropout_is_reproducible_under_manual_seed(need_weights):
    _, ours = module_pair(batch_first=True, dropout=0.5)
    inputs = make_inputs("self", True, BATCH)
    padding = bool_pairs_not_allowed(BATCH, LK)

    def run(seed):
        torch.manual_seed(seed)
        out, _ = ours(**inputs, key_padding_mask=padding, need_weights=need_weights)
        return (out, *torch.autograd.grad(out.sum(), [inputs["query"], ours.in_proj_weight]))

    first, again, other = run(1), run(1), run(2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


def test_dropout_of_the_weights_path_is_torchs():
    """need_weights=True draws torch's own F.dropout in torch's order: the same weights as torch's."""
    reference, ours = module_pair(batch_first=True, dropout=0.5)
    inputs = make_inputs("cross", True, BATCH)
    torch.manual_seed(3)
    expected = reference(**inputs)
    torch.manual_seed(3)
    actual = ours(**inputs)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **TOL)


# ----------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------


def test_backend_attribute_reaches_the_ops(monkeypatch):
    from transformer_kernels.nn import attention as module

    seen = []
    projection = module.qkv_projection

    def record(x, weight, bias=None, **kwargs):
        seen.append(kwargs["backend"])
        return projection(x, weight, bias, **kwargs)

    monkeypatch.setattr(module, "qkv_projection", record)
    _, ours = module_pair(batch_first=True)
    ours.backend = "eager"
    ours(**make_inputs("self", True, BATCH), need_weights=False)
    assert seen == ["eager"]


@pytest.mark.skipif(CUDA, reason="the Triton interpreter runs CPU tensors")
@pytest.mark.parametrize(("kind", "mask"), [("self", "padding_bool"), ("cross", "attn_float_2d+padding_float"),
                                            ("self", "causal_bool")])
def test_triton_backend_matches_torch(kind, mask):
    pytest.importorskip("triton")
    reference, ours = module_pair(batch_first=True, backend="triton")
    inputs = make_inputs(kind, True, BATCH)
    lq = LK if kind == "self" else LQ
    assert_same_outputs_and_grads(reference, ours, inputs, {**mask_kwargs(mask, BATCH, lq, LK),
                                                            "need_weights": False})


# ----------------------------------------------------------------------------
# replace_modules
# ----------------------------------------------------------------------------


def _parameter_grads(model: torch.nn.Module, loss: torch.Tensor, inputs: list[torch.Tensor]) -> dict:
    names = [f"input{i}" for i in range(len(inputs))] + [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, inputs + list(model.parameters()), allow_unused=True)
    return dict(zip(names, grads))


def assert_same_model_outputs_and_grads(reference, ours, run) -> None:
    """``run(model, *inputs)`` -> output; compares outputs and the gradients of the inputs and every
    parameter (a random weighting of the output as the loss)."""
    inputs = run.inputs()
    expected, actual = run(reference, *inputs), run(ours, *inputs)
    torch.testing.assert_close(actual, expected, **TOL)
    if not torch.is_grad_enabled():
        return
    weighting = torch.randn_like(expected)
    leaf_inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    expected_grads = _parameter_grads(reference, (expected * weighting).sum(), leaf_inputs)
    actual_grads = _parameter_grads(ours, (actual * weighting).sum(), leaf_inputs)
    assert actual_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, **TOL, msg=lambda m: f"grad of {name}: {m}")


def suffix_padding(batch: int, length: int) -> torch.Tensor:
    """bool [batch, length], True = padding after each sequence's length (at least 1)."""
    lengths = torch.randint(1, length + 1, (batch,))
    lengths[0] = length
    return torch.arange(length) >= lengths[:, None]


class TransformerRun:
    """nn.Transformer's forward with source padding, a causal target mask and memory padding."""

    def __init__(self, batch_first: bool, src_len: int = 7, tgt_len: int = 5, d_model: int = 16):
        self.batch_first, self.src_len, self.tgt_len, self.d_model = batch_first, src_len, tgt_len, d_model

    def inputs(self):
        def sequence(length):
            shape = (BATCH, length, self.d_model) if self.batch_first else (length, BATCH, self.d_model)
            return torch.randn(shape, requires_grad=torch.is_grad_enabled())

        return sequence(self.src_len), sequence(self.tgt_len), suffix_padding(BATCH, self.src_len)

    def __call__(self, model, src, tgt, padding):
        tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(self.tgt_len)
        return model(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=padding, memory_key_padding_mask=padding,
                     tgt_is_causal=True)


class EncoderRun:
    """nn.TransformerEncoder's forward with suffix source padding (the nested-tensor fast path's case)."""

    def __init__(self, length: int = 7, d_model: int = 16):
        self.length, self.d_model = length, d_model

    def inputs(self):
        return (torch.randn(BATCH, self.length, self.d_model, requires_grad=torch.is_grad_enabled()),
                suffix_padding(BATCH, self.length))

    def __call__(self, model, src, padding):
        return model(src, src_key_padding_mask=padding)


def transformer_pair(batch_first: bool):
    reference = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                     dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    ours = copy.deepcopy(reference)
    assert tknn.replace_modules(ours) == 6  # 2 encoder self-attentions, 2 x 2 in the decoder
    return reference, ours


def encoder_pair():
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    reference = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
    ours = copy.deepcopy(reference)
    assert tknn.replace_modules(ours) == 2
    return reference, ours


@pytest.fixture
def forward_calls(monkeypatch):
    """Counts the calls of transformer_kernels.nn.MultiheadAttention.forward."""
    calls = []
    forward = tknn.MultiheadAttention.forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(tknn.MultiheadAttention, "forward", counted)
    return calls


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad"])
def test_replace_modules_keeps_transformer_outputs_and_grads(forward_calls, batch_first, mode):
    reference, ours = transformer_pair(batch_first)
    reference.train(mode == "train")
    ours.train(mode == "train")
    with torch.set_grad_enabled(mode != "eval_no_grad"):
        assert_same_model_outputs_and_grads(reference, ours, TransformerRun(batch_first))
    # The decoder always calls its attention modules; under no_grad with batch_first the encoder's
    # layers take torch's fast path (torch._transformer_encoder_layer_fwd) and call none.
    encoder_calls = 0 if (mode == "eval_no_grad" and batch_first) else 2
    assert len(forward_calls) == 4 + encoder_calls


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad"])
def test_replace_modules_keeps_encoder_outputs_and_grads(forward_calls, mode):
    """In eval under no_grad the encoder turns the padded batch into a nested tensor and every layer
    runs torch._transformer_encoder_layer_fwd on the attention weights, never self_attn.forward: that
    path keeps working on the replaced modules.  Elsewhere the replaced forward runs."""
    reference, ours = encoder_pair()
    reference.train(mode == "train")
    ours.train(mode == "train")
    with torch.set_grad_enabled(mode != "eval_no_grad"):
        assert_same_model_outputs_and_grads(reference, ours, EncoderRun())
    assert len(forward_calls) == (0 if mode == "eval_no_grad" else 2)


def test_replace_modules_keeps_parameters_dtype_and_mode():
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True),
        torch.nn.TransformerDecoderLayer(d_model=8, nhead=2, dim_feedforward=16),
    ).double()
    model[1].eval()
    parameters = dict(model.named_parameters())
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    modes = {name: module.training for name, module in model.named_modules()}
    assert tknn.replace_modules(model, backend="eager") == 3
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.MultiheadAttention):
            assert type(module) is tknn.MultiheadAttention and module.backend == "eager"
        assert module.training == modes[name], name
    assert dict(model.named_parameters()).keys() == parameters.keys()
    for name, parameter in model.named_parameters():
        assert parameter is parameters[name], name  # the same objects: an existing optimizer keeps them
        assert parameter.dtype == torch.float64
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_replace_modules_counts_each_module_once_and_skips_subclasses():
    class CustomAttention(torch.nn.MultiheadAttention):
        pass

    shared = torch.nn.MultiheadAttention(8, 2)
    model = torch.nn.ModuleList([shared, shared, CustomAttention(8, 2), tknn.MultiheadAttention(8, 2)])
    assert tknn.replace_modules(model) == 1
    assert type(model[0]) is tknn.MultiheadAttention and model[1] is model[0]
    assert type(model[2]) is CustomAttention
    root = torch.nn.MultiheadAttention(8, 2)
    assert tknn.replace_modules(root) == 1 and type(root) is tknn.MultiheadAttention
    with pytest.raises(ValueError, match="backend must be None or one of"):
        tknn.replace_modules(torch.nn.Linear(2, 2), backend="fast")


class ToySeq2Seq(torch.nn.Module):
    """The smallest seed notebook's model, re-implemented: three attention layers of head dim 2 (embedding
    4, 2 heads): causal self-attention over the target prefix, padded self-attention over the source,
    and the prefix attending to the source."""

    def __init__(self, src_vocab: int, trg_vocab: int, max_len: int, pad_index: int):
        super().__init__()
        embed, heads = 4, 2
        self.pad_index = pad_index
        self.register_buffer("not_after", torch.ones(max_len, max_len, dtype=torch.bool).triu(1))
        self.position = torch.nn.Embedding(max_len, embed)
        self.trg_embedding = torch.nn.Embedding(trg_vocab, embed)
        self.src_embedding = torch.nn.Embedding(src_vocab, embed)
        self.prefix_attention = torch.nn.MultiheadAttention(embed, heads, batch_first=True)
        self.source_attention = torch.nn.MultiheadAttention(embed, heads, batch_first=True)
        self.combining_attention = torch.nn.MultiheadAttention(embed, heads, batch_first=True)
        self.output = torch.nn.Linear(embed, trg_vocab)

    def forward(self, src, trg_in):
        trg_len, src_len = trg_in.shape[1], src.shape[1]
        prefix = self.trg_embedding(trg_in) + self.position.weight[:trg_len]
        prefix, _ = self.prefix_attention(prefix, prefix, prefix, attn_mask=self.not_after[:trg_len, :trg_len],
                                          need_weights=False, is_causal=True)
        src_padding = src == self.pad_index
        source = self.src_embedding(src) + self.position.weight[:src_len]
        source, _ = self.source_attention(source, source, source, key_padding_mask=src_padding, need_weights=False)
        combined, _ = self.combining_attention(prefix, source, source, key_padding_mask=src_padding,
                                               need_weights=False)
        return self.output(combined)


def _train_toy(model: ToySeq2Seq, src, trg_in, trg_out, pad_index: int, steps: int) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(src, trg_in)
        loss = F.cross_entropy(logits.transpose(1, 2), trg_out, ignore_index=pad_index)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_seed_toy_seq2seq_trains_the_same_after_replace_modules():
    pad_index, src_vocab, trg_vocab, max_len = 0, 9, 10, 7
    lengths = torch.tensor([4, 5, 3, 6, 2, 5])
    src = torch.randint(1, src_vocab, (6, 6)).masked_fill(torch.arange(6) >= lengths[:, None], pad_index)
    trg = torch.randint(2, trg_vocab, (6, 7)).masked_fill(torch.arange(7) >= (lengths + 1)[:, None], pad_index)
    trg_in, trg_out = trg[:, :-1], trg[:, 1:]

    reference = ToySeq2Seq(src_vocab, trg_vocab, max_len, pad_index)
    ours = copy.deepcopy(reference)
    assert tknn.replace_modules(ours) == 3
    expected = _train_toy(reference, src, trg_in, trg_out, pad_index, steps=40)
    actual = _train_toy(ours, src, trg_in, trg_out, pad_index, steps=40)
    assert expected[-1] < 0.8 * expected[0]  # it learns something
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)
    for (name, parameter), expected_parameter in zip(ours.named_parameters(), reference.parameters()):
        if name.endswith("in_proj_bias"):
            # The key bias adds a constant to every score of a row, which softmax cancels: its gradient is
            # 0 up to rounding, and Adam turns rounding noise of either sign into full-size steps.
            embed = parameter.shape[0] // 3
            parameter, expected_parameter = (torch.cat([p[:embed], p[2 * embed:]]) for p in (parameter,
                                                                                               expected_parameter))
        torch.testing.assert_close(parameter, expected_parameter, atol=1e-5, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------
# GLUConv1d
# ----------------------------------------------------------------------------


def glu_reference(conv: torch.nn.Conv1d, x, padding: str, pad_value: float, residual, residual_scale: float):
    """nn.Conv1d + F.glu + residual, the seeds' way: pad explicitly, convolve without padding."""
    k = conv.kernel_size[0]
    pads = ((k - 1) // 2, k // 2) if padding == "same" else (k - 1, 0)
    out = F.glu(conv(F.pad(x, pads, value=pad_value)), dim=1)
    return (out if residual is None else out + residual) * residual_scale


def glu_pair(in_channels: int, out_channels: int, kernel_size: int, **kwargs):
    conv = torch.nn.Conv1d(in_channels, 2 * out_channels, kernel_size, bias=kwargs.get("bias", True))
    ours = tknn.GLUConv1d(in_channels, out_channels, kernel_size, **kwargs)
    ours.load_state_dict(conv.state_dict(), strict=True)
    return conv, ours


GLU_CASES = [
    # (in, out, k, padding, pad_value, residual, scale, bias)
    (6, 6, 3, "same", 0.0, True, math.sqrt(0.5), True),
    (6, 6, 4, "same", 0.0, False, 1.0, True),
    (5, 3, 3, "causal", 1.0, False, 1.0, True),
    (4, 4, 5, "causal", 1.0, True, math.sqrt(0.5), False),
    (3, 5, 1, "same", 0.0, False, 2.0, True),
]


@pytest.mark.parametrize("channel_last", [False, True], ids=["contiguous", "channel_last"])
@pytest.mark.parametrize(("cin", "cout", "k", "padding", "pad_value", "with_residual", "scale", "bias"), GLU_CASES)
def test_glu_conv_matches_conv1d_glu_residual(cin, cout, k, padding, pad_value, with_residual, scale, bias,
                                             channel_last):
    conv, ours = glu_pair(cin, cout, k, padding=padding, pad_value=pad_value, bias=bias)
    length = 9
    x = torch.randn(2, length, cin).transpose(1, 2) if channel_last else torch.randn(2, cin, length)
    x.requires_grad_()
    residual = torch.randn(2, cout, length, requires_grad=True) if with_residual else None
    expected = glu_reference(conv, x, padding, pad_value, residual, scale)
    actual = ours(x, residual=residual, residual_scale=scale)
    torch.testing.assert_close(actual, expected, **TOL)
    grad = torch.randn_like(expected)
    inputs = [x] + ([residual] if with_residual else [])
    expected_grads = torch.autograd.grad(expected, inputs + list(conv.parameters()), grad)
    actual_grads = torch.autograd.grad(actual, inputs + list(ours.parameters()), grad)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e, **TOL)


def test_glu_conv_state_dict_and_initialization_are_conv1ds():
    torch.manual_seed(11)
    conv = torch.nn.Conv1d(6, 8, 3)
    torch.manual_seed(11)
    ours = tknn.GLUConv1d(6, 4, 3)
    assert list(ours.state_dict()) == list(conv.state_dict()) == ["weight", "bias"]
    for name, tensor in conv.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    with torch.no_grad():
        ours.weight.mul_(2)
    conv.load_state_dict(ours.state_dict(), strict=True)
    assert torch.equal(conv.weight, ours.weight)
    no_bias = tknn.GLUConv1d(6, 4, 3, bias=False)
    assert list(no_bias.state_dict()) == list(torch.nn.Conv1d(6, 8, 3, bias=False).state_dict())


@pytest.mark.parametrize("with_residual", [False, True])
def test_glu_conv_steps_equal_the_causal_convolution(with_residual):
    ours = tknn.GLUConv1d(5, 4, 3, padding="causal", pad_value=1.0)
    x = torch.randn(2, 5, 8)
    residual = torch.randn(2, 4, 8) if with_residual else None
    scale = math.sqrt(0.5) if with_residual else 1.0
    expected = ours(x, residual=residual, residual_scale=scale)
    state = ours.initial_state(2)
    assert state.shape == (2, 5, 2) and bool((state == 1.0).all())
    columns = []
    for t in range(x.shape[2]):
        y_t, state = ours.step(x[:, :, t], state, residual=None if residual is None else residual[:, :, t],
                               residual_scale=scale)
        columns.append(y_t)
    torch.testing.assert_close(torch.stack(columns, dim=2), expected, **TOL)
    torch.testing.assert_close(state, x[:, :, -2:])


@pytest.mark.skipif(CUDA, reason="the Triton interpreter runs CPU tensors")
def test_glu_conv_triton_backend_matches_conv1d_glu():
    pytest.importorskip("triton")
    conv, ours = glu_pair(4, 4, 3, padding="causal", pad_value=1.0, backend="triton")
    x = torch.randn(2, 4, 6, requires_grad=True)
    expected = glu_reference(conv, x, "causal", 1.0, x, math.sqrt(0.5))
    actual = ours(x, residual=x, residual_scale=math.sqrt(0.5))
    torch.testing.assert_close(actual, expected, **TOL)
    grad = torch.randn_like(expected)
    for a, e in zip(torch.autograd.grad(actual, [x, *ours.parameters()], grad),
                    torch.autograd.grad(expected, [x, *conv.parameters()], grad)):
        torch.testing.assert_close(a, e, **TOL)
    y_t, _ = ours.step(x[:, :, 0].detach(), ours.initial_state(2))
    torch.testing.assert_close(y_t, ours(x.detach())[:, :, 0], **TOL)


def test_torch_jit_trace_records_the_modules():
    torch.manual_seed(0)
    conv = tknn.GLUConv1d(EMBED, EMBED, 3, padding="causal")
    traced_conv = torch.jit.trace(conv, (torch.randn(BATCH, EMBED, LK),))
    _, mha = module_pair(batch_first=True)

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    attention = SelfAttention()
    traced_attention = torch.jit.trace(attention, (torch.randn(BATCH, LK, EMBED),), check_trace=False)
    for module, traced, shape in ((conv, traced_conv, (BATCH + 1, EMBED, LK + 2)),
                                  (attention, traced_attention, (BATCH, LK, EMBED))):
        x = torch.randn(shape, requires_grad=True)
        eager, recorded = module(x), traced(x)
        torch.testing.assert_close(recorded, eager)
        parameters = [x, *module.parameters()]
        for ours, expected in zip(torch.autograd.grad(recorded.sum(), parameters),
                                  torch.autograd.grad(eager.sum(), parameters)):
            torch.testing.assert_close(ours, expected)


def test_glu_conv_argument_errors():
    with pytest.raises(ValueError, match="padding must be one of"):
        tknn.GLUConv1d(4, 4, 3, padding="valid")
    with pytest.raises(ValueError, match="kernel_size must be a positive int"):
        tknn.GLUConv1d(4, 4, 0)
    same = tknn.GLUConv1d(4, 4, 3)
    with pytest.raises(RuntimeError, match="needs padding='causal'"):
        same.step(torch.randn(2, 4), same.weight.new_zeros(2, 4, 2))
    with pytest.raises(RuntimeError, match="needs padding='causal'"):
        same.initial_state(2)
    for pad_value in ("1.5", True, None):  # as glu_conv1d refuses them
        with pytest.raises(TypeError, match="pad_value must be a Python float"):
            tknn.GLUConv1d(4, 4, 3, pad_value=pad_value)
    causal = tknn.GLUConv1d(4, 4, 3, padding="causal", pad_value=1)
    assert type(causal.pad_value) is float
    with pytest.raises(TypeError, match="batch_size must be an int, got float"):
        causal.initial_state(2.0)
    with pytest.raises(ValueError, match="batch_size must be non-negative, got -1"):
        causal.initial_state(-1)
    half = tknn.GLUConv1d(4, 4, 3, padding="causal", pad_value=1e5, dtype=torch.float16)
    for make_state in (half.initial_state, half.initial_conv_state):  # as forward refuses it
        with pytest.raises(ValueError, match="pad_value = 100000.0 overflows torch.float16"):
            make_state(2)


# ----------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------


@torch._inductor.config.patch(fx_graph_cache=False)
@torch._functorch.config.patch(enable_autograd_cache=False)
def test_torch_compile_fullgraph_multihead_attention():
    torch._dynamo.reset()
    reference, ours = module_pair(batch_first=True)
    x = torch.randn(BATCH, LK, EMBED, requires_grad=True)
    memory = torch.randn(BATCH, LQ, EMBED, requires_grad=True)
    padding = suffix_padding(BATCH, LQ)

    def block(module, x, memory):
        h, _ = module(x, x, x, attn_mask=causal_not_allowed(LK, LK), is_causal=True, need_weights=False)
        out, _ = module(h, memory, memory, key_padding_mask=padding, need_weights=False)
        return out

    compiled = torch.compile(functools.partial(block, ours), fullgraph=True)
    actual = compiled(x, memory)
    expected = block(reference, x, memory)
    torch.testing.assert_close(actual, expected, **TOL)
    grad = torch.randn_like(expected)
    actual_grads = torch.autograd.grad(actual, [x, memory, *ours.parameters()], grad)
    expected_grads = torch.autograd.grad(expected, [x, memory, *reference.parameters()], grad)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e, **TOL)


@torch._inductor.config.patch(fx_graph_cache=False)
@torch._functorch.config.patch(enable_autograd_cache=False)
def test_torch_compile_fullgraph_glu_conv():
    torch._dynamo.reset()
    conv, ours = glu_pair(6, 6, 3, padding="causal", pad_value=1.0)
    x = torch.randn(2, 6, 9, requires_grad=True)
    compiled = torch.compile(lambda x: ours(x, residual=x, residual_scale=math.sqrt(0.5)), fullgraph=True)
    actual = compiled(x)
    expected = glu_reference(conv, x, "causal", 1.0, x, math.sqrt(0.5))
    torch.testing.assert_close(actual, expected, **TOL)
    grad = torch.randn_like(expected)
    actual_grads = torch.autograd.grad(actual, [x, *ours.parameters()], grad)
    expected_grads = torch.autograd.grad(expected, [x, *conv.parameters()], grad)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e, **TOL)
