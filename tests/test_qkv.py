"""transformer_kernels.qkv_projection: eager, Triton (interpreter on CPU) and GPU tolerance tests."""

import pytest
import torch
import torch.nn.functional as F

import transformer_kernels as tk
from transformer_kernels import BackendUnavailableError
from transformer_kernels.ops.qkv import QkvProjectionArgs
from transformer_kernels.reference import qkv_projection as reference_qkv

from _helpers import (
    ForwardSpy, assert_close_to_reference, assert_low_precision_within_2x, assert_matches_reference, backend_params,
    device_for, outputs_and_grads, skip_unless_backend, working_dtype,
)
from conftest import CUDA, requires_cuda, tf32_setting

requires_triton = skip_unless_backend("triton", "qkv")

# (x shape, num_heads): the seeds' tiny E = 4 with two heads, E not a multiple
# of 16, head dims 2..16, an unbatched [L, E] input and two leading batch dims.
SHAPES = [
    ((2, 5, 4), 2),
    ((3, 7, 24), 3),
    ((2, 3, 6, 40), 5),
    ((9, 16), 4),
    ((1, 1, 8), 1),
    ((2, 33, 48), 3),
]


def _inputs(shape, num_proj, dtype=torch.float32, bias=True, device="cpu"):
    embed_dim = shape[-1]
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    weight = torch.randn(num_proj * embed_dim, embed_dim, dtype=dtype, device=device) / embed_dim**0.5
    weight.requires_grad_()
    b = torch.randn(num_proj * embed_dim, dtype=dtype, device=device, requires_grad=True) if bias else None
    return x, weight, b


