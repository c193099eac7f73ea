"""The cuda backend (the compiled extension): which calls it serves, auto's choice per architecture,
agreement with Triton and eager on identical inputs, the decoding step, and the raw ops' errors.

What needs no GPU runs everywhere: the reasons the backend gives for calls it does not serve, and
its attention Python layer over a host stand-in of the raw ops.  The rest needs a CUDA device and
the built extension; the op suites (test_qkv.py, test_glu_conv.py) run
the cuda backend too, through ``backend_params``.
"""

import pytest
import torch
from _helpers import assert_close_to_reference, backend_param

import transformer_kernels as tk
import transformer_kernels.backends.cuda as cuda_backend
from transformer_kernels.backends.cuda import AUTO_PREFERRED_MAJORS, MEASURED_FASTER, _auto_reason
from transformer_kernels.backends.cuda import _common as cuda_common
from transformer_kernels.backends.cuda import attention as cuda_attention
from transformer_kernels.backends.cuda import glu_conv as cuda_glu_conv
from transformer_kernels.backends.cuda import glu_conv_update as cuda_glu_conv_update
from transformer_kernels.backends.eager import glu_conv_update as eager_glu_conv_update
from transformer_kernels.backends.cuda import qkv as cuda_qkv
from transformer_kernels.ops.attention import KEY_BOUNDS_MIN_LENGTH, AttentionArgs, Causal, key_padding_bounds
from transformer_kernels.ops.glu_conv import GluConvArgs, empty_output
from transformer_kernels.ops.glu_conv_update import GluUpdateArgs
from transformer_kernels.ops.qkv import QkvProjectionArgs
from transformer_kernels.reference.glu_conv import glu_conv1d as reference_glu_conv1d


def _cuda_case(*values, op, id=None):
    return backend_param("cuda", *values, op=op, id=id)


# --------------------------------------------------------------------------- what it serves (no GPU needed)


def test_qkv_reasons():
    x = torch.empty(2, 5, 64, dtype=torch.float16)
    weight = torch.empty(192, 64, dtype=torch.float16)
    assert cuda_qkv.unsupported_reason(x, weight, None, QkvProjectionArgs(8)) is None
    assert "float16 and bfloat16, got torch.float32" in cuda_qkv.unsupported_reason(
        x.float(), weight.float(), None, QkvProjectionArgs(8))
    assert "multiples of 8, got E = 64, head dim 4" in cuda_qkv.unsupported_reason(
        x, weight, None, QkvProjectionArgs(16))
    # Past the kernels' 32-bit offsets the call is another backend's (auto moves on), not a raw op's error.
    huge = torch.empty(32, 8192, 8192, dtype=torch.float16, device="meta")
    assert "fewer than 2**31 elements per tensor, got 2147483648 in x" in cuda_qkv.unsupported_reason(
        huge, torch.empty(3 * 8192, 8192, dtype=torch.float16, device="meta"), None, QkvProjectionArgs(64))


def test_glu_conv_reasons():
    half = dict(dtype=torch.bfloat16)
    weight = torch.empty(16, 24, 3, **half)
    same = GluConvArgs(1, 1, 0.0, 1.0)
    assert cuda_glu_conv.unsupported_reason(torch.empty(2, 24, 9, **half), weight, None, None, same) is None
    assert "float16 and bfloat16" in cuda_glu_conv.unsupported_reason(
        torch.empty(2, 24, 9), weight.float(), None, None, same)
    odd = torch.empty(16, 12, 3, **half)
    assert "C_in a multiple of 8 and C a multiple of 4, got C_in = 12, C = 8" in cuda_glu_conv.unsupported_reason(
        torch.empty(2, 12, 9, **half), odd, None, None, same)
    # The pre-activation's gradient [B * L_out, 2C] is the largest tensor the kernels address.
    long_x, wide = torch.empty(64, 16, 4096, **half, device="meta"), torch.empty(8192, 16, 3, **half, device="meta")
    assert "got 2147483648 in preactivation_gradient" in cuda_glu_conv.unsupported_reason(
        long_x, wide, None, None, same)
    # A decoding step's window (k positions, no padding) goes to the step kernel when C_in * k % 8 == 0.
    step = GluConvArgs(0, 0, 0.0, 1.0)
    assert cuda_glu_conv._uses_step_kernel(torch.empty(2, 12, 2, **half), torch.empty(16, 12, 2, **half), step)
    assert not cuda_glu_conv._uses_step_kernel(torch.empty(2, 12, 3, **half), odd, step)
    assert cuda_glu_conv.empty_saved(torch.empty(2, 24, 3, **half), weight, step).shape == (2, 1, 16)
    assert cuda_glu_conv.empty_saved(torch.empty(2, 24, 9, **half), weight, same).shape == (16, 72)


