"""torch.compile traces into the triton backend's kernels (issue 9): under AOTAutograd's
functionalization each registered op decomposes into its backend's launches, recorded with
``torch.library.wrap_triton``, so Inductor compiles them into its own graph (``ops/_library.py``).

Here (``_traced_ops.py``, in a process that compiles rather than interprets the kernels, on fake
CUDA tensors: no GPU needed): what the traced graphs of attention, the QKV projection and the GLU
convolution call, forward and backward; that the other backends' ops and torch.export's stay whole.
On a GPU: a compiled layer, forward and gradients, against the same layer run eagerly, with every
kernel in Inductor's generated code; and with dynamic shapes, which keep the ops whole.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import transformer_kernels as tk

from _helpers import json_of_compiled_script, skip_unless_backend
from conftest import CUDA

pytest.importorskip("triton")

# What a traced call may do besides its launches: allocate, and lay out the GLU weight for them.
_ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
                "aten.new_empty.default", "aten.new_empty_strided.default", "aten.new_zeros.default"}


@pytest.fixture(scope="module")
def traced() -> dict:
    return json_of_compiled_script("_traced_ops.py", timeout=600)


@pytest.mark.parametrize("op, kernels", [
    ("attention", ["_attention_key_bounds_kernel", "_attention_forward_kernel", "_attention_key_bounds_kernel",
                   "_attention_delta_kernel", "_attention_grad_key_value_kernel", "_attention_grad_query_kernel"]),
    ("attention_short_keys", ["_attention_forward_kernel", "_attention_delta_kernel",
                              "_attention_grad_key_value_kernel", "_attention_grad_query_kernel"]),
    ("attention_float_mask", ["_attention_forward_kernel", "_attention_delta_kernel",
                              "_attention_grad_key_value_kernel", "_attention_grad_query_kernel"]),
    ("qkv", ["_qkv_forward_kernel", "_qkv_grad_input_kernel", "_qkv_grad_weight_kernel"]),
    ("glu", ["_glu_conv_forward_kernel", "_glu_conv_forward_kernel", "_glu_conv_grad_input_kernel",
             "_glu_conv_grad_weight_kernel", "_split_sum_kernel"]),
    ("glu_causal", ["_glu_conv_forward_kernel", "_glu_conv_forward_kernel", "_glu_conv_grad_input_kernel",
                    "_glu_conv_grad_weight_kernel", "_split_sum_kernel"]),
    ("glu_step", ["_glu_step_kernel"]),
])
def test_traced_triton_ops_are_their_launches(traced, op, kernels):
    called = traced[op]
    assert [name.removeprefix("triton:") for name in called if name.startswith("triton:")] == kernels
    others = {name for name in called if not name.startswith("triton:")}
    # The whole-sequence GLU kernels read the weight repacked; a decoding step's reads it as it is.
    packs = op.startswith("glu") and op != "glu_step"
    expected = _ALLOCATIONS | ({"aten.permute.default", "aten.clone.default"} if packs else set())
    assert others <= expected, f"{op}'s traced graph computes outside its kernels: {sorted(others - expected)}"


def test_other_backends_stay_whole(traced):
    assert traced["attention_on_eager"] == [
        "transformer_kernels.attention_forward.default", "transformer_kernels.attention_backward.default"
    ]


def test_export_keeps_the_ops(traced):
    assert traced["qkv_exported"] == [
        "transformer_kernels.qkv_projection_forward.default", "transformer_kernels.qkv_projection_backward.default"
    ]


@pytest.fixture(scope="module")
def inductor_sources() -> dict:
    return json_of_compiled_script("_inductor_sources.py", timeout=600)


def test_inductor_rebuilds_every_kernel(inductor_sources, traced):
    launched = {name.removeprefix("triton:") for calls in traced.values()
                for name in calls if name.startswith("triton:")}
    assert launched and launched <= set(inductor_sources)
    failed = {name: facts for name, facts in inductor_sources.items() if not facts["compiles"]}
    assert failed == {}
    assert [name for name, facts in inductor_sources.items() if not facts["same_ir"]] == []


# ----------------------------------------------------------------------------
# GPU: compiled against eager
# ----------------------------------------------------------------------------


def _layer_loss(x, qkv_weight, qkv_bias, conv_weight, conv_bias, padding):
    """The seeds' layer on the fused ops: QKV projection, attention with key padding, a GLU
    convolution with a residual."""
    batch, length, embed = x.shape
    query, key, value = tk.qkv_projection(x, qkv_weight, qkv_bias, num_heads=4, backend="triton")
    attended = tk.scaled_dot_product_attention(query, key, value, key_padding_mask=padding, backend="triton")
    h = attended.transpose(1, 2).reshape(batch, length, embed).transpose(1, 2)
    y = tk.glu_conv1d(h, conv_weight, conv_bias, residual=h, residual_scale=math.sqrt(0.5), backend="triton")
    return y.float().square().mean()


def _layer_inputs(batch: int, length: int, embed: int = 64, device: str = "cuda", dtype=torch.float16):
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, device=device, generator=generator) * scale).to(dtype).requires_grad_()

    x = randn(batch, length, embed)
    weights = [randn(3 * embed, embed, scale=embed**-0.5), randn(3 * embed, scale=0.1),
               randn(2 * embed, embed, 3, scale=(3 * embed) ** -0.5), randn(2 * embed, scale=0.1)]
    lengths = torch.randint(length // 2, length + 1, (batch,), device=device, generator=generator)
    padding = torch.arange(length, device=device) >= lengths[:, None]
    return [x, *weights], padding


def _loss_and_grads(function, inputs, padding):
    loss = function(*inputs, padding)
    return [loss, *torch.autograd.grad(loss, inputs)]


def _assert_close(actual, expected):
    for name, got, want in zip(("loss", "dx", "d qkv weight", "d qkv bias", "d conv weight", "d conv bias"),
                               actual, expected):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(CUDA, reason="the GPU tests below compile the layer on the GPU")
@torch._inductor.config.patch(fx_graph_cache=False)
@torch._functorch.config.patch(enable_autograd_cache=False)
def test_a_fullgraph_compile_of_the_layer_on_the_triton_backend():
    """Dynamo traces the public functions' checks and backend choice on the triton backend whole
    (its triton version check is a constant to it: torch 2.11's Dynamo could not trace importlib's
    find_spec there), here on the interpreter's CPU tensors, where the ops stay whole."""
    torch._dynamo.reset()
    compiled = torch.compile(_layer_loss, fullgraph=True)
    inputs, padding = _layer_inputs(2, 8, embed=32, device="cpu", dtype=torch.float32)
    _assert_close(_loss_and_grads(compiled, inputs, padding), _loss_and_grads(_layer_loss, inputs, padding))


