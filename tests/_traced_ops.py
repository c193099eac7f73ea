"""Trace the registered ops on the triton backend as torch.compile's AOTAutograd does (under
``FunctionalTensorMode``, with fake tensors) on a stand-in H100, and print, as JSON, what each
traced graph calls: per case, the ops of the graph in order (a Triton launch as
``triton:<kernel name>``).

Run in its own process by ``test_triton_tracing.py``: only compiled Triton kernels can be traced
(the test session interprets them, ``TRITON_INTERPRET=1``), and the stand-in GPU (its capability
and SM count patched in, which the backends cache) must not leak into other tests.  On a machine
without CUDA, the fake tensors say ``cuda`` while torch has no CUDA at all: tracing needs no GPU.
(Which tensors a kernel writes torch finds by compiling it for the present GPU; without one it
takes every tensor argument as written, which is correct, and warns at each launch.)
"""

import json
import os
from unittest import mock

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch._subclasses.functional_tensor import dispatch_functionalize  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from transformer_kernels import _backend  # noqa: E402
from transformer_kernels.ops.attention import (  # noqa: E402
    AttentionArgs, Causal, attention_backward, attention_forward,
)
from transformer_kernels.ops.glu_conv import GluConvArgs, glu_conv1d_backward, glu_conv1d_forward  # noqa: E402
from transformer_kernels.ops.qkv import QkvProjectionArgs, qkv_projection_backward, qkv_projection_forward  # noqa: E402


class _H100Properties:
    multi_processor_count = 132


def _called(graph_module: torch.fx.GraphModule) -> list[str]:
    """The graph's calls in order: ``triton:<kernel>`` for a Triton launch, else the op's name."""
    called = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target is getattr:
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name.startswith("triton_kernel_wrapper"):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            while not hasattr(kernel, "__name__"):  # an autotuner wrapping the launch options
                kernel = kernel.fn
            called.append(f"triton:{kernel.__name__}")
        elif "getitem" not in name:
            called.append(str(node.target))
    return called


def _traced(function, *inputs) -> list[str]:
    return _called(make_fx(dispatch_functionalize(function), tracing_mode="fake")(*inputs))


def _attention(query, key, value, grad_out, args: AttentionArgs, backend: str = "triton"):
    """Attention forward, then backward: grad-mode calls of the registered ops, as autograd makes them
    (the float mask's gradient too, where there is one)."""
    out, lse = attention_forward(query, key, value, args, True, backend)
    mask_needs_grad = args.attn_mask is not None and args.attn_mask.is_floating_point()
    return attention_backward(grad_out, query, key, value, out, lse, args, mask_needs_grad, backend)


def cases(fake: FakeTensorMode) -> dict:
    with fake:
        def empty(*shape):
            return torch.empty(shape, device="cuda", dtype=torch.float16)

        # Keys long enough for key bounds (past SHORT_MAX_LENGTH), and short ones, which go without.
        query, key = empty(2, 4, 16, 64), empty(2, 2, 72, 64)
        value, grad_out = empty(2, 2, 72, 64), empty(2, 4, 16, 64)
        padding = torch.zeros(2, 72, dtype=torch.bool, device="cuda")
        short_key, short_value = empty(2, 2, 24, 64), empty(2, 2, 24, 64)
        short_padding = torch.zeros(2, 24, dtype=torch.bool, device="cuda")
        scores_bias = empty(2, 1, 16, 72)  # one float mask for every head
        seed = torch.zeros(2, dtype=torch.int64, device="cuda")
        x, weight, bias = empty(2, 16, 64), empty(192, 64), empty(192)
        glu_x, glu_weight, glu_bias = empty(2, 32, 20), empty(64, 32, 3), empty(64)
        glu_window = empty(8, 32, 3)  # a decoding step's: the last k positions of 8 sequences

    def attention(query, key, value, grad_out, padding, seed):
        args = AttentionArgs(padding, None, Causal.TOP_LEFT, 0.125, 0.1, seed)
        return _attention(query, key, value, grad_out, args)

    def attention_float_mask(query, key, value, grad_out, scores_bias):
        args = AttentionArgs(None, scores_bias, Causal.BOTTOM_RIGHT, 0.125, 0.0, None)
        return _attention(query, key, value, grad_out, args)

    def attention_on_eager(query, key, value, grad_out, padding):
        args = AttentionArgs(padding, None, Causal.NONE, 0.125, 0.0, None)
        return _attention(query, key, value, grad_out, args, backend="eager")

    def qkv(x, weight, bias):
        args = QkvProjectionArgs(4)
        outputs = qkv_projection_forward(x, weight, bias, args, "triton")
        return qkv_projection_backward(outputs, x, weight, args, True, True, True, True, "triton")

    def glu(x, weight, bias):  # "same" padding, x its own residual
        args = GluConvArgs(1, 1, 0.0, 0.5)
        out, saved = glu_conv1d_forward(x, weight, bias, x, args, "triton")
        return glu_conv1d_backward(out, x, weight, bias, saved, args, True, True, True, "triton")

    def glu_causal(x, weight):  # a decoder's layer: causal padding, no bias, no residual
        args = GluConvArgs(2, 0, 0.0, 1.0)
        out, saved = glu_conv1d_forward(x, weight, None, None, args, "triton")
        return glu_conv1d_backward(out, x, weight, None, saved, args, True, True, False, "triton")

    def glu_step(window, weight, bias):  # a decoding step, forward alone (inference)
        return glu_conv1d_forward(window, weight, bias, None, GluConvArgs(0, 0, 0.0, 1.0), "triton")

    traced = {
        "attention": _traced(attention, query, key, value, grad_out, padding, seed),
        "attention_short_keys": _traced(attention, query, short_key, short_value, grad_out, short_padding, seed),
        "attention_float_mask": _traced(attention_float_mask, query, key, value, grad_out, scores_bias),
        "attention_on_eager": _traced(attention_on_eager, query, key, value, grad_out, padding),
        "qkv": _traced(qkv, x, weight, bias),
        "glu": _traced(glu, glu_x, glu_weight, glu_bias),
        "glu_causal": _traced(glu_causal, glu_x, glu_weight),
        "glu_step": _traced(glu_step, glu_window, glu_weight, glu_bias),
    }
    with torch._functorch.config.patch(decompose_custom_triton_ops=False):  # as torch.export traces
        traced["qkv_exported"] = _traced(qkv, x, weight, bias)
    return traced


def main() -> None:
    if torch.cuda.is_available():
        # On a GPU machine: CUDA initialized before the stand-in's properties are patched in (its
        # lazy initialization reads them, and a fake CUDA tensor initializes it).
        torch.cuda.init()
    with mock.patch.object(_backend, "_cuda_capability", lambda index: (9, 0)), \
            mock.patch.object(torch.cuda, "get_device_properties", lambda device: _H100Properties()):
        print(json.dumps(cases(FakeTensorMode())))


if __name__ == "__main__":
    main()