class _HostStepOps:
    """A host stand-in for the raw decoding-step op, to the contract ``csrc/bindings.cpp`` states:
    a contiguous window in, a contiguous ``[B, C, 1]`` output and the ``[B, 1, 2C]`` pre-activation out."""

    @staticmethod
    def glu_conv1d_step(window, weight, bias, residual, residual_scale):
        assert window.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous())
        assert window.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0, "the 16-byte chunks step_problem checks"
        z = torch.nn.functional.conv1d(window, weight, bias)  # [B, 2C, 1]
        out = torch.nn.functional.glu(z, 1)
        if residual is not None:
            out = out + residual
        return (out * residual_scale).contiguous(), z.transpose(1, 2).contiguous()


@pytest.mark.parametrize("channel_last", [False, True], ids=["contiguous", "channel_last"])
def test_decoding_step_python_layer_returns_the_layout_the_fake_states(monkeypatch, channel_last):
    """The step's output in the layout of ``empty_output`` of its window (what the fake kernel states),
    the values untouched."""
    monkeypatch.setattr(cuda_glu_conv, "raw_ops", _HostStepOps)
    generator = torch.Generator().manual_seed(0)
    batch, channels_in, channels, kernel_size = 3, 8, 4, 3
    rows = torch.randn(batch, kernel_size, channels_in, generator=generator)
    window = rows.transpose(1, 2) if channel_last else rows.transpose(1, 2).contiguous()
    weight = torch.randn(2 * channels, channels_in, kernel_size, generator=generator)
    bias, residual = torch.randn(2 * channels, generator=generator), torch.randn(batch, channels, 1, generator=generator)
    args = GluConvArgs(0, 0, 0.0, 0.5)
    assert cuda_glu_conv._uses_step_kernel(window, weight, args)
    out, z = cuda_glu_conv.forward(window, weight, bias, residual, args)
    expected = (torch.nn.functional.glu(torch.nn.functional.conv1d(window, weight, bias), 1) + residual) * 0.5
    assert out.stride() == empty_output(window, channels, 1).stride()
    torch.testing.assert_close(out, expected)
    assert z.shape == cuda_glu_conv.empty_saved(window, weight, args).shape


@pytest.mark.parametrize("misaligned", ["weight", "x"])
def test_decoding_step_hands_the_kernel_aligned_operands(monkeypatch, misaligned):
    """A contiguous view that starts off a 16-byte boundary (a weight unflattened from a flat buffer,
    a window sliced along channels) is contiguous already: the kernel gets an aligned copy."""
    monkeypatch.setattr(cuda_glu_conv, "raw_ops", _HostStepOps)
    generator = torch.Generator().manual_seed(0)
    channels_in, channels, kernel_size = 8, 4, 1 if misaligned == "x" else 3
    weight = torch.randn(2 * channels * channels_in * kernel_size + 3, generator=generator)[3:]
    weight = weight.view(2 * channels, channels_in, kernel_size)
    x = torch.randn(1, channels_in + 3, kernel_size, generator=generator)[:, 3:]
    if misaligned == "weight":
        x = x.contiguous()
    else:
        weight = weight.contiguous()
    assert x.is_contiguous() and weight.is_contiguous()
    assert (x if misaligned == "x" else weight).data_ptr() % 16 != 0
    args = GluConvArgs(0, 0, 0.0, 1.0)
    assert cuda_glu_conv._uses_step_kernel(x, weight, args)
    out, _ = cuda_glu_conv.forward(x, weight, None, None, args)
    torch.testing.assert_close(out, torch.nn.functional.glu(torch.nn.functional.conv1d(x, weight), 1))


class _HostUpdateOps:
    """A host stand-in for the raw in-place step, to the contract ``csrc/bindings.cpp`` and
    ``glu_conv.h`` state: a contiguous aligned ring written in place, contiguous x_t, an int64
    position of unit stride, an aligned weight, residual ``[B, C, 1]``."""

    @staticmethod
    def glu_conv1d_update(x_t, conv_state, position, weight, bias, residual, residual_scale):
        assert conv_state.is_contiguous() and conv_state.data_ptr() % 16 == 0 and x_t.is_contiguous()
        assert position.dtype == torch.int64 and (position.dim() == 0 or position.stride(0) == 1)
        assert weight.is_contiguous() and weight.data_ptr() % 16 == 0 and residual.shape[2:] == (1,)
        return eager_glu_conv_update.forward(x_t, conv_state, position, weight, bias, residual[:, :, 0],
                                             GluUpdateArgs(residual_scale))