# The launches a compiled step of the layer runs, forward and backward: every kernel's source must be
# in Inductor's generated code, each launched from there.  (At the seeds' lengths the attention takes
# no key bounds: the "attention" case above traces their kernel.)
_LAYER_KERNELS = ("_qkv_forward_kernel", "_attention_forward_kernel",
                  "_glu_conv_forward_kernel", "_glu_conv_grad_input_kernel", "_glu_conv_grad_weight_kernel",
                  "_attention_delta_kernel", "_attention_grad_key_value_kernel", "_attention_grad_query_kernel",
                  "_qkv_grad_input_kernel", "_qkv_grad_weight_kernel")


def _compiling_on_a_gpu(test):
    """A test that compiles the layer on a GPU, from no cached graph (an entry made by another test
    would stand in for what this one compiles)."""
    @functools.wraps(test)
    def fresh(*args, **kwargs):
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            return test(*args, **kwargs)

    return pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(skip_unless_backend("triton")(fresh))


@_compiling_on_a_gpu
def test_inductor_compiles_the_layers_kernels_into_its_graph():
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(_layer_loss, fullgraph=True)
    inputs, padding = _layer_inputs(4, 24)
    expected = _loss_and_grads(_layer_loss, inputs, padding)
    actual, sources = run_and_get_code(_loss_and_grads, compiled, inputs, padding)
    _assert_close(actual, expected)
    code = "\n".join(sources)
    assert [kernel for kernel in _LAYER_KERNELS if f"def {kernel}" not in code] == []
    assert "torch.ops.transformer_kernels." not in code


@_compiling_on_a_gpu
def test_dynamic_shapes_keep_the_ops_whole():
    compiled = torch.compile(_layer_loss, fullgraph=True, dynamic=True)
    for batch, length in ((4, 24), (6, 32)):
        inputs, padding = _layer_inputs(batch, length)
        _assert_close(_loss_and_grads(compiled, inputs, padding), _loss_and_grads(_layer_loss, inputs, padding))


@_compiling_on_a_gpu
def test_inductor_compiles_the_in_place_decoding_step():
    """glu_conv1d_update mutates its ring: traced into its kernel, the mutation is functionalized
    and written back, so compiled decoding updates the ring as eager decoding does."""
    weight = torch.randn(16, 8, 3, device="cuda") / 4
    x = torch.randn(2, 8, 5, device="cuda")

    def step(x_t, ring, position):
        return tk.glu_conv1d_update(x_t, ring, weight, position=position, backend="triton")

    compiled = torch.compile(step, fullgraph=True)
    rings = [torch.zeros(2, 8, 3, device="cuda") for _ in range(2)]
    with torch.no_grad():
        for t in range(5):
            position = torch.tensor(t, device="cuda")
            _assert_close(compiled(x[:, :, t], rings[0], position), step(x[:, :, t], rings[1], position))
    _assert_close(rings[0], rings[1])
