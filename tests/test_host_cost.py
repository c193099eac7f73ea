"""What a call costs on the host before its kernels run, counted without a clock.

On a GPU every torch op a call runs besides our kernels is a dispatch (several
microseconds) and often a kernel launch; at the seeds' short sequences the
kernels themselves take a few microseconds, so these ops decide the wall-clock.
They are counted here deterministically: the Triton backend runs on CPU tensors
(the interpreter's device) with every kernel launch stubbed out, under a
``TorchDispatchMode`` that records each aten op of the public call, of autograd
and of the backend's own ``forward``/``backward``.  Budgets (issue 9): a forward
allocates its outputs and does nothing else (at most 3 ops), a backward at most
6.  A budget not met yet is an ``xfail(strict=True)`` naming what is missing, so
meeting it fails the test until the mark goes.
"""

from __future__ import annotations

import pytest
import torch

import transformer_kernels as tk
from transformer_kernels._backend import backend_module

from _helpers import OpRecorder
from conftest import CUDA

pytestmark = pytest.mark.skipif(CUDA, reason="counts the interpreter's CPU calls with launches stubbed")
triton_common = pytest.importorskip("transformer_kernels.backends.triton._common")

FORWARD_BUDGET = 3
BACKWARD_BUDGET = 6


# Not ours: autograd detaches the tensors it saves and the gradients it stores on leaves.
_AUTOGRAD_BOOKKEEPING = {"detach"}


def _recorded(op: torch._ops.OpOverload) -> bool:
    """Every aten op, except our registered ops (what runs inside them is recorded through the
    backend's functions) and autograd's own bookkeeping."""
    return op.namespace != "transformer_kernels" and op.overloadpacket.__name__ not in _AUTOGRAD_BOOKKEEPING


@pytest.fixture
def host_ops(monkeypatch):
    """``count(op, call) -> (forward ops, backward ops)`` of the triton backend, kernels stubbed.
    ``call()`` returns the output(s); the backward pass gets ones for each."""
    monkeypatch.setattr(triton_common.KernelLaunch, "__call__", lambda self: None)

    def count(op: str, call):
        recorder = OpRecorder(_recorded)
        module = backend_module(op, "triton")
        for name in ("forward", "backward"):
            # A registered op runs with the recorder popped, so the backend re-enters it.
            def recorded(*args, _function=getattr(module, name)):
                with recorder:
                    return _function(*args)

            monkeypatch.setattr(module, name, recorded)
        with recorder:
            outputs = call()
        forward_ops, recorder.ops = recorder.ops, []
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grads = [torch.ones_like(output) for output in outputs]
        with recorder:
            torch.autograd.backward(outputs, grads)
        return forward_ops, recorder.ops

    return count


def _attention_inputs(**masks):
    query, key, value = (torch.randn(2, 4, 64, 64, requires_grad=True) for _ in range(3))
    return lambda: tk.scaled_dot_product_attention(query, key, value, backend="triton", **masks)


def _key_padding():
    padding = torch.zeros(2, 64, dtype=torch.bool)
    padding[1, 50:] = True
    return padding


ATTENTION_CASES = {
    "dense": dict(),
    "causal": dict(is_causal=True),
    "key_padding": dict(key_padding_mask=_key_padding()),
    "dropout": dict(dropout_p=0.1),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_forward_only_allocates(host_ops, case):
    forward_ops, _ = host_ops("attention", _attention_inputs(**ATTENTION_CASES[case]))
    assert len(forward_ops) <= FORWARD_BUDGET, forward_ops


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_backward_budget(host_ops, case):
    _, backward_ops = host_ops("attention", _attention_inputs(**ATTENTION_CASES[case]))
    assert len(backward_ops) <= BACKWARD_BUDGET, backward_ops


def _glu_conv_call():
    x = torch.randn(2, 64, 32, requires_grad=True)
    weight = torch.randn(128, 64, 3, requires_grad=True)
    bias = torch.randn(128, requires_grad=True)
    return lambda: tk.glu_conv1d(x, weight, bias, backend="triton")


def _qkv_call():
    x = torch.randn(2, 32, 64, dtype=torch.float16, requires_grad=True)
    weight = torch.randn(192, 64, dtype=torch.float16, requires_grad=True)
    return lambda: tk.qkv_projection(x, weight, num_heads=4, backend="triton")


def test_glu_conv_forward_budget(host_ops):
    forward_ops, _ = host_ops("glu_conv", _glu_conv_call())
    assert len(forward_ops) <= FORWARD_BUDGET, forward_ops


def test_glu_conv_backward_budget(host_ops):
    _, backward_ops = host_ops("glu_conv", _glu_conv_call())
    assert len(backward_ops) <= BACKWARD_BUDGET, backward_ops


def test_qkv_forward_budget(host_ops):
    forward_ops, _ = host_ops("qkv", _qkv_call())
    assert len(forward_ops) <= FORWARD_BUDGET, forward_ops


def test_qkv_backward_budget(host_ops):
    _, backward_ops = host_ops("qkv", _qkv_call())
    assert len(backward_ops) <= BACKWARD_BUDGET, backward_ops


def test_glu_step_runs_its_kernel_on_the_weight_as_it_is(monkeypatch):
    """A decoding step allocates its outputs and concatenates its window, and copies nothing else:
    not the weight, which the whole-sequence kernels read repacked.  (Under a dispatch mode a call
    takes its checked route, whose stand-in for the window is the first allocation.)"""
    monkeypatch.setattr(triton_common.KernelLaunch, "__call__", lambda self: None)
    x_t, state = torch.randn(2, 64, requires_grad=True), torch.randn(2, 64, 2, requires_grad=True)
    weight = torch.randn(128, 64, 3, requires_grad=True)
    recorder = OpRecorder(_recorded, descend=True)
    with recorder:
        tk.glu_conv1d_step(x_t, state, weight, backend="triton")
    views = {"unsqueeze", "squeeze", "slice"}  # x_t as the window's last column, out_t, new_state
    assert [op for op in recorder.ops if op not in views] == ["new_empty", "cat", "new_empty", "new_empty"], (
        recorder.ops
    )


def test_glu_update_only_allocates_its_output(monkeypatch):
    """The in-place decoding step reads its ring and x_t in the kernel: its one allocation is its
    output, and nothing is concatenated or copied (the weight neither)."""
    monkeypatch.setattr(triton_common.KernelLaunch, "__call__", lambda self: None)
    x_t, ring, weight, position = torch.randn(2, 64), torch.randn(2, 64, 3), torch.randn(128, 64, 3), torch.tensor(5)
    recorder = OpRecorder(_recorded, descend=True)
    with recorder:
        tk.glu_conv1d_update(x_t, ring, weight, position=position, backend="triton")
    assert recorder.ops == ["new_empty"], recorder.ops