def test_in_place_step_python_layer_hands_the_kernel_what_it_reads(monkeypatch):
    """Strided x_t, int32 positions of stride 2 and a residual [B, C] reach the raw op as it takes
    them, and the ring is the caller's own, updated in place; a ring the kernel cannot update in
    place is refused, not copied."""
    monkeypatch.setattr(cuda_glu_conv_update, "raw_ops", _HostUpdateOps)
    half = dict(dtype=torch.float16)
    x_t = torch.randn(8, 3, **half).t()
    ring, weight = torch.randn(3, 8, 3, **half), torch.randn(8, 8, 3, **half)
    position = torch.tensor([4, 0, 1, 0, 7, 0], dtype=torch.int32)[::2]
    residual, args = torch.randn(3, 4, **half), GluUpdateArgs(0.5)
    assert cuda_glu_conv_update.unsupported_reason(x_t, ring, position, weight, None, residual, args) is None
    expected_ring = ring.clone()
    expected = eager_glu_conv_update.forward(x_t, expected_ring, position, weight, None, residual, args)
    out = cuda_glu_conv_update.forward(x_t, ring, position, weight, None, residual, args)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(ring, expected_ring, rtol=0, atol=0)
    strided_ring = torch.randn(3, 3, 8, **half).transpose(1, 2)
    assert "contiguous conv_state" in cuda_glu_conv_update.unsupported_reason(
        x_t, strided_ring, position, weight, None, residual, args)
    assert "C_in * k a multiple of 8, got 15" in cuda_glu_conv_update.unsupported_reason(
        x_t[:5], torch.randn(3, 5, 3, **half), position, torch.randn(8, 5, 3, **half), None, residual, args)
    assert "float16 and bfloat16" in cuda_glu_conv_update.unsupported_reason(
        x_t.float(), ring.float(), position, weight.float(), None, residual.float(), args)


def test_in_chunks_copies_a_contiguous_view_that_starts_off_16_bytes():
    """What the QKV and attention launchers hand the kernels: a contiguous view 4 elements into a
    float16 buffer is contiguous already (``.contiguous()`` returned it as it is, which the raw ops
    refuse); an aligned chunk-readable view stays itself."""
    buffer = torch.randn(4 + 2 * 9 * 32, dtype=torch.float16)
    misaligned = buffer[4:].view(2, 9, 32)
    assert misaligned.is_contiguous() and misaligned.data_ptr() % 16 != 0
    for contiguous in (False, True):
        copied = cuda_common.in_chunks(misaligned, contiguous=contiguous)
        assert copied.data_ptr() % 16 == 0 and copied.is_contiguous() and torch.equal(copied, misaligned)
    aligned = torch.randn(2, 9, 40, dtype=torch.float16)[:, :, :32]
    assert cuda_common.in_chunks(aligned) is aligned
    assert cuda_common.in_chunks(aligned, contiguous=True) is not aligned


