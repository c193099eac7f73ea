"""transformer_kernels.scaled_dot_product_attention: outputs and gradients against
the fp64 reference, parity with torch, masks, dropout, errors, registration and
torch.compile (backend selection is in tests/test_backends.py).

Backend-agnostic tests run on every backend (``backend_params``): ``eager`` and
``triton`` (CPU tensors under TRITON_INTERPRET=1 here, CUDA tensors on a GPU
machine), the exhaustive grids on eager with a subset on triton; the Triton
kernels' own heavier coverage is in tests/test_attention_triton.py.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    assert_close_to_reference, assert_low_precision_within_2x, assert_matches_reference, backend_param,
    backend_params, device_for, outputs_and_grads, precise_dtype, result_names, skip_unless_backend, working_dtype,
)
from conftest import requires_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import transformer_kernels as tk
from transformer_kernels._backend import backend_module
from transformer_kernels.backends.eager import _attention_probs as eager_probs
from transformer_kernels.backends.eager import attention as eager_attention
from transformer_kernels.backends.eager import _attention_tiles as eager_tiles
from transformer_kernels.ops.attention import AttentionArgs
from transformer_kernels.ops.attention import _normalize as normalize_attention
from transformer_kernels.reference import attention as reference_attention

# The max abs error (relative to 1 + max |reference|) allowed on the triton backend in float32.
TRITON_TOLERANCE = 2e-3


# ----------------------------------------------------------------------------
# Case construction and the comparison against the fp64 reference
# ----------------------------------------------------------------------------

MASK_KINDS = [
    "none",
    "causal",  # is_causal=True (top-left)
    "causal_upper_left",  # CausalBias
    "causal_lower_right",  # CausalBias
    "pad_suffix",
    "pad_left",
    "pad_holes",
    "pad_one_all_padding",
    "bool_2d",
    "bool_4d_broadcast",
    "float_grad",
    "float_broadcast_grad",
    "bool_2d+pad_holes",
    "float_grad+pad_suffix",
    "causal+pad_left",
    "causal+bool_2d",  # is_causal with an attn_mask: both apply, as in torch's default CPU path
    "causal+float_grad+pad_suffix",
    "causal_lower_right+pad_suffix",
    "causal_lower_right+pad_holes",
]


def make_padding(kind: str, batch: int, lk: int) -> torch.Tensor:
    """bool [batch, lk], True = padding key."""
    lengths = torch.randint(1, lk + 1, (batch,))
    positions = torch.arange(lk)[None, :]
    if kind == "pad_suffix":
        return positions >= lengths[:, None]
    if kind == "pad_left":
        return positions < (lk - lengths)[:, None]
    if kind == "pad_holes":
        padding = torch.rand(batch, lk) < 0.4
        padding[0, 0] = True  # a leading pad in at least one row
        return padding
    if kind == "pad_one_all_padding":
        padding = positions >= lengths[:, None]
        padding[batch // 2] = True
        return padding
    raise AssertionError(kind)


def make_case(
    kind: str,
    batch: int,
    heads: int,
    kv_heads: int,
    lq: int,
    lk: int,
    head_dim: int,
    value_head_dim: Optional[int] = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device = torch.device("cpu"),
) -> dict:
    """Inputs (leaf tensors) plus keyword arguments for ours and for the reference."""
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    query = torch.randn(batch, heads, lq, head_dim, dtype=dtype)
    key = torch.randn(batch, kv_heads, lk, head_dim, dtype=dtype)
    value = torch.randn(batch, kv_heads, lk, value_head_dim, dtype=dtype)
    ours: dict = {"enable_gqa": kv_heads != heads}
    ref: dict = {"enable_gqa": kv_heads != heads}
    mask = None
    for part in kind.split("+"):
        if part == "none":
            pass
        elif part == "causal":
            ours["is_causal"] = ref["is_causal"] = True
        elif part == "causal_upper_left":
            ours["attn_mask"] = causal_upper_left(lq, lk)
            ref["is_causal"] = True
        elif part == "causal_lower_right":
            ours["attn_mask"] = causal_lower_right(lq, lk)
            ref["is_causal"] = ref["causal_bottom_right"] = True
        elif part.startswith("pad_"):
            ours["key_padding_mask"] = ref["key_padding_mask"] = make_padding(part, batch, lk).to(device)
        elif part == "bool_2d":
            mask = torch.rand(lq, lk) < 0.7
        elif part == "bool_4d_broadcast":
            mask = torch.rand(batch, 1, lq, lk) < 0.6
        elif part == "float_grad":
            mask = torch.randn(batch, heads, lq, lk, dtype=dtype)
            mask[..., 0, :] = float("-inf")  # one row masked entirely
        elif part == "float_broadcast_grad":
            mask = torch.randn(1, 1, lq, lk, dtype=dtype).masked_fill(torch.rand(lq, lk) < 0.3, float("-inf"))
        else:
            raise AssertionError(part)
    leaves = {"query": query, "key": key, "value": value}
    if mask is not None:
        mask = mask.to(device)
        if mask.is_floating_point():
            leaves["attn_mask"] = mask
        ours["attn_mask"] = ref["attn_mask"] = mask
    for name, tensor in leaves.items():
        leaves[name] = tensor.to(device).requires_grad_()
        if name == "attn_mask":
            ours["attn_mask"] = leaves[name]
    return {"leaves": leaves, "ours": ours, "ref": ref}


def attention_functions(case: dict, backend: Optional[str], scale: Optional[float] = None):
    """Ours on ``backend`` and the reference (exact masking) for ``case``, both
    ``fn(query, key, value[, float attn_mask])``, taking ``case['leaves']`` in order."""

    def with_mask(kwargs: dict, mask: tuple) -> dict:
        return {**kwargs, "attn_mask": mask[0]} if mask else kwargs

    def ours(query, key, value, *mask):
        kwargs = with_mask(case["ours"], mask)
        return tk.scaled_dot_product_attention(query, key, value, scale=scale, backend=backend, **kwargs)

    def reference(query, key, value, *mask):
        kwargs = with_mask(case["ref"], mask)
        return reference_attention(query, key, value, scale=scale, masked_value=float("-inf"), **kwargs)

    return ours, reference


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


def check_against_reference(case: dict, backend: str, scale: Optional[float] = None, **criteria) -> None:
    """Output and the gradients of ``case['leaves']`` against the fp64 reference."""
    leaves = case["leaves"]
    (out,) = assert_matches_reference(*attention_functions(case, backend, scale), list(leaves.values()),
                                      input_names=list(leaves), **criteria)
    assert out.dtype == leaves["query"].dtype


# (Lq, Lk): equal, Lk > Lq, Lq > Lk (bottom-right rows without keys), decode, and one
# large enough for the eager path to cut sequences one by one when their lengths differ.
# The triton backend's cases are test_attention_triton.py's CASES.
SHAPES = [(7, 7), (33, 130), (130, 33), (1, 33), (300, 300)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_matches_reference(kind, shape):
    lq, lk = shape
    batch, heads = (3, 2) if max(lq, lk) >= 300 else (3, 4)
    case = make_case(kind, batch, heads, heads, lq, lk, 16)
    check_against_reference(case, "eager", tol=tolerance(torch.float64))


@pytest.mark.parametrize("kind", ["pad_suffix", "causal", "causal_lower_right", "bool_4d_broadcast", "float_grad"])
@pytest.mark.parametrize(("lq", "lk"), [(300, 300), (260, 300), (300, 260)])
def test_eager_per_sequence_tiles(kind, lq, lk):
    """Sequences of very different lengths (one all padding, one with holes) are cut one by one."""
    case = make_case(kind, 4, 2, 2, lq, lk, 16)
    padding = torch.arange(lk)[None, :] >= torch.tensor([[lk], [40], [170], [0]])
    padding[2, 7:20] = True
    case["ours"]["key_padding_mask"] = case["ref"]["key_padding_mask"] = padding
    q, k = case["leaves"]["query"], case["leaves"]["key"]
    mask = case["ours"].get("attn_mask")
    dense_mask = mask.expand(4, 2, lq, lk) if isinstance(mask, torch.Tensor) else None
    causal = {"causal": 1, "causal_lower_right": 2}.get(kind, 0)
    tiles = eager_tiles.plan(q, k, AttentionArgs(padding, dense_mask, causal, 1.0, 0.0, None))
    assert tiles and all(tile.batch.stop - tile.batch.start == 1 for tile in tiles)
    assert any(tile.keys.stop < lk for tile in tiles)
    check_against_reference(case, "eager", tol=1e-9)


@pytest.mark.parametrize("head_dim", [2, 16, 48, 64, 80, 128, 256])
def test_head_dims(head_dim):
    case = make_case("causal+pad_left", 2, 2, 2, 33, 40, head_dim)
    check_against_reference(case, "eager", tol=1e-9)


@pytest.mark.parametrize("lq", [1, 7, 33, 130])
@pytest.mark.parametrize("lk", [1, 7, 33, 130])
def test_lengths(lq, lk):
    case = make_case("causal_lower_right+pad_suffix", 2, 2, 2, lq, lk, 16)
    check_against_reference(case, "eager", tol=1e-9)


@pytest.mark.parametrize("kind", ["none", "causal_lower_right+pad_holes", "float_grad"])
def test_value_head_dim_differs(kind):
    case = make_case(kind, 2, 2, 2, 9, 12, 16, value_head_dim=24)
    check_against_reference(case, "eager", tol=1e-9)


@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("lq", [1, 9])
@pytest.mark.parametrize("kind", ["causal_lower_right+pad_holes", "float_grad"])
def test_materialized_path_layouts_and_grouped_heads(kind, lq, heads, kv_heads, layout, small, monkeypatch):
    """Eager's materialized path (here for a value head dim unlike the query's): one ``bmm`` over
    ``B * H`` for ``[B, H, L, D]`` inputs of one head count, and for ``[B, L, H, D]`` ones copied
    when they are small; else one per query head, reading ``[B, L, H, D]`` memory in place (large
    operands: ``small`` False) and summing the key/value gradients over each group."""
    if not small:
        monkeypatch.setattr(eager_probs, "_small", lambda tensor: False)
    case = make_case(kind, 2, heads, kv_heads, lq, 12, 16, value_head_dim=24)
    if layout == "blhd":
        for name in ("query", "key", "value"):
            tensor = case["leaves"][name].detach().transpose(1, 2).contiguous().transpose(1, 2)
            case["leaves"][name] = tensor.requires_grad_()
    check_against_reference(case, "eager", tol=1e-9)


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
@pytest.mark.parametrize("lq", [1, 9])
@pytest.mark.parametrize("kind", ["pad_holes", "causal_lower_right+pad_holes", "float_grad", "float_broadcast_grad"])
@pytest.mark.parametrize("sequences_per_chunk", [1, 2])
def test_materialized_path_in_batch_chunks(kind, lq, heads, kv_heads, layout, sequences_per_chunk, monkeypatch):
    """Eager's materialized path cut into chunks of one or two sequences (of three: the last chunk
    a shorter one): each chunk with its slice of the key padding and of a per-sequence float mask
    (a broadcast one whole), its folded copies of the operands in the buffers the chunks share, and
    its results written into the call's outputs, gradients and mask gradient."""
    monkeypatch.setattr(eager_probs, "_chunk_size", lambda query, key, value, needs_backward: sequences_per_chunk)
    case = make_case(kind, 3, heads, kv_heads, lq, 12, 16)
    if layout == "blhd":
        for name in ("query", "key", "value"):
            tensor = case["leaves"][name].detach().transpose(1, 2).contiguous().transpose(1, 2)
            case["leaves"][name] = tensor.requires_grad_()
    check_against_reference(case, "eager", tol=1e-9)


