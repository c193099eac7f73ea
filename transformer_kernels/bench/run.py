"""Measuring the suites' groups: setup, error against the exact reference, interleaved timing.

:func:`measure_group` turns one :class:`~transformer_kernels.bench.suites.Group` into a record
(a plain dict, what ``results.json`` holds):

``op``, ``case``, ``direction``, ``device``, ``ours`` (our implementations), ``reference``,
``params``, ``flops``, ``rounds``, ``calls`` and ``times_s`` (per implementation: calls per sample
and the per-round seconds per call, ``times_s[a][r]`` and ``times_s[b][r]`` taken in the same
round), ``peak_mem_bytes`` (CUDA; 0 on CPU), ``errors`` (max abs error of the outputs, None where
not comparable), ``unavailable`` (implementation -> why it did not run: "n/a") and ``failed``
(one of ours raised: the error).
"""

from __future__ import annotations

import gc
import itertools
import time
from typing import Callable, Iterable, Optional

import torch

from .. import BackendUnavailableError
from .._progress import Progress
from . import suites, timing


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def measure_group(group: suites.Group, device: torch.device, schedule: timing.Schedule) -> dict:
    """Sets up every implementation of ``group`` (measuring its error), then times them interleaved."""
    calls: dict[str, Callable[[], None]] = {}
    errors: dict[str, Optional[float]] = {}
    unavailable, failed = dict(group.unavailable), {}
    for name, setup in group.setups.items():
        try:
            impl = setup()
            calls[name] = timing.timed_call(impl.forward, group.direction, impl.leaves)
            if impl.comparable:
                with torch.no_grad():
                    errors[name] = group.error(impl.forward())
            else:
                errors[name] = None
        except BackendUnavailableError as error:
            unavailable[name] = str(error)
        except Exception as error:  # a peer this torch or device cannot run; ours: a failure
            (failed if name in group.ours else unavailable)[name] = _first_line(error)
        if name in unavailable or name in failed:
            calls.pop(name, None)
    while True:  # one that raises while timed is left out, as at its setup, and the rest timed again
        try:
            result = timing.measure(calls, device, schedule)
            break
        except timing.ImplementationFailed as failure:
            (failed if failure.name in group.ours else unavailable)[failure.name] = _first_line(failure.error)
            calls.pop(failure.name)
            errors.pop(failure.name, None)
    return {
        "op": group.op, "case": group.case, "direction": group.direction, "device": device.type,
        "ours": [name for name in group.ours if name in calls], "reference": group.reference,
        "params": group.params, "flops": group.flops, **result, "errors": errors,
        "unavailable": unavailable, "failed": failed,
    }


def unavailable_suite_record(name: str, reason: str, device: torch.device) -> dict:
    """The one row a suite that cannot load leaves in the results."""
    return {"op": name, "case": "—", "direction": "—", "device": device.type, "ours": [], "reference": None,
            "params": {}, "flops": None, "rounds": 0, "calls": {}, "times_s": {}, "peak_mem_bytes": {}, "errors": {},
            "unavailable": {name: reason}, "failed": {}}


def run_suites(names: Iterable[str], setting: suites.Setting, schedule: timing.Schedule,
               on_record: Callable[[dict], None], first: Callable[[suites.Group], bool] = lambda group: False,
               select: Callable[[suites.Group], bool] = lambda group: True,
               deadline: Optional[float] = None) -> bool:
    """Measures every group of the suites ``names`` on ``setting`` that ``select`` keeps, passing each
    record to ``on_record`` as soon as it is measured; a suite that cannot load gives its one "n/a"
    record.  No group starts once ``time.monotonic()`` has passed ``deadline`` (the one in flight
    finishes): True when every planned group was measured, False when the deadline cut the run short.
    The groups ``first`` picks run before the others (the CLI's: those with a target, so that a run cut short
    by a time limit has measured them), taking turns between the suites: the first picked group of
    each suite, then the second of each, and so on (a GPU lease's report stopped after a few minutes
    has then measured some targets of every op, where the attention suite's long cases alone would
    fill them).  The other groups follow in suite order."""
    picked: list[list[suites.Group]] = []
    rest: list[suites.Group] = []
    for name in names:
        try:
            module = suites.load(name)
        except suites.SuiteUnavailable as error:
            on_record(unavailable_suite_record(name, str(error), setting.device))
            continue
        groups = [group for group in module.groups(setting) if select(group)]
        picked.append([group for group in groups if first(group)])
        rest += [group for group in groups if not first(group)]
    planned = [group for turn in itertools.zip_longest(*picked) for group in turn if group is not None] + rest
    # Everything alive now lives through the run: keep it out of the collections timing.measure starts with.
    gc.collect()
    gc.freeze()
    progress = Progress(len(planned), desc="benchmarks", unit="group")
    try:
        while planned:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            group = planned.pop(0)  # dropped once measured: its inputs are freed with it
            progress.begin(f"{group.op} {group.case} {group.direction}")
            on_record(measure_group(group, setting.device, schedule))
            progress.end()
        return True
    finally:
        progress.close()
        gc.unfreeze()