def test_attention_reasons():
    q = torch.empty(2, 4, 9, 64, dtype=torch.float16)
    kv = torch.empty(2, 2, 7, 64, dtype=torch.float16)
    args = AttentionArgs(None, None, Causal.NONE, 0.125, 0.0, None)
    assert cuda_attention.unsupported_reason(q, kv, kv, args) is None
    assert cuda_attention.unsupported_reason(q.requires_grad_(), kv, kv, args) is None
    assert "float16 and bfloat16, got torch.float32" in cuda_attention.unsupported_reason(
        q.float(), kv.float(), kv.float(), args)
    # Head dims up to 256, with gradients too (the float mask's included); past it, none.
    wide = torch.empty(2, 4, 9, 256, dtype=torch.float16, requires_grad=True)
    wide_kv = torch.empty(2, 2, 7, 256, dtype=torch.float16)
    mask = torch.zeros(2, 4, 9, 7, dtype=torch.float16, requires_grad=True)
    masked = AttentionArgs(None, mask, Causal.NONE, 0.125, 0.0, None)
    assert cuda_attention.unsupported_reason(wide, wide_kv, wide_kv, masked) is None
    wider = torch.empty(2, 4, 9, 264, dtype=torch.float16)
    assert "head dims up to 256, got 264" in cuda_attention.unsupported_reason(wider, wider, wider, args)
    many = torch.empty(1, 1, 9, 64, dtype=torch.float16).expand(300, 300, 9, 64)
    assert "B * Hq up to 65535, got 90000" in cuda_attention.unsupported_reason(many, kv, kv, args)
    # auto never picks it for attention (measured slower), whatever the architecture.
    assert "prefers triton for attention" in _auto_reason("attention", "scaled_dot_product_attention",
                                                          torch.device("cuda", 0))


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_auto_takes_the_cuda_backend_per_function_and_architecture(capability, monkeypatch):
    """On sm_80 every op but attention; on sm_90 only the GLU decoding step, which the H200 measured
    faster than Triton's; elsewhere nothing (no measurement)."""
    monkeypatch.setattr(cuda_backend, "cuda_capability", lambda device: capability)
    chosen = {name for op, name in [("qkv", "qkv_projection"), ("glu_conv", "glu_conv1d"),
                                    ("glu_conv", "glu_conv1d_step"), ("attention", "scaled_dot_product_attention")]
              if _auto_reason(op, name, torch.device("cuda", 0)) is None}
    assert chosen == {(8, 0): {"qkv_projection", "glu_conv1d", "glu_conv1d_step"}, (9, 0): {"glu_conv1d_step"},
                      (10, 0): set()}[capability]
    if capability == (10, 0):
        assert "no GPU measurement" in _auto_reason("qkv", "qkv_projection", torch.device("cuda", 0))