def test_batch_chunks_in_half_precision(monkeypatch):
    """float16 operands computed in float32 by chunk: each chunk's output is rounded into the
    call's float16 output (not written in place by the float32 matmul), and the gradients too."""
    monkeypatch.setattr(eager_probs, "_chunk_size", lambda query, key, value, needs_backward: 2)
    leaves = [torch.randn(3, 9, 4, 16, dtype=torch.float16).requires_grad_() for _ in range(3)]
    padding = torch.arange(9) >= torch.tensor([9, 5, 2])[:, None]

    def results(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in leaves]
        out = tk.scaled_dot_product_attention(*(t.transpose(1, 2) for t in inputs), key_padding_mask=padding,
                                              backend="eager")
        return [out, *torch.autograd.grad(out, inputs, torch.ones_like(out))]

    for half, full in zip(results(torch.float16), results(torch.float32)):
        assert half.dtype == torch.float16
        torch.testing.assert_close(half.float(), full, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_batch_chunks_keep_the_call_wide_dropout_mask(layout, monkeypatch):
    """Chunks cut the one keep-mask the call's seed draws: a chunked call matches an unchunked one
    (on [B, L, H, D] views, with the operands' folded copies kept for the backward pass both ways)."""
    shape = (3, 2, 9, 8) if layout == "bhld" else (3, 9, 2, 8)
    leaves = [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    q, k, v = leaves if layout == "bhld" else [t.transpose(1, 2) for t in leaves]
    results = []
    for chunk_bytes in (eager_probs._CHUNK_BYTES_PER_THREAD, 1):
        monkeypatch.setattr(eager_probs, "_CHUNK_BYTES_PER_THREAD", chunk_bytes)
        torch.manual_seed(5)
        out = tk.scaled_dot_product_attention(q, k, v, dropout_p=0.4, backend="eager")
        results.append((out, *torch.autograd.grad(out, leaves, torch.ones_like(out))))
    for unchunked, chunked in zip(*results):
        torch.testing.assert_close(chunked, unchunked, rtol=1e-12, atol=1e-12)


def backend_tolerance(backend: str) -> float:
    return {"eager": 1e-9, "cuda": tolerance(torch.float16)}.get(backend, TRITON_TOLERANCE)


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 1)])
def test_grouped_query_attention(backend, heads, kv_heads):
    case = make_case("causal+pad_left", 2, heads, kv_heads, 20, 20, 16, dtype=precise_dtype(backend),
                     device=device_for(backend))
    check_against_reference(case, backend, tol=backend_tolerance(backend))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_eager_low_precision(dtype):
    case = make_case("causal+pad_suffix", 2, 4, 4, 70, 70, 32, dtype=dtype)
    check_against_reference(case, "eager", tol=tolerance(dtype))


def test_custom_scale():
    case = make_case("pad_holes", 2, 2, 2, 9, 11, 8)
    check_against_reference(case, "eager", scale=0.37, tol=1e-9)


@pytest.mark.parametrize("scale", [torch.tensor(0.37), np.float32(0.37), 1])
def test_scale_and_dropout_p_take_what_torch_takes(scale):
    """A real number or a 0-dim tensor, as torch's argument parser takes them."""
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    out = tk.scaled_dot_product_attention(q, k, v, scale=scale, dropout_p=torch.tensor(0.0), backend="eager")
    expected = F.scaled_dot_product_attention(q, k, v, scale=float(scale))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_dropout_of_every_weight_gives_zeros_like_torch(backend):
    device = device_for(backend)
    q, k, v = (torch.randn(2, 3, 5, 8, device=device, requires_grad=True) for _ in range(3))
    mask = torch.randn(5, 5, device=device, requires_grad=True)
    out = tk.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=1.0, backend=backend)
    assert out.shape == (2, 3, 5, 8) and (out == 0).all()
    grads = torch.autograd.grad(out, (q, k, v, mask), torch.randn_like(out))
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize(("query_shape", "key_shape", "value_shape"), [
    ((0, 3, 5, 8), (0, 3, 6, 8), (0, 3, 6, 8)),  # no batch
    ((2, 0, 5, 8), (2, 0, 6, 8), (2, 0, 6, 8)),  # no heads
    ((2, 3, 0, 8), (2, 3, 6, 8), (2, 3, 6, 8)),  # no query
    ((2, 3, 5, 8), (2, 3, 0, 8), (2, 3, 0, 8)),  # no key: every row gives 0
    ((2, 3, 5, 8), (2, 3, 6, 8), (2, 3, 6, 0)),  # an empty value head dim
    ((2, 4, 5, 8), (2, 2, 0, 8), (2, 2, 0, 8)),  # grouped heads without keys
    ((1, 0, 2, 5, 8), (1, 0, 2, 6, 8), (1, 0, 2, 6, 8)),  # an empty inner batch dimension (5-D)
    ((2, 3, 2, 5, 8), (2, 3, 2, 0, 8), (2, 3, 2, 0, 8)),  # no key (5-D)
])
@pytest.mark.parametrize("mask", [None, "float", "padding"])
def test_zero_sized_inputs(query_shape, key_shape, value_shape, mask):
    """Torch accepts zero-sized batches, heads, lengths and value head dims: so does this, with
    zeros where torch's math has no key (it gives NaN there: rows without keys give 0 here), and
    every input, a float mask included, in the graph with a zero gradient."""
    q, k, v = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for shape in (query_shape, key_shape, value_shape))
    enable_gqa = query_shape[-3] != key_shape[-3] or query_shape[-3] == 0  # no heads: grouped too
    kwargs, leaves = {}, [q, k, v]
    if mask == "float":
        kwargs["attn_mask"] = torch.randn(query_shape[-2], key_shape[-2], dtype=torch.float64, requires_grad=True)
        leaves.append(kwargs["attn_mask"])
    out = tk.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, backend="eager", **kwargs,
                                          **({"key_padding_mask": torch.zeros(*query_shape[:-3], key_shape[-2],
                                                                              dtype=torch.bool)} if mask == "padding" else {}))
    assert out.shape == (*query_shape[:-1], value_shape[-1])
    assert (out == 0).all()
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert all(g.shape == t.shape and (g == 0).all() for g, t in zip(grads, leaves))


@pytest.mark.parametrize("padding_shape", [(6,), (1, 1, 6), (2, 0, 6)])
def test_an_empty_inner_batch_dimension_takes_a_broadcast_key_padding_mask(padding_shape):
    q, k, v = (torch.randn(2, 0, 2, length, 8) for length in (5, 6, 6))
    out = tk.scaled_dot_product_attention(q, k, v, key_padding_mask=torch.zeros(padding_shape, dtype=torch.bool),
                                          backend="eager")
    assert out.shape == (2, 0, 2, 5, 8)


@pytest.mark.parametrize("head_dim", [257, 300])
def test_head_dims_past_the_fused_kernels_run_on_eager(head_dim):
    """Wider heads than the GPU kernels serve (256) run on the eager backend, as torch's do."""
    case = make_case("causal+pad_holes", 2, 2, 2, 9, 11, head_dim)
    check_against_reference(case, "eager", tol=1e-9)
    reason = backend_module("attention", "triton").unsupported_reason(
        *(torch.empty(1, 1, 4, head_dim) for _ in range(3)), AttentionArgs(None, None, 0, 1.0, 0.0, None))
    assert "head dims up to 256" in reason


def test_upper_left_causal_bias_lengths_are_ignored_as_in_torch():
    """torch takes a causal_upper_left bias whatever its lengths (they do not move its diagonal)."""
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    out = tk.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(5, 6), backend="eager")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(5, 6))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("length", [9, 80])  # the materialized path, the tiled flash path
def test_float32_mask_with_other_query_dtypes(dtype, length):
    """torch takes a float32 attn_mask whatever the query's dtype: eager adds it in full precision;
    the fused GPU backends, which take the query's dtype, leave such calls to it."""
    case = make_case("pad_holes", 2, 3, 3, length, length, 16, dtype=dtype)
    mask = torch.randn(length, length).masked_fill(torch.rand(length, length) < 0.2, float("-inf"))
    case["leaves"]["attn_mask"] = case["ours"]["attn_mask"] = case["ref"]["attn_mask"] = mask.requires_grad_()
    check_against_reference(case, "eager", tol=1e-6 if dtype == torch.float64 else tolerance(dtype))
    reason = backend_module("attention", "triton").unsupported_reason(
        *(torch.empty(1, 1, 4, 16, dtype=torch.float16) for _ in range(3)), AttentionArgs(None, mask, 0, 1.0, 0.0, None))
    assert "attn_mask of the query's dtype" in reason


