"""Interleaved timing and ratio statistics, shared by the benchmark command and the pytest suites.

Sequential timings (all rounds of A, then all rounds of B) on a shared machine
drift by 2x between runs, so a ratio of two medians taken minutes apart says
little.  Here the compared implementations of one benchmark group run in
rounds: after warm-up, each round times every implementation once, one after
the other, and a ratio is computed per round from the two samples taken moments
apart.  The rounds' orders (:func:`round_orders`) let every implementation run
right after every other one equally often over each whole design, and a group runs
whole designs where its round limit holds one: what one implementation leaves behind
(cold caches, memory to fault in, threads asleep) slows the next one's first
call, and an order that merely rotated kept each implementation's predecessor
the same in every round.  The report shows the median of those per-round ratios
and its spread (``SPREAD`` quantiles); a target is met only when the spread's
lower end is at or above it.

A sample is ``calls`` back-to-back calls (``calls`` chosen from a timed warm-up
call so that a sample lasts at least ``min_sample_s``), divided by ``calls``.
On CUDA the L2 cache is flushed before each sample (a write of ``L2_FLUSH_BYTES``)
and the sample is timed with CUDA events; on CPU with ``time.perf_counter``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import math
import time
from typing import Callable, Optional, Sequence

import torch

# Lower and upper quantile of the per-round values shown as the spread.
SPREAD = (0.1, 0.9)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How many rounds a group gets: as many as fit in ``budget_s`` (after
    warm-up), clamped to ``[min_rounds, max_rounds]``, then made whole designs of round orders
    (:func:`_whole_designs`): at least ``min_rounds`` where such a number of designs fits in
    ``max_rounds``, else as many whole designs as fit."""

    min_rounds: int
    max_rounds: int
    budget_s: float
    min_sample_s: float

    @classmethod
    def for_device(cls, device: torch.device, size: str = "full") -> "Schedule":
        """The schedule of a ``"full"`` run, or of a ``"quick"`` one (fewer, shorter rounds: a wider
        spread), or ``"tiny"`` (a few rounds: the command's own tests)."""
        if size == "tiny":
            return cls(min_rounds=3, max_rounds=3, budget_s=0.0, min_sample_s=0.0)
        if device.type == "cuda":
            if size == "quick":
                return cls(min_rounds=7, max_rounds=15, budget_s=0.3, min_sample_s=1e-3)
            return cls(min_rounds=10, max_rounds=30, budget_s=1.0, min_sample_s=2e-3)
        if size == "quick":
            return cls(min_rounds=5, max_rounds=9, budget_s=0.6, min_sample_s=4e-3)
        return cls(min_rounds=7, max_rounds=15, budget_s=4.0, min_sample_s=10e-3)


# glibc hands memory freed at the top of its heap back to the system, and serves large blocks by
# mmap, so a call's buffers can come back as fresh pages whose first touch faults; how often
# depends on the process's whole allocation history, so it differs from run to run, not just from
# round to round.  On this project's 2-core CPU it moved the seeds' attention (B=128, L=16,
# forward+backward) between 0.91x and 1.16x against the naive math from one run to the next (p10-p90
# spread 0.5 wide; 0.07 with freed memory kept mapped), and the naive math's causal B=8, L=512
# forward (whose [B, H, L, L] tensors fault most) between 129 and 76 ms.  CPU runs keep freed memory
# mapped, as a caching allocator (jemalloc, tcmalloc, torch's CUDA one) does: blocks up to the
# largest mmap threshold glibc takes come from the heap, which is trimmed only past the trim
# threshold.  ``--malloc-defaults`` times with glibc's own settings instead.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def cpu_malloc(keep_freed_memory: bool) -> str:
    """A CPU run's allocator setting, for its environment record.  With ``keep_freed_memory``,
    raises glibc's mmap and trim thresholds for this process (``mallopt``), so that memory one call
    frees serves the next without page faults; else, or where the C library is not glibc (or
    refused), the C library's own settings stay."""
    defaults = "the C library allocator's own settings"
    if not keep_freed_memory:
        return defaults
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return defaults
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) != 1 or mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) != 1:
        return defaults
    return (f"glibc keeps freed memory mapped (mallopt: mmap threshold {_MMAP_THRESHOLD_BYTES >> 20} MiB, "
            f"trim threshold {_TRIM_THRESHOLD_BYTES >> 20} MiB)")