class _HostAttentionOps:
    """A host stand-in for the extension's raw attention ops, to the contract ``csrc/bindings.cpp``
    states (shapes, layouts, what each writes), computed in float64.  It checks what the
    backend's Python hands it (the padded head dims, the key bounds against the padding, the
    forward's output for the dO.O pre-pass) and writes the results into the tensors it is given,
    delta included, as the kernels do."""

    def _problem(self, q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale, dropout_seed):
        """``(probs, lse, keys, values)``: keys and values float64, repeated to the query heads."""
        batch, heads_q, lq, head_dim = q.shape
        heads_k, lk, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
        assert head_dim % 8 == 0 and head_dim_v % 8 == 0 and heads_q % heads_k == 0
        assert k.shape == (batch, heads_k, lk, head_dim) and v.shape[:3] == (batch, heads_k, lk)
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "the kernels read 16-byte chunks along the last dim"
        assert dropout_seed is None, "the stand-in draws no dropout keep-mask"
        excluded = torch.zeros(batch, heads_q, lq, lk, dtype=torch.bool)
        if key_padding_mask is not None:
            assert key_padding_mask.is_contiguous() and key_padding_mask.shape == (batch, lk)
            # Bounds only where they pay; without them the kernels test every key's padding.
            assert (key_bounds is not None) == (lk >= KEY_BOUNDS_MIN_LENGTH)
            if key_bounds is not None:
                assert key_bounds.dtype == torch.int32 and key_bounds.shape == (batch, 3)
                assert torch.equal(key_bounds, key_padding_bounds(key_padding_mask))
            excluded |= key_padding_mask[:, None, None, :]
        else:
            assert key_bounds is None
        if causal != Causal.NONE:
            shift = lk - lq if causal == Causal.BOTTOM_RIGHT else 0
            excluded |= torch.ones(lq, lk, dtype=torch.bool).triu(1 + shift)
        keys, values = (t.double().repeat_interleave(heads_q // heads_k, 1) for t in (k, v))
        scores = torch.matmul(q.double(), keys.transpose(-1, -2)) * scale
        if attn_mask is not None:
            assert attn_mask.shape == (batch, heads_q, lq, lk)
            if attn_mask.dtype == torch.bool:
                excluded |= ~attn_mask
            else:
                assert attn_mask.dtype == q.dtype
                scores = scores + attn_mask.double()
        scores = scores.masked_fill(excluded, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        empty = torch.isneginf(lse)
        probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
        return probs, lse.masked_fill(empty, float("inf")), keys, values

    def attention_key_bounds(self, key_padding_mask):
        assert key_padding_mask.dtype == torch.bool and key_padding_mask.dim() == 2 and key_padding_mask.is_contiguous()
        return key_padding_bounds(key_padding_mask)

    def attention_forward(self, q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale, dropout_seed,
                          dropout_threshold, dropout_scale, out, lse):
        probs, row_lse, _, values = self._problem(
            q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale, dropout_seed
        )
        assert out.shape == (*q.shape[:3], v.shape[3]) and out.stride(-1) == 1
        assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == q.shape[:3]
        out.copy_(torch.matmul(probs, values))
        lse.copy_(row_lse)

    def attention_backward(self, grad_out, q, k, v, out, lse, delta, key_padding_mask, key_bounds, attn_mask, causal,
                           scale, dropout_seed, dropout_threshold, dropout_scale, dq, dk, dv, grad_scores):
        probs, row_lse, keys, values = self._problem(
            q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale, dropout_seed
        )
        torch.testing.assert_close(lse.double(), row_lse.float().double(), msg="lse is the forward's")
        batch, heads_q, lq, _ = q.shape
        heads_k, lk = k.shape[1], k.shape[2]
        group = heads_q // heads_k
        d_out = grad_out.double()
        assert out.shape == grad_out.shape == (*q.shape[:3], v.shape[3]) and out.stride(-1) == grad_out.stride(-1) == 1
        torch.testing.assert_close(out.double(), torch.matmul(probs, values), atol=2e-2, rtol=2e-2,
                                   msg="out is the forward's (its head dim padded as v's)")
        # The kernels' pre-pass: dO . O from the output they are given.
        assert delta.dtype == torch.float32 and delta.is_contiguous() and delta.shape == q.shape[:3]
        delta.copy_((d_out * out.double()).sum(-1))
        d_probs = torch.matmul(d_out, values.transpose(-1, -2))
        d_scores = probs * (d_probs - delta.double()[..., None])

        def per_kv_head(grad):  # [B, Hq, L, X] summed over each kv head's query heads
            return grad.view(batch, heads_k, group, *grad.shape[2:]).sum(2)

        dq.copy_(torch.matmul(d_scores, keys) * scale)
        dk.copy_(per_kv_head(torch.matmul(d_scores.transpose(-1, -2), q.double())) * scale)
        dv.copy_(per_kv_head(torch.matmul(probs.transpose(-1, -2), d_out)))
        if grad_scores is not None:
            assert grad_scores.dtype == torch.float32 and grad_scores.shape == (batch, heads_q, lq, lk)
            grad_scores.copy_(d_scores)


GLUE_CASES = [
    # query [B, Hq, Lq, E], key heads, Lk, Ev, causal kind, key padding, dense mask kind
    ((2, 4, 9, 16), 2, 11, 16, Causal.NONE, True, None),
    ((2, 2, 7, 12), 2, 7, 20, Causal.TOP_LEFT, False, "bool"),  # head dims padded to 16 and 24
    ((1, 3, 12, 8), 1, 5, 8, Causal.BOTTOM_RIGHT, True, None),  # rows without keys
    ((2, 2, 6, 24), 1, 10, 40, Causal.NONE, False, "float"),  # the float mask's gradient
    ((2, 2, 5, 16), 1, 70, 16, Causal.TOP_LEFT, True, None),  # keys long enough for bounds
]


@pytest.mark.parametrize("q_shape,heads_k,lk,dim_v,causal,padded,mask_kind", GLUE_CASES)
def test_attention_python_layer_on_a_host_stand_in_of_the_raw_ops(
    monkeypatch, q_shape, heads_k, lk, dim_v, causal, padded, mask_kind
):
    """The backend's Python (padding head dims, writing in place or copying out, key bounds, what the
    dO.O pre-pass reads, the float mask's gradient) against the eager backend, the kernels replaced by
    :class:`_HostAttentionOps`: what the GPU agreement tests check, minus the kernels."""
    from transformer_kernels.backends.eager import attention as eager_attention

    monkeypatch.setattr(cuda_attention, "raw_ops", _HostAttentionOps)
    generator = torch.Generator().manual_seed(0)
    batch, heads_q, lq, dim = q_shape
    # A strided query: [B, Lq, Hq, E] memory read as [B, Hq, Lq, E].
    q = torch.randn(batch, lq, heads_q, dim, generator=generator).half().transpose(1, 2)
    k = torch.randn(batch, heads_k, lk, dim, generator=generator).half()
    v = torch.randn(batch, heads_k, lk, dim_v, generator=generator).half()
    padding = None
    if padded:  # a hole, a suffix, and (third row) nothing kept
        keys = torch.arange(lk)
        padding = torch.stack([(keys == 1) | (keys >= lk - 2), keys >= 2])[:batch].contiguous()
    attn_mask = None
    if mask_kind == "bool":
        attn_mask = torch.rand(batch, 1, lq, lk, generator=generator).expand(-1, heads_q, -1, -1) > 0.3
    elif mask_kind == "float":
        attn_mask = torch.randn(batch, heads_q, lq, lk, generator=generator).half()
    args = AttentionArgs(padding, attn_mask, causal, 0.3, 0.0, None)
    grad_out = torch.randn(batch, heads_q, lq, dim_v, generator=generator).half()

    out, lse = cuda_attention.forward(q, k, v, args, True)
    grads = cuda_attention.backward(grad_out, q, k, v, out, lse, args, mask_kind == "float")
    wide = [t.double() for t in (q, k, v, grad_out)]
    wide_mask = attn_mask.double() if mask_kind == "float" else attn_mask
    wide_args = AttentionArgs(padding, wide_mask, causal, 0.3, 0.0, None)
    expected_out, saved = eager_attention.forward(*wide[:3], wide_args, True)
    expected = eager_attention.backward(wide[3], *wide[:3], expected_out, saved, wide_args, mask_kind == "float")
    assert out.shape == expected_out.shape and out.dtype == q.dtype
    assert_close_to_reference([out, *grads[:3]], [expected_out, *expected[:3]], ["out", "dq", "dk", "dv"], tol=4e-3)
    if mask_kind == "float":
        assert_close_to_reference(grads[3], expected[3], "the float mask's gradient", tol=4e-3)


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.parametrize("backend", [_cuda_case(op="qkv", id="cuda")])
def test_auto_prefers_cuda_only_where_measured(backend, monkeypatch):
    from _helpers import ForwardSpy

    spy = ForwardSpy(monkeypatch, ops=["qkv", "glu_conv"], names=["cuda", "triton"])
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.float16)
    weight = torch.randn(384, 128, device="cuda", dtype=torch.float16)
    tk.qkv_projection(x, weight, num_heads=4)
    tk.glu_conv1d_step(x[:, 0], None, torch.randn(256, 128, 3, device="cuda", dtype=torch.float16))
    major = torch.cuda.get_device_capability()[0]
    assert spy.backends == ["cuda" if major in AUTO_PREFERRED_MAJORS or name in MEASURED_FASTER.get(major, ())
                            else "triton" for name in ("qkv_projection", "glu_conv1d_step")]
    tk.qkv_projection(x, weight, num_heads=4, backend="cuda")  # explicit: any architecture
    assert spy.backends[-1] == "cuda"


@pytest.mark.parametrize("backend", [_cuda_case(op="qkv", id="cuda")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape,num_heads,num_proj", [((3, 200, 256), 4, 3), ((1, 130, 96), 3, 2), ((300, 64), 1, 1)])
def test_qkv_agrees_with_triton_and_eager(backend, dtype, shape, num_heads, num_proj):
    embed = shape[-1]
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(num_proj * embed, embed, device="cuda", dtype=dtype) / embed**0.5).requires_grad_()
    bias = torch.randn(num_proj * embed, device="cuda", dtype=dtype, requires_grad=True)
    results = {}
    for name in ("cuda", "triton", "eager"):
        outputs = tk.qkv_projection(x, weight, bias, num_heads=num_heads, backend=name)
        grads = torch.autograd.grad(outputs, (x, weight, bias), [torch.ones_like(o) for o in outputs])
        results[name] = [*outputs, *grads]
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    assert_close_to_reference(results["cuda"], results["triton"], "cuda vs triton", tol=tol, same_dtype=True)
    assert_close_to_reference(results["cuda"], results["eager"], "cuda vs eager", tol=tol, same_dtype=True)


@pytest.mark.parametrize("backend", [_cuda_case(op="glu_conv", id="cuda")])
@pytest.mark.parametrize("padding,channels_last", [("same", False), ("causal", True)])
def test_glu_conv_agrees_with_triton_and_eager(backend, padding, channels_last):
    x = torch.randn(3, 48, 150, device="cuda", dtype=torch.float16)
    if channels_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    weight = (torch.randn(64, 48, 3, device="cuda", dtype=torch.float16) / 12).requires_grad_()
    bias = torch.randn(64, device="cuda", dtype=torch.float16, requires_grad=True)
    residual = torch.randn(3, 32, 150, device="cuda", dtype=torch.float16, requires_grad=True)
    x.requires_grad_()
    results = {}
    for name in ("cuda", "triton", "eager"):
        out = tk.glu_conv1d(x, weight, bias, padding=padding, pad_value=0.5, residual=residual,
                            residual_scale=0.7, backend=name)
        results[name] = [out, *torch.autograd.grad(out, (x, weight, bias, residual), torch.ones_like(out))]
    assert_close_to_reference(results["cuda"], results["triton"], "cuda vs triton", tol=2e-2, same_dtype=True)
    assert_close_to_reference(results["cuda"], results["eager"], "cuda vs eager", tol=2e-2, same_dtype=True)
    assert results["cuda"][0].stride() == results["eager"][0].stride()


@pytest.mark.parametrize("backend", [_cuda_case(op="glu_conv", id="cuda")])
@pytest.mark.parametrize("kernel_size", [2, 4])
def test_decoding_steps_on_cuda_equal_the_causal_convolution(backend, monkeypatch, kernel_size):
    from _helpers import ForwardSpy

    spy = ForwardSpy(monkeypatch, ops=["glu_conv"], names=["cuda"])
    x = torch.randn(5, 32, 12, device="cuda", dtype=torch.float16)
    weight = torch.randn(48, 32, kernel_size, device="cuda", dtype=torch.float16) / 8
    bias = torch.randn(48, device="cuda", dtype=torch.float16)
    residual = torch.randn(5, 24, 12, device="cuda", dtype=torch.float16)
    state, outs = None, []
    for t in range(x.shape[2]):
        out_t, state = tk.glu_conv1d_step(x[:, :, t], state, weight, bias, pad_value=1.0,
                                          residual=residual[:, :, t], residual_scale=0.5, backend="cuda")
        outs.append(out_t)
    expected = reference_glu_conv1d(x.float(), weight.float(), bias.float(), padding="causal", pad_value=1.0,
                                    residual=residual.float(), residual_scale=0.5)
    assert_close_to_reference(torch.stack(outs, dim=2).float(), expected, tol=1e-2)
    assert spy.calls == [("glu_conv", "cuda")] * x.shape[2]


@pytest.mark.parametrize("backend", [_cuda_case(op="qkv", id="cuda")])
def test_opcheck(backend):
    x = torch.randn(2, 9, 32, device="cuda", dtype=torch.float16)
    weight = torch.randn(96, 32, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.transformer_kernels.qkv_projection_forward, (x, weight, None, 4, "cuda"))
    xc = torch.randn(2, 16, 20, device="cuda", dtype=torch.float16)
    weight_c = torch.randn(16, 16, 3, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.transformer_kernels.glu_conv1d_forward,
                          (xc, weight_c, None, None, 1, 1, 0.0, 1.0, False, "cuda"))


@pytest.mark.parametrize("backend", [_cuda_case(op="qkv", id="cuda")])
def test_raw_ops_name_what_is_wrong(backend):
    raw = torch.ops.transformer_kernels_C
    x = torch.randn(2, 9, 32, device="cuda", dtype=torch.float16)
    weight = torch.randn(96, 32, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="qkv_forward: x must be float16 or bfloat16, got Float"):
        raw.qkv_forward(x.float(), weight.float(), None, 4)
    with pytest.raises(RuntimeError, match="qkv_forward: weight must be on cuda:0, got device cpu"):
        raw.qkv_forward(x, weight.cpu(), None, 4)
    with pytest.raises(RuntimeError, match="qkv_forward: x must have unit stride along its last dim"):
        raw.qkv_forward(torch.randn_like(x).transpose(1, 2).contiguous().transpose(1, 2), weight, None, 4)
    with pytest.raises(RuntimeError, match="weight must be \\[n\\*E, E\\]"):
        raw.qkv_forward(x, weight[:, :16], None, 4)



@pytest.mark.parametrize("backend", [_cuda_case(op="attention", id="cuda")])
@pytest.mark.parametrize("lk", [65, 256, 1000, 5000])
def test_key_bounds_kernel_gives_key_padding_bounds(backend, lk):
    """The extension's key bounds kernel against ``key_padding_bounds``: random, suffix, left and
    hole padding, a row of padding only, a row without padding, a kept last key alone; no rows."""
    keys = torch.arange(lk, device="cuda")
    padding = torch.stack([
        torch.rand(lk, device="cuda") > 0.5, keys >= lk // 3, keys < lk // 2, (keys % 7 == 3) | (keys < 5),
        keys >= 0, keys < 0, keys != lk - 1,
    ])
    raw = torch.ops.transformer_kernels_C
    assert torch.equal(raw.attention_key_bounds(padding), key_padding_bounds(padding))
    assert raw.attention_key_bounds(padding[:0]).shape == (0, 3)
    with pytest.raises(RuntimeError, match="attention_key_bounds: key_padding_mask must be a contiguous bool"):
        raw.attention_key_bounds(padding.t())


ATTENTION_CASES = [
    # query [B, Hq, Lq, E], key heads and length, Ev, causal kind, key padding, dense mask kind, dropout_p
    ((2, 4, 200, 64), 4, 200, 64, Causal.TOP_LEFT, True, None, 0.0),
    ((2, 8, 130, 128), 2, 257, 128, Causal.BOTTOM_RIGHT, True, None, 0.0),
    ((2, 4, 300, 128), 1, 100, 128, Causal.BOTTOM_RIGHT, False, None, 0.0),  # rows without keys
    ((1, 4, 1, 96), 4, 333, 96, Causal.NONE, True, None, 0.0),  # decoding
    ((2, 2, 90, 40), 2, 120, 24, Causal.NONE, False, "bool", 0.0),  # padded head dims, E != Ev
    ((2, 4, 100, 256), 4, 140, 256, Causal.NONE, True, "float", 0.0),
    ((2, 4, 160, 192), 2, 160, 192, Causal.TOP_LEFT, False, None, 0.0),
    ((2, 4, 128, 32), 4, 128, 32, Causal.NONE, True, "float", 0.3),  # the Triton backend's keep-mask
    ((2, 4, 150, 64), 2, 170, 64, Causal.TOP_LEFT, True, "float", 0.0),  # is_causal with a mask: both apply
    # Keys short enough to go without bounds (the seeds' batches); a row of padding only.
    ((3, 8, 40, 64), 8, 40, 64, Causal.NONE, True, None, 0.0),
    ((3, 4, 30, 64), 2, 64, 64, Causal.BOTTOM_RIGHT, True, "bool", 0.0),
]


@pytest.mark.parametrize("backend", [_cuda_case(op="attention", id="cuda")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("q_shape,heads_k,lk,dim_v,causal,padded,mask_kind,dropout_p", ATTENTION_CASES)
def test_attention_agrees_with_triton_and_eager(
    backend, dtype, q_shape, heads_k, lk, dim_v, causal, padded, mask_kind, dropout_p
):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    batch, heads_q, lq, dim = q_shape
    # Strided query: a [B, Lq, Hq, E] buffer read as [B, Hq, Lq, E].
    q = torch.randn(batch, lq, heads_q, dim, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, heads_k, lk, dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, heads_k, lk, dim_v, device="cuda", dtype=dtype)
    key_padding_mask = None
    if padded:  # suffix, left padding and holes, padding only
        keys = torch.arange(lk, device="cuda")
        key_padding_mask = torch.stack([keys >= lk * 2 // 3, (keys < lk // 4) | (keys % 5 == 2), keys >= 0])[:batch]
    attn_mask = None
    if mask_kind == "bool":  # broadcast over heads
        attn_mask = torch.rand(batch, 1, lq, lk, device="cuda") > 0.3
    elif mask_kind == "float":  # broadcast over batch; a -inf row
        attn_mask = torch.randn(1, heads_q, lq, lk, device="cuda", dtype=dtype)
        attn_mask[..., 3, :] = float("-inf")
        attn_mask = attn_mask.expand(batch, -1, -1, -1)
    elif causal != Causal.NONE:
        attn_mask = (causal_upper_left if causal == Causal.TOP_LEFT else causal_lower_right)(lq, lk)
    is_causal = mask_kind is not None and causal == Causal.TOP_LEFT
    # Gradients of every input, the float mask's included.
    inputs = [q, k, v] + ([attn_mask] if mask_kind == "float" else [])
    for t in inputs:
        t.requires_grad_()
    grad_out = torch.randn(batch, heads_q, lq, dim_v, device="cuda", dtype=dtype)
    results = {}
    for name in ("cuda", "triton", "eager"):
        torch.manual_seed(1)  # the same (seed, offset) for every backend
        out = tk.scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=heads_k != heads_q,
            key_padding_mask=key_padding_mask, backend=name,
        )
        results[name] = [out, *torch.autograd.grad(out, inputs, grad_out)]
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    assert_close_to_reference(results["cuda"], results["triton"], "cuda vs triton", tol=tol, same_dtype=True)
    assert results["cuda"][0].stride() == results["triton"][0].stride()
    if dropout_p == 0.0:  # eager draws its own keep-mask
        assert_close_to_reference(results["cuda"], results["eager"], "cuda vs eager", tol=tol, same_dtype=True)
