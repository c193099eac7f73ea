"""The eager backends' choice of oneDNN's float32 CPU kernels (backends/eager/onednn.py)."""

import pytest
import torch
import torch.nn.functional as F
from _helpers import glu_choices
from torch._subclasses.fake_tensor import FakeTensorMode

from transformer_kernels.backends.eager import onednn

requires_onednn = pytest.mark.skipif(onednn._LINEAR is None, reason="torch built without oneDNN")


def test_speedup_is_measured_once_outside_dispatch_modes(monkeypatch):
    """The probe runs on real tensors even under a fake-tensor mode (an op's fake kernel asks for
    the GLU algorithm while tracing), and its result is kept for the process."""
    monkeypatch.setattr(onednn, "_speedup", None)
    with FakeTensorMode():
        speedup = onednn.speedup()
    assert isinstance(speedup, float) and speedup >= 0.0
    assert onednn.speedup() == speedup


def _in_threads(count: int, function) -> list:
    """``function()`` in ``count`` threads started together; their results."""
    import threading

    barrier, results = threading.Barrier(count), [None] * count

    def run(index):
        barrier.wait()
        results[index] = function()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@requires_onednn
def test_threads_making_the_first_call_together_time_once(monkeypatch):
    """One timing for the process: threads that ask together wait for it (each timing on its own
    read the thread count another had set to 1, and restored that 1 for the whole process), and
    a timed choice is the one kept (each thread used its own winner, so identical calls gave
    different bits)."""
    import time

    from transformer_kernels.backends.eager import _tuning

    timings = []

    def best_times(runs):
        timings.append(torch.get_num_threads())
        time.sleep(0.05)
        return {name: float(len(timings) + index) for index, name in enumerate(runs)}

    monkeypatch.setattr(onednn, "_speedup", None)
    monkeypatch.setattr(_tuning, "best_times", best_times)
    monkeypatch.setattr(_tuning, "_choices", {})
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert len(set(_in_threads(4, onednn.speedup))) == 1 and timings == [1]
        assert torch.get_num_threads() == 2
        timings.clear()
        choices = _in_threads(4, lambda: _tuning.fastest("key", lambda: {"a": None, "b": None}))
        assert len(timings) == 1 and len(set(choices)) == 1
    finally:
        torch.set_num_threads(previous)


