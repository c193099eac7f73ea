"""Backend selection for every public function: the registry, precedence (``backend=`` argument,
then the innermost ``use_backend`` context, then ``TRANSFORMER_KERNELS_BACKEND``, then ``"auto"``),
invalid names, ``"auto"``'s choice, and the reasons an explicitly requested backend gives when it
cannot serve a call.

Which backend ran is read off a spy on each backend's ``forward``; the inputs are small.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable

import pytest
import torch
from _helpers import OPS, ForwardSpy, assert_close_to_reference, backend_params, device_for
from _helpers import skip_unless_backend, working_dtype
from conftest import requires_cuda

import transformer_kernels as tk
from transformer_kernels import BackendUnavailableError, _backend, use_backend
from transformer_kernels._backend import ENV_VAR, backend_module, backend_names
from transformer_kernels.reference import attention as reference_attention
from transformer_kernels.reference import glu_conv1d as reference_glu_conv1d
from transformer_kernels.reference import qkv_projection as reference_qkv


@dataclasses.dataclass(frozen=True)
class PublicFunction:
    op: str  # the registry's op
    inputs: Callable[[torch.dtype, torch.device], tuple]
    call: Callable  # call(*inputs, backend=...) -> output(s)
    reference: Callable  # reference(*inputs) -> the same output(s)


def _attention_inputs(dtype, device):
    return tuple(torch.randn(1, 2, 4, 8, dtype=dtype, device=device) for _ in range(3))


# Shapes every backend serves (the CUDA extension's kernels need channel and head dims in multiples of 8).
def _glu_inputs(dtype, device):
    return torch.randn(2, 8, 5, dtype=dtype, device=device), torch.randn(8, 8, 3, dtype=dtype, device=device) / 4


def _glu_step_inputs(dtype, device):
    return torch.randn(2, 8, dtype=dtype, device=device), torch.randn(8, 8, 3, dtype=dtype, device=device) / 4


def _qkv_inputs(dtype, device):
    x = torch.randn(2, 5, 32, dtype=dtype, device=device)
    return x, torch.randn(96, 32, dtype=dtype, device=device) / 8, torch.randn(96, dtype=dtype, device=device)


FUNCTIONS = {
    "scaled_dot_product_attention": PublicFunction(
        "attention", _attention_inputs, tk.scaled_dot_product_attention,
        lambda q, k, v: reference_attention(q, k, v, masked_value=float("-inf")),
    ),
    "glu_conv1d": PublicFunction("glu_conv", _glu_inputs, tk.glu_conv1d, reference_glu_conv1d),
    "glu_conv1d_step": PublicFunction(
        "glu_conv", _glu_step_inputs,
        lambda x_t, weight, **kwargs: tk.glu_conv1d_step(x_t, None, weight, **kwargs)[0],
        # The first step: a causal convolution over k - 1 padding positions and x_t.
        lambda x_t, weight: reference_glu_conv1d(x_t[:, :, None], weight, padding="causal")[:, :, 0],
    ),
    "glu_conv1d_update": PublicFunction(
        "glu_conv_update", _glu_step_inputs,
        lambda x_t, weight, **kwargs: tk.glu_conv1d_update(
            x_t, x_t.new_zeros(*x_t.shape, weight.shape[2]), weight, position=torch.tensor(0, device=x_t.device),
            **kwargs),
        lambda x_t, weight: reference_glu_conv1d(x_t[:, :, None], weight, padding="causal")[:, :, 0],
    ),
    "qkv_projection": PublicFunction(
        "qkv", _qkv_inputs, lambda *inputs, **kwargs: tk.qkv_projection(*inputs, num_heads=4, **kwargs),
        lambda *inputs: reference_qkv(*inputs, 4),
    ),
}


@pytest.fixture(params=list(FUNCTIONS))
def public(request):
    """(name, PublicFunction) of every public function."""
    return request.param, FUNCTIONS[request.param]


def _call(function: PublicFunction, backend=None, dtype=torch.float32, device="cpu"):
    kwargs = {} if backend is None else {"backend": backend}
    return function.call(*function.inputs(dtype, torch.device(device)), **kwargs)


@pytest.fixture
def forward_calls(monkeypatch):
    """A ForwardSpy on every op of every backend that can run here."""
    return ForwardSpy(monkeypatch)


@pytest.fixture(autouse=True)
def _no_environment_variable(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


# ----------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------


def test_backend_names_in_auto_order():
    assert backend_names() == ("auto", "cuda", "triton", "eager")


@pytest.mark.parametrize("op, backend", [
    pytest.param(op, *param.values, marks=param.marks, id=f"{op}-{param.id}")
    for op in OPS for param in backend_params(op)
])
def test_backend_modules_provide_forward_backward_and_reason(op, backend):
    module = backend_module(op, backend)
    # glu_conv1d_update is inference only: no backward.
    for name in ("forward", "unsupported_reason") + (() if op == "glu_conv_update" else ("backward",)):
        assert callable(getattr(module, name)), f"{backend} {op} module has no {name}"


def test_cuda_backend_reason_for_cpu_tensors():
    cuda = _backend._registry["cuda"]
    assert cuda.device_reason(torch.device("cpu"), torch.float32) == "the cuda backend needs CUDA tensors, got device cpu"
    assert cuda.auto_device_types == ("cuda",)


@torch._inductor.config.patch(fx_graph_cache=False)
@torch._functorch.config.patch(enable_autograd_cache=False)
def test_torch_compile_traces_every_backends_device_check_for_cuda_tensors():
    """The backend choice of a call on CUDA tensors asks every backend's device check, inside the
    user's torch.compile: each must trace without a graph break (a fullgraph compile of any call
    on a GPU failed where the cuda backend imported its extension, and on torch 2.11 where the
    triton backend looked its version up), and give what it gives eagerly.  Here on CPU tensors,
    asking about a CUDA device."""
    torch._dynamo.reset()
    cuda = torch.device("cuda")

    def reasons_length(x):
        lengths = [len(backend.device_reason(cuda, torch.float16) or "") for backend in _backend._registry.values()]
        return x + sum(lengths)

    expected = sum(len(backend.device_reason(cuda, torch.float16) or "") for backend in _backend._registry.values())
    assert torch.compile(reasons_length, fullgraph=True)(torch.zeros(1)).item() == expected


@pytest.mark.parametrize("name", ["auto", "eager"])
def test_register_backend_refuses_a_taken_name(monkeypatch, name):
    monkeypatch.setattr(_backend, "_registry", dict(_backend._registry))
    with pytest.raises(ValueError, match=f"backend name {name!r} is taken"):
        _backend.register_backend(name, rank=5, device_reason=lambda device, dtype: None, ops=OPS,
                                  load=lambda op: backend_module(op, "eager"))


def test_auto_passes_over_an_unable_backend_and_logs_why_once(monkeypatch, caplog, forward_calls, public):
    """A registered backend ranked before eager that cannot serve the call: auto moves on to eager
    and logs the reason once at DEBUG level; asked for explicitly, it raises with that reason; a
    backend without the op's kernel says so."""
    name, function = public
    monkeypatch.setattr(_backend, "_registry", dict(_backend._registry))
    monkeypatch.setattr(_backend, "_logged_reasons", set())
    _backend.register_backend("unable", rank=-1, device_reason=lambda device, dtype: "it is a test double",
                              ops=OPS, load=lambda op: backend_module(op, "eager"))
    _backend.register_backend("no_kernels", rank=-2, device_reason=lambda device, dtype: None,
                              ops=(), load=lambda op: backend_module(op, "eager"))
    assert backend_names()[:3] == ("auto", "no_kernels", "unable")
    with caplog.at_level(logging.DEBUG, logger="transformer_kernels"):
        _call(function)
        _call(function, "auto")
    assert forward_calls.backends == ["eager", "eager"]
    skipped = [record.getMessage() for record in caplog.records]
    assert skipped == [
        f"{name}: auto backend skipped 'no_kernels': the no_kernels backend has no {name} kernel",
        f"{name}: auto backend skipped 'unable': it is a test double",
    ]
    with pytest.raises(BackendUnavailableError, match=f"^{name}: backend='unable' cannot serve this call: "
                                                      "it is a test double$"):
        _call(function, "unable")
    with pytest.raises(BackendUnavailableError, match=f"backend='no_kernels'.*has no {name} kernel"):
        _call(function, "no_kernels")


