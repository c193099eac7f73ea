"""Choosing between the eager backends' implementations by timing them on this machine, once per
process and problem size, as cuDNN's benchmark mode chooses its convolution algorithms.

No rule of thumb chooses well on every CPU (the GLU convolution's algorithms, in
:mod:`.glu_conv`, flip with the thread count and the day's engines).  Under
``torch.use_deterministic_algorithms(True)`` nothing is timed and callers take a fixed choice, the
same in every run.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Callable, Hashable, Iterator, Mapping

import torch
import torch.utils._python_dispatch

__all__ = ["enabled", "real_tensors", "best_times", "fastest"]

# Interleaved rounds timed per choice, after one warm-up call of each run; the best round counts.
_ROUNDS = 5
_choices: dict[Hashable, str] = {}
# One timing at a time in the process: threads that make the same first call wait for its choice
# (rather than each timing, keeping a choice of its own, and the last one's standing for later
# calls), and a timing that sets torch's process-wide thread count (onednn.speedup) restores it
# before another one reads it.  Reentrant: a timing may ask for another (the GEMM speed-up).
timing_lock = threading.RLock()


def enabled() -> bool:
    """Whether choices may be timed: not under ``torch.use_deterministic_algorithms(True)``."""
    return not torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Real tensors and no autograd, even inside a dispatch mode: an op's fake kernel asks for its
    backend's choice while tracing, and the timing must run real kernels."""
    with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
        yield


def best_times(runs: Mapping[str, Callable[[], object]], rounds: int = _ROUNDS) -> dict[str, float]:
    """Each run's best time in seconds over ``rounds`` interleaved rounds, after one warm-up call
    of each (call inside :func:`real_tensors`)."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, math.inf)
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def fastest(key: Hashable, make_runs: Callable[[], Mapping[str, Callable[[], object]]]) -> str:
    """The name of the fastest of the runs ``make_runs()`` returns (timed with :func:`best_times`
    on the first call with ``key``, then kept for the process)."""
    choice = _choices.get(key)
    if choice is not None:
        return choice
    with timing_lock:
        if key not in _choices:
            with real_tensors():
                best = best_times(make_runs())
            _choices[key] = min(best, key=best.__getitem__)
        return _choices[key]
