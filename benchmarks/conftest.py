"""Shared fixtures for the pytest-benchmark suites.

Every benchmark records ``impl``, ``op``, ``case``, ``direction`` and
``peak_mem_bytes`` in ``benchmark.extra_info`` and uses the group
``f"{op} | {case} | {direction}"``, so ``benchmarks/report.py`` can turn the
JSON into speedup tables and check each suite's ``TARGETS``.
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(fn) -> int:
    """Peak bytes allocated on the device while running ``fn`` once (0 on CPU)."""
    if DEVICE.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.fixture
def run_benchmark(benchmark):
    """``run_benchmark(fn, op=..., case=..., impl=..., direction=...)`` times ``fn``."""

    def run(fn, *, op: str, case: str, impl: str, direction: str):
        def timed():
            fn()
            synchronize()

        timed()  # warm-up: compilation, autotuning, allocator
        benchmark.group = f"{op} | {case} | {direction}"
        benchmark.extra_info.update(
            op=op, case=case, impl=impl, direction=direction, device=str(DEVICE), peak_mem_bytes=peak_memory(fn)
        )
        benchmark.pedantic(timed, rounds=9 if DEVICE.type == "cpu" else 20, warmup_rounds=1, iterations=1)

    return run
