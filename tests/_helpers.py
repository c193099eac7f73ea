"""What the test modules share: which backends can run here, comparison against the reference,
the low-precision rule, and spies on the backends' ``forward`` and ``backward``.

* :func:`backend_params` / :func:`backend_param` / :func:`skip_unless_backend`: parametrize a test
  over backends, each skipped (with the reason) where it cannot run in this session, and
  :func:`device_for` gives the device a backend's tests use.
* :func:`outputs_and_grads`, :func:`assert_close_to_reference`, :func:`assert_matches_reference`:
  run a function and its reference on the same inputs and compare outputs and gradients.
* :func:`assert_low_precision_within_2x`: float16/bfloat16 error at most twice PyTorch's own.
* :class:`GradientSpy`: what a backend's ``backward`` returned, to check that gradients nobody
  asked for come back empty.  :class:`ForwardSpy`: which backends' ``forward`` ran.
  :class:`OpRecorder`: the ops that ran, as a dispatch mode sees them (:func:`reads_back` picks
  those that read a value back to the host).
* :func:`small_seed_model`: a small seed model of either family.
* :func:`glu_choices`: the eager GLU convolution's algorithms the same on every CPU: its fixed rule,
  or timings that find one of them fastest.
* :func:`script_output`: what a script prints, run with this session's package;
  :func:`json_of_compiled_script`: the JSON a script of this folder prints, run in a process whose
  Triton kernels are compiled rather than interpreted.

The spies look at what a backend function returns (or its positional arguments as a whole), never
at its parameter list: those signatures change with the kernels.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence, Union

import pytest
import torch
from conftest import CUDA, TRITON_DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_kernels
from transformer_kernels import _backend
from transformer_kernels._backend import backend_module
from transformer_kernels.bench.check import Results, as_list, outputs_and_grads  # noqa: F401  (shared with --check)
from transformer_kernels.ops._call_plans import CallPlans

# The backends the tests run.  A "cuda" case its backend cannot serve is reported as skipped with the
# reason (conftest.py's pytest_runtest_makereport).
BACKENDS = ("eager", "triton", "cuda")
OPS = ("attention", "glu_conv", "glu_conv_update", "qkv")

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


# ----------------------------------------------------------------------------
# Backends: where they run, parametrization
# ----------------------------------------------------------------------------


def backend_skip_reason(name: str, op: Optional[str] = None) -> Optional[str]:
    """Why backend ``name`` cannot run ``op`` (or any op, for None) in this test session, or None.

    Decided from the session, as conftest.py sets it up: Triton runs the GPU when there is one,
    else the interpreter (``TRITON_INTERPRET=1``) on CPU tensors."""
    if name == "triton":
        from transformer_kernels.backends.triton import triton_reason

        reason = triton_reason()  # not installed, or older than the oldest supported
        if reason is not None:
            return reason
        if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
            return "the triton backend needs CUDA or TRITON_INTERPRET=1"
    elif name == "cuda":
        from transformer_kernels.backends.cuda import extension

        if not CUDA:
            return "the cuda backend needs a CUDA device"
        if extension() is None:
            return "the CUDA extension transformer_kernels._C is not built"
    elif name != "eager":
        raise ValueError(f"unknown backend {name!r}")
    if op is not None and op not in _backend._registry[name].ops:
        return f"the {name} backend has no {op} kernel"
    return None


def backend_param(name: str, *values, op: Optional[str] = None, id: Optional[str] = None):
    """``pytest.param(name, *values)``, skipped where backend ``name`` cannot run ``op`` here."""
    reason = backend_skip_reason(name, op)
    marks = [pytest.mark.skip(reason=reason)] if reason is not None else []
    return pytest.param(name, *values, marks=marks, id=id)


def backend_params(op: Optional[str] = None, names: Sequence[str] = BACKENDS) -> list:
    """One ``pytest.param`` per backend for ``@pytest.mark.parametrize("backend", ...)``."""
    return [backend_param(name, op=op, id=name) for name in names]


def skip_unless_backend(name: str, op: Optional[str] = None):
    """A mark for tests of one backend: skipped where it cannot run ``op`` here."""
    reason = backend_skip_reason(name, op)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def device_for(backend: str) -> torch.device:
    """The device a backend's tests put their tensors on."""
    if backend == "triton":
        return TRITON_DEVICE
    return torch.device("cuda" if backend == "cuda" else "cpu")


def precise_dtype(backend: str) -> torch.dtype:
    """The most precise dtype ``backend`` runs: float64 on eager, float32 on Triton, float16 on the
    CUDA extension (which serves the half types only)."""
    return {"eager": torch.float64, "cuda": torch.float16}.get(backend, torch.float32)


def working_dtype(backend: str) -> torch.dtype:
    """The dtype of a test that needs no precision: float32, float16 on the CUDA extension."""
    return torch.float16 if backend == "cuda" else torch.float32


