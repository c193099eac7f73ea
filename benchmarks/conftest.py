"""The pytest face of the benchmark suites: ``pytest benchmarks/bench_<suite>.py``.

Each ``bench_<suite>.py`` names a suite of :mod:`transformer_kernels.bench.suites` (``SUITE``) and
holds one test, parametrized here over that suite's groups for this device: the cases and targets
live in the package, shared with ``python -m transformer_kernels.bench``, which is the report.
The ``measure`` fixture times a group's implementations interleaved and fails the test when one of
ours raised; ``--results-json PATH`` writes every record so far after each group, in the command's
``results.json`` format (``python -m transformer_kernels.bench --compare`` reads it).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0")

from transformer_kernels.bench import environment, report, run, suites, timing  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32

_RECORDS: list[dict] = []
# As the command does on a CPU: freed memory kept mapped, so that page faults do not decide the ratios.
_CPU_MALLOC = timing.cpu_malloc(keep_freed_memory=True) if DEVICE.type == "cpu" else None


def pytest_addoption(parser):
    parser.addoption("--results-json", type=Path, default=None,
                     help="write every benchmark group's record to this JSON file")
    parser.addoption("--bench-size", choices=suites.SIZES, default="full",
                     help="which cases: full (default), quick or tiny")


def _setting(config) -> suites.Setting:
    return suites.Setting(DEVICE, DTYPE, config.getoption("--bench-size"))


def pytest_generate_tests(metafunc):
    if "group" in metafunc.fixturenames:
        groups = suites.load(metafunc.module.SUITE).groups(_setting(metafunc.config))
        metafunc.parametrize("group", range(len(groups)), ids=[f"{group.case}-{group.direction}" for group in groups],
                             indirect=True)


@pytest.fixture
def group(request) -> suites.Group:
    """The suite's group at the test's index, built afresh: its inputs are freed with it after the test."""
    return suites.load(request.module.SUITE).groups(_setting(request.config))[request.param]


@pytest.fixture
def measure(request):
    """``measure(group)``: times the group, records it, fails when one of ours raised."""
    setting = _setting(request.config)

    def run_group(group: suites.Group) -> None:
        record = run.measure_group(group, DEVICE, timing.Schedule.for_device(DEVICE, setting.size))
        _RECORDS.append(record)
        path = request.config.getoption("--results-json")
        if path is not None:
            env = _environment(setting)
            report.write_results(path, env, _RECORDS, report.evaluate_targets(
                report.load_targets(suites.SUITES), _RECORDS, DEVICE.type))
        assert not record["failed"], record["failed"]

    return run_group


@functools.cache
def _environment(setting: suites.Setting) -> dict:
    env = environment.environment(setting.device, setting.dtype, setting.size)
    if setting.device.type == "cpu":
        env["malloc"] = _CPU_MALLOC
    return env



def pytest_terminal_summary(terminalreporter):
    for record in _RECORDS:
        medians = ", ".join(f"{impl} {report.median_ms(record, impl):.3f} ms" for impl in record["times_s"])
        terminalreporter.write_line(
            f"{record['op']} | {record['case']} | {record['direction']}: {medians} ({record['rounds']} rounds)")