# ----------------------------------------------------------------------------
# Precedence: argument > innermost context > environment variable > auto
# ----------------------------------------------------------------------------


def test_auto_on_cpu_runs_eager_and_matches_the_reference(forward_calls, public):
    _, function = public
    inputs = function.inputs(torch.float32, torch.device("cpu"))
    out = function.call(*inputs)
    function.call(*inputs, backend="auto")
    assert forward_calls.backends == ["eager", "eager"]
    assert_close_to_reference(out, function.reference(*inputs), rtol=1e-5, atol=1e-5, same_dtype=True)


@pytest.mark.parametrize("backend", backend_params())
def test_explicit_backend_runs_it(forward_calls, public, backend):
    _, function = public
    _call(function, backend, dtype=working_dtype(backend), device=device_for(backend))
    assert forward_calls.calls == [(function.op, backend)]


def test_precedence_seen_through_an_unavailable_backend(monkeypatch, forward_calls, public):
    """The cuda backend, unavailable for CPU tensors, shows where a choice came from: a call that
    raises chose it, a call that runs eager did not."""
    name, function = public

    def unavailable():
        return pytest.raises(BackendUnavailableError, match=f"^{name}: backend='cuda'")

    with unavailable():
        _call(function, "cuda")  # the argument
    with unavailable(), use_backend("cuda"):
        _call(function)  # the context
    with use_backend("cuda"):
        _call(function, "eager")  # the argument beats the context
    with use_backend("eager"):
        with unavailable(), use_backend("cuda"):
            _call(function)  # the innermost context beats the outer one
        _call(function)  # and the outer one is back once it exits
        with use_backend("cuda"), use_backend("eager"):
            _call(function)
    _call(function)  # no context left: auto
    assert forward_calls.backends == ["eager"] * 4

    forward_calls.calls.clear()
    monkeypatch.setenv(ENV_VAR, "cuda")
    with unavailable():
        _call(function)  # the environment variable beats auto
    with use_backend("eager"):
        _call(function)  # a context beats the environment variable
    _call(function, "eager")  # and so does the argument
    with unavailable(), use_backend("auto"):
        _call(function, "cuda")
    monkeypatch.setenv(ENV_VAR, "eager")
    _call(function)
    monkeypatch.setenv(ENV_VAR, "")  # empty: as if unset
    _call(function)
    monkeypatch.setenv(ENV_VAR, "auto")
    with use_backend("eager"):
        _call(function)
    assert forward_calls.backends == ["eager"] * 5