@requires_onednn
@pytest.mark.parametrize("fails", [False, True])
def test_speedup_is_timed_on_one_thread_and_the_thread_count_restored(monkeypatch, fails):
    """The engines are timed on one thread (a busy machine deschedules threads that share its cores,
    and the ratio swung from 1.5 to 5 there), whatever torch's thread count; the count is restored
    afterwards, also when the timing raises."""
    from transformer_kernels.backends.eager import _tuning

    threads_seen = []

    def best_times(runs):
        threads_seen.append(torch.get_num_threads())
        if fails:
            raise RuntimeError("timing failed")
        return {"onednn": 1.0, "blas": 2.0}

    monkeypatch.setattr(onednn, "_speedup", None)
    monkeypatch.setattr(_tuning, "best_times", best_times)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if fails:
            with pytest.raises(RuntimeError, match="timing failed"):
                onednn.speedup()
        else:
            assert onednn.speedup() == 2.0
        assert threads_seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def test_deterministic_algorithms_take_the_blas_paths_without_timing(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) no timing picks an algorithm: the speed-up is
    0 (the BLAS paths), whatever was measured, and nothing is measured; off again, the measured
    value returns."""
    from transformer_kernels.backends.eager import _tuning
    from transformer_kernels.backends.eager import glu_conv as eager_glu_conv

    def no_timing(*args, **kwargs):
        raise AssertionError("a timed choice under deterministic algorithms")

    glu_choices(monkeypatch, "onednn")
    monkeypatch.setattr(onednn, "_speedup", 2.0)
    x, weight = torch.randn(4, 64, 80), torch.empty(16, 64, 3)
    assert eager_glu_conv.algorithm(x, weight, 80, "forward") == ("onednn" if onednn.enabled() else "winograd")
    monkeypatch.setattr(onednn, "_measure", no_timing)
    monkeypatch.setattr(_tuning, "best_times", no_timing)
    monkeypatch.setattr(_tuning, "_choices", {})
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert onednn.speedup() == 0.0
        assert eager_glu_conv.algorithm(x, weight, 80, "forward") == "winograd"
        monkeypatch.setattr(onednn, "_LINEAR", lambda *args: no_timing())  # F.linear's GEMM only
        a, weight = torch.randn(512, 512), torch.randn(512, 512)
        assert torch.equal(onednn.linear(a, weight), F.linear(a, weight))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert onednn.speedup() == 2.0


@requires_onednn
@pytest.mark.parametrize("faster", [True, False])
def test_linear_takes_onednn_only_for_dense_float32_operands_where_it_is_faster(monkeypatch, faster):
    """Contiguous and transposed-contiguous operands go to oneDNN's GEMM when it is the faster
    engine; a slice of columns (which oneDNN would read 1000x slower), float64, empty
    contractions and products below _LINEAR_MIN_MACS go to F.linear; every way the result is
    F.linear's."""
    monkeypatch.setattr(onednn, "_speedup", 2.0 if faster else 1.0)
    calls = []
    real = onednn._LINEAR

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(onednn, "_LINEAR", spy)
    weight, bias = torch.randn(6, 8), torch.randn(6)
    cases = [  # (input, weight, bias, whether oneDNN serves it when faster), at _LINEAR_MIN_MACS = 1
        (torch.randn(3, 5, 8), weight, bias, True),               # contiguous N-D input
        (torch.randn(8, 7).t(), weight, None, True),               # transposed input
        (torch.randn(5, 8), torch.randn(8, 6).t(), None, True),    # transposed weight
        (torch.randn(5, 16)[:, :8], weight, bias, False),          # a slice of columns
        (torch.randn(5, 8, dtype=torch.float64), weight.double(), None, False),
        (torch.randn(5, 0), torch.randn(6, 0), None, False),       # empty contraction
    ]
    threshold_cases = [  # at the real _LINEAR_MIN_MACS
        (torch.randn(15, 256), torch.randn(256, 256), None, False),  # 983040 multiply-adds
        (torch.randn(16, 256), torch.randn(256, 256), None, True),   # 1048576
    ]
    for min_macs, group in ((1, cases), (onednn._LINEAR_MIN_MACS, threshold_cases)):
        monkeypatch.setattr(onednn, "_LINEAR_MIN_MACS", min_macs)
        for input, w, b, served in group:
            calls.clear()
            torch.testing.assert_close(onednn.linear(input, w, b), F.linear(input, w, b), rtol=1e-5, atol=1e-5)
            assert bool(calls) == (served and faster), tuple(input.shape)


@requires_onednn
def test_linear_and_glu_leave_onednn_when_the_user_turns_it_off(monkeypatch):
    """``torch.backends.mkldnn.flags(enabled=False)`` keeps the eager backend off oneDNN, as it
    keeps torch's own convolutions: the QKV GEMM on F.linear, the GLU convolution on Winograd or
    the im2col GEMM."""
    from transformer_kernels.backends.eager import glu_conv

    monkeypatch.setattr(onednn, "_speedup", 2.0)
    monkeypatch.setattr(onednn, "_LINEAR_MIN_MACS", 1)
    calls = []
    real = onednn._LINEAR
    monkeypatch.setattr(onednn, "_LINEAR", lambda *args: calls.append(1) or real(*args))
    x, weight_k3, weight_k5 = torch.randn(2, 8, 200), torch.empty(16, 8, 3), torch.empty(16, 8, 5)
    with torch.backends.mkldnn.flags(enabled=False):
        onednn.linear(torch.randn(5, 8), torch.randn(6, 8))
        assert glu_conv.algorithm(x, weight_k5, 200, "forward") == "im2col"
        assert glu_conv.algorithm(x, weight_k3, 200, "forward") == "winograd"
    assert not calls
    onednn.linear(torch.randn(5, 8), torch.randn(6, 8))
    assert calls and glu_conv.algorithm(x, weight_k5, 200, "forward") == "onednn"
