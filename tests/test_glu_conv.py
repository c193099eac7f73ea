"""transformer_kernels.glu_conv1d / glu_conv1d_step against the seed's padding + conv1d + GLU + residual·scale."""

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _helpers import (
    assert_close_to_reference, assert_low_precision_within_2x, assert_matches_reference, backend_param, backend_params,
    device_for, glu_choices, outputs_and_grads, precise_dtype, skip_unless_backend, working_dtype,
)
from conftest import CUDA, requires_cuda, tf32_setting

import transformer_kernels as tk
from transformer_kernels.reference.glu_conv import glu_conv1d as reference_glu_conv1d

SCALE = math.sqrt(0.5)
requires_triton = skip_unless_backend("triton", "glu_conv")


@pytest.fixture(autouse=True)
def _engines_alike(monkeypatch):
    """The eager algorithm choices these tests name, on every CPU: by the fixed rule, with oneDNN's
    GEMM no faster than the BLAS (test_timed_onednn_convolution_replaces_winograd takes the other
    algorithms; test_algorithms_are_timed_once_per_size times them)."""
    from transformer_kernels.backends.eager import onednn

    glu_choices(monkeypatch)
    monkeypatch.setattr(onednn, "_speedup", 1.0)


# (k, L, C_in, C): every k in {1, 2, 3, 5, 7}, L in {1, 3, 40, 1000}, C in {4, 24, 256, 520},
# including L < k, C_in != C and channel counts that are not multiples of the Triton tiles.
EAGER_SHAPES = [
    (1, 1, 4, 4),
    (2, 3, 4, 24),
    (3, 40, 24, 24),
    (5, 1000, 24, 4),
    (7, 40, 256, 256),
    (3, 3, 520, 520),
    (3, 101, 8, 12),  # 202 positions: Winograd forward (odd length), im2col backward
    (3, 160, 24, 24),  # 320 positions: Winograd both ways
    (7, 1, 24, 24),
    (2, 1000, 4, 4),
]


def _tolerance(backend: str) -> dict:
    """Elementwise tolerances of a backend's results against the reference on the same inputs: the
    defaults of eager's float64, float32 kernels, or the CUDA extension's float16 ones."""
    return {"eager": {}, "cuda": dict(atol=1e-2, rtol=1e-2)}.get(backend, dict(atol=1e-5, rtol=1e-5))


def _make_inputs(batch, k, length, channels_in, channels, *, dtype, device="cpu", channels_last=False, bias=True,
                 residual=True, residual_channels_last=None):
    def activation(c):
        t = torch.randn(batch, length, c, dtype=dtype, device=device)
        return t.transpose(1, 2) if channels_last else t.transpose(1, 2).contiguous()

    x = activation(channels_in)
    weight = torch.randn(2 * channels, channels_in, k, dtype=dtype, device=device) / math.sqrt(channels_in * k)
    b = torch.randn(2 * channels, dtype=dtype, device=device) if bias else None
    r = None
    if residual:
        r = torch.randn(batch, length, channels, dtype=dtype, device=device).transpose(1, 2)
        if not (channels_last if residual_channels_last is None else residual_channels_last):
            r = r.contiguous()
    return x, weight, b, r


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


INPUT_NAMES = ("x", "weight", "bias", "residual")


def _functions(backend, **kwargs):
    """glu_conv1d on ``backend`` and the reference, both ``fn(x, weight, bias, residual)``."""

    def ours(x, weight, bias, residual):
        return tk.glu_conv1d(x, weight, bias, residual=residual, backend=backend, **kwargs)

    def reference(x, weight, bias, residual):
        return reference_glu_conv1d(x, weight, bias, residual=residual, **kwargs)

    return ours, reference


