"""Triton attention kernels, driven through the public API with ``backend="triton"``.

On a CPU machine the kernels run under ``TRITON_INTERPRET=1`` (set by
conftest.py) on small shapes in float32 and float16; the interpreter uses
small tiles (see ``block_config``), so lengths up to 130 cross several query
and key blocks and the causal diagonal.  Outputs and gradients are compared
with the float64 reference (exact masking, ``masked_value=-inf``).  With CUDA
the same tests run on the GPU (plus bfloat16).

The tests every backend shares (rows without keys, dropout, the low-precision
error against PyTorch's own on the GPU, ...) are in tests/test_attention.py.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

pytest.importorskip("triton")

import transformer_kernels as tk  # noqa: E402
from transformer_kernels.backends.triton import attention as triton_attention  # noqa: E402
from transformer_kernels.backends.triton.attention import MAX_FLOAT32_HEAD_DIM_ON_GPU  # noqa: E402
from transformer_kernels.reference.attention import attention as reference_attention  # noqa: E402
from transformer_kernels.backends.triton._common import (  # noqa: E402
    KernelConfig, KernelLaunch, LaunchTemplates, run_launches,
)
from transformer_kernels.ops._call_plans import CallPlans  # noqa: E402
from transformer_kernels.ops.attention import AttentionArgs, Causal, key_padding_bounds  # noqa: E402

from _helpers import assert_close_to_reference, assert_matches_reference, device_for  # noqa: E402
from _helpers import OpRecorder, skip_unless_backend  # noqa: E402
from conftest import CUDA  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs"),
    skip_unless_backend("triton", "attention"),
]
DEVICE = device_for("triton")
# Relative error (norm of the difference over norm of the reference) allowed
# against the float64 reference.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# In float32, also the max abs error relative to 1 + max |reference| (test_attention.py's bound).
MAX_ABS_TOLERANCE = {torch.float32: 2e-3}


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
    elif kind == "left_and_right":  # kept keys contiguous: the kernels skip the padding mask between them
        padding[0, : min(5, lk - 1)] = True
        padding[0, lk - lk // 5 :] = True
        padding[1:, (2 * lk) // 3 :] = True
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
    elif kind == "bool_heads_broadcast":  # [B, 1, Lq, Lk]
        mask = torch.rand(b, 1, lq, lk) > 0.4
    elif kind == "bool_batch_broadcast":  # [1, Hq, Lq, Lk], the float mask's shape
        mask = torch.rand(1, hq, lq, lk) > 0.3
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
    # A float mask is an input (differentiated when mask_grad); the reference gets it in float64.
    mask_input = [attn_mask] if mask_grad else []
    fixed_mask = None if mask_grad else attn_mask
    fixed_mask64 = fixed_mask.double() if fixed_mask is not None and fixed_mask.is_floating_point() else fixed_mask
    if causal == "bottom_right":
        fixed_mask = causal_lower_right(lq, lk)

    def attention(query, key, value, attn_mask=fixed_mask):
        return tk.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=causal == "top_left", scale=scale,
            enable_gqa=kv_heads != heads, key_padding_mask=key_padding_mask, backend="triton",
        )

    def reference(query, key, value, attn_mask=fixed_mask64):
        return reference_attention(
            query, key, value, attn_mask, is_causal=causal is not None, scale=scale,
            key_padding_mask=key_padding_mask, causal_bottom_right=causal == "bottom_right",
            enable_gqa=kv_heads != heads, masked_value=float("-inf"),
        )

    if CUDA and dtype == torch.float32 and max(head_dim, value_head_dim) > MAX_FLOAT32_HEAD_DIM_ON_GPU:
        with pytest.raises(tk.BackendUnavailableError, match="float32 on the GPU up to head dim"):
            attention(query, key, value)
        return
    criteria = dict(norm_tol=TOLERANCE[dtype])
    if dtype in MAX_ABS_TOLERANCE:
        criteria["tol"] = MAX_ABS_TOLERANCE[dtype]
    (out,) = assert_matches_reference(attention, reference, [query, key, value, *mask_input],
                                      input_names=("query", "key", "value", "mask"), **criteria)
    assert out.dtype == dtype


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
    "float_mask_grad_padding": dict(mask="float", mask_grad=True, padding="suffix_and_all_pad"),
    # is_causal with an attn_mask: both apply.
    "top_left_bool_mask_padding": dict(lq=40, lk=47, causal="top_left", mask="bool_2d", padding="left_and_holes"),
    "top_left_float_mask_grad": dict(lq=47, lk=40, causal="top_left", mask="float", mask_grad=True),
    "bool_mask_heads_broadcast_decode": dict(lq=1, lk=33, mask="bool_heads_broadcast"),
    "gqa": dict(heads=2, kv_heads=1, lk=40),
    "gqa_causal_padding": dict(heads=2, kv_heads=1, lq=40, lk=40, causal="top_left", padding="left_and_holes"),
    "heads_interleaved": dict(layout="heads_interleaved", causal="top_left"),
    "head_dim_strided": dict(layout="head_dim_strided", lk=20),
    "three_d": dict(three_d=True, lq=7, lk=33),
    "head_dim_2": dict(lq=7, lk=7, head_dim=2),
    "head_dim_80_value_48": dict(head_dim=80, value_head_dim=48, lk=20),
    "head_dim_256": dict(batch=1, heads=1, head_dim=256, lk=40, causal="top_left"),
    "custom_scale": dict(scale=0.3),
    # The forward runs a negative scale as -query with the scale negated, a zero one as a zeroed
    # query (see the launcher).
    "negative_scale": dict(scale=-8.0, lk=20),
    # Milder for 16-bit inputs, whose rounding a large scale amplifies (bfloat16 on a GPU).
    "negative_scale_mild": dict(scale=-2.0, lk=20),
    "zero_scale_padding": dict(scale=0.0, lk=20, padding="suffix_and_all_pad"),
    "negative_scale_interior_padding": dict(lq=40, lk=83, head_dim=64, scale=-2.0, causal="top_left",
                                            padding="left_and_right"),
    # Head dim 64 fills its block, so whole key blocks inside the bounds load K
    # and V without any mask; these mix such blocks with edge blocks (a partial
    # tail, padding at either end, the diagonal), and holes in the padding
    # that put every block on the masked path.
    "interior_padding_left_and_right": dict(lq=40, lk=83, head_dim=64, padding="left_and_right"),
    "interior_top_left_padding": dict(lq=70, lk=83, head_dim=64, causal="top_left", padding="left_and_right"),
    "interior_bottom_right_padding": dict(lq=70, lk=83, head_dim=64, causal="bottom_right", padding="left_and_right"),
    "interior_bottom_right_holes": dict(lq=50, lk=83, head_dim=64, causal="bottom_right", padding="left_and_holes"),
    "interior_bool_mask_empty_rows": dict(lq=40, lk=83, head_dim=64, mask="bool_rows", padding="left_and_right"),
    "interior_float_mask": dict(lq=40, lk=83, head_dim=64, mask="float"),
    "interior_top_left_bool_mask": dict(lq=70, lk=83, head_dim=64, causal="top_left", mask="bool_rows"),
    "interior_lq1_padding": dict(lq=1, lk=83, head_dim=64, causal="bottom_right", padding="left_and_right"),
}
HALF_CASES = (
    "no_mask", "negative_scale_mild", "bottom_right_lq_gt_lk", "padding_causal", "float_mask_grad", "gqa",
    "head_dim_256", "interior_bottom_right_padding", "top_left_float_mask_grad",
)
LOW_PRECISION = [torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference_fp32(case):
    _run_case(**CASES[case])


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", HALF_CASES)
def test_matches_float64_reference_low_precision(case, dtype):
    _run_case(dtype=dtype, **CASES[case])


def test_calls_of_one_shape_that_differ_elsewhere_do_not_share_launches():
    # Each launch is built once per layout and reused (LaunchTemplates): calls of one shape that differ in a
    # scalar, a mask, a causal kind or a stride must each get their own; the repeated first call reuses its own.
    shape = dict(lq=33, lk=40, head_dim=32)
    variants = [
        dict(), dict(scale=0.3), dict(causal="top_left"), dict(causal="bottom_right"),
        dict(padding="left_and_holes"), dict(padding="left_and_holes", causal="top_left"),
        dict(mask="bool_4d"), dict(mask="bool_2d"), dict(mask="float"), dict(mask="bool_batch_broadcast"),
        dict(mask="float", mask_grad=True),
        dict(layout="heads_interleaved"), dict(),
    ]
    for variant in variants:
        _run_case(**shape, **variant)


def test_a_tile_changed_at_run_time_takes_effect_on_a_known_layout(monkeypatch):
    # The tile sweep (benchmarks/tune_attention.py) and the tile tests swap configurations between
    # calls of one layout: the launches kept for that layout must not keep the old tile.
    query, key, value = (torch.randn(1, 2, 40, 32, device=DEVICE) for _ in range(3))
    args = AttentionArgs(None, None, Causal.NONE, 0.25, 0.0, None)
    launched = []
    monkeypatch.setattr(KernelLaunch, "__call__", lambda launch: launched.append(launch.kwargs["BLOCK_M"]))
    triton_attention.forward(query, key, value, args, False)
    tile = KernelConfig(block_m=launched[0] * 2, block_n=16, num_warps=1, num_stages=1)
    table_config = triton_attention.block_config

    def patched(kernel, *rest):  # as the tile sweep patches it
        return tile if kernel == "forward" else table_config(kernel, *rest)

    monkeypatch.setattr(triton_attention, "block_config", patched)
    triton_attention.forward(query, key, value, args, False)
    assert launched[1] == tile.block_m


def test_launch_templates_keep_no_tensor():
    # A template outlives its call: a tensor left among the arguments it keeps would be read at a stale
    # address by the next call of that layout, so making such a template fails.
    tensor, other = torch.empty(4), torch.empty(4)
    templates = LaunchTemplates()
    launch = KernelLaunch(None, (1,), (tensor, other, 7), {"BLOCK": 16})
    with pytest.raises(RuntimeError, match="takes a tensor its template would keep"):
        templates.launches("layout", (tensor,), lambda: [launch])
    with pytest.raises(RuntimeError, match="does not begin with the call's pointer arguments"):
        templates.launches("layout", (other,), lambda: [launch])
    (bound,) = templates.launches("layout", (tensor, other), lambda: [launch])
    relaunch = KernelLaunch(None, (1,), (other, tensor, 7), {"BLOCK": 16})
    (rebound,) = templates.launches("layout", (other, tensor), lambda: [relaunch])
    assert bound.args == (tensor, other, 7) and bound.kwargs == {"BLOCK": 16}
    assert rebound.args == (other, tensor, 7) and rebound.kwargs == {"BLOCK": 16}


def test_launch_templates_verify_that_the_layout_determines_the_launches():
    # The test suite runs with LaunchTemplates.verify on: a layout that misses an argument the launches
    # depend on fails at its next call rather than launching with the first call's value.
    tensor, templates = torch.empty(4), LaunchTemplates()
    assert LaunchTemplates.verify
    templates.launches("layout", (tensor,), lambda: [KernelLaunch(None, (1,), (tensor, 7), {"BLOCK": 16})])
    with pytest.raises(AssertionError, match="misses something the launches depend on"):
        templates.launches("layout", (tensor,), lambda: [KernelLaunch(None, (1,), (tensor, 8), {"BLOCK": 16})])


@pytest.fixture
def fresh_plans(monkeypatch):
    """Call plans from none, each call checked against the checked route (the suite's default): a
    test that swaps a piece of the launchers (other than the tile table, which a prepared call
    checks) needs them, or a prepared forward or backward kept from an earlier test runs without it."""
    from transformer_kernels.ops import attention as attention_op

    monkeypatch.setattr(attention_op, "_PLANS", CallPlans())
    return attention_op._PLANS


def _kept_forward(plans: "CallPlans"):
    ((_, (_, plan)),) = plans._plans.items()
    return plan.forward


@pytest.mark.parametrize("masks", [dict(), dict(is_causal=True), dict(padding=True), dict(padding=True, dropout=0.3)],
                         ids=["none", "causal", "padding", "padding_dropout"])
def test_a_plan_runs_the_prepared_forward_on_each_calls_tensors(fresh_plans, masks):
    """The call plan of a layout the kernels take as it is keeps a forward prepared for it, which
    later calls run with their own tensors, padding and dropout seed, and which prepares their
    backward: the first call's values on its tensors (the checked route ran it), the reference's on
    the others (LaunchTemplates.verify, set for the suite, also compares the launches with those of
    forward and backward)."""
    batch, heads, length, head_dim = 3, 2, 40, 32
    padding_rows = [torch.tensor([[40], [17], [1]]), torch.tensor([[5], [40], [23]])]
    for call in range(3):
        q, k, v = (torch.randn(batch, length, heads, head_dim, device=DEVICE, requires_grad=True).transpose(1, 2)
                   for _ in range(3))
        padding = None
        if masks.get("padding"):
            padding = torch.arange(length, device=DEVICE) >= padding_rows[call % 2].to(DEVICE)
        kwargs = dict(is_causal=masks.get("is_causal", False), key_padding_mask=padding,
                      dropout_p=masks.get("dropout", 0.0))
        results = []
        for _ in range(2):  # on the first call of all, the checked route, then the plan
            torch.manual_seed(call)
            out = tk.scaled_dot_product_attention(q, k, v, backend="triton", **kwargs)
            results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
            assert isinstance(_kept_forward(fresh_plans), triton_attention._PreparedForward)
        assert isinstance(_kept_forward(fresh_plans).prepared_backward, triton_attention._PreparedBackward)
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
        if not kwargs["dropout_p"]:
            exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
            expected = reference_attention(*exact, is_causal=kwargs["is_causal"], key_padding_mask=padding,
                                           masked_value=float("-inf"))
            expected_grads = torch.autograd.grad(expected, exact, torch.ones_like(expected))
            assert_close_to_reference(results[1], (expected, *expected_grads), tol=TOLERANCE[torch.float32])


def test_the_prepared_forward_takes_forward_where_the_call_differs(fresh_plans, monkeypatch):
    """An address off 16 bytes (a layout the plan cannot tell from an aligned one) or a swapped tile
    table (the tile sweep's) sends a call to forward, which copies or retiles it."""
    shape, flat = (2, 2, 24, 32), 2 * 2 * 24 * 32
    q, k, v = (torch.randn(shape, device=DEVICE) for _ in range(3))
    tk.scaled_dot_product_attention(q, k, v, backend="triton")
    assert isinstance(_kept_forward(fresh_plans), triton_attention._PreparedForward)
    general = []
    real_forward = triton_attention.forward
    monkeypatch.setattr(triton_attention, "forward", lambda *args: general.append(1) or real_forward(*args))
    unaligned = torch.randn(flat + 1, device=DEVICE)[1:].view(shape)
    assert unaligned.stride() == q.stride() and unaligned.data_ptr() % 16 != 0
    out = tk.scaled_dot_product_attention(unaligned, k, v, backend="triton")
    assert len(general) == 1
    assert_close_to_reference(out, reference_attention(unaligned.double(), k.double(), v.double()), tol=TOLERANCE[
        torch.float32])
    table = triton_attention.block_config
    monkeypatch.setattr(triton_attention, "block_config", lambda *args: table(*args))
    tk.scaled_dot_product_attention(q, k, v, backend="triton")
    assert len(general) == 2


def test_the_prepared_forward_fails_where_its_launches_differ_from_forwards(fresh_plans):
    """What the suite relies on: under LaunchTemplates.verify, a prepared forward whose templates are
    not what forward would launch fails the call."""
    q, k, v = (torch.randn(2, 2, 24, 32, device=DEVICE) for _ in range(3))
    tk.scaled_dot_product_attention(q, k, v, backend="triton")
    prepared = _kept_forward(fresh_plans)
    prepared.forward = prepared.forward + prepared.forward
    with pytest.raises(AssertionError, match="prepared attention forward's launches differ"):
        tk.scaled_dot_product_attention(q, k, v, backend="triton")


def test_the_prepared_backward_takes_backward_where_the_call_differs(fresh_plans, monkeypatch):
    """The backward of a prepared forward's call: its grad_out in another layout than the first's, an
    address off 16 bytes or a swapped tile table sends it to backward; each gradient against the
    reference."""
    shape = (2, 2, 24, 32)
    q, k, v = (torch.randn(shape, device=DEVICE, requires_grad=True) for _ in range(3))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*exact)
    general = []
    real_backward = triton_attention.backward
    monkeypatch.setattr(triton_attention, "backward", lambda *args: general.append(1) or real_backward(*args))

    def check_gradients(grad_out):
        out = tk.scaled_dot_product_attention(q, k, v, backend="triton")
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        expected_grads = torch.autograd.grad(expected, exact, grad_out.double(), retain_graph=True)
        assert_close_to_reference(grads, expected_grads, tol=TOLERANCE[torch.float32])

    grad_out = torch.randn(shape, device=DEVICE)
    for _ in range(2):  # the checked route, then the plan's prepared forward and backward
        check_gradients(grad_out)
    assert isinstance(_kept_forward(fresh_plans).prepared_backward, triton_attention._PreparedBackward)
    assert general == [1]  # the checked route's backward only
    check_gradients(torch.randn(2, 24, 2, 32, device=DEVICE).transpose(1, 2))
    assert len(general) == 2
    unaligned = torch.randn(grad_out.numel() + 1, device=DEVICE)[1:].view(shape)
    assert unaligned.stride() == grad_out.stride() and unaligned.data_ptr() % 16 != 0
    check_gradients(unaligned)
    assert len(general) == 3
    table = triton_attention.block_config
    monkeypatch.setattr(triton_attention, "block_config", lambda *args: table(*args))
    check_gradients(grad_out)
    assert len(general) == 4
    monkeypatch.setattr(triton_attention, "block_config", table)
    check_gradients(grad_out)
    assert len(general) == 4


def test_a_backward_pass_under_a_dispatch_mode_goes_through_the_op(fresh_plans):
    """A forward run plainly, by its prepared forward, whose backward pass runs under a dispatch mode
    (a flop counter, an op recorder): the mode sees the backward op, which the prepared backward
    would have skipped the dispatcher for."""
    q, k, v = (torch.randn(2, 2, 24, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    for _ in range(2):  # the checked route, then the plan's prepared forward
        out = tk.scaled_dot_product_attention(q, k, v, backend="triton")
    assert isinstance(_kept_forward(fresh_plans), triton_attention._PreparedForward)
    with OpRecorder(lambda op: op.namespace == "transformer_kernels") as recorder:
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert "attention_backward" in recorder.ops
    expected = torch.autograd.grad(tk.scaled_dot_product_attention(q, k, v, backend="eager"), (q, k, v),
                                   torch.ones_like(out))
    assert_close_to_reference(grads, expected, tol=TOLERANCE[torch.float32])


def test_the_prepared_backward_fails_where_its_launches_differ_from_backwards(fresh_plans):
    """Under LaunchTemplates.verify, a prepared backward whose templates are not what backward would
    launch fails the call."""
    q, k, v = (torch.randn(2, 2, 24, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    for _ in range(2):
        out = tk.scaled_dot_product_attention(q, k, v, backend="triton")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    prepared = _kept_forward(fresh_plans).prepared_backward
    prepared.grad_query = prepared.grad_query + prepared.grad_query
    out = tk.scaled_dot_product_attention(q, k, v, backend="triton")
    with pytest.raises(AssertionError, match="prepared attention backward's launches differ"):
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def test_layouts_the_kernels_take_only_copied_keep_forward_in_their_plan(fresh_plans):
    """An odd head dim (copied, zero-padded to 16 columns) or a scale <= 0 prepares nothing: the plan
    keeps the registered op's implementation."""
    from transformer_kernels.ops import attention as attention_op

    for head_dim, scale in ((24, None), (32, -0.5)):
        fresh_plans._plans.clear()
        q, k, v = (torch.randn(2, 2, 24, head_dim, device=DEVICE) for _ in range(3))
        out = tk.scaled_dot_product_attention(q, k, v, scale=scale, backend="triton")
        assert _kept_forward(fresh_plans) is attention_op._attention_forward
        expected = reference_attention(q.double(), k.double(), v.double(), scale=scale)
        assert_close_to_reference(out, expected, tol=TOLERANCE[torch.float32])


def test_key_bounds_kernel_extends_key_padding_bounds_with_the_kept_count():
    # The kernels' key bounds, as key_padding_bounds gives them to the other
    # backends: the first kept key and the last + 1, then the count of kept
    # keys (short of end - first where padding sits between them).
    # Lengths past the kernel's 1024-key block take two scan steps.
    lk = 1100
    padding = torch.rand(6, lk) > 0.5  # holes everywhere
    padding[0] = True
    padding[1] = False
    padding[2, 700:] = True
    padding[2, [0, 699]] = False
    padding[3] = True
    padding[3, 1030:1031] = False
    padding[4, :3] = padding[4, 1090:] = False
    padding[5, :5] = padding[5, 1050:] = True
    padding[5, 5:1050] = False
    padding = padding.to(DEVICE)
    masks = triton_attention._Masks.of(AttentionArgs(padding, None, Causal.NONE, 1.0, 0.0, None), padding.device)
    run_launches(triton_attention._key_bounds_launches(masks), padding)
    kept = (~padding).sum(1).tolist()
    expected = torch.tensor(
        [[0, 0, 0], [0, lk, lk], [0, 700, kept[2]], [1030, 1031, 1], [0, lk, kept[4]], [5, 1050, 1045]],
        dtype=torch.int32,
    )
    assert torch.equal(masks.key_bounds.cpu(), expected)
    assert torch.equal(key_padding_bounds(padding).cpu(), expected)


def test_batch_heads_beyond_the_grid_limit_are_launched_in_chunks(fresh_plans, monkeypatch):
    # CUDA caps the grid's second dimension (batch * heads) at 65535; shrink
    # the cap so the chunked launch runs at a testable size.
    monkeypatch.setattr(triton_attention, "_MAX_GRID_Y", 3)
    # Launches are kept by layout, and the limit is not part of it: build them anew under this one.
    monkeypatch.setattr(triton_attention, "_TEMPLATES", LaunchTemplates())
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
    out, _ = triton_attention.forward(query, key, value, AttentionArgs(None, mask, Causal.NONE, 0.25, 0.0, None), False)
    expected = reference_attention(query, key, value, attn_mask=mask.contiguous(), scale=0.25)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


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
    assert_close_to_reference(out, expected, rtol=1e-4, atol=1e-4)
    grad_out = torch.randn_like(expected)
    grads = torch.autograd.grad(out, leaves, grad_out.float())
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    assert_close_to_reference(grads, expected_grads, "grad", rtol=1e-4, atol=1e-4, same_dtype=True)


def _gpu_tiles() -> list[tuple[str, int, int]]:
    """Every (kernel, BLOCK_M, BLOCK_N) in the GPU tables: tile ratios and diagonal offsets that the
    interpreter's own small tiles never meet."""
    tables = [*triton_attention._CONFIG_TABLES.values(), triton_attention._SHORT_CONFIGS,
              triton_attention._FLOAT32_CONFIGS]
    keyed = [(key[0], config) for table in tables for key, config in table.items()]
    keyed += [(key[1], config) for key, config in triton_attention._SM90_CONFIGS.items()]
    return sorted({(kernel, config.block_m, config.block_n) for kernel, config in keyed})


@pytest.mark.skipif(CUDA, reason="interpreter: runs the GPU tables' tile shapes on CPU tensors")
@pytest.mark.parametrize("masks", [dict(causal="bottom_right", padding="left_and_holes"),
                                   dict(mask="float", mask_grad=True, padding="suffix_and_all_pad")],
                         ids=["causal_padding", "float_mask"])
@pytest.mark.parametrize("kernel,block_m,block_n", _gpu_tiles(), ids=lambda value: str(value))
def test_every_gpu_tile_shape_in_the_interpreter(kernel, block_m, block_n, masks, monkeypatch):
    """Each GPU tile shape, in its own kernel (the other two keep the interpreter's tiles), on
    lengths that cross its largest blocks and the causal diagonal off their boundaries."""
    tile = KernelConfig(block_m=block_m, block_n=block_n, num_warps=1, num_stages=1)
    monkeypatch.setitem(triton_attention._INTERPRETER_CONFIGS, kernel, tile)
    _run_case(heads=1, lq=150, lk=170, head_dim=32, **masks)


@pytest.mark.parametrize("splits", [False, True], ids=["one_masked_stage", "split_keys"])
def test_grad_query_with_and_without_split_keys(splits, fresh_plans, monkeypatch):
    """dQ's two key stages (SPLIT_KEYS) and its one masked stage, which the launcher picks per GPU
    (``_grad_query_splits_keys``: the interpreter would only meet the first without masks)."""
    monkeypatch.setattr(triton_attention, "_grad_query_splits_keys", lambda variant, capability: splits)
    _run_case(lq=70, lk=83, head_dim=64)
    _run_case(lq=70, lk=83, head_dim=64, causal="top_left", padding="left_and_right")


@pytest.mark.parametrize("case", ["float_mask_grad_padding", "gqa_causal_padding", "bool_mask_rows"])
def test_grad_key_value_in_a_pass_per_gradient(case, fresh_plans, monkeypatch):
    """dK and dV in passes of their own (``grad_key_value_passes``: triton 3.6's dense mask or
    dropout at head dim 256), here at head dim 64 with masks and with causality and padding,
    against the math."""
    monkeypatch.setattr(triton_attention, "_GRAD_KEY_VALUE_APART", {(variant, 64) for variant in ("masked", "fast")})
    passes = []
    build = triton_attention._masked_kernel_template

    def counting(kernel_name, *args, **kwargs):
        if kernel_name == "grad_key_value":
            passes.append((kwargs["GRAD_KEY"], kwargs["GRAD_VALUE"]))
        return build(kernel_name, *args, **kwargs)

    monkeypatch.setattr(triton_attention, "_masked_kernel_template", counting)
    _run_case(**CASES[case])
    half = len(passes) // 2
    assert passes and passes[::2] == [(True, False)] * half and passes[1::2] == [(False, True)] * half


@pytest.mark.parametrize("kernel", ["forward", "grad_key_value", "grad_query"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("capability", [80, 90])
def test_block_config_picks_the_table_for_the_problem_and_the_gpu(kernel, head_dim, capability, monkeypatch):
    """The GPU tables (what the interpreter's small tiles replace): for 16-bit inputs without a dense
    mask or dropout whose sequences are at most SHORT_MAX_LENGTH long, SM90's "short" entry on
    sm_90, else SHORT, where they have one; else SM90's entry on sm_90; else the shared table of
    the mask variant; FLOAT32 for float32."""
    monkeypatch.setattr(triton_attention, "_INTERPRETED", False)
    short_length = triton_attention.SHORT_MAX_LENGTH

    def config(dtype, variant, length):
        return triton_attention.block_config(kernel, head_dim, head_dim, dtype, variant, length, capability)

    for variant in ("dense", "fast"):
        shared = triton_attention._CONFIG_TABLES[variant][(kernel, head_dim)]
        if capability >= 90:
            shared = triton_attention._SM90_CONFIGS.get((variant, kernel, head_dim), shared)
        short = triton_attention._SHORT_CONFIGS.get((kernel, head_dim), shared)
        if capability >= 90:
            short = triton_attention._SM90_CONFIGS.get(("short", kernel, head_dim), short)
        assert config(torch.bfloat16, variant, short_length) == short
        assert config(torch.float16, variant, short_length + 1) == shared
    masked = triton_attention._MASKED_CONFIGS[(kernel, head_dim)]
    if capability >= 90:
        masked = triton_attention._SM90_CONFIGS.get(("masked", kernel, head_dim), masked)
    assert config(torch.float16, "masked", 16) == masked
    if head_dim <= MAX_FLOAT32_HEAD_DIM_ON_GPU:
        assert config(torch.float32, "fast", 16) == triton_attention._FLOAT32_CONFIGS[(kernel, head_dim)]