@pytest.mark.parametrize("scale", [0.0, -0.7])
@pytest.mark.parametrize("kind", ["causal", "causal_lower_right", "causal+pad_holes"])
def test_nonpositive_scale_with_causal_masks(kind, scale):
    """Long enough for the tiled flash path, whose CPU kernel gives NaN rows for such scales: eager
    computes them on the materialized path, as the reference does."""
    case = make_case(kind, 2, 2, 2, 90, 70, 8)
    check_against_reference(case, "eager", scale=scale, tol=1e-9)


# ----------------------------------------------------------------------------
# Layouts: strides, 2-D/3-D/5-D inputs
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_non_contiguous_inputs_are_read_in_place(backend):
    device = device_for(backend)
    dtype = precise_dtype(backend)
    batch, length, heads, head_dim = 2, 19, 4, 16
    packed = torch.randn(batch, length, 3 * heads * head_dim, dtype=dtype, device=device, requires_grad=True)
    q, k, v = (t.view(batch, length, heads, head_dim).transpose(1, 2) for t in packed.chunk(3, dim=-1))
    assert not q.is_contiguous()
    padding = make_padding("pad_suffix", batch, length).to(device)
    out = tk.scaled_dot_product_attention(q, k, v, is_causal=True, key_padding_mask=padding, backend=backend)
    (grad_packed,) = torch.autograd.grad(out.square().sum(), packed)

    packed_ref = packed.detach().double().requires_grad_()
    qr, kr, vr = (t.view(batch, length, heads, head_dim).transpose(1, 2) for t in packed_ref.chunk(3, dim=-1))
    ref = reference_attention(qr, kr, vr, is_causal=True, key_padding_mask=padding, masked_value=float("-inf"))
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), packed_ref)
    if backend == "eager":  # torch's CPU SDPA layout: merging the heads back is free
        assert out.transpose(1, 2).is_contiguous()
    assert_close_to_reference([out, grad_packed], [ref, grad_ref], ["out", "grad"], tol=backend_tolerance(backend))


def test_strided_head_dim():
    base = torch.randn(2, 3, 10, 32, dtype=torch.float64)
    q, k, v = base[..., ::2], base.flip(2)[..., 1::2], base[..., :16]
    out = tk.scaled_dot_product_attention(q, k, v, backend="eager")
    ref = reference_attention(q, k, v, masked_value=float("-inf"))
    assert_close_to_reference(out, ref, "out", tol=1e-9)


def test_3d_inputs_with_padding():
    q, k, v = (torch.randn(4, 9, 16, dtype=torch.float64) for _ in range(3))
    padding = make_padding("pad_holes", 4, 9)
    out = tk.scaled_dot_product_attention(q, k, v, key_padding_mask=padding, is_causal=True)
    ref = reference_attention(q, k, v, key_padding_mask=padding, is_causal=True, masked_value=float("-inf"))
    assert out.shape == (4, 9, 16)
    assert_close_to_reference(out, ref, "out", tol=1e-9)


def test_2d_inputs():
    q, k, v = (torch.randn(*shape, dtype=torch.float64) for shape in ((5, 8), (7, 8), (7, 3)))
    out = tk.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 7))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 7))
    assert_close_to_reference(out, expected, "out", tol=1e-9)


def test_5d_inputs_flatten_batch_dims():
    q = torch.randn(2, 3, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    padding = make_padding("pad_suffix", 6, 5).view(2, 3, 5)
    mask = torch.rand(3, 1, 6, 5) < 0.8
    out = tk.scaled_dot_product_attention(q, k, v, attn_mask=mask, key_padding_mask=padding)
    assert out.shape == (2, 3, 4, 6, 8)
    flat = [t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v)]
    ref = reference_attention(
        *flat, attn_mask=mask.expand(2, 3, 4, 6, 5).flatten(0, 1), key_padding_mask=padding.flatten(0, 1),
        masked_value=float("-inf"),
    )
    grad = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad.view_as(out))
    grads_ref = torch.autograd.grad(ref, flat, grad)
    assert_close_to_reference([t.flatten(0, 1) for t in (out, *grads)], [ref, *grads_ref],
                              result_names(1, ["query", "key", "value"]), tol=1e-9)


# ----------------------------------------------------------------------------
# Semantics shared with torch
# ----------------------------------------------------------------------------

TORCH_PARITY = [
    dict(),
    dict(is_causal=True),
    dict(attn_mask="bool"),
    dict(attn_mask="float"),
    dict(attn_mask=causal_upper_left(12, 17)),
    dict(attn_mask=causal_lower_right(12, 17)),
    dict(enable_gqa=True, is_causal=True),
    dict(scale=0.2, attn_mask="bool"),
    # torch's default CPU path (its flash kernel) applies both; its math backend, which a float mask
    # that requires grad takes, refuses the pair.
    dict(is_causal=True, attn_mask="bool"),
    dict(is_causal=True, attn_mask="float_fixed"),
]


@pytest.mark.parametrize("kwargs", TORCH_PARITY, ids=[str(i) for i in range(len(TORCH_PARITY))])
def test_parity_with_torch_sdpa(kwargs):
    kwargs = dict(kwargs)
    heads, kv_heads = (4, 2) if kwargs.get("enable_gqa") else (4, 4)
    q = torch.randn(2, heads, 12, 32, requires_grad=True)
    k = torch.randn(2, kv_heads, 17, 32, requires_grad=True)
    v = torch.randn(2, kv_heads, 17, 32, requires_grad=True)
    inputs = [q, k, v]
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(2, 1, 12, 17) < 0.7
        kwargs["attn_mask"][..., 0] = True  # torch's math returns NaN-free rows only when a key is left
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(1, heads, 12, 17, requires_grad=True)
        inputs.append(kwargs["attn_mask"])
    elif kwargs.get("attn_mask") == "float_fixed":
        kwargs["attn_mask"] = torch.randn(1, heads, 12, 17)
    out = tk.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    assert_close_to_reference([out, *grads], [expected, *expected_grads], result_names(1, "qkvm"[: len(inputs)]),
                              tol=1e-5)


# Batch broadcasting, as torch does it: every leading dimension (heads included) of query, key,
# value and attn_mask may be 1 or missing.  torch's own SDPA is the oracle: a call is accepted
# exactly when torch accepts it, with torch's output shape, values and gradients.
BROADCAST_FORMS = {
    "full": lambda b, h, *rest: (b, h, *rest),
    "batch_1": lambda b, h, *rest: (1, h, *rest),
    "heads_1": lambda b, h, *rest: (b, 1, *rest),
    "no_batch": lambda b, h, *rest: (h, *rest),
}
MASK_FORMS = [None, "full", "batch_1", "heads_1", "no_batch", "2d"]
BROADCAST_CASES = [
    (q_form, k_form, v_form, MASK_FORMS[i % len(MASK_FORMS)])
    for i, (q_form, k_form, v_form) in enumerate(
        (q, k, v) for q in BROADCAST_FORMS for k in BROADCAST_FORMS for v in BROADCAST_FORMS
    )
]
# Leading dimensions of 5-D inputs [X=2, Y=3, H, L, E]: which ones an input has.
LEAD_FORMS = {"full": (2, 3), "outer_1": (1, 3), "inner_1": (2, 1), "no_outer": (3,), "none": ()}
LEAD_CASES = [
    (q_form, k_form, v_form, [*LEAD_FORMS, None][i % (len(LEAD_FORMS) + 1)])
    for i, (q_form, k_form, v_form) in enumerate(
        (q, k, v) for q in LEAD_FORMS for k in LEAD_FORMS for v in LEAD_FORMS
    )
]


def _random_mask(shape, dtype, device, float_mask: bool, requires_grad: bool = True) -> torch.Tensor:
    if float_mask:
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)
    mask = torch.rand(*shape, device=device) < 0.7
    mask[..., 0] = True  # every row sees a key
    return mask


def _broadcast_case(q_form, k_form, v_form, mask_form, dtype, device, float_mask):
    # Head dims of 16 keep the triton backend from padding (copying) its inputs, so its kernels
    # read the stride-0 views themselves.
    batch, heads, lq, lk = 2, 3, 5, 7
    shapes = [
        BROADCAST_FORMS[q_form](batch, heads, lq, 16),
        BROADCAST_FORMS[k_form](batch, heads, lk, 16),
        BROADCAST_FORMS[v_form](batch, heads, lk, 16),
    ]
    inputs = [torch.randn(*shape, dtype=dtype, device=device, requires_grad=True) for shape in shapes]
    mask = None
    if mask_form is not None:
        shape = (lq, lk) if mask_form == "2d" else BROADCAST_FORMS[mask_form](batch, heads, lq, lk)
        mask = _random_mask(shape, dtype, device, float_mask)
    return inputs, mask


def _assert_same_values_and_grads(out, expected, leaves, tol) -> None:
    grad_out = torch.randn_like(expected)
    grads = torch.autograd.grad(out, leaves, grad_out)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    assert_close_to_reference([out, *grads], [expected, *expected_grads], result_names(1, "qkvm"[: len(leaves)]),
                              tol=tol)


