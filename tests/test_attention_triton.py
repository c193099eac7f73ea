"""Triton attention kernels, driven through the public API with ``backend="triton"``.

On a CPU machine the kernels run under ``TRITON_INTERPRET=1`` (set by
conftest.py) on small shapes in float32 and float16; the interpreter uses
small tiles (see ``block_config``), so lengths up to 130 cross several query
and key blocks and the causal diagonal.  Outputs and gradients are compared
with the float64 reference (exact masking, ``masked_value=-inf``).  With CUDA
the same tests run on the GPU (plus bfloat16), and the ``requires_cuda`` tests
check low-precision error against PyTorch's own low-precision math at longer
shapes.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

pytest.importorskip("triton")

import transformer_kernels as tk  # noqa: E402
from transformer_kernels.backends.triton import attention as triton_attention  # noqa: E402
from transformer_kernels.backends.triton.attention import MAX_FLOAT32_HEAD_DIM_ON_GPU  # noqa: E402
from transformer_kernels.reference.attention import attention as reference_attention  # noqa: E402
from transformer_kernels.ops.attention import AttentionArgs, Causal  # noqa: E402

from conftest import CUDA, requires_cuda  # noqa: E402
from conftest import TRITON_DEVICE as DEVICE  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
# Relative error (norm of the difference over norm of the reference) allowed
# against the float64 reference.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _randn(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A tensor of ``shape`` [..., H, L, E] in one of the memory layouts users pass."""
    if layout == "contiguous" or len(shape) < 4:
        return torch.randn(shape, device=DEVICE, dtype=dtype)
    b, h, length, e = shape
    if layout == "heads_interleaved":  # x.view(B, L, H, E).transpose(1, 2)
        return torch.randn(b, length, h, e, device=DEVICE, dtype=dtype).transpose(1, 2)
    assert layout == "head_dim_strided"  # last stride != 1: the backend copies
    return torch.randn(b, h, e, length, device=DEVICE, dtype=dtype).transpose(-1, -2)