def _chunk_path(x, weight, bias, num_heads):
    """nn.MultiheadAttention's packed linear + chunk + head split."""
    *batch, seq_len, embed_dim = x.shape
    num_proj = weight.shape[0] // embed_dim
    packed = F.linear(x, weight, bias)
    return tuple(
        y.view(*batch, seq_len, num_heads, embed_dim // num_heads).transpose(-3, -2)
        for y in packed.chunk(num_proj, dim=-1)
    )


def _grads(outputs, inputs, grad_outputs):
    inputs = [t for t in inputs if t is not None]
    return torch.autograd.grad(outputs, inputs, grad_outputs)


def _tolerance(backend: str) -> dict:
    """Elementwise tolerances of a backend's results against the reference on the same inputs: float32
    kernels, or the CUDA extension's float16 ones."""
    return dict(rtol=1e-2, atol=1e-2) if backend == "cuda" else dict(rtol=1e-4, atol=1e-4)


def _check_against_references(backend, shape, num_heads, num_proj, dtype, bias, tol, device="cpu"):
    inputs = _inputs(shape, num_proj, dtype, bias, device)
    ours = outputs_and_grads(lambda *a: tk.qkv_projection(*a, num_heads=num_heads, backend=backend), inputs)
    assert len(ours.outputs) == num_proj
    *batch, seq_len, embed_dim = shape
    for out in ours.outputs:
        assert out.shape == (*batch, num_heads, seq_len, embed_dim // num_heads)
        assert out.is_contiguous()
    # fp32 references for low-precision runs
    for reference in (reference_qkv, _chunk_path):
        expected = outputs_and_grads(lambda *a: reference(*a, num_heads), inputs, ours.grad_outputs, dtype=torch.float32)
        assert_close_to_reference(ours.all, expected.all, **tol)


# --------------------------------------------------------------------------- eager


@pytest.fixture(params=["blas", "onednn"])
def gemm_engine(request, monkeypatch):
    """The eager projection's GEMMs on torch's BLAS or on oneDNN's GEMM, the faster of which this
    CPU runs (backends/eager/onednn.py)."""
    from transformer_kernels.backends.eager import onednn

    if request.param == "onednn" and onednn._LINEAR is None:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(onednn, "_speedup", 2.0 if request.param == "onednn" else 1.0)
    return request.param


@pytest.mark.parametrize("num_proj", [1, 2, 3])
@pytest.mark.parametrize("shape,num_heads", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_eager_matches_references(shape, num_heads, num_proj, bias, gemm_engine):
    _check_against_references("eager", shape, num_heads, num_proj, torch.float32, bias, dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("num_proj", [1, 3])
@pytest.mark.parametrize("token_major_grads", [False, True])
def test_eager_fp32_many_tokens_matches_references(num_proj, token_major_grads, gemm_engine):
    """float32 at 600 tokens (the shapes above stay small): forward and backward against both
    references, with contiguous and token-major ([*batch, L, H, Dh]) gradients."""
    inputs = _inputs((3, 200, 64), num_proj)
    grad_outputs = [torch.randn(3, 4, 200, 16) for _ in range(num_proj)]
    if token_major_grads:
        grad_outputs = [g.transpose(1, 2).contiguous().transpose(1, 2) for g in grad_outputs]
    ours = outputs_and_grads(lambda *a: tk.qkv_projection(*a, num_heads=4, backend="eager"), inputs, grad_outputs)
    for reference in (reference_qkv, _chunk_path):
        expected = outputs_and_grads(lambda *a: reference(*a, 4), inputs, grad_outputs)
        assert_close_to_reference(ours.all, expected.all, rtol=1e-4, atol=1e-4, same_dtype=True)


def test_eager_float32_error_within_twice_torchs(gemm_engine):
    """At the seeds' size (2048 tokens, E=512) every output and gradient errs (RMS, against float64)
    at most twice torch's own float32 projection: oneDNN's GEMM sums a contraction in one pass, and
    erred 2.2x in the gradients until they were cut into shallower products (onednn._MAX_DEPTH)."""
    inputs = _inputs((128, 16, 512), 3)
    ours = outputs_and_grads(lambda *a: tk.qkv_projection(*a, num_heads=8, backend="eager"), inputs)
    torch_float32 = outputs_and_grads(lambda *a: reference_qkv(*a, 8), inputs, ours.grad_outputs)
    exact = outputs_and_grads(lambda *a: reference_qkv(*a, 8), inputs, ours.grad_outputs, dtype=torch.float64)
    names = ("q", "k", "v", "grad_x", "grad_weight", "grad_bias")
    for name, got, theirs, expected in zip(names, ours.all, torch_float32.all, exact.all):
        our_error = (got.double() - expected).square().mean().sqrt()
        torch_error = (theirs.double() - expected).square().mean().sqrt()
        assert our_error <= 2 * torch_error, f"{name}: RMS error {our_error:.3e} > 2 x torch's {torch_error:.3e}"


@pytest.mark.parametrize(
    "shape,chunk_tokens",
    [((5, 3, 16), 7), ((2, 9, 16), 4), ((9, 16), 2), ((2, 2, 3, 16), 100)],
    ids=["whole_sequences", "pieces_of_sequences", "unbatched", "one_chunk"],
)
def test_eager_forward_in_token_chunks(monkeypatch, shape, chunk_tokens, gemm_engine):
    """The packed product made and split chunk by chunk (whole sequences, pieces of one sequence)
    gives the seeds' outputs, each in its own contiguous tensor."""
    from transformer_kernels.backends.eager import qkv as eager_qkv

    x, weight, b = _inputs(shape, 3)
    monkeypatch.setattr(eager_qkv, "_CHUNK_ELEMENTS", chunk_tokens * weight.shape[0])
    with torch.no_grad():
        outputs = tk.qkv_projection(x, weight, b, num_heads=4, backend="eager")
        expected = reference_qkv(x, weight, b, 4)
    assert all(out.is_contiguous() for out in outputs)
    assert len({out.data_ptr() for out in outputs}) == 3
    assert_close_to_reference(outputs, expected, rtol=1e-5, atol=1e-5, same_dtype=True)


def test_eager_forward_off_the_cpu_in_one_piece(monkeypatch):
    """Off the CPU (here the meta device, which stands in for a GPU) the forward makes the packed
    product in one piece, however large: chunks only pay on a CPU, whose cache holds a chunk from
    the GEMM to the head split."""
    from transformer_kernels.backends.eager import qkv as eager_qkv

    monkeypatch.setattr(eager_qkv, "_CHUNK_ELEMENTS", 4)
    x, weight, b = (t.to("meta") for t in _inputs((2, 9, 16), 3))
    calls = []
    monkeypatch.setattr(eager_qkv, "_token_chunks", lambda *a: calls.append(a) or iter(()))
    outputs = eager_qkv.forward(x, weight, b, QkvProjectionArgs(4))
    assert calls == [] and [tuple(o.shape) for o in outputs] == [(2, 4, 9, 4)] * 3


def test_eager_gradcheck_float64():
    x, weight, b = _inputs((2, 3, 6), 3, torch.float64)
    assert torch.autograd.gradcheck(lambda *a: tk.qkv_projection(*a, num_heads=3, backend="eager"), (x, weight, b))
    x, weight, _ = _inputs((4, 8), 2, torch.float64)
    assert torch.autograd.gradcheck(lambda *a: tk.qkv_projection(*a, num_heads=2, backend="eager"), (x, weight))


def test_outputs_share_no_storage_even_when_views_would_be_contiguous():
    # B = L = 1: every head-split view of the packed result would be contiguous.
    x, weight, b = _inputs((1, 1, 8), 3)
    outputs = tk.qkv_projection(x, weight, b, num_heads=1, backend="eager")
    storages = {o.untyped_storage().data_ptr() for o in outputs}
    assert len(storages) == 3


@pytest.mark.parametrize("shape,num_proj,chunk_tokens", [
    ((2, 5, 8), 3, None), ((1, 1, 8), 1, None), ((2, 2, 3, 8), 2, None), ((3, 4, 8), 3, 2),
], ids=["three", "one_token", "two_batch_dims", "in_chunks"])
@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_outputs_can_be_changed_in_place_as_torchs(monkeypatch, backend, shape, num_proj, chunk_tokens):
    """Like the view of nn.Linear's output it replaces, each output takes an in-place change while
    autograd records (``q.mul_(scale)``), and the gradients follow it: no output is a view that the
    op's forward made, which autograd would refuse to change in place."""
    from transformer_kernels.backends.eager import qkv as eager_qkv

    if chunk_tokens is not None:
        monkeypatch.setattr(eager_qkv, "_CHUNK_ELEMENTS", chunk_tokens * num_proj * shape[-1])
    x, weight, b = _inputs(shape, num_proj, working_dtype(backend), device=device_for(backend))
    outputs = tk.qkv_projection(x, weight, b, num_heads=2, backend=backend)
    assert not any(out._is_view() for out in outputs)
    for i, out in enumerate(outputs):
        out.mul_(i + 2)
    grads = torch.autograd.grad(sum(out.square().sum() for out in outputs), (x, weight, b))
    expected = [out * (i + 2) for i, out in enumerate(reference_qkv(x, weight, b, 2))]
    expected_grads = torch.autograd.grad(sum(out.square().sum() for out in expected), (x, weight, b))
    assert_close_to_reference(grads, expected_grads, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- triton (interpreter on CPU)

TRITON_CASES = [
    ((2, 5, 4), 2, 3, torch.float32, True),
    ((3, 7, 24), 3, 2, torch.float32, False),
    ((2, 2, 3, 40), 5, 1, torch.float32, True),
    ((9, 16), 4, 3, torch.float32, True),
    ((2, 5, 4), 2, 3, torch.float16, True),
    ((2, 9, 48), 3, 3, torch.float16, True),
    ((2, 6, 40), 5, 2, torch.float16, False),
]


@requires_triton
@pytest.mark.parametrize("shape,num_heads,num_proj,dtype,bias", TRITON_CASES)
def test_triton_matches_references(shape, num_heads, num_proj, dtype, bias):
    # float32 runs as torch matmuls; 16-bit inputs reach the kernels.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    _check_against_references("triton", shape, num_heads, num_proj, dtype, bias, tol, device_for("triton"))


@requires_triton
@pytest.mark.parametrize("api", ["legacy", "new"])
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_triton_float32_runs_torch_matmuls(monkeypatch, api, allow_tf32):
    """float32 runs as torch matmuls under either TF32 setting (they follow it exactly); no kernel launches."""
    from transformer_kernels.backends.eager import qkv as eager_qkv
    from transformer_kernels.backends.triton import qkv as triton_qkv

    launched = []
    real_launch = triton_qkv.KernelLaunch.__call__
    monkeypatch.setattr(triton_qkv.KernelLaunch, "__call__", lambda self: launched.append(self) or real_launch(self))
    x, weight, b = _inputs((2, 5, 16), 3, device=device_for("triton"))
    with tf32_setting("matmul", allow_tf32, api):
        outputs = tk.qkv_projection(x, weight, b, num_heads=2, backend="triton")
        grads = torch.autograd.grad(sum(o.sum() for o in outputs), (x, weight, b))
        with torch.no_grad():
            expected = eager_qkv.forward(x, weight, b, QkvProjectionArgs(2))
        expected_grads = torch.autograd.grad(sum(o.sum() for o in reference_qkv(x, weight, b, 2)), (x, weight, b))
    assert launched == []
    assert_close_to_reference(outputs, expected, rtol=1e-6, atol=1e-6, same_dtype=True)
    assert_close_to_reference(grads, expected_grads, "grad", rtol=1e-5, atol=1e-5, same_dtype=True)


@requires_triton
@pytest.mark.skipif(CUDA, reason="interpreter-only: forces tile configurations through the SM count")
@pytest.mark.parametrize("num_sms", [1, 1000], ids=["large_tiles", "small_tiles_split_tokens"])
def test_triton_every_config_path(monkeypatch, num_sms):
    from transformer_kernels.backends.triton import qkv as triton_qkv

    # 1 SM: every grid counts as full, so the large tiles run (128x256 forward
    # and 128x128 backward); 1000 SMs: the 64x64 tiles run and the weight
    # gradient splits the 1040 tokens over program_id(1) (fp32 partial sums,
    # then a sum).
    monkeypatch.setattr(triton_qkv, "multiprocessor_count", lambda device: num_sms)
    forward_cfg = triton_qkv.gemm_config("forward", 1040, 48, num_sms)
    weight_cfg = triton_qkv.gemm_config("grad_weight", 48, 16, num_sms)
    if num_sms == 1:
        assert forward_cfg.block_m == 128 and weight_cfg.block_m == 128
    else:
        assert forward_cfg.block_m == 64 and weight_cfg.block_m == 64
        assert triton_qkv.grad_weight_splits(3, 1040, weight_cfg.block_k, num_sms) == 2
    _check_against_references("triton", (2, 520, 16), 2, 3, torch.float16, True, dict(rtol=1e-2, atol=1e-2))


@requires_triton
@pytest.mark.skipif(CUDA, reason="interpreter-only: forces tile configurations through the SM count")
def test_triton_forward_takes_128x128_tiles_where_128x256_ones_leave_sms_idle(monkeypatch):
    from transformer_kernels.backends.triton import qkv as triton_qkv

    # 1040 tokens x 288 features: 18 tiles of 128x256 would leave 20 SMs idle, 27 of 128x128 do not.
    monkeypatch.setattr(triton_qkv, "multiprocessor_count", lambda device: 20)
    forward_cfg = triton_qkv.gemm_config("forward", 1040, 288, 20)
    assert (forward_cfg.block_m, forward_cfg.block_n) == (128, 128)
    _check_against_references("triton", (2, 520, 96), 2, 3, torch.float16, True, dict(rtol=1e-2, atol=1e-2))


@requires_triton
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_triton_plan_runs_the_prepared_forward_on_each_calls_tensors(monkeypatch, bias):
    """The call plan of a [B, L, E] float16 call keeps the Triton forward prepared for its layout,
    which prepares the backward of its calls: later calls run both with their own tensors (the
    first call's values on its tensors, the reference's on the others), or forward where the SM
    count picks other tiles.  LaunchTemplates.verify, set for the suite, also compares their
    launches with forward's and backward's."""
    from transformer_kernels.backends.triton import qkv as triton_qkv
    from transformer_kernels.ops import qkv as qkv_op
    from transformer_kernels.ops._call_plans import CallPlans

    monkeypatch.setattr(qkv_op, "_PLANS", CallPlans())
    device = device_for("triton")

    def project(x, weight, b):
        return tk.qkv_projection(x, weight, b, num_heads=2, backend="triton")

    for call in range(3):
        inputs = _inputs((2, 9, 32), 3, torch.float16, bias, device)
        first = outputs_and_grads(project, inputs)
        again = outputs_and_grads(project, inputs, first.grad_outputs)
        ((_, (_, (_, prepared))),) = qkv_op._PLANS._plans.items()
        assert isinstance(prepared, triton_qkv._PreparedForward)
        assert isinstance(prepared.prepared_backward, triton_qkv._PreparedBackward)
        torch.testing.assert_close((first.outputs, first.grads), (again.outputs, again.grads), rtol=0, atol=0)
        expected = outputs_and_grads(lambda x, weight, b: reference_qkv(x, weight, b, 2), inputs, first.grad_outputs)
        assert_close_to_reference(again.outputs + again.grads, expected.outputs + expected.grads, rtol=1e-2,
                                  atol=1e-2, same_dtype=True)
    x, weight, b = inputs
    general = []
    real_forward = triton_qkv.forward
    monkeypatch.setattr(triton_qkv, "forward", lambda *args: general.append(1) or real_forward(*args))
    real_count = triton_qkv.multiprocessor_count
    monkeypatch.setattr(triton_qkv, "multiprocessor_count", lambda device: 1)  # every grid full: large tiles
    tk.qkv_projection(x, weight, b, num_heads=2, backend="triton")
    assert general == [1]
    monkeypatch.setattr(triton_qkv, "multiprocessor_count", real_count)
    prepared.template = prepared.template * 2
    with pytest.raises(AssertionError, match="the prepared QKV forward's launches differ"):
        tk.qkv_projection(x, weight, b, num_heads=2, backend="triton")


@requires_triton
def test_the_prepared_qkv_backward_takes_backward_where_the_call_differs(monkeypatch):
    """A call of a prepared layout whose gradients have other layouts than the first's, that asks for
    other gradients, or that meets another SM count runs backward; each gradient against the
    reference.  Under LaunchTemplates.verify a prepared backward whose templates are not what
    backward would launch fails the call."""
    from transformer_kernels.backends.triton import qkv as triton_qkv
    from transformer_kernels.ops import qkv as qkv_op
    from transformer_kernels.ops._call_plans import CallPlans

    monkeypatch.setattr(qkv_op, "_PLANS", CallPlans())
    device = device_for("triton")
    x, weight, b = _inputs((2, 9, 32), 3, torch.float16, True, device)
    general = []
    real_backward = triton_qkv.backward
    monkeypatch.setattr(triton_qkv, "backward", lambda *args: general.append(1) or real_backward(*args))

    def check_gradients(grads, leaves=(x, weight, b)):
        wanted = [t for t in leaves if t.requires_grad]
        ours = torch.autograd.grad(tk.qkv_projection(*leaves, num_heads=2, backend="triton"), wanted, grads)
        exact = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
        expected = torch.autograd.grad(reference_qkv(*exact, 2), [t for t in exact if t.requires_grad],
                                       [g.double() for g in grads])
        assert_close_to_reference(ours, expected, rtol=1e-2, atol=1e-2)

    grads = [torch.randn(2, 2, 9, 16, dtype=torch.float16, device=device) for _ in range(3)]
    check_gradients(grads)
    check_gradients(grads)
    ((_, (_, (_, prepared))),) = qkv_op._PLANS._plans.items()
    assert isinstance(prepared.prepared_backward, triton_qkv._PreparedBackward)
    assert general == []
    check_gradients([torch.randn(2, 9, 2, 16, dtype=torch.float16, device=device).transpose(1, 2)] * 3)
    assert len(general) == 1
    check_gradients(grads, (x, weight.detach(), b.detach()))
    assert len(general) == 2
    real_count = triton_qkv.multiprocessor_count
    monkeypatch.setattr(triton_qkv, "multiprocessor_count", lambda device: 1)
    check_gradients(grads)
    assert len(general) == 3
    monkeypatch.setattr(triton_qkv, "multiprocessor_count", real_count)
    prepared.prepared_backward.templates.reverse()
    outputs = tk.qkv_projection(x, weight, b, num_heads=2, backend="triton")
    with pytest.raises(AssertionError, match="the prepared QKV backward's launches differ"):
        torch.autograd.grad(outputs, (x, weight, b), grads)


def test_gradients_the_kernels_cannot_read_in_place_are_copied_once(monkeypatch):
    """Broadcast gradients (those of ``out.sum()``) share no stride set: each backward copies them
    once (``_shared_layout``), and the forward's plan prepares no backward for them, asking
    without copying."""
    from transformer_kernels.backends.triton import qkv as triton_qkv
    from transformer_kernels.ops import qkv as qkv_op
    from transformer_kernels.ops._call_plans import CallPlans

    monkeypatch.setattr(qkv_op, "_PLANS", CallPlans())
    copies = []
    real_shared_layout = triton_qkv._shared_layout

    def shared_layout(grads):
        shared = real_shared_layout(grads)
        copies.extend(s for s, g in zip(shared, grads) if s is not g)
        return shared

    monkeypatch.setattr(triton_qkv, "_shared_layout", shared_layout)
    device = device_for("triton")
    x, weight, b = _inputs((2, 9, 32), 3, torch.float16, True, device)
    grads = [torch.ones((), dtype=torch.float16, device=device).expand(2, 2, 9, 16)] * 3
    for _ in range(2):
        copies.clear()
        outputs = tk.qkv_projection(x, weight, b, num_heads=2, backend="triton")
        torch.autograd.grad(outputs, (x, weight, b), grads)
        assert len(copies) == 3
    ((_, (_, (_, prepared))),) = qkv_op._PLANS._plans.items()
    assert isinstance(prepared, triton_qkv._PreparedForward) and prepared.prepared_backward is None


def _bias(layout: str, size: int, device, dtype) -> torch.Tensor:
    """A bias leaf ``[size]``: contiguous, every second element of a buffer, or one value expanded."""
    if layout == "strided":
        return torch.randn(2 * size, device=device, dtype=dtype)[::2].requires_grad_()
    if layout == "expanded":
        return torch.randn(1, device=device, dtype=dtype).expand(size).requires_grad_()
    return torch.randn(size, device=device, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("bias_layout", ["strided", "expanded"])
@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_bias_of_any_layout(backend, bias_layout):
    """A bias that is every second element of a buffer, or one value expanded (the Triton kernel once
    read a strided bias as contiguous, an expanded one past its storage), in the dtype each backend's
    kernels run (float16 on Triton: its float32 runs torch's matmuls): outputs and gradients against
    the reference in float64."""
    device = device_for(backend)
    dtype = torch.float32 if backend == "eager" else torch.float16
    x = torch.randn(3, 6, 24, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(72, 24, device=device, dtype=dtype) / 5).requires_grad_()
    b = _bias(bias_layout, 72, device, dtype)
    outputs = tk.qkv_projection(x, weight, b, num_heads=3, backend=backend)
    exact_inputs = [t.detach().double().requires_grad_() for t in (x, weight, b)]
    expected = reference_qkv(*exact_inputs, 3)
    grads = [torch.randn_like(t) for t in expected]
    tolerance = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    for got, want in zip([*outputs, *torch.autograd.grad(outputs, (x, weight, b), [g.to(dtype) for g in grads])],
                         [*expected, *torch.autograd.grad(expected, exact_inputs, grads)]):
        torch.testing.assert_close(got.double(), want, **tolerance)


@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_strided_inputs_and_unusual_gradients(backend):
    device, dtype = device_for(backend), working_dtype(backend)
    # x transposed (non-contiguous), weight a transposed view.
    x = torch.randn(3, 24, 6, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    weight = torch.randn(24, 72, device=device, dtype=dtype).t().requires_grad_()
    b = torch.randn(72, device=device, dtype=dtype, requires_grad=True)
    q, k, v = tk.qkv_projection(x, weight, b, num_heads=3, backend=backend)
    rq, rk, rv = reference_qkv(x, weight, b, 3)
    assert_close_to_reference([q, k, v], [rq, rk, rv], **_tolerance(backend), same_dtype=True)
    # A stride-0 gradient (from .sum()), a transposed one, and no gradient for v.
    g_k = torch.randn(3, 3, 8, 6, device=device, dtype=dtype).transpose(-1, -2)
    loss = q.sum() + (k * g_k).sum()
    ref_loss = rq.sum() + (rk * g_k).sum()
    grads = torch.autograd.grad(loss, (x, weight, b))
    expected = torch.autograd.grad(ref_loss, (x, weight, b))
    assert_close_to_reference(grads, expected, "grad", **_tolerance(backend), same_dtype=True)


@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_token_major_gradients(backend):
    # Gradients laid out [B, L, H, Dh] (e.g. from the packed-linear path): both
    # backends read them in place, without packing them first.
    device, dtype = device_for(backend), working_dtype(backend)
    x, weight, b = _inputs((2, 7, 24), 3, dtype=dtype, device=device)
    outputs = tk.qkv_projection(x, weight, b, num_heads=3, backend=backend)
    grad_outputs = [torch.randn(2, 7, 3, 8, device=device, dtype=dtype).transpose(1, 2) for _ in outputs]
    expected = reference_qkv(x, weight, b, 3)
    assert_close_to_reference(
        _grads(outputs, (x, weight, b), grad_outputs), _grads(expected, (x, weight, b), grad_outputs), "grad",
        **_tolerance(backend), same_dtype=True,
    )


@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_only_needed_gradients(backend, gradient_spy):
    """A frozen weight and bias, then an x without requires_grad: the backend computes only the
    gradients asked for, and those match the reference."""
    spy = gradient_spy("qkv", backend)
    device, dtype = device_for(backend), working_dtype(backend)
    x = torch.randn(2, 5, 16, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(32, 16, device=device, dtype=dtype)  # frozen
    b = torch.randn(32, device=device, dtype=dtype)
    k, v = tk.qkv_projection(x, weight, b, num_heads=2, backend=backend)
    (k.sum() + (v * v).sum()).backward()
    x_ref = x.detach().requires_grad_()
    rk, rv = reference_qkv(x_ref, weight, b, 2)
    (rk.sum() + (rv * rv).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **_tolerance(backend))
    spy.assert_computed(x=True, weight=False, bias=False)

    spy.returned.clear()
    x = torch.randn(2, 5, 16, device=device, dtype=dtype)
    weight.requires_grad_()
    (q,) = tk.qkv_projection(x, weight[:16], None, num_heads=2, backend=backend)
    q.sum().backward()
    torch.testing.assert_close(weight.grad[:16], x.reshape(-1, 16).sum(0).expand(16, 16), **_tolerance(backend))
    spy.assert_computed(x=False, weight=True, bias=False)


@pytest.mark.parametrize("shape", [(0, 5, 16), (2, 0, 16), (0, 16)], ids=["no_batch", "no_tokens", "2d_no_tokens"])
@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_empty_batch(backend, shape):
    device, dtype = device_for(backend), working_dtype(backend)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(48, 16, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(48, device=device, dtype=dtype, requires_grad=True)
    outputs = tk.qkv_projection(x, weight, b, num_heads=2, backend=backend)
    assert [o.shape for o in outputs] == [(*shape[:-2], 2, shape[-2], 8)] * 3
    sum(o.sum() for o in outputs).backward()
    assert x.grad.shape == x.shape
    assert torch.count_nonzero(weight.grad) == 0 and torch.count_nonzero(b.grad) == 0


@requires_triton
def test_a_backend_that_cannot_serve_the_dtype_raises_without_tokens_too():
    """An explicitly requested backend's refusal does not depend on the call having tokens (the
    calls without any run on eager's GEMMs)."""
    x, weight = torch.randn(0, 5, 16, dtype=torch.float64), torch.randn(48, 16, dtype=torch.float64)
    with pytest.raises(BackendUnavailableError, match="backend='triton' cannot serve this call"):
        tk.qkv_projection(x.to(device_for("triton")), weight.to(device_for("triton")), num_heads=2, backend="triton")


# --------------------------------------------------------------------------- registration


@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_opcheck(backend):
    # The registered op runs the backend it is given: these shapes and dtypes are ones each serves.
    device, dtype = device_for(backend), working_dtype(backend)
    op = torch.ops.transformer_kernels.qkv_projection_forward
    x, weight, b = _inputs((2, 3, 16), 3, dtype=dtype, device=device)
    torch.library.opcheck(op, (x, weight, b, 2, backend))
    x, weight, _ = _inputs((5, 16), 2, dtype=dtype, device=device)
    torch.library.opcheck(op, (x, weight, None, 2, backend))


def test_fake_outputs_match_real_strides():
    x, weight, b = _inputs((2, 3, 5, 12), 3)
    real = tk.qkv_projection(x, weight, b, num_heads=4, backend="eager")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_inputs = [mode.from_tensor(t) for t in (x, weight, b)]
        fake = tk.qkv_projection(*fake_inputs, num_heads=4, backend="eager")
    assert [(f.shape, f.stride(), f.dtype) for f in fake] == [(r.shape, r.stride(), r.dtype) for r in real]


def test_torch_compile_fullgraph():
    x, weight, b = _inputs((2, 5, 8), 3)

    def attention_block(x, weight, b):
        q, k, v = tk.qkv_projection(x, weight, b, num_heads=2, backend="eager")
        return F.scaled_dot_product_attention(q, k, v).sum()

    compiled = torch.compile(attention_block, fullgraph=True)
    expected_grads = torch.autograd.grad(attention_block(x, weight, b), (x, weight, b))
    grads = torch.autograd.grad(compiled(x, weight, b), (x, weight, b))
    assert_close_to_reference(grads, expected_grads, "grad", rtol=1e-5, atol=1e-5, same_dtype=True)


# --------------------------------------------------------------------------- attention interop


@pytest.mark.parametrize("backend", backend_params("qkv"))
def test_outputs_feed_attention_without_copy(monkeypatch, backend):
    """q, k, v reach the attention backend as they are (contiguous [B, H, L, Dh]: the layout
    attention reads with unit-stride rows; nothing to copy), and the projection + attention block
    gives the fp64 reference's output and gradients of x, weight and bias."""
    forward_calls = ForwardSpy(monkeypatch, ops=["attention"], names=[backend])
    projected = []

    def block(x, weight, b):
        q, k, v = tk.qkv_projection(x, weight, b, num_heads=2, backend=backend)
        projected[:] = [q, k, v]
        return tk.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)

    def reference(x, weight, b):
        return F.scaled_dot_product_attention(*reference_qkv(x, weight, b, 2), is_causal=True)

    inputs = _inputs((2, 9, 16), 3, dtype=working_dtype(backend), device=device_for(backend))
    assert_matches_reference(block, reference, inputs, input_names=("x", "weight", "bias"), **_tolerance(backend))
    for t in projected:
        assert t.is_contiguous() and t.shape == (2, 2, 9, 8)
    assert forward_calls.calls == [("attention", backend)]
    for name, given, received in zip("qkv", projected, forward_calls.inputs[0]):
        assert received.data_ptr() == given.data_ptr() and received.stride() == given.stride(), f"{name} was copied"


# --------------------------------------------------------------------------- autocast


def test_autocast_cpu_runs_in_bfloat16_like_linear():
    x, weight, b = _inputs((2, 5, 16), 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = tk.qkv_projection(x, weight, b, num_heads=2)
        expected = _chunk_path(x, weight, b, 2)
    assert all(o.dtype == torch.bfloat16 for o in outputs)
    assert_close_to_reference(outputs, expected, rtol=2e-2, atol=2e-2, same_dtype=True)
    sum(o.float().sum() for o in outputs).backward()
    assert x.grad.dtype == weight.grad.dtype == b.grad.dtype == torch.float32
    # float64 is not autocast-eligible (as for nn.Linear): it stays float64.
    x64, w64, _ = _inputs((2, 3, 4), 1, torch.float64, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = tk.qkv_projection(x64, w64, num_heads=2)
    assert out.dtype == torch.float64


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    x = torch.randn(2, 5, 12)
    w = torch.randn(36, 12)
    with pytest.raises(ValueError, match=r"E = x.shape\[-1\] = 12 must be divisible by num_heads = 5"):
        tk.qkv_projection(x, w, num_heads=5)
    with pytest.raises(ValueError, match=r"weight must have shape \[n\*E, E\].*got weight of shape \(30, 12\)"):
        tk.qkv_projection(x, torch.randn(30, 12), num_heads=3)
    with pytest.raises(ValueError, match=r"n in \(1, 2, 3\).*\(48, 12\)"):
        tk.qkv_projection(x, torch.randn(48, 12), num_heads=3)
    with pytest.raises(ValueError, match=r"weight must have shape.*\(36, 10\)"):
        tk.qkv_projection(x, torch.randn(36, 10), num_heads=3)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        tk.qkv_projection(x, torch.randn(3, 12, 12), num_heads=3)
    with pytest.raises(ValueError, match=r"bias must have shape \[n\*E\] = \[36\]"):
        tk.qkv_projection(x, w, torch.randn(12), num_heads=3)
    with pytest.raises(TypeError, match="weight must have the same dtype as x"):
        tk.qkv_projection(x, w.double(), num_heads=3)
    with pytest.raises(TypeError, match="bias must have the same dtype as x"):
        tk.qkv_projection(x, w, torch.randn(36, dtype=torch.float16), num_heads=3)
    with pytest.raises(ValueError, match="weight must be on the same device as x"):
        tk.qkv_projection(x, w.to("meta"), num_heads=3)
    with pytest.raises(ValueError, match="x must have at least 2 dimensions"):
        tk.qkv_projection(torch.randn(12), w, num_heads=3)
    with pytest.raises(TypeError, match="x must have dtype in"):
        tk.qkv_projection(x.int(), w, num_heads=3)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        tk.qkv_projection(x, w, num_heads=3.0)
    with pytest.raises(ValueError, match="num_heads must be positive"):
        tk.qkv_projection(x, w, num_heads=0)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        tk.qkv_projection(torch.randn(2, 5, 0), torch.randn(0, 0), num_heads=1)
    with pytest.raises(TypeError, match=r"x must be a dense \(torch.strided\) tensor, got layout torch.sparse_coo"):
        tk.qkv_projection(x.to_sparse(), w, num_heads=3)


@requires_triton
def test_triton_refuses_int32_overflow_before_launching():
    device = device_for("triton")
    huge = torch.randn(1, 1, 16, device=device).expand(2**12, 2**16, 16)  # 2**32 elements, no memory
    with pytest.raises(BackendUnavailableError, match="int32"):
        tk.qkv_projection(huge, torch.randn(48, 16, device=device), num_heads=2, backend="triton")


# --------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("backend", backend_params("qkv", names=("triton", "cuda")))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,num_heads,num_proj", [((4, 128, 512), 8, 3), ((3, 77, 40), 5, 2), ((2, 16, 4), 2, 3), ((2, 1000, 768), 12, 1)]
)
def test_cuda_error_within_twice_pytorch(backend, dtype, shape, num_heads, num_proj):
    inputs = _inputs(shape, num_proj, torch.float32, device="cuda")
    *batch, seq_len, embed_dim = shape
    grad_outputs = [torch.randn(*batch, num_heads, seq_len, embed_dim // num_heads, device="cuda")
                    for _ in range(num_proj)]
    # The float64 reference runs on the float32 inputs themselves, before rounding to dtype.
    assert_low_precision_within_2x(
        lambda *a: tk.qkv_projection(*a, num_heads=num_heads, backend=backend), lambda *a: reference_qkv(*a, num_heads),
        [t.to(dtype) for t in inputs], grad_outputs, exact_dtype=torch.float64, exact_inputs=inputs,
    )


@requires_cuda
@pytest.mark.parametrize("api", ["legacy", "new"])
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_cuda_float32_follows_allow_tf32(api, allow_tf32):
    """float32 outputs within twice the error of cuBLAS's under the same setting."""
    inputs = _inputs((4, 100, 256), 3, device="cuda")
    with tf32_setting("matmul", allow_tf32, api):
        assert_low_precision_within_2x(
            lambda *a: tk.qkv_projection(*a, num_heads=4, backend="triton"), lambda *a: reference_qkv(*a, 4),
            inputs, exact_dtype=torch.float64, backward=False,
        )


@requires_cuda
def test_cuda_autocast_runs_in_float16():
    x, weight, b = _inputs((2, 64, 128), 3, device="cuda")
    with torch.autocast("cuda"):
        outputs = tk.qkv_projection(x, weight, b, num_heads=4)
        expected = _chunk_path(x, weight, b, 4)
    assert all(o.dtype == torch.float16 for o in outputs)
    assert_close_to_reference(outputs, expected, rtol=2e-3, atol=2e-3, same_dtype=True)
    sum(o.float().sum() for o in outputs).backward()
    assert weight.grad.dtype == torch.float32


@requires_cuda
def test_cuda_gradients_of_expanded_and_unused_outputs():
    x, weight, b = _inputs((2, 300, 192), 3, device="cuda")
    q, k, v = tk.qkv_projection(x, weight, b, num_heads=3, backend="triton")
    grads = torch.autograd.grad(q.sum() + (k * k).sum(), (x, weight, b))
    rq, rk, _ = reference_qkv(x, weight, b, 3)
    expected = torch.autograd.grad(rq.sum() + (rk * rk).sum(), (x, weight, b))
    assert_close_to_reference(grads, expected, "grad", rtol=1e-3, atol=1e-3, same_dtype=True)


def test_single_projection_gradient_of_any_layout():
    """n = 1 with a gradient laid out [*batch, H, Dh, L] (a transposed view): the eager backward
    packs it without assuming the stacked gradient is contiguous."""
    x, weight, _ = _inputs((3, 5, 8), 1)
    (q,) = tk.qkv_projection(x, weight, None, num_heads=2, backend="eager")
    grad = torch.randn(3, 2, 4, 5, dtype=x.dtype).transpose(-1, -2)
    grads = torch.autograd.grad(q, (x, weight), grad)
    expected = torch.autograd.grad(reference_qkv(x, weight, None, 2)[0], (x, weight), grad)
    for actual, reference in zip(grads, expected):
        torch.testing.assert_close(actual, reference)