def _assert_matches_torch(inputs, mask, tol, enable_gqa=False, backend="eager", error_match="attn_mask of shape"):
    """``tk`` and torch on the same call: both refuse it (``tk`` with a ValueError matching
    ``error_match``), or both accept it with the same output shape, values and gradients of
    query, key, value and a float mask."""
    try:
        expected = F.scaled_dot_product_attention(*inputs, attn_mask=mask, enable_gqa=enable_gqa)
    except (RuntimeError, IndexError):
        with pytest.raises(ValueError, match=error_match):
            tk.scaled_dot_product_attention(*inputs, attn_mask=mask, enable_gqa=enable_gqa, backend=backend)
        return
    out = tk.scaled_dot_product_attention(*inputs, attn_mask=mask, enable_gqa=enable_gqa, backend=backend)
    leaves = [*inputs, *([mask] if mask is not None and mask.requires_grad else [])]
    _assert_same_values_and_grads(out, expected, leaves, tol)


def torch_parity_tolerance(backend: str) -> float:
    return 1e-9 if backend == "eager" else 1e-4


# Every combination on eager (a bool and a float mask where there is a mask); a few on triton.
TRITON_BROADCAST_CASES = [
    ("full", "batch_1", "heads_1", None),
    ("no_batch", "full", "full", "heads_1"),
    ("heads_1", "full", "batch_1", "batch_1"),
    ("batch_1", "heads_1", "heads_1", "2d"),
]


@pytest.mark.parametrize(("backend", "q_form", "k_form", "v_form", "mask_form", "float_mask"), [
    *(backend_param("eager", *case, float_mask, op="attention")
      for float_mask in (False, True) for case in BROADCAST_CASES if case[3] is not None or not float_mask),
    *(backend_param("triton", *case, case[3] is not None, op="attention") for case in TRITON_BROADCAST_CASES),
])
def test_batch_broadcasting_matches_torch(backend, q_form, k_form, v_form, mask_form, float_mask):
    """3-D and 4-D inputs, each of query, key and value with full, size-1 or missing batch and
    head dimensions, in every combination (each with one of the mask forms)."""
    inputs, mask = _broadcast_case(q_form, k_form, v_form, mask_form, precise_dtype(backend), device_for(backend),
                                   float_mask)
    _assert_matches_torch(inputs, mask, torch_parity_tolerance(backend), backend=backend)


def _lead_case(q_form, k_form, v_form, mask_form, dtype, device, heads=4, kv_heads=4):
    lq, lk = 5, 7
    shapes = [
        (*LEAD_FORMS[q_form], heads, lq, 8),
        (*LEAD_FORMS[k_form], kv_heads, lk, 8),
        (*LEAD_FORMS[v_form], kv_heads, lk, 4),
    ]
    inputs = [torch.randn(*shape, dtype=dtype, device=device, requires_grad=True) for shape in shapes]
    mask = None if mask_form is None else _random_mask((*LEAD_FORMS[mask_form], 1, lq, lk), dtype, device, True)
    return inputs, mask


@pytest.mark.parametrize(("q_form", "k_form", "v_form", "mask_form"), LEAD_CASES)
def test_batch_broadcasting_5d_matches_torch(q_form, k_form, v_form, mask_form):
    """5-D inputs ``[X, Y, H, L, E]`` with full, size-1 or missing leading dimensions in every
    combination for query, key and value; the mask ``[..., 1, Lq, Lk]`` is broadcast over heads.
    Some of these are read as views folded into ``[B, H']``, the rest copied; all are exact."""
    inputs, mask = _lead_case(q_form, k_form, v_form, mask_form, torch.float64, "cpu")
    _assert_matches_torch(inputs, mask, 1e-9)


def test_mask_must_broadcast_to_query_key_scores():
    """As in torch, attn_mask broadcasts to ``query @ key^T``, not to the output: a mask with
    heads that only ``value`` has is refused, naming attn_mask."""
    q = torch.randn(2, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 7, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(2, 3, 5, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 3, 5, 7\) cannot be broadcast to the shape of "
                       r"query @ key\^T, \[\.\.\., Lq, Lk\] = \(2, 1, 5, 7\)"):
        tk.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(2, 3, 5, 7, dtype=torch.float64))
    _assert_matches_torch((q, k, v), torch.randn(2, 1, 5, 7, dtype=torch.float64, requires_grad=True), 1e-9)


# Grouped-query attention with broadcasting: (query, key, value, mask shapes, error if torch refuses).
GQA_CASES = {
    "4d": ((2, 6, 5, 16), (2, 2, 7, 16), (2, 2, 7, 8), (2, 1, 5, 7), None),
    "4d_batch_broadcast": ((2, 6, 5, 16), (1, 3, 7, 16), (3, 7, 16), (6, 5, 7), None),
    "key_one_head": ((2, 6, 5, 16), (2, 1, 7, 16), (2, 3, 7, 16), None, None),
    "key_value_heads_differ": ((2, 6, 5, 16), (2, 2, 7, 16), (2, 3, 7, 16), (2, 6, 5, 7), None),
    "3d_groups_first_dim": ((6, 5, 16), (2, 7, 16), (3, 7, 16), (6, 5, 7), None),
    "5d_folded_into_heads": ((2, 3, 4, 5, 16), (3, 2, 7, 16), (3, 2, 7, 16), (1, 1, 5, 7), None),
    "5d_copied": ((2, 1, 4, 5, 16), (1, 3, 2, 7, 16), (2, 3, 1, 7, 16), (3, 1, 5, 7), None),
    "query_fewer_heads": ((2, 2, 5, 16), (2, 4, 7, 16), (2, 4, 7, 8), None, "multiple of"),
    "not_divisible": ((2, 6, 5, 16), (2, 4, 7, 16), (2, 4, 7, 8), None, "multiple of"),
    "key_without_heads": ((2, 6, 5, 16), (7, 16), (2, 1, 7, 8), None, "key must have a heads dimension"),
}


def _gqa_case(name, dtype, device):
    *shapes, mask_shape, error = GQA_CASES[name]
    inputs = [torch.randn(*shape, dtype=dtype, device=device, requires_grad=True) for shape in shapes]
    mask = None if mask_shape is None else _random_mask(mask_shape, dtype, device, True)
    return inputs, mask, error


@pytest.mark.parametrize(("backend", "name"), [
    *(backend_param("eager", name, op="attention") for name in GQA_CASES),
    *(backend_param("triton", name, op="attention")
      for name in ["5d_folded_into_heads", "key_value_heads_differ", "3d_groups_first_dim"]),
])
def test_grouped_query_attention_broadcasting_matches_torch(backend, name):
    """enable_gqa groups dimension -3 as torch does: heads of 4-D and 5-D inputs (served natively,
    also folded with leading dims), the first dimension of 3-D inputs, and key and value with
    different head counts (both repeated); refused where torch refuses."""
    inputs, mask, error = _gqa_case(name, precise_dtype(backend), device_for(backend))
    _assert_matches_torch(inputs, mask, torch_parity_tolerance(backend), enable_gqa=True, backend=backend,
                          error_match=error or "attn_mask of shape")


def _spy_on_forward(monkeypatch, backend: str) -> list:
    """The query, key, value and attn_mask that the backend's forward receives, once called."""
    module = backend_module("attention", backend)
    seen = []
    forward = module.forward

    def spy(query, key, value, args, needs_backward):
        seen[:] = [query, key, value, args.attn_mask]
        return forward(query, key, value, args, needs_backward)

    monkeypatch.setattr(module, "forward", spy)
    return seen


def _assert_views(given, received, shapes_and_strides) -> None:
    for name, tensor, view, (shape, strides) in zip("qkvm", given, received, shapes_and_strides):
        assert view.data_ptr() == tensor.data_ptr(), f"{name} was copied"
        assert (tuple(view.shape), view.stride()) == (shape, strides), name


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_broadcast_inputs_reach_the_backend_as_views(monkeypatch, backend):
    """Broadcast inputs arrive as stride-0 views of the caller's storage, and the backend computes
    torch's values and gradients from them."""
    seen = _spy_on_forward(monkeypatch, backend)
    device = device_for(backend)
    q, k, v, mask = (
        torch.randn(*shape, device=device, dtype=working_dtype(backend), requires_grad=True)
        for shape in ((1, 3, 5, 16), (2, 1, 7, 16), (7, 16), (1, 1, 5, 7))
    )
    out = tk.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    tol = tolerance(torch.float16) if backend == "cuda" else 1e-5
    _assert_same_values_and_grads(out, expected, (q, k, v, mask), tol)
    # query's and value's batch dims are broadcast (stride 0); key's and value's single head
    # stays a single key/value head, served as grouped-query attention.
    _assert_views((q, k, v, mask), seen, [
        ((2, 3, 5, 16), (0, 80, 16, 1)),
        ((2, 1, 7, 16), (112, 112, 16, 1)),
        ((2, 1, 7, 16), (0, 112, 16, 1)),
        ((2, 3, 5, 7), (0, 0, 7, 1)),
    ])


def test_5d_inputs_fold_into_the_backends_batch_and_heads_as_views(monkeypatch):
    """``[X, Y, H, ...]`` becomes ``[X * Y, H, ...]`` where every input allows it as a view, else
    ``[X, Y * H, ...]``: key/value shared over X (a stride-0 X) and query's Y and heads merge."""
    seen = _spy_on_forward(monkeypatch, "eager")
    q = torch.randn(2, 3, 4, 5, 8)
    k, v = torch.randn(4, 7, 8), torch.randn(4, 7, 8)
    tk.scaled_dot_product_attention(q, k, v, backend="eager")
    _assert_views((q, k, v), seen, [
        ((6, 4, 5, 8), (160, 40, 8, 1)),
        ((6, 4, 7, 8), (0, 56, 8, 1)),
        ((6, 4, 7, 8), (0, 56, 8, 1)),
    ])
    k, v = torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    tk.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, backend="eager")
    _assert_views((q, k, v, mask), seen, [
        ((2, 12, 5, 8), (480, 40, 8, 1)),
        ((2, 6, 7, 8), (0, 56, 8, 1)),
        ((2, 6, 7, 8), (0, 56, 8, 1)),
        ((2, 12, 5, 7), (0, 0, 7, 1)),
    ])