def _key_padding(kind: Optional[str], batch: int, lk: int) -> Optional[torch.Tensor]:
    """True = padding.  Two batch rows per kind, so every pattern meets a normal row."""
    if kind is None:
        return None
    padding = torch.zeros(batch, lk, dtype=torch.bool)
    if kind == "suffix_and_all_pad":
        padding[0, (3 * lk) // 5 :] = True
        padding[1:, :] = True
    elif kind == "left_and_holes":
        padding[0, : min(5, lk - 1)] = True
        padding[1:, 1::3] = True
        padding[1:, lk - lk // 4 :] = True
    else:
        raise AssertionError(kind)
    return padding.to(DEVICE)


def _attn_mask(kind: Optional[str], b: int, hq: int, lq: int, lk: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    if kind is None:
        return None
    if kind == "bool_2d":
        mask = torch.rand(lq, lk) > 0.3
    elif kind == "bool_4d":
        mask = torch.rand(b, hq, lq, lk) > 0.5
    elif kind == "bool_rows":  # [Lq, 1]: some query rows see no key at all
        mask = torch.rand(lq, 1) > 0.3
    elif kind == "float":
        mask = torch.randn(1, hq, lq, lk).to(dtype)
        mask.masked_fill_(torch.rand(1, hq, lq, lk) < 0.2, float("-inf"))
    else:
        raise AssertionError(kind)
    return mask.to(DEVICE)


def _run_case(
    *,
    dtype: torch.dtype = torch.float32,
    batch: int = 2,
    heads: int = 2,
    kv_heads: Optional[int] = None,
    lq: int = 33,
    lk: int = 33,
    head_dim: int = 48,
    value_head_dim: Optional[int] = None,
    causal: Optional[str] = None,
    padding: Optional[str] = None,
    mask: Optional[str] = None,
    mask_grad: bool = False,
    layout: str = "contiguous",
    three_d: bool = False,
    scale: Optional[float] = None,
) -> None:
    kv_heads = heads if kv_heads is None else kv_heads
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    if three_d:
        query = _randn((batch, lq, head_dim), dtype, layout)
        key = _randn((batch, lk, head_dim), dtype, layout)
        value = _randn((batch, lk, value_head_dim), dtype, layout)
    else:
        query = _randn((batch, heads, lq, head_dim), dtype, layout)
        key = _randn((batch, kv_heads, lk, head_dim), dtype, layout)
        value = _randn((batch, kv_heads, lk, value_head_dim), dtype, layout)
    key_padding_mask = _key_padding(padding, batch, lk)
    attn_mask = _attn_mask(mask, batch, 1 if three_d else heads, lq, lk, dtype)
    if three_d and attn_mask is not None:
        attn_mask = attn_mask.squeeze(1) if attn_mask.dim() == 4 else attn_mask
    for tensor in (query, key, value):
        tensor.requires_grad_(True)
    if mask_grad:
        attn_mask.requires_grad_(True)

    torch_mask = causal_lower_right(lq, lk) if causal == "bottom_right" else attn_mask

    def attention():
        return tk.scaled_dot_product_attention(
            query, key, value, attn_mask=torch_mask, is_causal=causal == "top_left", scale=scale,
            enable_gqa=kv_heads != heads, key_padding_mask=key_padding_mask, backend="triton",
        )

    if CUDA and dtype == torch.float32 and max(head_dim, value_head_dim) > MAX_FLOAT32_HEAD_DIM_ON_GPU:
        with pytest.raises(tk.BackendUnavailableError, match="float32 on the GPU up to head dim"):
            attention()
        return
    out = attention()
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    inputs64 = [t.detach().double().requires_grad_(True) for t in (query, key, value)]
    mask64 = attn_mask
    if attn_mask is not None and attn_mask.is_floating_point():
        mask64 = attn_mask.detach().double().requires_grad_(mask_grad)
    expected = reference_attention(
        *inputs64, mask64, is_causal=causal is not None, scale=scale, key_padding_mask=key_padding_mask,
        causal_bottom_right=causal == "bottom_right", enable_gqa=kv_heads != heads, masked_value=float("-inf"),
    )
    expected.backward(grad_out.double())

    tolerance = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    pairs = [("out", out, expected)] + [
        (f"d{name}", tensor.grad, reference.grad)
        for name, tensor, reference in zip(("query", "key", "value"), (query, key, value), inputs64)
    ]
    if mask_grad:
        pairs.append(("dmask", attn_mask.grad, mask64.grad))
    for name, actual, reference in pairs:
        assert torch.isfinite(actual).all(), f"{name} has non-finite values"
        assert actual.shape == reference.shape, name
        error = _relative_error(actual, reference)
        assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


CASES = {
    "no_mask": dict(),
    "lq1_decode": dict(lq=1, lk=130, causal="bottom_right"),
    "lengths_130x7": dict(lq=130, lk=7, head_dim=64),
    "lengths_7x130_top_left": dict(lq=7, lk=130, causal="top_left"),
    "square_130_top_left": dict(batch=1, heads=1, lq=130, lk=130, head_dim=64, causal="top_left"),
    "top_left_lq_gt_lk": dict(lq=47, lk=33, causal="top_left"),
    "bottom_right_lq_gt_lk": dict(lq=47, lk=33, causal="bottom_right"),
    "bottom_right_lq_lt_lk": dict(lq=33, lk=47, causal="bottom_right"),
    "padding_suffix_all_pad": dict(lk=47, padding="suffix_and_all_pad"),
    "padding_left_holes": dict(lk=47, padding="left_and_holes"),
    "padding_causal": dict(lq=40, lk=47, padding="left_and_holes", causal="bottom_right"),
    "bool_mask_2d": dict(lk=40, mask="bool_2d"),
    "bool_mask_4d_padding": dict(mask="bool_4d", padding="suffix_and_all_pad"),
    "bool_mask_rows": dict(mask="bool_rows"),
    "float_mask_grad": dict(lq=20, lk=40, mask="float", mask_grad=True),
    "float_mask_padding": dict(mask="float", padding="left_and_holes"),
    "gqa": dict(heads=2, kv_heads=1, lk=40),
    "gqa_causal_padding": dict(heads=2, kv_heads=1, lq=40, lk=40, causal="top_left", padding="left_and_holes"),
    "heads_interleaved": dict(layout="heads_interleaved", causal="top_left"),
    "head_dim_strided": dict(layout="head_dim_strided", lk=20),
    "three_d": dict(three_d=True, lq=7, lk=33),
    "head_dim_2": dict(lq=7, lk=7, head_dim=2),
    "head_dim_80_value_48": dict(head_dim=80, value_head_dim=48, lk=20),
    "head_dim_256": dict(batch=1, heads=1, head_dim=256, lk=40, causal="top_left"),
    "custom_scale": dict(scale=0.3),
}
HALF_CASES = ("no_mask", "bottom_right_lq_gt_lk", "padding_causal", "float_mask_grad", "gqa", "head_dim_256")
LOW_PRECISION = [torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference_fp32(case):
    _run_case(**CASES[case])


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", HALF_CASES)
def test_matches_float64_reference_low_precision(case, dtype):
    _run_case(dtype=dtype, **CASES[case])


def test_rows_without_keys_give_zero_output_and_zero_gradient():
    # Bottom-right causal with Lq > Lk leaves the first Lq - Lk rows without
    # keys; the second sequence is all padding.
    lq, lk = 40, 24
    query, key, value = (
        torch.randn(2, 2, length, 16, device=DEVICE, requires_grad=True) for length in (lq, lk, lk)
    )
    padding = torch.zeros(2, lk, dtype=torch.bool, device=DEVICE)
    padding[1] = True
    out = tk.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(lq, lk), key_padding_mask=padding, backend="triton"
    )
    out.backward(torch.randn_like(out))
    for tensor in (out, query.grad, key.grad, value.grad):
        assert torch.isfinite(tensor).all()
    assert out[0, :, : lq - lk].abs().max() == 0
    assert out[1].abs().max() == 0
    assert query.grad[0, :, : lq - lk].abs().max() == 0
    assert query.grad[1].abs().max() == 0
    assert key.grad[1].abs().max() == 0 and value.grad[1].abs().max() == 0
    assert out[0, :, lq - lk :].abs().min() > 0


def test_batch_heads_beyond_the_grid_limit_are_launched_in_chunks(monkeypatch):
    # CUDA caps the grid's second dimension (batch * heads) at 65535; shrink
    # the cap so the chunked launch runs at a testable size.
    monkeypatch.setattr(triton_attention, "_MAX_GRID_Y", 3)
    _run_case(batch=2, heads=4, kv_heads=2, lq=20, lk=20, causal="top_left", padding="left_and_holes")


@pytest.mark.skipif(CUDA, reason="interpreter: the huge strides stay in one lazily allocated host buffer")
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_dense_mask_rows_beyond_int32_offsets(kind):
    # Rows 2 and 3 of this mask start 2**31 and 3 * 2**30 elements into its
    # buffer: with int32 row offsets (row * stride) they would wrap around.
    # Only the rows' pages are ever written or read.
    lq, lk, row_stride = 4, 64, 2**30
    dtype = torch.bool if kind == "bool" else torch.float32
    buffer = torch.empty((lq - 1) * row_stride + lk, dtype=dtype)
    mask = buffer.as_strided((1, 1, lq, lk), (0, 0, row_stride, 1))
    mask.copy_(torch.rand(1, 1, lq, lk) > 0.3 if kind == "bool" else torch.randn(1, 1, lq, lk))
    query, key, value = (torch.randn(1, 1, length, 16) for length in (lq, lk, lk))
    out, _ = triton_attention.forward(query, key, value, AttentionArgs(None, mask, Causal.NONE, 0.25, 0.0, None))
    expected = reference_attention(query, key, value, attn_mask=mask.contiguous(), scale=0.25)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------

DROPOUT_P = 0.3


def _dropout_inputs(lq: int = 37, lk: int = 40, head_dim: int = 16):
    query = torch.randn(2, 2, lq, head_dim, device=DEVICE)
    key = torch.randn(2, 2, lk, head_dim, device=DEVICE)
    value = torch.randn(2, 2, lk, 24, device=DEVICE)
    return query, key, value


def _dropped_weights(query, key, seed: int, causal: bool = False, padding=None) -> torch.Tensor:
    """The kernel's dropout(P) for one seed, read off by attending to value = I."""
    lk = key.shape[-2]
    identity = torch.eye(lk, device=DEVICE).expand(*key.shape[:-1], lk)
    torch.manual_seed(seed)
    return tk.scaled_dot_product_attention(
        query, key, identity, dropout_p=DROPOUT_P, is_causal=causal, key_padding_mask=padding, backend="triton"
    ).double()


def test_dropout_is_deterministic_under_a_fixed_seed():
    query, key, value = _dropout_inputs()
    outputs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        outputs.append(tk.scaled_dot_product_attention(query, key, value, dropout_p=DROPOUT_P, backend="triton"))
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.allclose(outputs[0], outputs[2])


def test_dropout_keep_rate_and_scale():
    # lk is the value head dim here (value = I): float32 on the GPU serves up to 64.
    query, key, _ = _dropout_inputs(lq=64, lk=64)
    dropped = _dropped_weights(query, key, seed=3)
    weights = torch.softmax(query.double() @ key.double().transpose(-1, -2) / 4.0, -1)
    ratio = dropped / weights
    kept = ratio > 0.5
    # Every weight is either dropped or scaled by 1 / (1 - p).
    assert torch.allclose(ratio[kept], torch.full_like(ratio[kept], 1 / (1 - DROPOUT_P)), rtol=1e-4)
    assert ratio[~kept].abs().max() < 1e-6
    keep_rate = kept.double().mean().item()
    n = kept.numel()
    assert abs(keep_rate - (1 - DROPOUT_P)) < 5 * math.sqrt(DROPOUT_P * (1 - DROPOUT_P) / n)
    # The expected row sum stays 1 (mean preserved).
    row_sums = dropped.sum(-1)
    assert abs(row_sums.mean().item() - 1.0) < 5 * row_sums.std().item() / math.sqrt(row_sums.numel())
    # Masks differ between (batch, head) pairs.
    assert not torch.equal(kept[0, 0], kept[0, 1]) and not torch.equal(kept[0, 0], kept[1, 0])


@pytest.mark.parametrize("masks", ["none", "causal", "padding"])
def test_dropout_backward_matches_reference_with_the_same_keep_mask(masks):
    # Key padding moves where the kernels' key loops start: the keep-mask must
    # still be the same element by element in forward, dK/dV and dQ.
    query, key, value = _dropout_inputs()
    lq, lk = query.shape[-2], key.shape[-2]
    causal = masks == "causal"
    padding = _key_padding("left_and_holes", 2, lk) if masks == "padding" else None
    dropped = _dropped_weights(query, key, seed=5, causal=causal, padding=padding)
    scale = 1.0 / math.sqrt(query.shape[-1])

    query, key, value = (t.requires_grad_(True) for t in (query, key, value))
    torch.manual_seed(5)
    out = tk.scaled_dot_product_attention(
        query, key, value, dropout_p=DROPOUT_P, is_causal=causal, key_padding_mask=padding, backend="triton"
    )
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    inputs64 = [t.detach().double().requires_grad_(True) for t in (query, key, value)]
    scores = inputs64[0] @ inputs64[1].transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    if padding is not None:
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, -1)
    ratio = torch.where(weights > 0, dropped / weights, 0.0).detach()
    kept = ratio > 0.5
    keep_scale = kept * ratio[kept].mean()  # the kernel's 1 / (1 - p)
    expected = (weights * keep_scale) @ inputs64[2]
    expected.backward(grad_out.double())
    for name, actual, reference in (
        ("out", out, expected), ("dquery", query.grad, inputs64[0].grad),
        ("dkey", key.grad, inputs64[1].grad), ("dvalue", value.grad, inputs64[2].grad),
    ):
        error = _relative_error(actual, reference)
        assert error <= TOLERANCE[torch.float32], f"{name}: relative error {error:.2e}"


# ----------------------------------------------------------------------------
# GPU: low-precision error at most twice PyTorch's own (FlashAttention's rule)
# ----------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "padded_causal"])
def test_gpu_low_precision_error_at_most_twice_torch(dtype, head_dim, mask):
    batch, heads, length = 2, 4, 1024
    query, key, value = (torch.randn(batch, heads, length, head_dim, device="cuda") for _ in range(3))
    padding = None
    if mask == "padded_causal":
        lengths = torch.tensor([length, 3 * length // 5], device="cuda")
        padding = torch.arange(length, device="cuda")[None, :] >= lengths[:, None]
    causal = mask != "none"
    grad_out = torch.randn(batch, heads, length, head_dim, device="cuda")

    def run(fn, tensors):
        tensors = [t.detach().requires_grad_(True) for t in tensors]
        out = fn(*tensors)
        out.backward(grad_out.to(out.dtype))
        return [out.float()] + [t.grad.float() for t in tensors]

    def reference(q, k, v):
        return reference_attention(q, k, v, is_causal=causal, key_padding_mask=padding, masked_value=float("-inf"))

    def ours(q, k, v):
        return tk.scaled_dot_product_attention(q, k, v, is_causal=causal, key_padding_mask=padding, backend="triton")

    low = [t.to(dtype) for t in (query, key, value)]
    exact = run(reference, [t.float() for t in low])
    torch_low = run(reference, low)
    triton_low = run(ours, low)
    for name, e, t, o in zip(("out", "dq", "dk", "dv"), exact, torch_low, triton_low):
        torch_error = (t - e).abs().max().item()
        our_error = (o - e).abs().max().item()
        assert our_error <= 2 * torch_error + 1e-5, f"{name}: {our_error:.3e} > 2 x torch's {torch_error:.3e}"


def test_padding_an_odd_head_dim_keeps_broadcast_dims_broadcast():
    # Head dim 8 is zero-padded to 16 by a copy; a key shared over a batch of 64 (stride 0)
    # must cost one slice of that copy, not 64, and still give torch's values and gradients.
    shared = torch.randn(1, 2, 7, 8, device=DEVICE)
    padded = triton_attention._aligned(shared.expand(64, 2, 7, 8))
    assert padded.shape == (64, 2, 7, 16) and padded.stride(0) == 0
    assert torch.equal(padded[..., :8], shared.expand(64, 2, 7, 8)) and not padded[..., 8:].any()

    query = torch.randn(64, 2, 5, 8, device=DEVICE, requires_grad=True)
    key, value = (torch.randn(1, 2, 7, 8, device=DEVICE, requires_grad=True) for _ in range(2))
    leaves = (query, key, value)
    out = tk.scaled_dot_product_attention(query, key.expand(64, -1, -1, -1), value.expand(64, -1, -1, -1),
                                          backend="triton")
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double().expand(64, -1, -1, -1), value.double().expand(64, -1, -1, -1)
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
    grad_out = torch.randn_like(expected)
    grads = torch.autograd.grad(out, leaves, grad_out.float())
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)