# ----------------------------------------------------------------------------
# Comparison against the reference
# ----------------------------------------------------------------------------


def result_names(num_outputs: int, input_names: Sequence[str]) -> list[str]:
    """Names for :attr:`Results.all`: ``out`` (``out 0``, ``out 1``, ...) then ``grad <input>``."""
    outputs = ["out"] if num_outputs == 1 else [f"out {i}" for i in range(num_outputs)]
    return outputs + [f"grad {name}" for name in input_names]


def assert_close_to_reference(
    actual: Tensors,
    expected: Tensors,
    names: Union[str, Sequence[str], None] = None,
    *,
    tol: Optional[float] = None,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    norm_tol: Optional[float] = None,
    same_dtype: bool = False,
) -> None:
    """Each tensor of ``actual`` against the one at its position in ``expected`` (the reference,
    usually in a higher precision): same shape, finite values, and every criterion given:

    * ``tol``: ``max |a - e| <= tol * (1 + max |e|)``, in float64;
    * ``atol``/``rtol``: ``|a - e| <= atol + rtol * |e|`` elementwise (``torch.testing.assert_close``
      on ``a`` cast to ``e``'s dtype; both default to that dtype's tolerances);
    * ``norm_tol``: ``||a - e|| / ||e|| <= norm_tol``, in float64.

    ``same_dtype``: ``a`` must also have ``e``'s dtype."""
    actual, expected = as_list(actual), as_list(expected)
    if names is None or isinstance(names, str):
        prefix = names or "out"
        names = [prefix] if len(actual) == 1 else [f"{prefix} {i}" for i in range(len(actual))]
    assert len(actual) == len(expected) == len(names), (len(actual), len(expected), len(names))
    elementwise = atol is not None or rtol is not None
    assert tol is not None or norm_tol is not None or elementwise, "no criterion given"
    for name, a, e in zip(names, actual, expected):
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        if same_dtype:
            assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != {e.dtype}"
        if tol is not None:
            error = (a.double() - e.double()).abs().max().item()
            bound = tol * (1.0 + e.abs().max().item())
            assert error <= bound, f"{name}: max abs error {error:.3e} > {bound:.3e}"
        if norm_tol is not None:
            error = ((a.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30)).item()
            assert error <= norm_tol, f"{name}: relative error {error:.2e} > {norm_tol:.0e}"
        if elementwise:
            torch.testing.assert_close(a.to(e.dtype), e, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


def assert_matches_reference(
    fn: Callable,
    reference: Callable,
    inputs: Sequence,
    grad_outputs: Optional[Tensors] = None,
    *,
    input_names: Optional[Sequence[str]] = None,
    reference_dtype: torch.dtype = torch.float64,
    **criteria,
) -> list:
    """``fn`` and ``reference`` on the same ``inputs`` (the reference on copies cast to
    ``reference_dtype``) with the same output gradients: outputs and the gradients of every
    floating-point input compared by :func:`assert_close_to_reference` with ``criteria``.
    Returns ``fn``'s outputs."""
    ours = outputs_and_grads(fn, inputs, grad_outputs)
    expected = outputs_and_grads(reference, inputs, ours.grad_outputs, dtype=reference_dtype)
    if input_names is None:
        input_names = [str(i) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    else:
        input_names = [n for n, t in zip(input_names, inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert_close_to_reference(ours.all, expected.all, result_names(len(ours.outputs), input_names), **criteria)
    return ours.outputs


def assert_low_precision_within_2x(
    fn: Callable,
    reference: Callable,
    low_inputs: Sequence,
    grad_outputs: Optional[Tensors] = None,
    *,
    exact_dtype: torch.dtype = torch.float32,
    exact_inputs: Optional[Sequence] = None,
    names: Optional[Sequence[str]] = None,
    backward: bool = True,
) -> None:
    """The low-precision rule (FlashAttention's criterion): on inputs in a low precision
    (float16/bfloat16; or float32, against float64), ``fn``'s max abs error against ``reference``
    computed in ``exact_dtype`` is at most twice (+ 1e-5) the error of ``reference`` run in that
    low precision itself (PyTorch's own low-precision math) -- for every output and, unless
    ``backward=False``, every input gradient, all with the same output gradients.  ``fn``'s
    outputs and gradients must keep the low dtype.

    ``exact_inputs``: what the exact reference runs on (cast to ``exact_dtype``); by default
    ``low_inputs`` themselves."""
    low_dtype = next(t.dtype for t in low_inputs if isinstance(t, torch.Tensor) and t.is_floating_point())
    ours = outputs_and_grads(fn, low_inputs, grad_outputs, backward=backward)
    torch_low = outputs_and_grads(reference, low_inputs, ours.grad_outputs, backward=backward)
    exact = outputs_and_grads(
        reference, low_inputs if exact_inputs is None else exact_inputs, ours.grad_outputs, dtype=exact_dtype,
        backward=backward,
    )
    if names is None:
        floating = [t for t in low_inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        names = result_names(len(ours.outputs), [str(i) for i in range(len(floating))] if backward else [])
    assert len(ours.all) == len(torch_low.all) == len(exact.all) == len(names)
    for name, o, t, e in zip(names, ours.all, torch_low.all, exact.all):
        assert o.dtype == low_dtype, f"{name}: dtype {o.dtype}, not {low_dtype}"
        our_error = (o.double() - e.double()).abs().max().item()
        torch_error = (t.double() - e.double()).abs().max().item()
        assert our_error <= 2 * torch_error + 1e-5, f"{name}: {our_error:.3e} > 2 x torch's {torch_error:.3e}"


# ----------------------------------------------------------------------------
# Spies on the backends
# ----------------------------------------------------------------------------

# What each op's backward returns, in order.
GRADIENT_NAMES = {
    "attention": ("query", "key", "value", "attn_mask"),
    "glu_conv": ("x", "weight", "bias"),
    "qkv": ("x", "weight", "bias"),
}


class GradientSpy:
    """Wraps ``backend_module(op, backend).backward`` (through ``monkeypatch``) and records what
    each call returned; :meth:`assert_computed` then checks which gradients were computed.

    The glu_conv and qkv backends return an empty tensor for a gradient not asked for; attention
    returns an empty ``dmask`` unless a float ``attn_mask`` needs a gradient.

    The op's calls run unprepared while it spies (:func:`_run_unprepared`)."""

    def __init__(self, monkeypatch, op: str, backend: str):
        self.op, self.backend = op, backend
        self.returned: list[tuple[torch.Tensor, ...]] = []
        module = backend_module(op, backend)
        _run_unprepared(monkeypatch, op, module)
        backward = module.backward

        def spy(*args, **kwargs):
            result = backward(*args, **kwargs)
            self.returned.append(tuple(result))
            return result

        monkeypatch.setattr(module, "backward", spy)

    def assert_none_computed(self) -> None:
        """Every gradient the backward returned (if it ran at all) is empty."""
        for grads in self.returned:
            numels = [g.numel() for g in grads]
            assert not any(numels), f"the {self.backend} {self.op} backward computed gradients nobody asked for: {numels}"

    def assert_computed(self, **computed: bool) -> None:
        """The backward ran, and in each of its calls the gradient of every named input is
        non-empty where ``True`` and empty (``numel() == 0``) where ``False``."""
        assert self.returned, f"the {self.backend} {self.op} backward never ran"
        names = GRADIENT_NAMES[self.op]
        for grads in self.returned:
            assert len(grads) == len(names), f"{self.op} backward returned {len(grads)} tensors, not {len(names)}"
            by_name = dict(zip(names, grads))
            for name, wanted in computed.items():
                numel = by_name[name].numel()
                if wanted:
                    assert numel > 0, f"the {self.backend} {self.op} backward did not compute the gradient of {name}"
                else:
                    assert numel == 0, (
                        f"the {self.backend} {self.op} backward computed the gradient of {name} ({numel} elements), "
                        "which nobody asked for"
                    )


def _run_unprepared(monkeypatch, op: str, module) -> None:
    """Calls of ``op`` on the backend ``module`` run its ``forward`` and ``backward`` while the test
    runs: no call plan keeps a forward the backend prepared for a layout (which runs the kernels
    without calling ``forward``, and whose prepared backward does not call ``backward``).  The
    suite's ``LaunchTemplates.verify`` holds every prepared call to the launches of the unprepared
    one."""
    monkeypatch.setattr(importlib.import_module(f"transformer_kernels.ops.{op}"), "_PLANS", CallPlans())
    if hasattr(module, "prepare_forward"):
        monkeypatch.setattr(module, "prepare_forward", lambda *arguments: None)


class OpRecorder(TorchDispatchMode):
    """The names of the ops dispatched while active (``"addmm"``, ``"attention_backward"``: overloads
    and namespaces dropped), in order, in ``ops``; ``keep(op)`` chooses which ones (every one).

    A dispatch mode sees one of our registered ops as one op: its implementation runs with the mode
    popped.  ``descend=True`` runs it with the recorder active instead, so that what the op does
    inside (the backend's torch ops) is recorded too."""

    def __init__(self, keep: Callable[[torch._ops.OpOverload], bool] = lambda op: True, *,
                 descend: bool = False) -> None:
        super().__init__()
        self.keep, self.descend = keep, descend
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.keep(func):
            self.ops.append(func.overloadpacket.__name__)
        if self.descend and func.namespace == transformer_kernels.ops._library.NAMESPACE:
            with self:  # the op's one kernel, for every device: calling func again would come back here
                return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def small_seed_model(family: str, impl: str = "fused", **overrides) -> torch.nn.Module:
    """A small ``"transformer"`` or ``"convs2s"`` seed model (vocabularies of 40, pad index 0, no
    dropout unless ``overrides`` say), seeded: the same weights on every call."""
    from transformer_kernels.models import ConvSeq2Seq, Transformer

    torch.manual_seed(0)
    common = dict(num_encoder_layers=1, num_decoder_layers=2, dropout=0.0, max_len=12, pad_index=0, impl=impl)
    if family == "transformer":
        return Transformer(40, 40, **(common | dict(d_model=32, nhead=2, dim_feedforward=64) | overrides))
    return ConvSeq2Seq(40, 40, **(common | dict(emb_dim=16, hid_dim=32) | overrides))


def reads_back(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` reads a tensor's value back to the host (an :class:`OpRecorder` filter): each
    such op syncs with a GPU, and breaks a CUDA graph's capture."""
    return op.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "is_nonzero", "item")


class ForwardSpy:
    """Wraps ``forward`` of ``op`` on every backend in ``names`` that can run here; ``calls`` lists
    ``(op, backend)`` of each call the op made, ``inputs`` its positional arguments.  A backend's
    forward that calls another's (Triton QKV runs float32 through eager's) counts once, as the
    backend called first.  The ops' calls run unprepared while it spies (:func:`_run_unprepared`)."""

    def __init__(self, monkeypatch, ops: Sequence[str] = OPS, names: Sequence[str] = BACKENDS):
        self.calls: list[tuple[str, str]] = []
        self.inputs: list[tuple] = []
        self._depth = 0
        for op in ops:
            for name in names:
                if backend_skip_reason(name, op) is not None:
                    continue
                module = backend_module(op, name)
                _run_unprepared(monkeypatch, op, module)

                def spy(*args, _forward=module.forward, _key=(op, name), **kwargs):
                    if self._depth == 0:
                        self.calls.append(_key)
                        self.inputs.append(args)
                    self._depth += 1
                    try:
                        return _forward(*args, **kwargs)
                    finally:
                        self._depth -= 1

                monkeypatch.setattr(module, "forward", spy)

    @property
    def backends(self) -> list[str]:
        return [name for _, name in self.calls]


# ----------------------------------------------------------------------------
# Scripts that need Triton's compiled kernels
# ----------------------------------------------------------------------------


def script_output(script: pathlib.Path, *args: str, env: Optional[dict] = None, timeout: float) -> str:
    """What ``python script *args`` prints, run with this session's package (and ``env`` added to the
    environment); fails with its error output unless it exits with 0."""
    # A script's path starts at its own folder, not the working directory: put
    # the package this session imported first, or a checkout run from its root
    # would use the installed copy's kernels instead of its own.
    package_root = str(pathlib.Path(transformer_kernels.__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **(env or {}), "PYTHONPATH": python_path}
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def json_of_compiled_script(script_name: str, timeout: float) -> Any:
    """The JSON that ``tests/<script_name>`` prints, run with ``TRITON_INTERPRET=0``: this session
    interprets the kernels, and only compiled ones can be compiled for a GPU or bound by Triton."""
    script = pathlib.Path(__file__).with_name(script_name)
    return json.loads(script_output(script, env={"TRITON_INTERPRET": "0"}, timeout=timeout))


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> Optional[pathlib.Path]:
    """The CUDA toolkit's include directory (``cuda_runtime.h``), as nvcc names it (nvcc may be a
    wrapper script away from its toolkit), or None without nvcc.  Asked once per session."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    dryrun = subprocess.run([nvcc, "--dryrun", "-c", "x.cu"], capture_output=True, text=True).stderr
    match = re.search(r'INCLUDES="-I([^"\s]+)', dryrun)
    return pathlib.Path(match.group(1)) if match else None


def glu_choices(monkeypatch, fastest: Optional[str] = None) -> None:
    """The eager GLU convolution's algorithms, the same on every CPU: with ``fastest`` None, its
    fixed rule (no timing: Winograd where it applies, else oneDNN past the im2col GEMM's few
    positions); else its timed choices, with timings that find ``fastest`` the fastest wherever it
    is a candidate (timing stays off under deterministic algorithms)."""
    from transformer_kernels.backends.eager import _tuning

    if fastest is None:
        monkeypatch.setattr(_tuning, "enabled", lambda: False)
        return
    monkeypatch.setattr(_tuning, "enabled", lambda: not torch.are_deterministic_algorithms_enabled())
    monkeypatch.setattr(_tuning, "_choices", {})
    monkeypatch.setattr(_tuning, "best_times", lambda runs, rounds=0: {name: float(name != fastest) for name in runs})