@pytest.mark.parametrize(("padding_shape", "copies_key"), [((2, 1, 7), False), ((7,), False), ((2, 3, 7), True)])
def test_key_padding_mask_of_5d_inputs(monkeypatch, padding_shape, copies_key):
    """key_padding_mask ``[X, Y, Lk]`` (or broadcastable to it) with key/value shared over X: a
    padding mask constant over Y lets Y fold into heads (key/value stay views); one that varies
    over Y keeps Y in the batch, which copies key/value."""
    seen = _spy_on_forward(monkeypatch, "eager")
    q = torch.randn(2, 3, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 4, 7, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 4, 7, 8, dtype=torch.float64, requires_grad=True)
    padding = torch.rand(padding_shape) < 0.4
    padding[..., 0] = False
    out = tk.scaled_dot_product_attention(q, k, v, key_padding_mask=padding, backend="eager")
    assert (seen[1].data_ptr() != k.data_ptr()) == copies_key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~padding[..., None, None, :])
    _assert_same_values_and_grads(out, expected, (q, k, v), 1e-9)


@pytest.mark.parametrize(("padding_shape", "ok"), [((2, 7), True), ((1, 7), True), ((7,), True), ((3, 7), False)])
def test_key_padding_mask_broadcasts_over_batch(padding_shape, ok):
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    k = v = torch.randn(1, 3, 7, 8, dtype=torch.float64)
    padding = torch.zeros(padding_shape, dtype=torch.bool)
    padding[..., 4:] = True
    if not ok:
        with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[\.\.\., Lk\] = \(2, 7\)"):
            tk.scaled_dot_product_attention(q, k, v, key_padding_mask=padding)
        return
    out = tk.scaled_dot_product_attention(q, k, v, key_padding_mask=padding)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~padding.expand(2, 7)[:, None, None, :])
    assert_close_to_reference(out, expected, "out", tol=1e-9)


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize(("kind", "lq", "lk", "head_dim"), [
    ("causal_lower_right", 12, 5, 8),
    ("pad_one_all_padding", 12, 5, 8),
    ("bool_2d", 12, 5, 8),
    ("float_grad", 12, 5, 8),
    ("causal_lower_right+pad_one_all_padding", 40, 24, 16),  # several query and key blocks on triton
])
def test_rows_without_keys_give_zero_output_and_zero_gradient(backend, kind, lq, lk, head_dim):
    """Rows without keys (bottom-right causal with Lq > Lk leaves the first Lq - Lk rows without
    keys; a sequence all padding; a masked-out row) give zero output and zero query gradient, keys
    that no row sees zero key and value gradients; every other row has an output."""
    case = make_case(kind, 4, 2, 2, lq, lk, head_dim, dtype=working_dtype(backend), device=device_for(backend))
    leaves = list(case["leaves"].values())
    if kind == "bool_2d":
        case["ours"]["attn_mask"][3] = False
    ours, reference = attention_functions(case, backend)
    out = ours(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    expected = outputs_and_grads(reference, leaves, torch.ones_like(out), dtype=torch.float64)
    rows_without_keys = expected.outputs[0].abs().amax(-1) == 0
    assert rows_without_keys.any()
    assert (out[rows_without_keys] == 0).all()
    # Rows, not elements: a row that sees one key is that key's value row, which may hold a zero
    # (torch 2.11's float16 randn draws exact zeros).
    assert (out[~rows_without_keys].abs().amax(-1) != 0).all()
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][rows_without_keys] == 0).all()
    # With an all-ones output gradient, a key's value gradient is its total weight over the rows.
    keys_unseen = expected.grads[2].abs().amax(-1) == 0
    assert keys_unseen.any() or "pad" not in kind
    assert (grads[1][keys_unseen] == 0).all() and (grads[2][keys_unseen] == 0).all()


@pytest.mark.parametrize("sequences_per_chunk", [1, 3, None])  # None: the whole batch in one piece
@pytest.mark.parametrize(("kind", "lq", "lk"), [
    ("causal_lower_right", 12, 5),
    ("pad_one_all_padding", 12, 5),
    ("causal+pad_left", 6, 6),  # below: the first rows of a sequence see only padding keys
    ("causal_lower_right+pad_holes", 5, 12),
])
def test_rows_without_keys_give_zero_on_the_materialized_path(kind, lq, lk, sequences_per_chunk, monkeypatch):
    """Eager's materialized path zeroes the probabilities of rows without keys only when some row
    can have none (see _every_row_sees_a_key, decided once per call): every such row still gives 0,
    in batch chunks and in one piece."""
    if sequences_per_chunk is not None:
        monkeypatch.setattr(eager_probs, "_chunk_size", lambda query, key, value, needs_backward: sequences_per_chunk)
    case = make_case(kind, 4, 2, 2, lq, lk, 8)
    if "causal" in kind and "pad" in kind:
        case["ours"]["key_padding_mask"][1, : 3 + max(0, lk - lq)] = True  # shared with the reference's
    leaves = list(case["leaves"].values())
    ours, reference = attention_functions(case, "eager")
    out = ours(*leaves)
    expected = reference(*leaves)
    rows_without_keys = expected.abs().amax(-1) == 0
    assert rows_without_keys.any()
    assert (out[rows_without_keys] == 0).all()
    check_against_reference(case, "eager", tol=1e-9)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(("lq", "lk"), [(1, 7), (6, 6), (9, 4), (4, 9)])
def test_every_row_sees_a_key_rule(kind, lq, lk):
    """The rule that lets eager skip zeroing empty rows: never True when a row sees no key, and
    True whenever key padding (with or without a causal mask) leaves every row a key."""
    for seed in range(8):
        torch.manual_seed(seed)
        case = make_case(kind, 5, 1, 1, lq, lk, 4)
        query, key, value = (case["leaves"][name] for name in ("query", "key", "value"))
        ours = case["ours"]
        *_, args, _ = normalize_attention(query, key, value, ours.get("attn_mask"), 0.0, ours.get("is_causal", False),
                                          None, False, ours.get("key_padding_mask"))
        excluded = eager_probs._excluded_keys(query, key, args)
        if args.attn_mask is not None and args.attn_mask.dtype != torch.bool:
            excluded = args.attn_mask.isneginf()
        empty = excluded is not None and bool(excluded.expand(5, 1, lq, lk).all(-1).any())
        rule = eager_probs._every_row_sees_a_key(lq, lk, args, may_sync=True)
        assert not (rule and empty)
        if args.attn_mask is None:
            assert rule == (not empty)
        # Without a host sync, key padding is not looked at: the rule assumes an empty row may exist.
        if args.key_padding_mask is not None:
            assert not eager_probs._every_row_sees_a_key(lq, lk, args, may_sync=False)


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize("mask_needs_grad", [False, True])
def test_float_mask_gradient_only_when_it_needs_one(backend, mask_needs_grad, gradient_spy):
    """A float attn_mask gets its gradient (the reference's) exactly when it requires grad: else
    the backend's backward returns an empty one."""
    spy = gradient_spy("attention", backend)
    case = make_case("float_grad+pad_suffix", 2, 2, 2, 9, 11, 8, dtype=precise_dtype(backend),
                     device=device_for(backend))
    if not mask_needs_grad:
        mask = case["leaves"].pop("attn_mask").detach()
        case["ours"]["attn_mask"], case["ref"]["attn_mask"] = mask, mask.double()
    check_against_reference(case, backend, tol=backend_tolerance(backend))
    spy.assert_computed(query=True, key=True, value=True, attn_mask=mask_needs_grad)


# ----------------------------------------------------------------------------
# gradcheck (fp64, eager)
# ----------------------------------------------------------------------------

GRADCHECK_CASES = [
    ("float_grad+pad_suffix", 2, 1, 1, 5, 6),
    ("causal_lower_right+pad_holes", 2, 2, 1, 7, 4),
    ("bool_4d_broadcast", 2, 2, 1, 4, 5),
    ("float_broadcast_grad", 1, 2, 2, 5, 6),
]


@pytest.mark.parametrize(("kind", "batch", "heads", "kv_heads", "lq", "lk"), GRADCHECK_CASES)
def test_gradcheck_eager(kind, batch, heads, kv_heads, lq, lk):
    case = make_case(kind, batch, heads, kv_heads, lq, lk, 4)
    leaves = case["leaves"]
    kwargs = {k: v for k, v in case["ours"].items() if k != "attn_mask" or "attn_mask" not in leaves}

    def fn(query, key, value, *mask):
        extra = {"attn_mask": mask[0]} if mask else {}
        return tk.scaled_dot_product_attention(query, key, value, backend="eager", **kwargs, **extra)

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))


def test_gradcheck_eager_with_dropout():
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(query, key, value):
        torch.manual_seed(1234)  # the same keep-mask on every evaluation
        return tk.scaled_dot_product_attention(query, key, value, dropout_p=0.3, is_causal=True, backend="eager")

    assert torch.autograd.gradcheck(fn, (q, k, v))


# ----------------------------------------------------------------------------
# Hypothesis: random shapes and masks (eager)
# ----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    lq=st.integers(1, 40),
    lk=st.integers(1, 40),
    head_dim=st.sampled_from([1, 3, 8, 20]),
    mask_kind=st.sampled_from(["none", "bool", "float", "causal", "causal_lower_right"]),
    padding_kind=st.sampled_from([None, "pad_suffix", "pad_left", "pad_holes", "pad_one_all_padding"]),
    mask_with_causal=st.booleans(),  # a bool or float mask together with is_causal
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(batch, kv_heads, group, lq, lk, head_dim, mask_kind, padding_kind,
                                    mask_with_causal, seed):
    torch.manual_seed(seed)
    kind = "none" if mask_kind in ("none", "bool", "float") else mask_kind
    if mask_with_causal and mask_kind in ("bool", "float"):
        kind = "causal"
    if padding_kind is not None:
        kind = padding_kind if kind == "none" else f"{kind}+{padding_kind}"
    case = make_case(kind, batch, kv_heads * group, kv_heads, lq, lk, head_dim)
    if mask_kind in ("bool", "float"):
        shape = [s if torch.rand(()) < 0.5 else 1 for s in (batch, kv_heads * group, lq, lk)]
        mask = torch.rand(shape) < 0.6 if mask_kind == "bool" else torch.randn(shape, dtype=torch.float64)
        if mask_kind == "float":
            mask = mask.masked_fill(torch.rand(shape) < 0.2, float("-inf")).requires_grad_()
            case["leaves"]["attn_mask"] = mask
        case["ours"]["attn_mask"] = case["ref"]["attn_mask"] = mask
    check_against_reference(case, "eager", tol=1e-9)