def test_context_is_left_when_the_call_raises(forward_calls, public):
    _, function = public
    with pytest.raises(BackendUnavailableError):
        with use_backend("cuda"):
            _call(function)
    _call(function)
    assert forward_calls.backends == ["eager"]


def test_a_context_leaving_removes_its_own_entry(monkeypatch):
    """Blocks of two threads that leave out of order (the first opened leaves first): the other's
    block stays in force, not the one that left."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    first, second = use_backend("triton"), use_backend("eager")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert _backend.requested_backend(None) == "eager"
    second.__exit__(None, None, None)
    assert _backend.requested_backend(None) == "auto"


@skip_unless_backend("triton")
def test_argument_beats_context_beats_environment_variable(forward_calls, monkeypatch, public):
    _, function = public
    device = device_for("triton")
    monkeypatch.setenv(ENV_VAR, "triton")
    _call(function, device=device)  # the environment variable
    with use_backend("eager"):
        _call(function, device=device)  # a context beats the environment variable
        _call(function, "triton", device=device)  # the argument beats the context
        with use_backend("triton"):
            _call(function, device=device)  # the innermost context
        _call(function, device=device)
    assert forward_calls.backends == ["triton", "eager", "triton", "triton", "eager"]


@requires_cuda
@skip_unless_backend("triton")
def test_auto_on_cuda_runs_triton_where_it_can(forward_calls, monkeypatch, public):
    # Where auto prefers no CUDA extension kernel (test_cuda_backend covers where it does).
    from transformer_kernels.backends import cuda as cuda_backend

    monkeypatch.setattr(cuda_backend, "AUTO_PREFERRED_MAJORS", ())
    monkeypatch.setattr(cuda_backend, "MEASURED_FASTER", {})
    _, function = public
    _call(function, dtype=torch.float16, device="cuda")
    _call(function, dtype=torch.float64, device="cuda")  # Triton has no float64: eager
    assert forward_calls.backends == ["triton", "eager"]


# ----------------------------------------------------------------------------
# Invalid names
# ----------------------------------------------------------------------------


def test_invalid_names_raise(monkeypatch, forward_calls, public):
    _, function = public
    names = r"\('auto', 'cuda', 'triton', 'eager'\)"
    with pytest.raises(ValueError, match=f"backend must be one of {names}, got 'fast'"):
        _call(function, "fast")
    with pytest.raises(ValueError, match=rf"use_backend\(name\) must be one of {names}, got 'fast'"):
        with use_backend("fast"):
            pass
    monkeypatch.setenv(ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=f"environment variable {ENV_VAR} must be one of {names}, got 'fastest'"):
        _call(function)
    monkeypatch.delenv(ENV_VAR)
    _call(function)  # the refused context left nothing behind
    assert forward_calls.backends == ["eager"]


# ----------------------------------------------------------------------------
# An explicitly requested backend that cannot serve the call raises with the reason
# ----------------------------------------------------------------------------


def test_cuda_backend_on_cpu_tensors_raises_with_its_reason(public):
    name, function = public
    with pytest.raises(BackendUnavailableError, match=f"^{name}: backend='cuda' cannot serve this call: "
                                                      "the cuda backend needs CUDA tensors, got device cpu$"):
        _call(function, "cuda")


@requires_cuda
def test_cuda_backend_on_cuda_tensors_raises_with_its_reason(public):
    from transformer_kernels.backends.cuda import extension

    name, function = public
    reason = ("the CUDA extension transformer_kernels._C is not built" if extension() is None
              else "the CUDA kernels support float16 and bfloat16, got torch.float32")  # _call's dtype
    with pytest.raises(BackendUnavailableError, match=f"^{name}: backend='cuda' cannot serve this call: {re.escape(reason)}"):
        _call(function, "cuda", device="cuda")


@skip_unless_backend("triton")
def test_triton_backend_raises_with_its_reason(monkeypatch, public):
    name, function = public
    prefix = f"^{name}: backend='triton' cannot serve this call: "
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match=prefix + "the triton backend needs CUDA tensors "
                       r"\(or TRITON_INTERPRET=1 with CPU tensors\), got device cpu"):
        _call(function, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BackendUnavailableError, match=prefix + "the Triton interpreter does not support bfloat16"):
        _call(function, "triton", dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match=prefix + ".*float16, bfloat16 and float32, got torch.float64"):
        _call(function, "triton", dtype=torch.float64)