def _assert_matches_reference(x, weight, bias, residual, *, backend, atol, rtol, **kwargs):
    """Output and gradients of x, weight, bias and residual against the fp64 reference."""
    grad = torch.randn(x.shape[0], weight.shape[0] // 2, x.shape[2], dtype=torch.float64, device=x.device)
    (out,) = assert_matches_reference(*_functions(backend, **kwargs), (x, weight, bias, residual), grad,
                                      input_names=INPUT_NAMES, atol=atol, rtol=rtol)
    assert out.dtype == x.dtype
    return out


# --------------------------------------------------------------------------- eager vs reference


@pytest.mark.parametrize("k,length,channels_in,channels", EAGER_SHAPES)
@pytest.mark.parametrize("padding", ["same", "causal"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["nores", "res"])
def test_eager_matches_reference_fp64(k, length, channels_in, channels, padding, channels_last, with_residual):
    x, weight, bias, residual = _make_inputs(
        2, k, length, channels_in, channels, dtype=torch.float64, channels_last=channels_last, residual=with_residual
    )
    pad_value = 1.0 if with_residual else -0.5
    out = _assert_matches_reference(
        x, weight, bias, residual, backend="eager", atol=1e-10, rtol=1e-10,
        padding=padding, pad_value=pad_value, residual_scale=SCALE,
    )
    assert _has_layout(out, _eager_channel_last(x, k))


@pytest.mark.parametrize("k,length,forward,backward", [
    (5, 20, "onednn", "im2col"), (5, 140, "onednn", "onednn"),
    (3, 100, "winograd", "im2col"), (3, 161, "winograd", "winograd"),
], ids=["fwd_onednn", "fwd_bwd_onednn", "fwd_winograd", "fwd_bwd_winograd"])
@pytest.mark.parametrize("padding,pad_value", [("same", 0.0), ("same", -0.5), ("causal", 0.0)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("with_residual,with_bias", [(True, True), (False, False)], ids=["res_bias", "plain"])
def test_eager_fp32_paths_match_reference(k, length, forward, backward, padding, pad_value, channels_last,
                                          with_residual, with_bias):
    """float32 on a CPU convolves through oneDNN or Winograd past a few output positions (most
    fp64 tests above take the im2col GEMM): each algorithm in each direction, batch 2."""
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv

    x, weight, bias, residual = _make_inputs(
        2, k, length, 24, 16, dtype=torch.float32, channels_last=channels_last, bias=with_bias,
        residual=with_residual,
    )
    if not torch.backends.mkldnn.is_available() and "onednn" in (forward, backward):
        pytest.skip("torch built without oneDNN")
    assert eager_glu_conv.algorithm(x, weight, length, "forward") == forward
    assert eager_glu_conv.algorithm(x, weight, length, "backward") == backward
    out = _assert_matches_reference(
        x, weight, bias, residual, backend="eager", atol=1e-4, rtol=1e-4,
        padding=padding, pad_value=pad_value, residual_scale=SCALE,
    )
    assert _has_layout(out, channels_last and forward != "onednn")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("forward,backward", [("winograd", "onednn"), ("onednn", "winograd")])
@pytest.mark.parametrize("padding,pad_value", [("same", 0.0), ("causal", 1.0)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_eager_fp32_timed_pairs_match_reference(forward, backward, padding, pad_value, channels_last, monkeypatch):
    """Pairs no fixed rule makes, but timing can (each direction is timed on its own): Winograd
    forward with oneDNN's backward, which gets Winograd's channel-last pre-activation, and the
    reverse, whose backward gets oneDNN's transposed one."""
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv

    chosen = {"forward": forward, "backward": backward}
    monkeypatch.setattr(eager_glu_conv, "algorithm", lambda x, weight, length, direction, timed=True: chosen[direction])
    x, weight, bias, residual = _make_inputs(2, 3, 21, 24, 16, dtype=torch.float32, channels_last=channels_last)
    out = _assert_matches_reference(
        x, weight, bias, residual, backend="eager", atol=1e-4, rtol=1e-4,
        padding=padding, pad_value=pad_value, residual_scale=SCALE,
    )
    assert _has_layout(out, channels_last and forward != "onednn")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("forward,backward,gemm_speedup,recorded", [
    ("onednn", "onednn", 1.0, True),
    ("onednn", "onednn", 2.0, False),  # a fast oneDNN: the weight gradient as a GEMM on its kernels
    ("onednn", "im2col", 1.0, False),
    ("onednn", "winograd", 1.0, False),
    ("winograd", "onednn", 1.0, False),
], ids=["onednn_both_ways", "onednn_gemm_gradients", "im2col_backward", "winograd_backward", "winograd_forward"])
@pytest.mark.parametrize("residual_kind", ["x", "other", "none"])
@pytest.mark.parametrize("padding,pad_value", [("same", 0.0), ("causal", 1.0)])
def test_eager_calls_on_onednn_both_ways_are_recorded_by_autograd(
    forward, backward, gemm_speedup, recorded, residual_kind, padding, pad_value, monkeypatch
):
    """Where both directions convolve with oneDNN and the backward computes no gradient as a GEMM,
    its backward is the kernels of torch's own ops, so autograd records those ops (their grad_fn,
    not the op's Function); elsewhere the op's Function runs.  Either way: the reference's output,
    in the layout the fake states, and gradients (the seeds' residual=x summed from both paths)."""
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv
    from transformer_kernels.backends.eager import onednn

    chosen = {"forward": forward, "backward": backward}
    monkeypatch.setattr(eager_glu_conv, "algorithm", lambda x, weight, length, direction, timed=True: chosen[direction])
    monkeypatch.setattr(onednn, "_speedup", gemm_speedup)
    # C_in * k = 1536 and 280 positions: where a fast oneDNN takes the GEMM gradients.
    x, weight, bias, other = _make_inputs(2, 3, 140, 512, 512, dtype=torch.float32, channels_last=True)
    x, weight, bias, other = _leaves(x, weight, bias, other)
    residual = {"x": x, "other": other, "none": None}[residual_kind]
    kwargs = dict(padding=padding, pad_value=pad_value, residual_scale=SCALE)
    out = tk.glu_conv1d(x, weight, bias, residual=residual, backend="eager", **kwargs)
    # A Python autograd.Function's node, or one of torch's own.
    assert isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction) != recorded
    assert _has_layout(out, forward != "onednn")

    leaves = (x, weight, bias, other) if residual_kind == "other" else (x, weight, bias)
    reference_leaves = _leaves(*leaves)
    reference_residual = {"x": reference_leaves[0], "other": reference_leaves[-1], "none": None}[residual_kind]
    expected = reference_glu_conv1d(*reference_leaves[:3], residual=reference_residual, **kwargs)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(expected)
    for name, got, want in zip(INPUT_NAMES, torch.autograd.grad(out, leaves, grad),
                               torch.autograd.grad(expected, reference_leaves, grad)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("fastest", ["blas", "onednn"])
def test_algorithms_are_timed_once_per_size(fastest, monkeypatch):
    """float32 past the im2col GEMM's few positions: where the rule takes Winograd (k = 3, from a
    few hundred positions) or a short backward's im2col GEMM, that and oneDNN's convolution are
    timed against each other on the first call of a size class, forward and backward apart, on
    real tensors even while tracing, and the faster is kept; sizes from the last of _SIZE_CLASSES
    on share one class; oneDNN alone, float64, untimed calls and deterministic algorithms time
    nothing."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from transformer_kernels.backends.eager import _tuning
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv

    glu_choices(monkeypatch, "onednn")  # timing on; the timings are the test's
    timings = []

    def best_times(runs, rounds=0):
        results = {name: run() for name, run in runs.items()}  # each run runs, on real tensors
        assert all(not isinstance(t, FakeTensor) for result in results.values() for t in result if t.numel())
        timings.append(sorted(runs))
        return {name: float((name == "onednn") == (fastest == "blas")) for name in runs}

    monkeypatch.setattr(_tuning, "best_times", best_times)

    def choice(batch, length, direction="forward", dtype=torch.float32, kernel_size=3, timed=True):
        weight = torch.empty(32, 24, kernel_size, dtype=dtype)
        return eager_glu_conv.algorithm(torch.empty(batch, 24, length, dtype=dtype), weight, length, direction, timed)

    def faster(blas_path):
        return blas_path if fastest == "blas" else "onednn"

    with FakeTensorMode() as mode:  # an op's fake kernel asks first
        x, weight = mode.from_tensor(torch.empty(2, 24, 100)), mode.from_tensor(torch.empty(32, 24, 3))
        assert eager_glu_conv.algorithm(x, weight, 100, "forward") == faster("winograd")
    assert timings == [["onednn", "winograd"]]
    assert {choice(2, 100), choice(4, 50), choice(1, 210)} == {faster("winograd")}  # one class: timed once
    assert len(timings) == 1
    # The backward is timed after the forward's choice at its size, on what that forward leaves it.
    assert choice(2, 300, "backward") == faster("winograd") and len(timings) == 3
    assert choice(2, 300) == faster("winograd") and len(timings) == 3
    assert {choice(8, 1000), choice(2, 4000), choice(1, 9000)} == {faster("winograd")} and len(timings) == 4
    # A short backward: the im2col GEMM or oneDNN (its forward is oneDNN's by the rule: untimed).
    assert choice(2, 50, "backward") == faster("im2col") and timings[-1] == ["im2col", "onednn"]
    assert choice(2, 50, kernel_size=5) == "onednn" and len(timings) == 5
    assert choice(2, 20, "backward") == "im2col" and len(timings) == 5  # 40 positions: untimed
    assert choice(2, 300, dtype=torch.float64) == "winograd" and len(timings) == 5
    assert choice(2, 700, timed=False) == "winograd" and len(timings) == 5
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert choice(2, 700) == "winograd" and len(timings) == 5
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_traced_calls_take_the_fixed_rule(monkeypatch):
    """torch.compile (dynamic sizes, and the graph that FX caches may hand to another process) takes
    the fixed rule, timing nothing, so that the layouts its fake kernels state are the real ones on
    any machine: Winograd's x layout, where the eager calls' timings here chose oneDNN (contiguous
    results); inductor checks every real stride against the fake one."""
    from transformer_kernels.backends.eager import _tuning

    glu_choices(monkeypatch, "onednn")

    def layer(x_blc, weight, bias):
        h = x_blc.transpose(1, 2)
        return tk.glu_conv1d(h, weight, bias, residual=h, residual_scale=SCALE, backend="eager")

    torch._dynamo.reset()
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    weight, bias = torch.randn(16, 8, 3, requires_grad=True), torch.randn(16, requires_grad=True)
    for length in (100, 120, 300):
        x = torch.randn(2, length, 8, requires_grad=True)
        got = compiled(x, weight, bias)
        assert not _tuning._choices and got.transpose(1, 2).is_contiguous()  # untimed: Winograd, x's layout
        expected = layer(x, weight, bias)
        assert _tuning._choices and expected.is_contiguous()  # timed: oneDNN
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # Winograd's rounding and oneDNN's
        grad = torch.randn_like(expected)
        for want, have in zip(torch.autograd.grad(expected, (x, weight, bias), grad),
                              torch.autograd.grad(got, (x, weight, bias), grad)):
            torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
        _tuning._choices.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extreme", ["inf_in_x", "inf_in_weight", "near_the_limit"])
def test_winograd_extremes_like_torch(monkeypatch, dtype, extreme):
    """Winograd's transforms add inputs (or weights) and subtract products: an inf became NaN
    (inf - inf) where torch's convolution gives inf, and inputs near the dtype's limit overflowed
    where the direct sum does not.  Where its result shows either, the direct GEMMs compute it:
    inf, NaN and finite values exactly where torch has them, forward and backward."""
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv

    glu_choices(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 300, generator=generator, dtype=dtype)
    weight = torch.randn(4, 2, 3, generator=generator, dtype=dtype)
    bias = torch.randn(4, generator=generator, dtype=dtype)
    if extreme == "inf_in_x":
        x[0, 0, 100] = float("inf")
    elif extreme == "inf_in_weight":
        weight[0, 0, 1] = float("inf")
    else:
        x = x * torch.finfo(dtype).max / 4
        weight = weight / 20
    assert eager_glu_conv.algorithm(x, weight, 300, "forward") == "winograd"
    assert eager_glu_conv.algorithm(x, weight, 300, "backward") == "winograd"
    grad_out = torch.randn(1, 2, 300, generator=generator, dtype=dtype)
    results = []
    for convolve in (lambda *a: tk.glu_conv1d(*a, padding="same"),
                     lambda x, weight, bias: F.glu(F.conv1d(x, weight, bias, padding=1), 1)):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        out = convolve(*leaves)
        results.append([out, *torch.autograd.grad(out, leaves, grad_out)])
    for name, got, expected in zip(["out", "grad_x", "grad_weight", "grad_bias"], *results):
        assert torch.equal(got.isnan(), expected.isnan()), name
        assert torch.equal(got.isinf(), expected.isinf()), name
        finite = expected.isfinite()
        if finite.any():
            scale = expected[finite].abs().max().item()
            torch.testing.assert_close(got[finite], expected[finite], rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_timed_onednn_convolution_replaces_winograd(monkeypatch):
    """Where oneDNN's convolution times faster, float32 takes it instead of Winograd's BLAS GEMMs,
    and a short backward instead of the im2col GEMM; float64, which oneDNN does not convolve, keeps
    Winograd.  Where oneDNN's GEMM also outruns the BLAS, its backward computes the weight's (and a
    short call's input) gradient as im2col GEMMs on oneDNN's GEMM kernels."""
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv
    from transformer_kernels.backends.eager import onednn

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    glu_choices(monkeypatch, "onednn")
    monkeypatch.setattr(onednn, "_speedup", 2.0)
    for dtype, expected in ((torch.float32, "onednn"), (torch.float64, "winograd")):
        x, weight = torch.randn(2, 8, 200, dtype=dtype), torch.empty(16, 8, 3, dtype=dtype)
        assert [eager_glu_conv.algorithm(x, weight, 200, d) for d in ("forward", "backward")] == [expected] * 2
    x, weight = torch.randn(2, 8, 50), torch.empty(16, 8, 5)  # 100 positions
    assert eager_glu_conv.algorithm(x, weight, 50, "backward") == "onednn"
    assert eager_glu_conv.algorithm(x, weight, 50, "backward", timed=False) == "im2col"
    # The gradients every way: oneDNN's convolution backward; the im2col GEMM that takes the weight's
    # over from _GEMM_WEIGHT_GRADIENT_MIN_DEPTH (C_in * k) on, here from 1; and the input's too, up
    # to _GEMM_INPUT_GRADIENT_MAX_POSITIONS (here 400 positions: with it, or from 0 without).
    cases = ((eager_glu_conv._GEMM_WEIGHT_GRADIENT_MIN_DEPTH, 640, True), (1, 640, True), (1, 640, False),
             (1, 0, True))
    for min_depth, input_max_positions, with_bias in cases:
        monkeypatch.setattr(eager_glu_conv, "_GEMM_WEIGHT_GRADIENT_MIN_DEPTH", min_depth)
        monkeypatch.setattr(eager_glu_conv, "_GEMM_INPUT_GRADIENT_MAX_POSITIONS", input_max_positions)
        for channels_last, padding, pad_value in ((True, "same", 0.0), (True, "causal", 1.5), (False, "same", -0.5)):
            x, weight, bias, residual = _make_inputs(2, 3, 200, 24, 16, dtype=torch.float32,
                                                     channels_last=channels_last, bias=with_bias)
            for max_positions, on_gemms in ((eager_glu_conv._GEMM_WEIGHT_GRADIENT_MAX_POSITIONS, min_depth == 1),
                                            (input_max_positions, min_depth == 1 and input_max_positions > 0)):
                assert eager_glu_conv._on_gemms(x, 24 * 3, 200, max_positions) == on_gemms
            out = _assert_matches_reference(x, weight, bias, residual, backend="eager", atol=1e-4, rtol=1e-4,
                                            padding=padding, pad_value=pad_value, residual_scale=SCALE)
            assert _has_layout(out, False)  # oneDNN's layout, whatever x's


@pytest.mark.parametrize("gemm_speedup,algorithm", [(1.0, "winograd"), (2.0, "onednn")],
                         ids=["winograd", "onednn_gemm_weight_gradient"])
def test_fp32_error_is_within_twice_the_direct_convolutions(gemm_speedup, algorithm, monkeypatch):
    """Winograd's transforms add rounding, and so could oneDNN's kernels where the eager backend
    picks others than torch's convolution would (its GEMMs for the gradients; a channels-last
    convolution erred 4x): the float32 error against float64 (RMS and max, output and gradients)
    stays within 2.5x that of torch's direct convolution on the seeds' sizes (C = 512, a 1536-term
    sum per output).  Measured for Winograd's grad_x: 1.6x RMS on an AMD EPYC (torch 2.13), 2.2x on
    the H100 machine's CPU (torch 2.11), where torch's own error was the same."""
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv
    from transformer_kernels.backends.eager import onednn

    if algorithm == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    if algorithm == "onednn":
        glu_choices(monkeypatch, "onednn")
    monkeypatch.setattr(onednn, "_speedup", gemm_speedup)
    x, weight, bias, _ = _make_inputs(4, 3, 80, 512, 512, dtype=torch.float32, channels_last=True, residual=False)
    assert eager_glu_conv.algorithm(x, weight, 80, "forward") == algorithm
    assert eager_glu_conv.algorithm(x, weight, 80, "backward") == algorithm
    gemms = eager_glu_conv._GEMM_INPUT_GRADIENT_MAX_POSITIONS
    assert eager_glu_conv._on_gemms(x, 3 * 512, 80, gemms) == (algorithm == "onednn")
    grad = torch.randn(4, 512, 80)

    def results(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, weight, bias)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad.to(dtype))]

    exact = results(reference_glu_conv1d, torch.float64)
    ours = results(functools.partial(tk.glu_conv1d, backend="eager"), torch.float32)
    direct = results(reference_glu_conv1d, torch.float32)
    for name, want, got, torch_own in zip(("out", "grad_x", "grad_weight", "grad_bias"), exact, ours, direct):
        error, torch_error = (got.double() - want).abs(), (torch_own.double() - want).abs()
        assert error.max() <= 2.5 * torch_error.max(), name
        assert error.square().mean().sqrt() <= 2.5 * torch_error.square().mean().sqrt(), name


def test_eager_fp32_without_bias_mixed_layouts():
    x, weight, _, residual = _make_inputs(3, 3, 40, 24, 24, dtype=torch.float32, channels_last=True,
                                          residual_channels_last=False)
    _assert_matches_reference(x, weight, None, residual, backend="eager", atol=2e-5, rtol=2e-5,
                              padding="causal", pad_value=2.0, residual_scale=SCALE)


def _has_layout(t, channels_last):
    """Dense in the layout asked for (with a size-1 dimension both layouts hold at once)."""
    return t.transpose(1, 2).is_contiguous() if channels_last else t.is_contiguous()


def _eager_channel_last(x, kernel_size, direction="forward"):
    """The eager backend's results are in x's layout, except after oneDNN's convolution: contiguous."""
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv

    channel_last = x.transpose(1, 2).is_contiguous() and not x.is_contiguous()
    weight = torch.empty(2, x.shape[1], kernel_size)
    return channel_last and eager_glu_conv.algorithm(x, weight, x.shape[2], direction) != "onednn"


@pytest.mark.parametrize("backend", backend_params("glu_conv"))
def test_residual_is_the_input(backend):
    """The encoder's layer: residual=x, so x gets the convolution's and the residual's gradient."""
    device = device_for(backend)
    x, weight, bias, _ = _make_inputs(2, 3, 9, 8, 8, dtype=precise_dtype(backend), device=device, channels_last=True,
                                      residual=False)
    x, weight, bias = _leaves(x, weight, bias)
    out = tk.glu_conv1d(x, weight, bias, residual=x, residual_scale=SCALE, backend=backend)
    (grad_x,) = torch.autograd.grad(out.sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    expected = reference_glu_conv1d(x_ref, weight, bias, residual=x_ref, residual_scale=SCALE)
    torch.testing.assert_close(out, expected, **_tolerance(backend))
    torch.testing.assert_close(grad_x, torch.autograd.grad(expected.sum(), x_ref)[0], **_tolerance(backend))


@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("backend", backend_params("glu_conv"))
def test_the_output_can_be_changed_in_place_as_torchs(backend, channels_last):
    """As F.glu's output, the output takes an in-place change while autograd records, and the
    gradients follow it: it is no view that the op's forward made (a channel-last output is made
    with its strides, not as a transposed tensor)."""
    device = device_for(backend)
    x, weight, bias, _ = _make_inputs(2, 3, 7, 8, 8, dtype=working_dtype(backend), device=device,
                                      channels_last=channels_last, residual=False)
    x, weight, bias = _leaves(x, weight, bias)
    out = tk.glu_conv1d(x, weight, bias, backend=backend)
    assert not out._is_view()
    out.mul_(3.0)
    grads = torch.autograd.grad(out.square().sum(), (x, weight, bias))
    expected = reference_glu_conv1d(x, weight, bias) * 3.0
    expected_grads = torch.autograd.grad(expected.square().sum(), (x, weight, bias))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=2e-2, rtol=2e-2)


def test_residual_scale_applies_without_residual():
    x, weight, bias, _ = _make_inputs(2, 3, 7, 4, 4, dtype=torch.float64, residual=False)
    out = tk.glu_conv1d(x, weight, bias, residual_scale=0.25, backend="eager")
    torch.testing.assert_close(out, F.glu(F.conv1d(x, weight, bias, padding=1), dim=1) * 0.25)


def test_same_padding_equals_nn_conv1d_and_causal_equals_left_pad():
    x, weight, bias, _ = _make_inputs(2, 5, 9, 4, 6, dtype=torch.float64, residual=False)
    conv = nn.Conv1d(4, 12, 5, padding=2).double()
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
    torch.testing.assert_close(tk.glu_conv1d(x, weight, bias, backend="eager"), F.glu(conv(x), dim=1))
    left = torch.full((2, 4, 4), 3.0, dtype=torch.float64)  # the decoder's pad-index filled prefix
    expected = F.glu(F.conv1d(torch.cat([left, x], dim=2), weight, bias), dim=1)
    out = tk.glu_conv1d(x, weight, bias, padding="causal", pad_value=3.0, backend="eager")
    torch.testing.assert_close(out, expected)


def test_even_kernel_same_padding_puts_extra_position_right():
    x, weight, bias, _ = _make_inputs(1, 4, 6, 4, 4, dtype=torch.float64, residual=False)
    expected = F.glu(F.conv1d(F.pad(x, (1, 2)), weight, bias), dim=1)
    torch.testing.assert_close(tk.glu_conv1d(x, weight, bias, backend="eager"), expected)


@pytest.mark.parametrize("bias_layout", ["strided", "expanded"])
@pytest.mark.parametrize("backend", backend_params("glu_conv"))
def test_bias_of_any_layout(backend, bias_layout):
    """A bias that is every second element of a buffer, or one value expanded, whole sequences and
    decoding steps (the Triton kernel once read a strided bias as contiguous, an expanded one past
    its storage): outputs and gradients against the reference in float64."""
    device, dtype = device_for(backend), working_dtype(backend)
    x, weight, _, residual = _make_inputs(2, 3, 20, 16, 8, dtype=dtype, device=device)
    if bias_layout == "strided":
        bias = torch.randn(32, dtype=dtype, device=device)[::2]
    else:
        bias = torch.randn(1, dtype=dtype, device=device).expand(16)
    x, weight, bias = (t.requires_grad_() for t in (x, weight, bias))
    tolerance = dict(atol=1e-2, rtol=1e-2) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    out = tk.glu_conv1d(x, weight, bias, residual=residual, backend=backend)
    exact_inputs = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    expected = reference_glu_conv1d(*exact_inputs, residual=residual.double())
    grad = torch.randn_like(expected)
    for got, want in zip(torch.autograd.grad(out, (x, weight, bias), grad.to(dtype)),
                         torch.autograd.grad(expected, exact_inputs, grad)):
        torch.testing.assert_close(got.double(), want, **tolerance)
    torch.testing.assert_close(out.double(), expected, **tolerance)
    state = x.detach()[:, :, :2]
    step, _ = tk.glu_conv1d_step(x.detach()[:, :, 2], state, weight.detach(), bias.detach(), backend=backend)
    causal = reference_glu_conv1d(*(t.detach().double() for t in (x[:, :, :3], weight, bias)), padding="causal")
    torch.testing.assert_close(step.double(), causal[:, :, 2], **tolerance)


def test_strided_input_read_in_place():
    x, weight, bias, residual = _make_inputs(2, 3, 40, 24, 24, dtype=torch.float64)
    x_strided = torch.randn(2, 48, 80, dtype=torch.float64)[:, ::2, ::2]
    out = tk.glu_conv1d(x_strided, weight, bias, residual=residual, backend="eager")
    torch.testing.assert_close(out, reference_glu_conv1d(x_strided, weight, bias, residual=residual))
    assert out.is_contiguous()


@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_eager_gradcheck_fp64(channels_last):
    x, weight, bias, residual = _make_inputs(2, 3, 6, 3, 2, dtype=torch.float64, channels_last=channels_last)
    inputs = _leaves(x, weight, bias, residual)
    for padding in ("same", "causal"):
        assert torch.autograd.gradcheck(
            lambda x, w, b, r: tk.glu_conv1d(x, w, b, padding=padding, pad_value=0.7, residual=r,
                                             residual_scale=SCALE, backend="eager"),
            inputs,
        )


def test_eager_gradcheck_step_fp64():
    x_t, state = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, 2, dtype=torch.float64)
    weight, bias = torch.randn(4, 3, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    inputs = _leaves(x_t, state, weight, bias)
    assert torch.autograd.gradcheck(lambda x_t, s, w, b: tk.glu_conv1d_step(x_t, s, w, b, backend="eager")[0], inputs)


@pytest.mark.parametrize("wanted", INPUT_NAMES)
@pytest.mark.parametrize("backend", backend_params("glu_conv"))
def test_only_some_gradients_requested(backend, wanted, gradient_spy):
    """One input requires grad: its gradient matches the reference, and the backend computes no
    other (the residual's gradient needs none of the backend's)."""
    spy = gradient_spy("glu_conv", backend)
    inputs = dict(zip(INPUT_NAMES, _make_inputs(2, 3, 10, 8, 4, dtype=precise_dtype(backend),
                                                device=device_for(backend))))
    inputs[wanted].requires_grad_()
    out = tk.glu_conv1d(inputs["x"], inputs["weight"], inputs["bias"], residual=inputs["residual"], backend=backend)
    (grad,) = torch.autograd.grad(out.sum(), inputs[wanted])
    reference_inputs = {name: t.detach().clone().requires_grad_(name == wanted) for name, t in inputs.items()}
    expected_out = reference_glu_conv1d(reference_inputs["x"], reference_inputs["weight"], reference_inputs["bias"],
                                        residual=reference_inputs["residual"])
    (expected,) = torch.autograd.grad(expected_out.sum(), reference_inputs[wanted])
    torch.testing.assert_close(grad, expected, **_tolerance(backend))
    if wanted == "residual":
        spy.assert_none_computed()
    else:
        spy.assert_computed(**{name: name == wanted for name in ("x", "weight", "bias")})


@pytest.mark.parametrize("backend", backend_params("glu_conv"))
def test_weight_norm_gradients_reach_g_and_v(backend):
    dtype, device = precise_dtype(backend), device_for(backend)
    tolerance = _tolerance(backend)
    ours = nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 16, 3).to(device, dtype))
    theirs = nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 16, 3).to(device, dtype))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 16, 8, dtype=dtype, device=device).transpose(1, 2)
    out = tk.glu_conv1d(x, ours.weight, ours.bias, padding="causal", pad_value=1.0, backend=backend)
    expected = reference_glu_conv1d(x, theirs.weight, theirs.bias, padding="causal", pad_value=1.0)
    torch.testing.assert_close(out, expected, **tolerance)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for name in ("original0", "original1"):
        got = getattr(ours.parametrizations.weight, name).grad
        want = getattr(theirs.parametrizations.weight, name).grad
        assert got is not None and got.abs().sum() > 0
        torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, **tolerance)