# ----------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------


def dropped_weights(backend: str, shape: tuple, dropout_p: float, seed: int, device: torch.device) -> torch.Tensor:
    """A call's attention weights after dropout, read off with value = identity (every output
    entry is one weight); query and key are zero, so before dropout every weight is 1 / Lk."""
    batch, heads, lq, lk = shape
    dtype = working_dtype(backend)
    query = torch.zeros(batch, heads, lq, 8, device=device, dtype=dtype)
    key = torch.zeros(batch, heads, lk, 8, device=device, dtype=dtype)
    value = torch.eye(lk, device=device, dtype=dtype).expand(batch, heads, lk, lk)
    torch.manual_seed(seed)
    return tk.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, backend=backend)


def keep_mask_of(backend: str, shape: tuple, dropout_p: float, seed: int, device: torch.device) -> torch.Tensor:
    """Recover a call's keep-mask."""
    return dropped_weights(backend, shape, dropout_p, seed, device) != 0


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_dropout_statistics(backend):
    """Every weight is dropped or scaled by 1 / (1 - p); the keep rate is 1 - p; the keep-masks of
    different batch rows and heads differ; the mean is preserved."""
    device = device_for(backend)
    dropout_p = 0.3
    batch, heads, lq, lk = (2, 4, 256, 128) if backend == "eager" else (2, 2, 64, 64)
    weights = dropped_weights(backend, (batch, heads, lq, lk), dropout_p, 0, device)
    keep = weights != 0
    kept = weights[keep]
    # float16 rounds the weight before its product with value and the output after it.
    rtol = 2e-3 if weights.dtype == torch.float16 else 1e-4
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / ((1 - dropout_p) * lk)), rtol=rtol, atol=0)
    samples = keep.numel()
    keep_rate = keep.double().mean().item()
    # 5 standard deviations of a binomial proportion.
    assert abs(keep_rate - (1 - dropout_p)) < 5 * math.sqrt(dropout_p * (1 - dropout_p) / samples)
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])

    # Uniform attention over value = 1 averages to 1 in expectation: dropout preserves the mean.
    query, key, value = (torch.full((batch, heads, length, 8), fill, device=device, dtype=working_dtype(backend))
                         for length, fill in ((lq, 0.0), (lk, 0.0), (lk, 1.0)))
    out = tk.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, backend=backend)
    assert abs(out.mean().item() - 1.0) < 6 * math.sqrt(dropout_p / (1 - dropout_p) / samples)


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_dropout_is_reproducible_under_manual_seed(backend):
    device = device_for(backend)
    q, k, v = (torch.randn(2, 2, 16, 8, device=device, dtype=working_dtype(backend)) for _ in range(3))
    results = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        results.append(tk.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend))
    assert torch.equal(results[0], results[1])
    assert not torch.allclose(results[0], results[2])


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize("kind", ["none", "causal", "pad_left", "pad_holes", "causal_lower_right+pad_suffix"])
def test_dropout_forward_and_backward_match_reference_with_same_keep_mask(backend, kind):
    """The keep-mask of a call without masks (read off by ``keep_mask_of``) is the one a masked
    call with the same seed uses, element by element, in the forward and both backward passes:
    key padding moves where the kernels' key loops start, and must not move the mask."""
    device = device_for(backend)
    dropout_p, seed = 0.25, 77
    shape = (2, 2, 37, 40)  # several query and key blocks on triton
    keep = keep_mask_of(backend, shape, dropout_p, seed, device)
    batch, heads, lq, lk = shape
    case = make_case(kind, batch, heads, heads, lq, lk, 16, value_head_dim=24, dtype=precise_dtype(backend),
                     device=device)
    case["ours"]["dropout_p"] = dropout_p
    case["ref"].update(dropout_p=dropout_p, dropout_keep_mask=keep.double())
    torch.manual_seed(seed)
    criteria = dict(tol=backend_tolerance(backend))
    if backend == "triton":
        criteria.update(norm_tol=1e-5)
    check_against_reference(case, backend, **criteria)


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------


def _bad_inputs():
    """(id, overrides of the valid arguments below, error type, message pattern)."""
    k = torch.randn(2, 4, 10, 16)
    pad = torch.zeros(2, 10, dtype=torch.bool)

    def kv(*shape):
        return dict(key=torch.randn(*shape), value=torch.randn(*shape))

    return [
        ("batch", kv(3, 4, 10, 16), ValueError, "query, key and value must have batch dimensions that broadcast"),
        ("batch_rank", kv(3, 3, 4, 10, 16), ValueError,
         "query, key and value must have batch dimensions that broadcast"),
        ("gqa_rank", dict(key=torch.randn(10, 16), enable_gqa=True), ValueError,
         r"with enable_gqa=True, key must have a heads dimension \(dimension -3"),
        ("gqa_value_divisible", dict(value=torch.randn(2, 3, 10, 16), enable_gqa=True), ValueError,
         r"query heads \(4\) must be a multiple of the number of key heads \(4\) and of value heads \(3\)"),
        ("mask_batch", dict(attn_mask=torch.ones(3, 4, 8, 10, dtype=torch.bool)), ValueError,
         r"attn_mask of shape \(3, 4, 8, 10\) cannot be broadcast"),
        ("heads", kv(2, 2, 10, 16), ValueError, r"key and value must have as many heads as query \(4\) or one"),
        ("value_heads_vs_query", dict(key=torch.randn(2, 1, 10, 16), value=torch.randn(2, 2, 10, 16)), ValueError,
         r"key and value must have as many heads as query \(4\) or one"),
        ("gqa_divisible", dict(**kv(2, 3, 10, 16), enable_gqa=True), ValueError, "multiple of"),
        ("value_heads", dict(value=torch.randn(2, 2, 10, 16)), ValueError, "value must have as many heads as key"),
        ("head_dim", dict(key=torch.randn(2, 4, 10, 8)), ValueError, "key must have query's head dim"),
        ("value_length", dict(value=torch.randn(2, 4, 9, 16)), ValueError, "value must have key's length"),
        ("ndim", dict(key=torch.randn(10)), ValueError, r"key must have at least 2 dimensions \[\.\.\., L, E\]"),
        ("dtype", dict(key=k.double()), TypeError, "key must have the same dtype as query"),
        ("integer", dict(query=torch.ones(2, 4, 8, 16, dtype=torch.int64)), TypeError,
         "query must have a floating-point dtype"),
        ("is_causal_int", dict(is_causal=1), TypeError, "is_causal must be a bool, got int"),
        ("enable_gqa_none", dict(enable_gqa=None), TypeError, "enable_gqa must be a bool, got NoneType"),
        ("scale_vector", dict(scale=torch.tensor([0.5])), TypeError, "scale must be a float, got Tensor"),
        ("dropout_string", dict(dropout_p="0.1"), TypeError, "dropout_p must be a float, got str"),
        ("mask_shape", dict(attn_mask=torch.ones(8, 9, dtype=torch.bool)), ValueError, "attn_mask of shape"),
        ("mask_dtype", dict(attn_mask=torch.zeros(8, 10, dtype=torch.float64)), TypeError, "attn_mask must have dtype"),
        ("mask_int", dict(attn_mask=torch.zeros(8, 10, dtype=torch.int32)), TypeError, "attn_mask must have dtype"),
        ("causal_bias_and_causal", dict(attn_mask=causal_lower_right(8, 10), is_causal=True), ValueError,
         "cannot both be set"),
        ("causal_bias_lengths", dict(attn_mask=causal_lower_right(8, 11)), ValueError, "CausalBias for Lq=8, Lk=11"),
        ("padding_dtype", dict(key_padding_mask=pad.float()), TypeError, "key_padding_mask must have dtype"),
        ("padding_shape", dict(key_padding_mask=pad[:, :9]), ValueError,
         r"key_padding_mask must have shape \[\.\.\., Lk\] = \(2, 10\)"),
        ("padding_4d", dict(key_padding_mask=pad[:, None, None, :]), ValueError, "key_padding_mask must have shape"),
        ("dropout_high", dict(dropout_p=1.5), ValueError, r"dropout_p must be a float in \[0, 1\]"),
        ("dropout_negative", dict(dropout_p=-0.1), ValueError, "dropout_p"),
        ("backend_name", dict(backend="fast"), ValueError, "backend must be one of"),
        ("not_a_tensor", dict(value=[1.0]), TypeError, "value must be a torch.Tensor"),
        ("sparse", dict(key=torch.randn(2, 4, 10, 16).to_sparse()), TypeError,
         "key must be a dense \\(torch.strided\\) tensor, got layout torch.sparse_coo"),
        ("sparse_padding", dict(key_padding_mask=pad.to_sparse()), TypeError,
         "key_padding_mask must be a dense"),
    ]


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize(("overrides", "error", "match"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_clear_error(overrides, error, match):
    args = dict(query=torch.randn(2, 4, 8, 16), key=torch.randn(2, 4, 10, 16), value=torch.randn(2, 4, 10, 16))
    args.update(overrides)
    with pytest.raises(error, match=match):
        tk.scaled_dot_product_attention(**args)


# Refusals torch's default path does not make, each with why ours stands.
TORCH_ACCEPTS = {
    "value_length": "torch's CPU flash kernel reads value past its length (its math backend refuses)",
}


@pytest.mark.parametrize(("name", "overrides"), [(c[0], c[1]) for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_are_refused_by_torch_too(name, overrides):
    """A drop-in refuses only what torch refuses: each bad input that torch's SDPA can take (not
    our ``key_padding_mask`` or ``backend``) fails there too, but for the listed exceptions."""
    args = dict(query=torch.randn(2, 4, 8, 16), key=torch.randn(2, 4, 10, 16), value=torch.randn(2, 4, 10, 16))
    args.update(overrides)
    if "key_padding_mask" in args or "backend" in args:
        pytest.skip("an argument of ours alone")
    try:
        F.scaled_dot_product_attention(**args)
    except Exception:
        assert name not in TORCH_ACCEPTS, "torch refuses it now: drop the exception"
        return
    assert name in TORCH_ACCEPTS, "torch accepts this call, so a drop-in must too"


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(attn_mask="float"), dict(scale=3.0)], ids=str)
def test_zero_head_dim_averages_the_visible_values_as_torch(backend, kwargs):
    """``E = 0``: every score is an empty sum, so each row averages the values its masks leave
    (weighted by a float mask), as torch computes it; query and key get empty gradients."""
    kwargs = dict(kwargs)
    device = device_for(backend)
    q, k = torch.randn(2, 3, 5, 0, device=device), torch.randn(2, 3, 7, 0, device=device)
    v = torch.randn(2, 3, 7, 8, device=device)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    if kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(5, 7, device=device, requires_grad=True)
        inputs.append(kwargs["attn_mask"])
    out = tk.scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
    expected = F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), **{
        name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()})
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out.cpu())
    assert [g.shape for g in grads] == [t.shape for t in inputs]  # those of query and key are empty
    # The CPU reference's gradients reach the inputs through .cpu(): they are on the inputs' device.
    assert_close_to_reference([out.cpu(), *(g.cpu() for g in grads[2:])],
                              [expected, *(g.cpu() for g in expected_grads[2:])],
                              ["out", "grad_value", "grad_mask"][: len(inputs) - 1], tol=1e-5)


