import contextlib
import importlib.util
import os

import pytest
import torch

# Triton's interpreter must be switched on before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA = torch.cuda.is_available()
# Where the triton backend runs in tests: real kernels on a GPU, the interpreter on CPU.
TRITON_DEVICE = torch.device("cuda" if CUDA else "cpu")
if CUDA:
    os.environ["TRITON_INTERPRET"] = "0"

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

if importlib.util.find_spec("triton") is not None:
    from transformer_kernels.backends.triton._common import LaunchTemplates

    # Every call of a known layout also builds its launches anew and checks them against the kept ones.
    LaunchTemplates.verify = True


from transformer_kernels.ops._call_plans import CallPlans  # noqa: E402

# Every call that finds a plan also takes the checked route and checks it decides the same.
CallPlans.verify = True


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def gradient_spy(monkeypatch):
    """``gradient_spy(op, backend)``: a :class:`_helpers.GradientSpy` on that backend's backward."""
    from _helpers import GradientSpy

    return lambda op, backend: GradientSpy(monkeypatch, op, backend)


@pytest.fixture(autouse=True)
def _exact_float32():
    """Every test starts with TF32 off for float32 matmuls and convolutions:
    on CUDA torch's own convolutions (the references) use TF32 by default,
    and the tests hold float32 results to float32 tolerances.  Tests of the
    TF32 behaviour switch it on themselves with ``tf32_setting``."""
    with tf32_setting("matmul", False, "legacy"), tf32_setting("conv", False, "legacy"):
        yield


@contextlib.contextmanager
def tf32_setting(kind: str, allowed: bool, api: str):
    """Let float32 matmuls (``kind`` "matmul") or convolutions ("conv") use
    TF32 or not, through torch's legacy ``allow_tf32`` flag (``api``
    "legacy") or its ``fp32_precision`` setting ("new"); the old value is
    restored through the same API (mixing the two makes torch raise)."""
    if api == "legacy":
        owner = torch.backends.cuda.matmul if kind == "matmul" else torch.backends.cudnn
        name, value = "allow_tf32", allowed
    else:
        owner = torch.backends.cuda.matmul if kind == "matmul" else torch.backends.cudnn.conv
        name, value = "fp32_precision", "tf32" if allowed else "ieee"
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test parametrized with ``backend="cuda"`` whose call the cuda backend cannot serve (float32,
    sizes its kernels do not take, an op it has no kernel for) is reported as skipped with the
    backend's reason rather than failed: the op suites written for every backend pick up the CUDA
    kernels for the cases they serve."""
    outcome = yield
    report = outcome.get_result()
    params = getattr(getattr(item, "callspec", None), "params", {})
    if call.when != "call" or call.excinfo is None or params.get("backend") != "cuda":
        return
    from transformer_kernels import BackendUnavailableError

    if call.excinfo.errisinstance(BackendUnavailableError):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1], f"Skipped: {call.excinfo.value}")