def test_empty_batch():
    x, weight, bias, _ = _make_inputs(0, 3, 5, 4, 4, dtype=torch.float32, residual=False)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    out = tk.glu_conv1d(x, weight, bias, backend="eager")
    assert out.shape == (0, 4, 5)
    out.sum().backward()
    assert torch.count_nonzero(weight.grad) == 0


# --------------------------------------------------------------------------- decoding step


def _decode(x, weight, bias, residual, *, pad_value, backend, reorder_at=None, order=None):
    state, outs = None, []
    for t in range(x.shape[2]):
        if t == reorder_at:
            state = state.index_select(0, order)
            x = x.index_select(0, order)
            residual = residual.index_select(0, order)
        out_t, state = tk.glu_conv1d_step(x[:, :, t], state, weight, bias, pad_value=pad_value,
                                          residual=residual[:, :, t], residual_scale=SCALE, backend=backend)
        assert state.shape == (x.shape[0], x.shape[1], weight.shape[2] - 1)
        outs.append(out_t)
    return torch.stack(outs, dim=2)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_step_by_step_equals_causal(k):
    x, weight, bias, residual = _make_inputs(3, k, 9, 6, 4, dtype=torch.float64)
    full = tk.glu_conv1d(x, weight, bias, padding="causal", pad_value=1.0, residual=residual, residual_scale=SCALE,
                         backend="eager")
    torch.testing.assert_close(_decode(x, weight, bias, residual, pad_value=1.0, backend="eager"), full)