@requires_cuda
def test_device_mismatch_raises():
    q = torch.randn(2, 4, 8, 16, device="cuda")
    with pytest.raises(ValueError, match="key must be on the same device as query"):
        tk.scaled_dot_product_attention(q, q.cpu(), q)
    with pytest.raises(ValueError, match="key_padding_mask must be on the same device"):
        tk.scaled_dot_product_attention(q, q, q, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool))


# ----------------------------------------------------------------------------
# Registration: opcheck, torch.compile
# ----------------------------------------------------------------------------


def _op_arguments(backend: str, device: torch.device, dropout: bool, float_mask: bool):
    dtype = torch.float32
    q = torch.randn(2, 4, 9, 16, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 11, 16, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 11, 16, device=device, dtype=dtype, requires_grad=True)
    padding = make_padding("pad_holes", 2, 11).to(device)

    mask = None
    if float_mask:
        mask = torch.randn(1, 4, 9, 11, device=device, dtype=dtype, requires_grad=True).expand(2, 4, 9, 11)
    seed = torch.tensor([3, 4], dtype=torch.int64) if dropout else None
    causal = 0 if float_mask else 2
    return (q, k, v, padding, mask, causal, 0.25, 0.2 if dropout else 0.0, seed, backend)


OPCHECK_CASES = [
    backend_param(backend, dropout, float_mask, needs_backward, op="attention")
    for backend, dropout, float_mask, needs_backward in [
        ("eager", False, False, True), ("eager", True, False, True), ("eager", True, False, False),
        ("eager", False, True, True), ("triton", False, True, True),
    ]
]


@pytest.mark.parametrize(("backend", "dropout", "float_mask", "needs_backward"), OPCHECK_CASES)
def test_opcheck_forward_and_backward(backend, dropout, float_mask, needs_backward):
    """Both ops, with each thing a forward saves for the backward: the lse (tiled flash paths), the
    eager backend's materialized probabilities (dropout), or nothing (no backward was expected: the
    backward computes the probabilities again)."""
    device = device_for(backend)
    args = _op_arguments(backend, device, dropout, float_mask)
    forward_args = (*args[:-1], needs_backward, args[-1])
    torch.library.opcheck(torch.ops.transformer_kernels.attention_forward, forward_args)

    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in forward_args]
    out, saved = torch.ops.transformer_kernels.attention_forward(*detached)
    expected_dim = (4 if needs_backward else 1) if backend == "eager" and dropout else 3
    assert saved.dim() == expected_dim
    q, k, v, padding, mask, causal, scale, dropout_p, seed, _ = args
    backward_args = (
        torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, saved, padding,
        None if mask is None else mask.detach(), causal, scale, dropout_p, seed, float_mask, backend,
    )
    torch.library.opcheck(torch.ops.transformer_kernels.attention_backward, backward_args)


@pytest.mark.parametrize(("layout", "length", "needs_backward", "chunk_bytes", "saved_dim", "threads"), [
    ("bhld", 9, True, None, 4, None),   # short, differentiated: the probabilities
    ("blhd", 9, True, None, 1, None),   # ... with the folded copies of views (one flat buffer)
    ("blhd", 9, True, 1, 1, None),      # ... made chunk by chunk
    ("bhld", 9, True, 1, 4, None),      # ... the probabilities alone, in chunks: batch-major
    # No backward pass: nothing kept, whichever path runs (so an export's shapes hold across them):
    ("bhld", 9, False, None, 1, None),  # operands that fold: the materialized path
    ("blhd", 9, False, None, 1, 1),     # views it would copy to fold, at one thread: the flash path
    ("blhd", 9, False, None, 1, 2),     # ... and at more: the materialized path
    ("bhld", 41, False, None, 1, None),  # past _INFERENCE_PROBS_MAX_SCORES: the flash path
    ("gqa", 9, True, None, 3, None),    # grouped heads: the flash path
    ("bhld", 129, True, None, 3, None),  # past _PROBS_MAX_SCORES: the flash path
])
def test_eager_keeps_probabilities_for_short_calls(layout, length, needs_backward, chunk_bytes, saved_dim, threads,
                                                   monkeypatch, request):
    """What the eager forward keeps for its backward pass, op-checked with it: short differentiated
    calls with one head count keep the probabilities (with the folded copies of operands it copies
    to fold them), calls without a backward pass nothing (a backward recomputes what it needs),
    the others the lse."""
    if chunk_bytes is not None:
        monkeypatch.setattr(eager_probs, "_CHUNK_BYTES_PER_THREAD", chunk_bytes)
    if threads is not None:  # torch's own setter, restored after (never a monkeypatched torch attribute)
        request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
        torch.set_num_threads(threads)
    shape = (2, 4, length, 16) if layout != "blhd" else (2, length, 4, 16)
    q, k, v = (torch.randn(shape) if layout != "blhd" else torch.randn(shape).transpose(1, 2) for _ in range(3))
    if layout == "gqa":
        k, v = k[:, :2], v[:, :2]
    padding = make_padding("pad_holes", 2, length)
    args = (q, k, v, padding, None, 1, 0.25, 0.0, None, needs_backward, "eager")
    torch.library.opcheck(torch.ops.transformer_kernels.attention_forward, args)
    out, saved = torch.ops.transformer_kernels.attention_forward(*args)
    assert saved.dim() == saved_dim
    backward_args = (torch.randn_like(out), q, k, v, out, saved, padding, None, 1, 0.25, 0.0, None, False, "eager")
    torch.library.opcheck(torch.ops.transformer_kernels.attention_backward, backward_args)
    # The gradients' layout, which the fake states too: contiguous where folded matmuls wrote them
    # (in chunks, or on the folded operands the forward kept), else like the inputs.
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ops.transformer_kernels.attention_backward(*backward_args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in backward_args]
        fake = torch.ops.transformer_kernels.attention_backward(*fake_args)
    assert [t.stride() for t in fake] == [t.stride() for t in real]
    folded = (chunk_bytes is not None or saved.dim() == 1 and saved.numel() > 0) and layout != "gqa"
    for grad, like in zip(real[:3], (q, k, v)):
        assert grad.stride() == (grad.contiguous().stride() if folded else torch.empty_like(like).stride())


