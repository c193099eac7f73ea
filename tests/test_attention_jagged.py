"""Attention of jagged nested tensors, the variable-length inputs torch's SDPA takes: the same outputs
and gradients as torch's jagged SDPA, on every backend; causal per sequence (which torch's jagged
SDPA refuses) as each sequence alone; a result that shares the query's offsets; clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import backend_params, device_for, precise_dtype

import transformer_kernels as tk


def _jagged(lengths, heads, dim, dtype, device, offsets=None):
    """``([B, H, j, E] nested, its [T, H, E] values leaf)``; ``offsets``: another's, to share its lengths."""
    values = torch.randn(sum(lengths), heads, dim, dtype=dtype, device=device, requires_grad=True)
    if offsets is None:
        offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2), values


def _tolerance(dtype):
    return dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_cross_attention_equals_torch(backend):
    dtype, device = precise_dtype(backend), device_for(backend)
    query, query_values = _jagged([5, 3, 7], 2, 16, dtype, device)
    key, key_values = _jagged([4, 6, 1], 2, 16, dtype, device)
    value, value_values = _jagged([4, 6, 1], 2, 16, dtype, device, offsets=key.transpose(1, 2).offsets())
    out = tk.scaled_dot_product_attention(query, key, value, backend=backend)
    leaves = (query_values, key_values, value_values)
    # torch's jagged SDPA in float64 on the same values (the reference: its CPU math path).
    exact_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    offsets = (query.transpose(1, 2).offsets(), *[key.transpose(1, 2).offsets()] * 2)
    expected = F.scaled_dot_product_attention(*(
        torch.nested.nested_tensor_from_jagged(t, o.cpu()).transpose(1, 2) for t, o in zip(exact_leaves, offsets)
    ))
    torch.testing.assert_close(out.values().double().cpu(), expected.values(), **_tolerance(dtype))
    grads = torch.autograd.grad(out.values().float().square().sum(), leaves)
    expected_grads = torch.autograd.grad(expected.values().square().sum(), exact_leaves)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double().cpu(), expected_grad, **_tolerance(dtype))
    assert (out.transpose(1, 2) + query.transpose(1, 2)).shape == query.transpose(1, 2).shape  # the same offsets


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_causal_is_top_left_within_each_sequence(backend):
    dtype, device = precise_dtype(backend), device_for(backend)
    x, _ = _jagged([6, 2, 9], 2, 16, dtype, device)
    out = tk.scaled_dot_product_attention(x, x, x, is_causal=True, backend=backend)
    for got, tokens in zip(out.transpose(1, 2).unbind(), x.transpose(1, 2).unbind()):
        sequence = tokens.transpose(0, 1).double().cpu()  # [H, L, E]
        expected = F.scaled_dot_product_attention(sequence, sequence, sequence, is_causal=True)
        torch.testing.assert_close(got.transpose(0, 1).double().cpu(), expected, **_tolerance(dtype))


def test_inputs_that_do_not_fit_are_refused():
    x, _ = _jagged([3, 4], 2, 8, torch.float64, "cpu")
    dense = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="key must be a nested tensor of layout torch.jagged .* got a Tensor"):
        tk.scaled_dot_product_attention(x, dense, dense)
    with pytest.raises(ValueError, match="attn_mask and key_padding_mask must be None with nested inputs"):
        tk.scaled_dot_product_attention(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    other, _ = _jagged([4, 3], 2, 8, torch.float64, "cpu")
    with pytest.raises(ValueError, match="key and value must have the same sequence lengths"):
        tk.scaled_dot_product_attention(x, x, other)
    untransposed = x.transpose(1, 2)  # [B, j, H, E]: the sequence is not dimension 2
    with pytest.raises(ValueError, match="sequence dimension ragged"):
        tk.scaled_dot_product_attention(untransposed, untransposed, untransposed)
    # A nested tensor of layout torch.strided is of type Tensor: it once reached a plan key that read
    # its shape (torch: "NestedTensorImpl doesn't support sizes").
    strided = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)])
    with pytest.raises(ValueError, match="query must be a nested tensor of layout torch.jagged .* torch.strided"):
        tk.scaled_dot_product_attention(strided, strided, strided)
    # Holes (lengths apart from the offsets), which torch's jagged SDPA refuses too: named, not
    # to_padded_tensor's error.
    values = torch.randn(20, 2, 8, dtype=torch.float64)
    offsets, lengths = torch.tensor([0, 6, 13, 20]), torch.tensor([2, 3, 4])
    holes = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths)
    query, _ = _jagged([2, 3, 4], 2, 8, torch.float64, "cpu")
    with pytest.raises(ValueError, match="key must be a jagged tensor without holes"):
        tk.scaled_dot_product_attention(query, holes.transpose(1, 2), holes.transpose(1, 2))


@pytest.mark.parametrize("op", ["qkv_projection", "glu_conv1d"])
def test_the_other_ops_refuse_nested_inputs_by_name(op):
    """qkv_projection and glu_conv1d take dense tensors: a nested one of either layout is named."""
    for layout in (torch.strided, torch.jagged):
        x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=layout)
        with pytest.raises(TypeError, match="x must be a dense"):
            if op == "qkv_projection":
                tk.qkv_projection(x, torch.randn(24, 8), num_heads=2)
            else:
                tk.glu_conv1d(x, torch.randn(16, 3, 3))