def test_step_state_reorders_with_index_select():
    x, weight, bias, residual = _make_inputs(4, 3, 8, 6, 4, dtype=torch.float64)
    order = torch.tensor([2, 0, 0, 3])
    steps = _decode(x, weight, bias, residual, pad_value=1.0, backend="eager", reorder_at=5, order=order)
    full = tk.glu_conv1d(x[order], weight, bias, padding="causal", pad_value=1.0, residual=residual[order],
                         residual_scale=SCALE, backend="eager")
    torch.testing.assert_close(steps[:, :, 5:], full[:, :, 5:])


@pytest.mark.parametrize("pad_value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("backend", backend_params("glu_conv"))
def test_a_non_finite_pad_value_reaches_only_the_outputs_that_read_padding(backend, pad_value):
    """Only positions whose window holds padding see an infinite or NaN pad_value: as F.pad +
    conv1d give it, and for every gradient the same."""
    device, dtype = device_for(backend), working_dtype(backend)
    x, weight, bias, _ = _make_inputs(2, 3, 6, 5, 4, dtype=dtype, device=device, residual=False)
    x, weight, bias = _leaves(x, weight, bias)
    out = tk.glu_conv1d(x, weight, bias, padding="same", pad_value=pad_value, backend=backend)
    interior = out[:, :, 1:-1]  # positions 1 .. L-2 of a k=3 "same" convolution read no padding
    expected = reference_glu_conv1d(x.double(), weight.double(), bias.double())[:, :, 1:-1]
    torch.testing.assert_close(interior, expected.to(dtype), **_tolerance(backend))
    assert not out[:, :, [0, -1]].isfinite().any()
    without_padding = tk.glu_conv1d(x, weight[:, :, :1], bias, padding="same", pad_value=pad_value, backend=backend)
    grads = torch.autograd.grad(without_padding.sum(), (x, weight, bias))
    assert without_padding.isfinite().all() and all(grad.isfinite().all() for grad in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_a_pad_value_the_dtype_cannot_hold_is_refused(dtype):
    """As F.pad refuses it; a value that would overflow to infinity in the kernels' tiles."""
    too_large = float(torch.finfo(dtype).max) * 2
    x, weight = torch.randn(1, 4, 3, dtype=dtype), torch.randn(8, 4, 3, dtype=dtype)
    with pytest.raises(ValueError, match="pad_value = .* overflows"):
        tk.glu_conv1d(x, weight, pad_value=too_large)
    with pytest.raises(ValueError, match="pad_value = .* overflows"):
        tk.glu_conv1d_step(x[:, :, 0], None, weight, pad_value=-too_large)
    tk.glu_conv1d(x, weight, pad_value=float(torch.finfo(dtype).max))  # the largest value is taken


def test_step_errors():
    weight = torch.randn(8, 6, 3)
    with pytest.raises(ValueError, match=r"state must have shape \[B, C_in, k - 1\]"):
        tk.glu_conv1d_step(torch.randn(2, 6), torch.randn(2, 6, 3), weight)
    with pytest.raises(ValueError, match="x_t must be 2-D"):
        tk.glu_conv1d_step(torch.randn(2, 6, 1), None, weight)
    with pytest.raises(ValueError, match=r"residual must have the output's shape \[2, 4\]"):
        tk.glu_conv1d_step(torch.randn(2, 6), None, weight, residual=torch.randn(2, 8))


# --------------------------------------------------------------------------- Triton (interpreter on CPU)

# (k, L, C_in, C, padding, pad_value, channels_last, residual, bias): small for the interpreter, still
# covering every k, L < k, channel counts off the tile sizes (520 channels span 9 to 17 tiles), split-K
# weight gradients (L=40), and padding of zeros (the kernels' own fill), of -0.0 and of another value.
TRITON_CASES = [
    (1, 3, 4, 4, "same", 0.75, False, True, True),
    (2, 40, 24, 4, "same", 0.0, True, True, True),
    (3, 40, 4, 24, "causal", 0.75, False, False, True),
    (3, 40, 24, 24, "causal", 0.0, True, False, True),
    (5, 3, 24, 24, "causal", 0.75, True, True, False),
    (7, 1, 4, 24, "same", -0.0, False, True, True),
    (3, 3, 520, 4, "causal", 0.75, True, False, True),
    (2, 3, 4, 520, "same", 0.0, False, True, True),
]


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("k,length,channels_in,channels,padding,pad_value,channels_last,with_residual,with_bias",
                         TRITON_CASES)
def test_triton_matches_reference(dtype, k, length, channels_in, channels, padding, pad_value, channels_last,
                                  with_residual, with_bias):
    x, weight, bias, residual = _make_inputs(2, k, length, channels_in, channels, dtype=dtype, device=device_for("triton"),
                                             channels_last=channels_last, bias=with_bias, residual=with_residual)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    if channels_in == 520:
        tolerance *= 4  # sums of 1560 products per output element
    out = _assert_matches_reference(x, weight, bias, residual, backend="triton", atol=tolerance, rtol=tolerance,
                                    padding=padding, pad_value=pad_value, residual_scale=SCALE)
    assert _has_layout(out, channels_last)


@requires_triton
@pytest.mark.skipif(CUDA, reason="interpreter: runs the sm_90 tiles on CPU tensors")
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_triton_sm90_tiles_in_the_interpreter(channels_last, monkeypatch, fresh_glu_plans):
    """The 16-bit sm_90 tiles (128 rows, 64-wide K steps), which the interpreter's capability-less
    calls never pick, on channel counts and positions that leave partial tiles; channel-first, 75
    positions are ragged rows, whose forward and weight gradient take their own tiles.  (Fresh
    call plans: a prepared forward keeps the capability of its layout's first call.)"""
    from transformer_kernels.backends.triton import glu_conv as triton_glu_conv

    monkeypatch.setattr(triton_glu_conv, "compute_capability", lambda device: 90)
    x, weight, bias, residual = _make_inputs(2, 3, 75, 96, 80, dtype=torch.float16, device=device_for("triton"),
                                             channels_last=channels_last)
    for kernel in ("forward", "grad_input", "grad_weight"):
        expected = triton_glu_conv._SM90_16BIT_CONFIGS[kernel]
        if not channels_last:
            expected = triton_glu_conv._RAGGED_X_CONFIGS.get((kernel, "sm90_16bit"), expected)
        assert triton_glu_conv._Dots.of(x, x.shape[2]).config(kernel, x.dtype) == expected
    for pad_value in (0.75, 0.0):
        _assert_matches_reference(x, weight, bias, residual, backend="triton", atol=1e-2, rtol=1e-2,
                                  padding="causal", pad_value=pad_value, residual_scale=SCALE)


@requires_triton
@pytest.mark.parametrize(("length", "length_out", "channels_last", "ragged"), [
    (512, 512, False, False),
    (40, 40, False, True),    # the seeds' padded length: not a multiple of 16
    (512, 509, False, True),  # an output length that is not
    (40, 40, True, False),    # channel-last rows are channels: always whole
    (1, 1, False, False),     # one position: channel-first strides say nothing
])
def test_triton_ragged_rows_rule(length, length_out, channels_last, ragged):
    """Which inputs take the ragged-rows tiles, and that the compile check holds the variants they
    launch: channel-first x whose rows Triton cannot prove aligned."""
    from transformer_kernels.backends.triton import glu_conv as triton_glu_conv

    shape = (2, length, 32) if channels_last else (2, 32, length)
    x = torch.empty(shape, dtype=torch.float16)
    x = x.transpose(1, 2) if channels_last else x
    assert triton_glu_conv._Dots.of(x, length_out).ragged_x == ragged
    for batch, target_length, _ in triton_glu_conv._TARGET_SHAPES.values():
        target_x = torch.empty(batch, triton_glu_conv._TARGET_CHANNELS, target_length)
        assert triton_glu_conv._Dots.of(target_x, target_length).ragged_x == (target_length % 16 != 0)


@requires_triton
def test_weight_gradient_split_ends_the_grid_soonest():
    from transformer_kernels.backends.triton._split_sum import split_count

    # The seeds' GLU weight gradient on an H100/H200: 96 tiles, 80 K steps, 132 SMs.  Waves x steps
    # per range: 1 split 1 x 80, 2: 2 x 40, 3: 3 x 27, 4: 3 x 20, 8: 6 x 10 (a tie: the fewest win).
    assert split_count(96, 80, 132, min_steps=2, max_splits=6) == 4
    assert split_count(96, 80, 132, min_steps=2, max_splits=3) == 1  # 2 and 3 ranges gain nothing
    assert split_count(96, 80, 132, min_steps=30, max_splits=6) == 1  # 4 ranges would hold 20 steps
    assert split_count(48, 32, 132, min_steps=16, max_splits=6) == 2  # the seeds' QKV: one wave
    assert split_count(300, 80, 132, min_steps=2, max_splits=1) == 1
    assert split_count(96, 0, 132, min_steps=2, max_splits=6) == 1  # an empty batch


@requires_triton
def test_triton_step_by_step_equals_causal():
    x, weight, bias, residual = _make_inputs(2, 3, 5, 4, 4, dtype=torch.float32, device=device_for("triton"))
    full = tk.glu_conv1d(x, weight, bias, padding="causal", pad_value=1.0, residual=residual, residual_scale=SCALE,
                         backend="triton")
    steps = _decode(x, weight, bias, residual, pad_value=1.0, backend="triton")
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


@requires_triton
@pytest.mark.parametrize("batch", [1, 5, 128, 129], ids=lambda b: f"B{b}")  # 129: past the step kernel's rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kernel_size,with_bias,with_residual", [(3, True, True), (1, False, False), (2, True, False)])
def test_triton_step_matches_the_exact_math_with_its_gradients(batch, dtype, kernel_size, with_bias, with_residual):
    device = device_for("triton")
    generator = torch.Generator().manual_seed(batch)
    channels_in, channels = 7, 5  # K = 7 k: no tile divides it

    def make(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype).requires_grad_()

    x_t, state = make(batch, channels_in), make(batch, channels_in, kernel_size - 1)
    weight = make(2 * channels, channels_in, kernel_size, scale=0.3)
    bias = make(2 * channels) if with_bias else None
    residual = make(batch, channels) if with_residual else None
    out, new_state = tk.glu_conv1d_step(x_t, state, weight, bias, residual=residual, residual_scale=SCALE,
                                        backend="triton")
    inputs = [t for t in (x_t, state, weight, bias, residual) if t is not None]
    exact_inputs = [t.detach().double().requires_grad_() for t in inputs]
    exact_x_t, exact_state, exact_weight, *rest = exact_inputs
    exact_bias = rest.pop(0) if with_bias else None
    exact_residual = rest.pop(0) if with_residual else None
    window = torch.cat([exact_state, exact_x_t.unsqueeze(2)], dim=2)
    exact = reference_glu_conv1d(window, exact_weight, exact_bias, padding="causal", residual_scale=SCALE)[:, :, -1]
    if exact_residual is not None:
        exact = exact + exact_residual * SCALE
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out.double(), exact, **tolerance)
    torch.testing.assert_close(new_state, window[:, :, 1:].to(dtype))
    grad = torch.randn(out.shape, generator=generator).to(device, dtype)
    grads = torch.autograd.grad(out, inputs, grad)
    exact_grads = torch.autograd.grad(exact, exact_inputs, grad.double())
    for got, expected in zip(grads, exact_grads):
        torch.testing.assert_close(got.double(), expected, **tolerance)


@requires_triton
def test_triton_step_reads_a_weight_whose_rows_are_strided():
    """A weight whose rows are each contiguous but lie apart (every other row of a larger one): the
    step kernel reads them in place, at their own stride."""
    device = device_for("triton")
    weight = torch.randn(16, 6, 3, device=device)[::2]
    x_t, state = torch.randn(3, 6, device=device), torch.randn(3, 6, 2, device=device)
    out, _ = tk.glu_conv1d_step(x_t, state, weight, backend="triton")
    expected, _ = tk.glu_conv1d_step(x_t, state, weight.contiguous(), backend="eager")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@requires_triton
def test_triton_strided_input_and_empty_batch():
    device = device_for("triton")
    _, weight, bias, residual = _make_inputs(2, 3, 6, 4, 4, dtype=torch.float32, device=device)
    x_strided = torch.randn(2, 8, 12, device=device)[:, ::2, ::2]
    out = tk.glu_conv1d(x_strided, weight, bias, residual=residual, backend="triton")
    torch.testing.assert_close(out, reference_glu_conv1d(x_strided, weight, bias, residual=residual),
                               atol=1e-5, rtol=1e-5)
    x_empty = torch.randn(0, 4, 6, device=device, requires_grad=True)
    weight = weight.detach().requires_grad_()
    tk.glu_conv1d(x_empty, weight, bias, backend="triton").sum().backward()
    assert torch.count_nonzero(weight.grad) == 0


@pytest.fixture
def fresh_glu_plans(monkeypatch):
    """glu_conv1d's call plans from none, so that the test's first call prepares its layout."""
    from transformer_kernels.ops import glu_conv as glu_conv_op
    from transformer_kernels.ops._call_plans import CallPlans

    monkeypatch.setattr(glu_conv_op, "_PLANS", CallPlans())
    return glu_conv_op._PLANS


def _kept_glu_forward(plans):
    ((_, (_, (_, prepared))),) = plans._plans.items()
    return prepared


@requires_triton
@pytest.mark.parametrize("channels_last,with_residual,with_bias", [(True, True, True), (False, False, False)],
                         ids=["cl_res_bias", "cf_plain"])
def test_triton_plan_runs_the_prepared_forward_and_backward_on_each_calls_tensors(
    fresh_glu_plans, channels_last, with_residual, with_bias
):
    """The call plan of a layout keeps the Triton forward prepared for it, which prepares the
    backward of its calls: later calls run both on their own tensors, each against the reference.
    LaunchTemplates.verify, set for the suite, also compares their launches with forward's and
    backward's."""
    from transformer_kernels.backends.triton import glu_conv as triton_glu_conv

    def glu(x, weight, bias, residual):
        return tk.glu_conv1d(x, weight, bias, padding="causal", pad_value=1.0, residual=residual,
                             residual_scale=SCALE, backend="triton")

    def reference(x, weight, bias, residual):
        return reference_glu_conv1d(x, weight, bias, padding="causal", pad_value=1.0, residual=residual,
                                    residual_scale=SCALE)

    for call in range(3):
        inputs = _make_inputs(2, 3, 11, 8, 12, dtype=torch.float32, device=device_for("triton"),
                              channels_last=channels_last, bias=with_bias, residual=with_residual)
        ours = outputs_and_grads(glu, inputs)
        prepared = _kept_glu_forward(fresh_glu_plans)
        assert isinstance(prepared, triton_glu_conv._PreparedForward)
        assert isinstance(prepared.prepared_backward, triton_glu_conv._PreparedBackward)
        expected = outputs_and_grads(reference, [t if t is None else t.double() for t in inputs],
                                     ours.grad_outputs)
        assert_close_to_reference(ours.outputs + ours.grads, expected.outputs + expected.grads, rtol=1e-5, atol=1e-5)


@requires_triton
def test_the_prepared_glu_backward_takes_backward_where_the_call_differs(fresh_glu_plans, monkeypatch):
    """A call of a prepared layout whose grad_out has another layout than the first's, that asks for
    other gradients, or that meets another float32 TF32 setting runs backward (the setting sends the
    forward to forward too); each gradient against the reference."""
    from transformer_kernels.backends.triton import glu_conv as triton_glu_conv

    device = device_for("triton")
    x, weight, bias, residual = _leaves(*_make_inputs(2, 3, 9, 8, 8, dtype=torch.float32, device=device))
    general = {"forward": 0, "backward": 0}
    for name in general:
        real = getattr(triton_glu_conv, name)
        monkeypatch.setattr(triton_glu_conv, name, functools.partial(_counted, general, name, real))
    exact = [t.detach().double().requires_grad_() for t in (x, weight, bias, residual)]
    expected = reference_glu_conv1d(*exact[:3], residual=exact[3])

    def check_gradients(grad_out, wanted=range(4)):
        leaves = [t if i in wanted else t.detach() for i, t in enumerate((x, weight, bias, residual))]
        out = tk.glu_conv1d(*leaves[:3], residual=leaves[3], backend="triton")
        grads = torch.autograd.grad(out, [leaves[i] for i in wanted], grad_out)
        expected_grads = torch.autograd.grad(expected, [exact[i] for i in wanted], grad_out.double(),
                                             retain_graph=True)
        torch.testing.assert_close(grads, expected_grads, rtol=1e-5, atol=1e-5, check_dtype=False)

    grad_out = torch.randn(2, 8, 9, device=device)
    check_gradients(grad_out)
    check_gradients(grad_out)
    assert isinstance(_kept_glu_forward(fresh_glu_plans).prepared_backward, triton_glu_conv._PreparedBackward)
    assert general == {"forward": 0, "backward": 0}
    check_gradients(torch.randn(2, 9, 8, device=device).transpose(1, 2))
    assert general == {"forward": 0, "backward": 1}
    check_gradients(grad_out, [0])
    assert general == {"forward": 0, "backward": 2}
    with tf32_setting("conv", True, "legacy"):
        check_gradients(grad_out)
    assert general == {"forward": 1, "backward": 3}


def _counted(counts: dict, name: str, function, *args):
    counts[name] += 1
    return function(*args)


@requires_triton
def test_the_prepared_glu_calls_fail_where_their_launches_differ(fresh_glu_plans):
    """What the suite relies on: under LaunchTemplates.verify, a prepared forward or backward whose
    templates are not what forward or backward would launch fails the call."""
    x, weight, bias, residual = _leaves(*_make_inputs(2, 3, 9, 8, 8, dtype=torch.float32,
                                                      device=device_for("triton")))
    out = tk.glu_conv1d(x, weight, bias, residual=residual, backend="triton")
    torch.autograd.grad(out, x, torch.ones_like(out))
    prepared = _kept_glu_forward(fresh_glu_plans)
    prepared.prepared_backward.templates.reverse()
    out = tk.glu_conv1d(x, weight, bias, residual=residual, backend="triton")
    with pytest.raises(AssertionError, match="prepared GLU convolution backward's launches differ"):
        torch.autograd.grad(out, x, torch.ones_like(out))
    prepared.template = prepared.template * 2
    with pytest.raises(AssertionError, match="prepared GLU convolution forward's launches differ"):
        tk.glu_conv1d(x, weight, bias, residual=residual, backend="triton")


# --------------------------------------------------------------------------- registration


def _opcheck(backend, device, channels_last, length=7, kernel_size=3):
    x, weight, bias, residual = _make_inputs(2, kernel_size, length, 4, 6, dtype=torch.float32, device=device,
                                             channels_last=channels_last)
    x, weight, bias, residual = _leaves(x, weight, bias, residual)
    op = torch.ops.transformer_kernels.glu_conv1d_forward.default
    # (..., pad_left, pad_right, pad_value, residual_scale, timed_choices, backend): not timed, as
    # the public functions pass a call that torch traces (opcheck traces with dynamic sizes too).
    pads = (kernel_size // 2, (kernel_size - 1) // 2)
    torch.library.opcheck(op, (x, weight, bias, residual, *pads, 0.5, SCALE, False, backend))
    torch.library.opcheck(op, (x, weight, None, None, kernel_size - 1, 0, 0.0, 1.0, False, backend))
    saved = op(x, weight, bias, residual, kernel_size - 1, 0, 1.0, SCALE, False, backend)[1].detach()
    grad_out = torch.randn(2, 6, length, device=device)
    torch.library.opcheck(
        torch.ops.transformer_kernels.glu_conv1d_backward.default,
        (grad_out, x.detach(), weight.detach(), bias.detach(), saved, kernel_size - 1, 0, 1.0, SCALE, False,
         True, True, True, backend),
    )


@pytest.mark.parametrize("backend,channels_last", [
    backend_param("eager", False, op="glu_conv", id="eager-cf"),
    backend_param("eager", True, op="glu_conv", id="eager-cl"),
    backend_param("triton", True, op="glu_conv", id="triton-cl"),
])
def test_opcheck(backend, channels_last):
    _opcheck(backend, device_for(backend), channels_last)


@pytest.mark.parametrize("length", [101, 160], ids=["winograd_fwd_odd", "winograd_both"])
def test_opcheck_eager_winograd(length):
    """The eager backend's Winograd path saves z as a view of an even-length buffer (odd lengths)."""
    _opcheck("eager", "cpu", True, length)


@pytest.mark.parametrize("length", [20, 200], ids=["conv1d_im2col_backward", "channels_last_both_ways"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_opcheck_eager_onednn(channels_last, length, monkeypatch):
    """oneDNN forward (kernel size 5): z channel-first after F.conv1d, whatever x's layout; backward
    on oneDNN (400 positions) or the im2col GEMM (40), with its gradients on oneDNN's GEMMs."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    from transformer_kernels.backends.eager import onednn

    monkeypatch.setattr(onednn, "_speedup", 2.0)
    _opcheck("eager", "cpu", channels_last, length, kernel_size=5)


@pytest.mark.parametrize("length,kernel_size,algorithm", [(7, 3, "im2col"), (101, 3, "winograd"), (101, 5, "onednn")])
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_fake_layouts_match_real(channels_last, length, kernel_size, algorithm):
    """The output's and grad_x's strides under FakeTensorMode are those of a call that torch traces
    (the fixed rule's algorithm, see GluConvArgs.timed_choices) run for real: x's layout, except
    after oneDNN's convolution (contiguous)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv

    if algorithm == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    x, weight, bias, residual = _make_inputs(2, kernel_size, length, 4, 6, dtype=torch.float32,
                                             channels_last=channels_last)
    assert eager_glu_conv.algorithm(x, weight, length, "forward", timed=False) == algorithm

    def out_and_grad_x(*tensors):
        x, weight, bias, residual = (t.detach().requires_grad_() for t in tensors)
        out = tk.glu_conv1d(x, weight, bias, residual=residual, backend="eager")
        return out, torch.autograd.grad(out, x, torch.ones_like(out))[0]

    real = out_and_grad_x(x, weight, bias, residual)
    with FakeTensorMode() as mode:
        fake = out_and_grad_x(*(mode.from_tensor(t) for t in (x, weight, bias, residual)))
    for real_tensor, fake_tensor in zip(real, fake):
        assert fake_tensor.shape == real_tensor.shape and fake_tensor.stride() == real_tensor.stride()
    backward = eager_glu_conv.algorithm(x, weight, length, "backward", timed=False)
    for tensor, chosen in zip(real, (algorithm, backward)):
        expected = channels_last and chosen != "onednn"
        assert _has_layout(tensor, expected) and not _has_layout(tensor, not expected)


def test_torch_compile_fullgraph_encoder_layer():
    def encoder_layer(x_blc, weight, bias):
        h = x_blc.transpose(1, 2)  # the seq2seq model kept in [B, L, C]: no permute copies
        return tk.glu_conv1d(h, weight, bias, residual=h, residual_scale=SCALE, backend="eager").transpose(1, 2)

    x, weight, bias = torch.randn(2, 7, 8), torch.randn(16, 8, 3), torch.randn(16)
    x, weight, bias = _leaves(x, weight, bias)
    compiled = torch.compile(encoder_layer, fullgraph=True)
    out = compiled(x, weight, bias)
    grads = torch.autograd.grad(out.sum(), (x, weight, bias))
    expected = encoder_layer(x, weight, bias)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (x, weight, bias))):
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    x, weight, bias = torch.randn(2, 6, 5), torch.randn(8, 6, 3), torch.randn(8)
    with pytest.raises(ValueError, match=r"weight must have shape \[2\*C, C_in, k\] with C_in = x.shape\[1\] = 6"):
        tk.glu_conv1d(x, torch.randn(8, 5, 3))
    with pytest.raises(ValueError, match=r"weight.shape\[0\].*must be even"):
        tk.glu_conv1d(x, torch.randn(7, 6, 3))
    with pytest.raises(ValueError, match="padding must be one of"):
        tk.glu_conv1d(x, weight, padding="valid")
    with pytest.raises(ValueError, match=r"bias must have shape \[2\*C\] = \[8\]"):
        tk.glu_conv1d(x, weight, torch.randn(4))
    with pytest.raises(ValueError, match=r"residual must have the output's shape \[2, 4, 5\]"):
        tk.glu_conv1d(x, weight, bias, residual=torch.randn(2, 6, 5))
    with pytest.raises(ValueError, match="x must be 3-D"):
        tk.glu_conv1d(torch.randn(6, 5), weight)
    with pytest.raises(ValueError, match=r"at least one position \(L >= 1\)"):
        tk.glu_conv1d(torch.randn(2, 6, 0), weight)
    with pytest.raises(ValueError, match=r"x must have at least one channel \(C_in >= 1\)"):
        tk.glu_conv1d(torch.randn(2, 0, 5), torch.randn(8, 0, 3), bias)
    with pytest.raises(ValueError, match=r"x_t must have at least one channel \(C_in >= 1\)"):
        tk.glu_conv1d_step(torch.randn(2, 0), None, torch.randn(8, 0, 3), bias)
    with pytest.raises(TypeError, match="weight must have the same dtype as x"):
        tk.glu_conv1d(x, weight.double())
    with pytest.raises(ValueError, match="residual must be on the same device as x"):
        tk.glu_conv1d(x, weight, residual=torch.randn(2, 4, 5, device="meta"))
    with pytest.raises(TypeError, match="x must have dtype in"):
        tk.glu_conv1d(x.long(), weight.long())
    with pytest.raises(TypeError, match="residual_scale must be a Python float"):
        tk.glu_conv1d(x, weight, residual_scale=torch.tensor(0.5))
    with pytest.raises(TypeError, match=r"weight must be a dense \(torch.strided\) tensor, got layout torch.sparse_coo"):
        tk.glu_conv1d(x, weight.to_sparse())


# --------------------------------------------------------------------------- GPU tolerances


@requires_cuda
@pytest.mark.parametrize("backend", backend_params("glu_conv", names=("triton", "cuda")))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k,length,channels,padding,channels_last", [
    (3, 60, 512, "same", True),
    (3, 37, 520, "causal", False),
    (5, 1000, 256, "causal", True),
    (2, 3, 24, "same", False),
])
def test_gpu_error_within_twice_pytorch(backend, dtype, k, length, channels, padding, channels_last):
    """Error of ours in dtype vs an fp32 reference <= 2x the error of PyTorch's own dtype math (+1e-5)."""
    inputs = _make_inputs(16, k, length, channels, channels, dtype=dtype, device="cuda", channels_last=channels_last)
    grad = torch.randn(16, channels, length, device="cuda", dtype=dtype)
    ours, reference = _functions(backend, padding=padding, pad_value=1.0, residual_scale=SCALE)
    assert_low_precision_within_2x(ours, reference, inputs, grad, names=["out", *(f"grad {n}" for n in INPUT_NAMES)])


@requires_cuda
def test_gpu_fp32_and_step():
    x, weight, bias, residual = _make_inputs(4, 3, 50, 64, 64, dtype=torch.float32, device="cuda", channels_last=True)
    _assert_matches_reference(x, weight, bias, residual, backend="triton", atol=1e-2, rtol=1e-2,
                              padding="causal", pad_value=1.0, residual_scale=SCALE)
    full = tk.glu_conv1d(x, weight, bias, padding="causal", pad_value=1.0, residual=residual, residual_scale=SCALE)
    steps = _decode(x, weight, bias, residual, pad_value=1.0, backend="triton")
    torch.testing.assert_close(steps, full, atol=1e-2, rtol=1e-2)


@requires_triton
@pytest.mark.parametrize("api", ["legacy", "new"])
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_triton_float32_follows_the_conv_tf32_setting_of_either_api(api, allow_tf32):
    from transformer_kernels.backends.triton import glu_conv as triton_glu_conv

    with tf32_setting("conv", allow_tf32, api):
        # TF32 allowed: 3xTF32 dots (a single TF32 product truncates its operands; see input_precision).
        assert triton_glu_conv._input_precision(torch.float32) == ("tf32x3" if allow_tf32 else "ieee")
        assert triton_glu_conv._input_precision(torch.float16) == "tf32"
