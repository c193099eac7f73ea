"""Shared fixture of the benchmark suites: interleaved comparison of implementations.

A suite's test builds, for one benchmark group (op, case, direction), a dict of
the implementations to compare (name -> zero-argument callable) and passes it
to ``compare``; ``interleaved.measure`` times them round by round.  With
``--results-json PATH`` (what ``benchmarks/report.py`` passes) every group's
per-round times are written there, after each group, for the report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0")

import transformer_kernels as tk  # noqa: E402
import interleaved  # noqa: E402  (pytest's default prepend import mode puts benchmarks/ on sys.path)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

_RECORDS: list[dict] = []


def timed_call(
    make_forward: Callable[[], Callable[[], object]], direction: str, leaves: Sequence[torch.Tensor]
) -> Callable[[], object]:
    """Sets up ``forward = make_forward()`` (returning a tensor or a tuple of tensors) and
    returns what one timed call of ``direction`` runs: ``"fwd"``, the forward under
    ``torch.no_grad()``; ``"bwd"``, the gradients for ``leaves`` of one stored forward
    (``retain_graph``); ``"fwd+bwd"``, a forward and its gradients.  Runs it once, so a
    failing setup raises here."""
    forward = make_forward()

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


def pytest_addoption(parser):
    parser.addoption("--results-json", type=Path, default=None,
                     help="write every benchmark group's per-round times to this JSON file")


@pytest.fixture
def compare(request):
    """``compare(factories, op=..., case=..., direction=..., ours=..., skipped={impl: reason})``.

    ``factories`` maps each implementation's name to a zero-argument function
    that sets it up and returns the callable to time (one call = one timed
    operation).  An implementation whose setup raises is left out of the group
    and recorded with the reason: a peer (any name but ``ours``) for any
    exception (an SDPA backend this GPU lacks, a compiler that fails), ``ours``
    only for ``tk.BackendUnavailableError``; any other error of ours fails the
    test.  ``skipped`` records implementations not even set up, and why.
    """

    def run(factories: dict[str, Callable[[], Callable[[], object]]], *, op: str, case: str, direction: str,
            ours: str, skipped: dict[str, str] | None = None) -> None:
        fns, unavailable = {}, dict(skipped or {})
        for name, factory in factories.items():
            try:
                fns[name] = factory()
            except tk.BackendUnavailableError as error:
                unavailable[name] = f"unavailable: {error}"
            except Exception as error:
                if name == ours:
                    raise
                unavailable[name] = f"unavailable: {type(error).__name__}: {str(error).splitlines()[0]}"
        result = interleaved.measure(fns, DEVICE, interleaved.Schedule.for_device(DEVICE))
        _RECORDS.append({"op": op, "case": case, "direction": direction, "device": DEVICE.type, "ours": ours,
                         "unavailable": unavailable, **result})
        _write_records(request.config)

    return run


def _write_records(config) -> None:
    """Rewrites ``--results-json`` with every group so far, so a run cut short keeps what it measured."""
    path = config.getoption("--results-json")
    if path is not None:
        path.write_text(json.dumps({"device": DEVICE.type, "groups": _RECORDS}, indent=1))


def pytest_terminal_summary(terminalreporter):
    for record in _RECORDS:
        times = record["times_s"]
        medians = ", ".join(f"{name} {interleaved.quantile(t, 0.5) * 1e3:.3f} ms" for name, t in times.items())
        terminalreporter.write_line(
            f"{record['op']} | {record['case']} | {record['direction']}: {medians} ({record['rounds']} rounds)"
        )