# Several times the L2 cache of current GPUs (H100 and H200: 50 MB).
L2_FLUSH_BYTES = 256 * 2**20
_flush_buffers: dict[torch.device, torch.Tensor] = {}


def _sample(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds per call over ``calls`` back-to-back calls (on CUDA after flushing the L2 cache)."""
    if device.type == "cuda":
        buffer = _flush_buffers.get(device)
        if buffer is None:
            buffer = _flush_buffers[device] = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        buffer.zero_()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    start_s = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start_s) / calls


def peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated on ``device`` beyond what was live before, while ``fn`` runs once (0 on CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def round_orders(count: int) -> list[list[int]]:
    """Orders in which successive rounds run ``count`` implementations (indices): a Williams design,
    the rows of a Latin square in which each implementation runs right after each other one exactly
    once (``count`` rows; for an odd ``count``, twice over those rows and their mirror images).  So
    every implementation runs in every position, and no implementation always follows the same one.

    (Rotating one order each round kept every implementation's predecessor: on a CPU the seeds'
    attention always ran right after SDPA on jagged nested tensors, whose 13 ms of work left it
    0.5 ms slower (1.5 -> 2.0 ms, B128 L16 forward), and it measured 0.89x the naive math, which
    ran after it, where the two run level after any one predecessor.)"""
    first = [0] + [(i + 1) // 2 if i % 2 else count - i // 2 for i in range(1, count)]
    rows = [[(index + shift) % count for index in first] for shift in range(count)]
    return rows if count % 2 == 0 else rows + [row[::-1] for row in rows]


def _whole_designs(rounds: int, design_rounds: int, min_rounds: int, max_rounds: int) -> int:
    """``rounds`` rounded to a whole number of :func:`round_orders` designs of ``design_rounds`` rounds
    (their orders balance predecessors only over whole designs): the nearest such count, but at
    least ``min_rounds`` and at most ``max_rounds`` (where both cannot hold, the most designs that
    fit), where one design fits in ``max_rounds``; else ``rounds``."""
    if design_rounds > max_rounds:
        return rounds
    designs = max(round(rounds / design_rounds), math.ceil(min_rounds / design_rounds))
    return min(designs, max_rounds // design_rounds) * design_rounds


class ImplementationFailed(Exception):
    """Raised by :func:`measure` when the implementation ``name`` raised ``error`` while timed."""

    def __init__(self, name: str, error: Exception) -> None:
        super().__init__(f"{name}: {type(error).__name__}: {error}")
        self.name, self.error = name, error


def measure(fns: dict[str, Callable[[], object]], device: torch.device, schedule: Schedule) -> dict:
    """Times the implementations ``fns`` (name -> zero-argument callable) interleaved.

    Returns ``{"rounds": R, "calls": {name: n}, "times_s": {name: [R seconds per call]},
    "peak_mem_bytes": {name: bytes}}``; ``times_s[a][r]`` and ``times_s[b][r]``
    were taken in the same round ``r``.  An implementation that raises (out of memory on its
    third call, say) raises :class:`ImplementationFailed` naming it.
    """
    names = list(fns)
    if not names:
        return {"rounds": 0, "calls": {}, "times_s": {}, "peak_mem_bytes": {}}

    def naming_failures(name: str, measurement: Callable[[], float]) -> float:
        try:
            return measurement()
        except Exception as error:
            raise ImplementationFailed(name, error) from error

    def sample(name: str, calls: int) -> float:
        return naming_failures(name, lambda: _sample(fns[name], calls, device))

    for name in names:  # compilation, autotuning, allocator caches
        sample(name, 1)
    estimate = {name: sample(name, 1) for name in names}
    calls = {name: max(1, math.ceil(schedule.min_sample_s / max(estimate[name], 1e-9))) for name in names}
    round_s = sum(estimate[name] * calls[name] for name in names)
    rounds = int(min(schedule.max_rounds, max(schedule.min_rounds, schedule.budget_s // max(round_s, 1e-9))))
    orders = round_orders(len(names))
    rounds = _whole_designs(rounds, len(orders), schedule.min_rounds, schedule.max_rounds)
    peak = {name: naming_failures(name, lambda: peak_memory(fns[name], device)) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for index in orders[r % len(orders)]:
                times[names[index]].append(sample(names[index], calls[names[index]]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {"rounds": rounds, "calls": calls, "times_s": times, "peak_mem_bytes": peak}


def timed_call(forward: Callable[[], object], direction: str, leaves: Sequence[torch.Tensor]) -> Callable[[], None]:
    """What one timed call of ``direction`` runs, given ``forward`` (returning a tensor or a tuple of
    tensors): ``"fwd"``, the forward under ``torch.no_grad()``; ``"bwd"``, the gradients for
    ``leaves`` of one stored forward (``retain_graph``); ``"fwd+bwd"``, a forward and its gradients.
    Runs it once, so a failing setup raises here."""

    def outputs() -> tuple:
        out = forward()
        return out if isinstance(out, (tuple, list)) else (out,)

    if direction == "fwd":

        def call():
            with torch.no_grad():
                forward()

    elif direction == "bwd":
        stored = outputs()
        grads = [torch.randn_like(o) for o in stored]

        def call():
            torch.autograd.grad(stored, leaves, grads, retain_graph=True)

    elif direction == "fwd+bwd":
        with torch.no_grad():
            grads = [torch.randn_like(o) for o in outputs()]

        def call():
            torch.autograd.grad(outputs(), leaves, grads)

    else:
        raise ValueError(f"direction must be 'fwd', 'bwd' or 'fwd+bwd', got {direction!r}")
    call()
    return call


def host_speed() -> str:
    """How fast this machine's host runs the kinds of work a call's host path is made of (a Python
    call, a small allocation and a view of a CPU tensor), medians of 20 samples of 1000 calls:
    printed where a host path is timed (benchmarks/host_time.py here, benchmarks/profile_seeds.py
    on a GPU machine), they tell how much of a gap between two machines' host times is the host's."""
    def noop() -> None:
        return None

    tensor = torch.empty(16, 16)
    work = {"a Python call": noop, "torch.empty(16)": functools.partial(torch.empty, 16),
            "a transpose": functools.partial(tensor.transpose, 0, 1)}
    medians = []
    for name, call in work.items():
        samples = []
        for _ in range(20):
            started = time.perf_counter()
            for _ in range(1000):
                call()
            samples.append((time.perf_counter() - started) * 1e3)  # microseconds per call
        medians.append(f"{name} {quantile(samples, 0.5):.3f} us")
    return "host speed (CPU, medians of 20 x 1000 calls): " + ", ".join(medians)


# ----------------------------------------------------------------------------- statistics


def quantile(values: list[float], q: float) -> float:
    """The ``q``-quantile of ``values``, interpolating linearly between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@dataclasses.dataclass(frozen=True)
class Summary:
    """Median and spread (``SPREAD`` quantiles) of per-round values."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Summary":
        return cls(quantile(values, 0.5), quantile(values, SPREAD[0]), quantile(values, SPREAD[1]))


def ratio_summary(times_s: dict[str, list[float]], numerator: str, denominator: str) -> Optional[Summary]:
    """Per-round ``times[numerator] / times[denominator]`` summarized; with the
    baseline as numerator this is the speedup of ``denominator`` over it.
    ``None`` when either implementation was not measured."""
    if numerator not in times_s or denominator not in times_s:
        return None
    return Summary.of([a / b for a, b in zip(times_s[numerator], times_s[denominator])])