# Graph-level caches key on the graph, not on the op's fake implementation: a stale entry would
# hide a fake/real stride mismatch.  (Compiled C++ kernels stay cached by their source.)  torch's own
# config.patch restores the settings; monkeypatch would delete these dynamically served attributes.
@torch._inductor.config.patch(fx_graph_cache=False)
@torch._functorch.config.patch(enable_autograd_cache=False)
def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def block(q, k, v, mask, padding):
        scores_bias = mask * 0.5
        out = tk.scaled_dot_product_attention(q, k, v, attn_mask=scores_bias, key_padding_mask=padding)
        return out.relu().sum(-1)

    compiled = torch.compile(block, fullgraph=True)
    q, k, v = (torch.randn(2, 2, 12, 16, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 1, 12, 12, requires_grad=True)
    padding = make_padding("pad_suffix", 2, 12)
    inputs = (q, k, v, mask)
    expected = block(q, k, v, mask, padding)
    actual = compiled(q, k, v, mask, padding)
    grads = torch.autograd.grad(actual.sum(), inputs)
    expected_grads = torch.autograd.grad(expected.sum(), inputs)
    assert_close_to_reference([actual, *grads], [expected, *expected_grads], result_names(1, "qkvm"), tol=1e-5)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_export_with_dynamic_batch_and_length_holds_across_the_eager_paths(strict):
    """One exported program for every batch and length in the ranges, as torch's own SDPA exports:
    no guard on the sizes at which the eager backend changes paths (the inference call's saved
    tensor is empty on every path), nor a batch or length fixed by reading the output's numel."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return tk.scaled_dot_product_attention(q, k, v, is_causal=True)

    batch, length = torch.export.Dim("batch", min=2, max=64), torch.export.Dim("length", min=2, max=256)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    program = torch.export.export(Attend(), (q, k, v), dynamic_shapes=({0: batch, 2: length},) * 3, strict=strict)
    for size, tokens in ((3, 9), (2, 200)):  # both sides of the eager backend's materialized-path limit
        q, k, v = (torch.randn(size, 2, tokens, 8) for _ in range(3))
        torch.testing.assert_close(program.module()(q, k, v), Attend()(q, k, v))


def test_meta_inputs_with_dropout_give_shapes_not_a_read_of_the_seed():
    q, k, v = (torch.randn(2, 2, 6, 4, device="meta", requires_grad=grad) for grad in (True, False, False))
    out = tk.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert out.device.type == "meta" and out.shape == (2, 2, 6, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape


# ----------------------------------------------------------------------------
# GPU: low-precision error against an fp32 reference (FlashAttention's criterion)
# ----------------------------------------------------------------------------


@requires_cuda
@skip_unless_backend("triton", "attention")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("kind", "length", "head_dim"), [
    ("causal+pad_suffix", 1000, 64), ("none", 513, 128), ("causal_lower_right+pad_holes", 257, 80),
    ("float_grad+pad_left", 200, 64), ("bool_4d_broadcast", 300, 32),
    # Long sequences without a dense mask.
    ("none", 1024, 64), ("none", 1024, 128), ("causal", 1024, 64), ("causal", 1024, 128),
    ("causal+pad_suffix", 1024, 64), ("causal+pad_suffix", 1024, 128),
])
def test_gpu_low_precision_error_within_twice_torch(dtype, kind, length, head_dim):
    case = make_case(kind, 2, 4, 4, length, length, head_dim, dtype=torch.float32, device=torch.device("cuda"))
    leaves = case["leaves"]
    grad_out = torch.randn(2, 4, length, head_dim, device="cuda")
    assert_low_precision_within_2x(*attention_functions(case, "triton"), [t.to(dtype) for t in leaves.values()],
                                   grad_out, names=result_names(1, list(leaves)))


@pytest.mark.parametrize("mask_needs_grad", [False, True])
@pytest.mark.parametrize("length", [6, 80])  # the materialized path, the tiled flash path
@pytest.mark.parametrize(("dtype", "row_value"), [
    (torch.float64, torch.finfo(torch.float64).min), (torch.float32, torch.finfo(torch.float32).min),
    (torch.float32, -1e9),
])
def test_eager_gradients_of_rows_of_huge_mask_values_are_torchs_math(dtype, row_value, length, mask_needs_grad):
    """A row whose mask is one huge finite value on every key averages uniformly, and its gradients
    are those of torch's math: the flash backward's lse has lost log(Lk) to that value, so eager
    recomputes the probabilities (torch's own flash backends get them wrong)."""
    q, k, v, grad_out = (torch.randn(2, 2, length, 16, dtype=dtype) for _ in range(4))
    mask = torch.randn(length, length, dtype=dtype)
    mask[0] = row_value
    mask[3, : length // 2] = row_value
    inputs = [t.clone().requires_grad_() for t in (q, k, v)] + [mask.clone().requires_grad_(mask_needs_grad)]
    reference_inputs = [t.clone().requires_grad_() for t in (q, k, v)] + [mask.clone().requires_grad_(mask_needs_grad)]
    out = tk.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3], backend="eager")
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*reference_inputs[:3], attn_mask=reference_inputs[3])
    differentiated = slice(None) if mask_needs_grad else slice(3)
    grads = torch.autograd.grad(out, inputs[differentiated], grad_out)
    expected_grads = torch.autograd.grad(expected, reference_inputs[differentiated], grad_out)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    for actual, wanted in zip((out, *grads), (expected, *expected_grads)):
        torch.testing.assert_close(actual, wanted, rtol=tol, atol=tol)


@pytest.mark.parametrize("mask_shape", [(1, 2, 1, 1), (3, 1, 9, 1), (1, 1, 1, 11)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_broadcast_16bit_mask_gradient_within_twice_torch(dtype, mask_shape):
    """A broadcast 16-bit mask's gradient is summed over its broadcast dimensions before it is
    rounded, as torch's math sums it (a per-head mask's gradient, exactly 0, stays near 0)."""
    q, k, v = (torch.randn(3, 2, n, 16) for n in (9, 11, 11))
    mask = torch.randn(mask_shape)

    def ours(query, key, value, attn_mask):
        return tk.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, backend="eager")

    def torchs(query, key, value, attn_mask):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)

    assert_low_precision_within_2x(ours, torchs, [t.to(dtype) for t in (q, k, v, mask)], names=result_names(1, "qkvm"))


@pytest.mark.parametrize("backend", backend_params("attention"))
def test_expanded_16bit_mask_gradient_is_elementwise(backend):
    """A 16-bit mask the caller expanded (stride 0) and differentiates itself gets its element-wise
    gradient, within twice torch's float16 error; not the broadcast dimensions' sums in the first
    slice, which only the expand the public function makes for a smaller mask may hold."""
    device = device_for(backend)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16, generator=generator) for n in (9, 11, 11))
    base, grad_out = torch.randn(1, 1, 9, 11, generator=generator), torch.randn(2, 2, 9, 16, generator=generator)

    def mask_gradient(attend, dtype, device):
        mask = base.to(device, dtype).expand(2, 2, 9, 11).requires_grad_()
        out = attend(*(t.to(device, dtype) for t in (q, k, v)), attn_mask=mask)
        return torch.autograd.grad(out, mask, grad_out.to(device, dtype))[0].cpu().double()

    exact = mask_gradient(F.scaled_dot_product_attention, torch.float64, "cpu")
    torch_error = (mask_gradient(F.scaled_dot_product_attention, torch.float16, "cpu") - exact).abs().max()
    ours = mask_gradient(functools.partial(tk.scaled_dot_product_attention, backend=backend), torch.float16, device)
    assert (ours - exact).abs().max() <= 2 * torch_error + 1e-5


@pytest.mark.parametrize("backend", backend_params("attention"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_finfo_min_mask_rows_average_like_torch(backend, dtype):
    """A float mask of finfo(dtype).min stays finite (it would overflow to -inf in base-2 units):
    a row made of it averages uniformly, a partly finfo.min row ignores those keys, and -inf
    still excludes a key — outputs and gradients as torch computes them in float32."""
    device = device_for(backend)
    q, k, v = (torch.randn(2, 2, 6, 16, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 1, 6, 6, dtype=dtype, device=device)
    lowest = torch.finfo(dtype).min
    mask[:, :, 1] = lowest
    mask[:, :, 2, :4] = lowest
    mask[:, :, 3, :2] = float("-inf")
    mask.requires_grad_()
    inputs = (q, k, v, mask)
    out = tk.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    # torch's CPU kernels are the reference: its CUDA kernels treat an all-finfo.min row differently.
    reference_inputs = [t.detach().cpu().float().requires_grad_() for t in inputs]
    expected = F.scaled_dot_product_attention(*reference_inputs[:3], attn_mask=reference_inputs[3])
    # The all-finfo.min row's scores are absorbed into finfo.min, so their gradient is rounding
    # noise (torch's math and CPU flash backends disagree on it by O(1)); the other rows are compared.
    grad_out = torch.randn_like(expected)
    grad_out[:, :, 1] = 0
    grads = torch.autograd.grad(out, inputs, grad_out.to(device, dtype))
    expected_grads = torch.autograd.grad(expected, reference_inputs, grad_out)
    assert_close_to_reference([t.cpu().float() for t in (out, *grads)], [expected, *expected_grads],
                              result_names(1, "qkvm"), tol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("logit_scale", [1e2, 1e15])
def test_eager_large_logits_gradients_like_torch_math(logit_scale):
    """Scores far from 0 without any mask (about 5e4, and 1e30: representable in float32) on the
    flash tiles (more than 128 x 128 scores): the backward does not derive the probabilities from an
    lse that has lost them (torch's CPU flash kernel gave NaN at 1e30, and dq 50x its math's error at
    5e4) but recomputes them, as torch's math: gradients within its float32 error."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 200, 16 if logit_scale < 1e3 else 8, generator=generator) for _ in range(3))
    q, k = q * logit_scale, k * logit_scale
    grad_out = torch.randn(q.shape, generator=generator)
    assert eager_attention._takes_flash_tiles(q, k, v, AttentionArgs(None, None, 0, 0.25, 0.0, None), True)

    def grads(attend, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attend(*inputs), inputs, grad_out.to(dtype))

    def torch_math(*inputs):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(*inputs)

    exact = grads(torch_math, torch.float64)
    ours = grads(lambda *inputs: tk.scaled_dot_product_attention(*inputs, backend="eager"), torch.float32)
    torchs = grads(torch_math, torch.float32)
    for name, got, reference, expected in zip("qkv", ours, torchs, exact):
        error, torch_error = ((t.double() - expected).abs().max().item() for t in (got, reference))
        assert error <= 2 * torch_error + 1e-6 * expected.abs().max().item(), (name, error, torch_error)


# ----------------------------------------------------------------------------
# Eager: causal triangles cut into row blocks
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["causal", "causal_lower_right", "causal+pad_left", "causal_lower_right+pad_holes"])
@pytest.mark.parametrize(("lq", "lk"), [(300, 300), (260, 400), (400, 260)])
def test_eager_causal_row_blocks(kind, lq, lk):
    """Row blocks on the diagonal see only the keys up to their last row's: fewer scores than one
    tile over the whole causal relation, and the same result as the reference."""
    case = make_case(kind, 2, 2, 2, lq, lk, 16)
    q, k = case["leaves"]["query"], case["leaves"]["key"]
    causal = 2 if "lower_right" in kind else 1
    tiles = eager_tiles.plan(q, k, AttentionArgs(None, None, causal, 1.0, 0.0, None))
    scores = sum((t.rows.stop - t.rows.start) * (t.keys.stop - t.keys.start) for t in tiles)
    assert len(tiles) > 1 and scores < lq * lk
    assert all(t.rows.stop - t.rows.start <= eager_tiles._CAUSAL_ROW_BLOCK for t in tiles if t.bias is not None)
    check_against_reference(case, "eager", tol=1e-9)
