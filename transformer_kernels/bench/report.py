"""From measured records to what a person reads: targets, ``report.md``, ``results.json``, run
comparison and the README's performance section.

Every number comes from the records of a run (see :mod:`transformer_kernels.bench.run`).  A speed-up
is the median of the per-round ratios (the other implementation's time / this one's, same round)
with its ``timing.SPREAD`` quantiles; a target is "met" when the lower quantile is at or above it,
"within noise" when the spread straddles it and "MISSED" when even the upper quantile is below it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from . import suites, timing

LOW, HIGH = (f"p{round(q * 100)}" for q in timing.SPREAD)
RESULTS_FORMAT = 1
# How the suites count a group's FLOPs (``Group.flops``), recorded in results.json: files from before
# count 2 (useful work of real query rows and tokens only) show the suites' present counts instead.
FLOP_COUNT = 2


def median_ms(record: dict, impl: str) -> float:
    return timing.quantile(record["times_s"][impl], 0.5) * 1e3


def ratio_text(summary: Optional[timing.Summary], target: Optional[float] = None) -> str:
    """``median (low–high)`` to 2 decimals; against a ``target``, each to as many more as keep it on
    the side of the target it is on (0.996 shown as 1.00 would contradict its MISSED)."""
    if summary is None:
        return "—"
    low, median, high = (_end_text(value, target) for value in (summary.low, summary.median, summary.high))
    return f"{median}x ({low}–{high})"


def _end_text(value: float, target: Optional[float]) -> str:
    digits = 2
    while target is not None and digits < 6 and (round(value, digits) >= target) != (value >= target):
        digits += 1
    return f"{value:.{digits}f}"


def best_peer(record: dict) -> Optional[str]:
    """The fastest implementation that is neither ours nor the reference (by median time)."""
    peers = [impl for impl in record["times_s"] if impl not in record["ours"] and impl != record["reference"]]
    return min(peers, key=lambda impl: median_ms(record, impl), default=None)


def tflops(record: dict, impl: str) -> Optional[float]:
    """None for a group that counts no work (``flops`` None, or 0 in files from before count 2)."""
    if not record["flops"]:
        return None
    return record["flops"] / (median_ms(record, impl) / 1e3) / 1e12


def target_status(speedup: Optional[timing.Summary], minimum: float) -> str:
    if speedup is None:
        return "not measured"
    if speedup.low >= minimum:
        return "met"
    return "within noise" if speedup.high >= minimum else "MISSED"


# Why a target's case has no record: the run ended before it, or --cases or the run's size left it out.
CUT_SHORT = "the run ended before this case (cut short)"
NOT_SELECTED = "not selected by --cases"


def planned_keys(names: Iterable[str], setting: suites.Setting) -> set[tuple[str, str, str]]:
    """``(op, case, direction)`` of every group a run of the suites ``names`` on ``setting`` plans."""
    found = set()
    for name in names:
        try:  # (in a report written after a run cut short: nothing here may keep it from being written)
            groups = suites.load(name).groups(setting)
        except Exception:
            continue
        found |= {(g.op, g.case, g.direction) for g in groups}
    return found


def absent_reasons(names: Iterable[str], setting: suites.Setting, cut_short: bool,
                   selected: Callable[[tuple], bool] = lambda key: True) -> Callable[[tuple], str]:
    """Why a run of the suites ``names`` on ``setting`` has no record of a group (``(op, case,
    direction)``): ``--cases`` left it out (``selected`` is False), the run ended before a group it
    would have run (:data:`CUT_SHORT`), or the group is another size's (``--quick``, ``--full``), or
    no case of this run's suites, device and dtype."""
    planned = planned_keys(names, setting)
    others = {size: planned_keys(names, dataclasses.replace(setting, size=size))
              for size in ("quick", "full") if size != setting.size}

    def why(key: tuple) -> str:
        if key in planned and not selected(key):
            return NOT_SELECTED
        if key in planned:
            return CUT_SHORT if cut_short else "its group recorded nothing"
        sizes = [size for size, found in others.items() if key in found]
        if sizes:
            return f"not in this run (the case is in --{sizes[0]})"
        return "not a case of this run's suites, device or dtype"

    return why


def evaluate_targets(targets: Iterable[suites.Target], records: list[dict], device_type: str,
                     why_absent: Callable[[tuple], str]) -> list[dict]:
    """Each target of ``device_type`` against the records; a target without a record is "not
    measured", ``why_absent`` of its ``(op, case, direction)`` (:func:`absent_reasons`)."""
    by_key = {group_key(r): r for r in records}
    results = []
    for target in targets:
        if target.device != device_type:
            continue
        record = by_key.get((target.op, target.case, target.direction))
        why_not = why_absent((target.op, target.case, target.direction)) if record is None else None
        speedup = memory_ratio = None
        if record is not None:
            speedup = timing.ratio_summary(record["times_s"], target.baseline, target.impl)
            missing = [impl for impl in (target.impl, target.baseline) if impl not in record["times_s"]]
            if missing:
                reasons = {**record["unavailable"], **record["failed"]}
                why_not = "; ".join(f"{impl}: {reasons.get(impl, 'not measured')}" for impl in missing)
        status = target_status(speedup, target.min_speedup)
        if speedup is not None and target.max_memory_ratio is not None and record["peak_mem_bytes"][target.baseline] > 0:
            memory_ratio = record["peak_mem_bytes"][target.impl] / record["peak_mem_bytes"][target.baseline]
            if memory_ratio > target.max_memory_ratio:
                status = "MISSED"
        results.append({
            **dataclasses.asdict(target), "status": status, "why_not": why_not, "memory_ratio": memory_ratio,
            "speedup": None if speedup is None else dataclasses.asdict(speedup),
            "ours_ms": None if speedup is None else median_ms(record, target.impl),
            "baseline_ms": None if speedup is None else median_ms(record, target.baseline),
        })
    return results


def load_targets(names: Iterable[str]) -> list[suites.Target]:
    targets = []
    for name in names:
        try:
            targets += suites.load(name).TARGETS
        except suites.SuiteUnavailable:
            pass
    return targets


# ----------------------------------------------------------------------------- results.json


def write_results(path: Path, env: dict, records: list[dict], target_results: list[dict]) -> None:
    path.write_text(json.dumps({"format": RESULTS_FORMAT, "flop_count": FLOP_COUNT, "environment": env,
                                "targets": target_results, "groups": records}, indent=1))


def read_results(path: Path) -> dict:
    """A ``results.json`` this command wrote; a ValueError naming ``path`` for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:  # missing, a folder, not UTF-8, not JSON
        raise ValueError(f"{path}: cannot read it as JSON ({error})") from error
    problem = _results_problem(data)
    if problem is not None:
        raise ValueError(f"{path}: not a results.json of `python -m transformer_kernels.bench` "
                         f"(format {RESULTS_FORMAT}): {problem}")
    return data


_ENVIRONMENT_KEYS = ("device", "device_type", "dtype", "size", "date", "torch", "threads", "load_average_1min_at_start")
_GROUP_KEYS = ("op", "case", "direction", "device", "ours", "reference", "flops", "times_s", "errors",
               "peak_mem_bytes", "failed", "unavailable")
_TARGET_KEYS = ("op", "case", "direction", "impl", "baseline", "min_speedup", "status", "why_not", "speedup",
                "ours_ms", "baseline_ms", "memory_ratio", "max_memory_ratio")


def _results_problem(data: object) -> Optional[str]:
    """What keeps ``data`` from being a results file the report, ``--compare`` and ``--readme`` read."""
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
        return f"no \"format\": {RESULTS_FORMAT}"
    if not isinstance(data.get("environment"), dict):
        return "no environment"
    missing = [key for key in _ENVIRONMENT_KEYS if key not in data["environment"]]
    if missing:
        return f"the environment lacks {', '.join(missing)}"
    if not isinstance(data.get("groups"), list) or not isinstance(data.get("targets"), list):
        return "no list of groups or of targets"
    for index, target in enumerate(data["targets"]):
        if not isinstance(target, dict) or any(key not in target for key in _TARGET_KEYS):
            return f"target {index} lacks one of {', '.join(_TARGET_KEYS)}"
    for index, group in enumerate(data["groups"]):
        if not isinstance(group, dict) or any(key not in group for key in _GROUP_KEYS):
            return f"group {index} lacks one of {', '.join(_GROUP_KEYS)}"
        times = group["times_s"]
        if not (isinstance(times, dict) and isinstance(group["ours"], list)
                and all(isinstance(t, list) and t for t in times.values())
                and all(impl in times for impl in group["ours"])):
            return f"group {index} ({group['op']} {group['case']}) has an implementation of ours without times"
    return None


def recounted_flops(data: dict) -> dict:
    """``data`` (a results file) with each group's ``flops`` as the suites count it now, where the
    file was written by an older :data:`FLOP_COUNT`: the suite's group of the same (op, case,
    direction) on the file's device type, dtype and size, or None (no TFLOP/s) where it has none."""
    if data.get("flop_count") == FLOP_COUNT:
        return data
    env = data["environment"]
    counts = _suite_flops(env["device_type"], env["dtype"], env["size"])
    groups = [{**group, "flops": counts.get(_group_key(group))} for group in data["groups"]]
    return {**data, "flop_count": FLOP_COUNT, "groups": groups}


@functools.cache
def _suite_flops(device_type: str, dtype: str, size: str) -> dict[tuple[str, str, str], Optional[float]]:
    """Every suite's groups' FLOP counts on a setting, by (op, case, direction)."""
    setting = suites.Setting(torch.device(device_type), getattr(torch, dtype), size)
    counts = {}
    for name in suites.SUITES:
        try:
            counts.update({(g.op, g.case, g.direction): g.flops for g in suites.load(name).groups(setting)})
        except Exception:  # a suite this installation cannot load: its groups show no rate
            continue
    return counts


# ----------------------------------------------------------------------------- report.md


def _fmt(value: Optional[float], spec: str) -> str:
    return "—" if value is None or not math.isfinite(value) else format(value, spec)


def _summary_row(record: dict, impl: str, peak_tflops: Optional[float]) -> list[str]:
    times = record["times_s"]
    spread = timing.Summary.of([t * 1e3 for t in times[impl]])
    rate = tflops(record, impl)
    peer = best_peer(record)
    vs_reference = None if impl == record["reference"] else timing.ratio_summary(times, record["reference"], impl)
    vs_peer = None if peer in (None, impl) else timing.ratio_summary(times, peer, impl)
    peak_mib = record["peak_mem_bytes"][impl] / 2**20 if record["device"] == "cuda" else None
    return [impl, f"{spread.median:.3f}", f"{spread.low:.3f}–{spread.high:.3f}", _fmt(rate, ".3g"),
            _fmt(100 * rate / peak_tflops if peak_tflops and rate is not None else None, ".1f"), _fmt(peak_mib, ".1f"),
            _fmt(record["errors"].get(impl), ".1e"), ratio_text(vs_reference),
            "—" if vs_peer is None else f"{ratio_text(vs_peer)} {peer}"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _peak_tflops(env: dict) -> Optional[float]:
    return env["peak"]["tflops"] if env.get("peak") else None


def _environment_lines(env: dict) -> list[str]:
    peak = env["peak"]
    dirty = " (uncommitted changes)" if env.get("dirty") else ""
    return [
        f"- device: {env['device']} ({env['device_type']}), dtype {env['dtype']}, {env['size']} run",
        f"- date: {env['date']}; commit {env.get('commit') or 'unknown'}{dirty}",
        f"- torch {env['torch']}, triton {env.get('triton') or 'not installed'}, CUDA {env.get('cuda') or '—'}, "
        f"Python {env['python']}",
        f"- {env['threads']} torch threads on {env['cpu_count']} CPUs; load average at start "
        f"{env['load_average_1min_at_start']:.2f}",
        f"- peak: {peak['tflops']:.0f} TFLOP/s, {peak['gbps']:.0f} GB/s ({peak['source']})" if peak
        else "- peak: not known for CPUs (no % of peak)",
        *([f"- CPU kernels: torch's {env['cpu_capability']}; oneDNN's float32 GEMM "
           f"{env['onednn_gemm_speedup']:.1f}x the BLAS's (the eager backend's engine choices follow it)"]
          if "cpu_capability" in env else []),
        *([f"- memory: {env['malloc']}"] if "malloc" in env else []),
        *([f"- groups: those `--cases {env['cases']}` matches"] if env.get("cases") else []),
        *(["- cut short: groups the run had planned were not measured (see Targets)"] if env.get("cut_short") else []),
    ]


def targets_table(target_results: list[dict]) -> list[str]:
    rows = []
    for t in target_results:
        speedup = None if t["speedup"] is None else timing.Summary(**t["speedup"])
        memory = "—" if t["memory_ratio"] is None else f"{t['memory_ratio']:.2f}x"
        if t["max_memory_ratio"] is not None:
            memory += f" (≤ {t['max_memory_ratio']}x)"
        status = t["status"] if t["why_not"] is None else f"{t['status']}: {t['why_not']}"
        rows.append([t["op"], t["case"], t["direction"], t["impl"], t["baseline"], _fmt(t["ours_ms"], ".3f"),
                     _fmt(t["baseline_ms"], ".3f"), ratio_text(speedup, t["min_speedup"]), f"≥ {t['min_speedup']}x",
                     memory, status])
    return _table(["op", "case", "direction", "ours", "baseline", "ours ms", "baseline ms", f"speed-up ({LOW}–{HIGH})",
                   "target", "peak memory vs baseline", "status"], rows)


def key_table(records: list[dict], peak_tflops: Optional[float]) -> list[str]:
    """One row per group and implementation of ours: time, rate, error, speed-ups."""
    rows = []
    for record in records:
        for impl in record["ours"]:
            rows.append([record["op"], record["case"], record["direction"],
                         *_summary_row(record, impl, peak_tflops)])
    return _table(["op", "case", "direction", "ours", "median ms", f"{LOW}–{HIGH} ms", "TFLOP/s", "% of peak",
                   "peak MiB", "max error", "vs reference", "vs best peer"], rows)


def write_report(path: Path, env: dict, records: list[dict], target_results: list[dict], plots: list[str]) -> None:
    peak_tflops = _peak_tflops(env)
    lines = ["# transformer_kernels benchmark report", "", *_environment_lines(env), ""]
    lines += [
        "Each group's implementations ran interleaved: after warm-up, every round times each of them once "
        "(a sample of back-to-back calls, reported per call; on CUDA after an L2 flush, with CUDA events), in "
        "the orders of a Williams design, which let each run right after each other one equally often over each "
        "whole design (n rounds for n implementations, 2n for an odd n; a group runs whole designs where its "
        "round limit holds one). Times are medians over rounds with "
        f"their {LOW}–{HIGH} range; a speed-up is the median of the per-round ratios (the other's time / this "
        f"one's, same round) with their {LOW}–{HIGH} range. A target is met when the ratio's {LOW} reaches it, "
        f"within noise when the range straddles it, MISSED when even its {HIGH} falls short. TFLOP/s count useful "
        "work: attention's real query rows against the keys each sees (padding excluded, causal about halved), "
        "a projection's or model's weights against the real tokens they read; decoding counts none (—). Max error "
        "is the largest absolute difference of the outputs from the exact math (float64 on CPU, float32 on CUDA); "
        "for the models, of the training loss, and for greedy decoding the fraction of tokens that differ from the "
        "exact model's. Peak memory is measured on CUDA only.",
        "",
    ]
    failures = [(r, impl, why) for r in records for impl, why in r["failed"].items()]
    if failures:
        lines += ["## Failures", ""]
        lines += [f"- **{r['op']} {r['case']} {r['direction']}: `{impl}` failed**: {why}" for r, impl, why in failures]
        lines.append("")
    if target_results:
        lines += ["## Targets", "", *targets_table(target_results), ""]
    measured = [r for r in records if r["ours"]]
    if measured:
        lines += ["## Ours", "", *key_table(measured, peak_tflops), ""]
    missing = [r for r in records if not r["times_s"]]
    for record in missing:
        lines += [f"- {record['op']}: n/a: {reason}" for reason in record["unavailable"].values()]
    if missing:
        lines.append("")
    if plots:
        lines += ["## Plots", "", *[f"![{name}]({name})" for name in plots], ""]
    lines += ["## All measurements", ""]
    for record in records:
        if not record["times_s"]:
            continue
        lines += [f"### {record['op']} — {record['case']} — {record['direction']}", "",
                  f"{record['rounds']} rounds; reference `{record['reference']}`.", ""]
        impls = sorted(record["times_s"], key=lambda impl: median_ms(record, impl))
        lines += _table(["impl", "median ms", f"{LOW}–{HIGH} ms", "TFLOP/s", "% of peak", "peak MiB", "max error",
                         "vs reference", "vs best peer"], [_summary_row(record, impl, peak_tflops) for impl in impls])
        lines += [f"- `{impl}`: n/a: {reason}" for impl, reason in record["unavailable"].items()]
        lines += [f"- `{impl}`: FAILED: {reason}" for impl, reason in record["failed"].items()]
        lines.append("")
    path.write_text("\n".join(lines))


# ----------------------------------------------------------------------------- --compare


@dataclasses.dataclass(frozen=True)
class Change:
    """One implementation of one group in two runs: ``ratio`` = new median / old median; a regression
    when the new run's whole spread lies above the old one's (an improvement: below)."""

    key: tuple[str, str, str, str]
    old: timing.Summary
    new: timing.Summary

    @property
    def ratio(self) -> float:
        return self.new.median / self.old.median

    @property
    def verdict(self) -> str:
        if self.new.low > self.old.high:
            return "REGRESSION"
        if self.new.high < self.old.low:
            return "faster"
        return "within noise"


def compare(old: dict, new: dict) -> list[Change]:
    """Every (op, case, direction, impl) measured in both results."""
    old_times = {(r["op"], r["case"], r["direction"], impl): times
                 for r in old["groups"] for impl, times in r["times_s"].items()}
    changes = []
    for record in new["groups"]:
        for impl, times in record["times_s"].items():
            key = (record["op"], record["case"], record["direction"], impl)
            if key in old_times:
                changes.append(Change(key, timing.Summary.of(old_times[key]), timing.Summary.of(times)))
    return changes


def comparable(old_env: dict, new_env: dict) -> Optional[str]:
    """Why two runs' times do not compare (another dtype or device type), or None."""
    for key in ("device_type", "dtype"):
        if old_env.get(key) != new_env.get(key):
            return f"the runs differ in {key}: {old_env.get(key)} (old) and {new_env.get(key)} (new)"
    return None


def group_key(record: dict) -> tuple[str, str, str]:
    return record["op"], record["case"], record["direction"]


def failed_in(records: list[dict]) -> list[tuple[str, str, str, str]]:
    """(op, case, direction, impl) of each of our implementations that failed in a run's records."""
    return [(*group_key(r), impl) for r in records for impl in r.get("failed", {})]


def compare_text(changes: list[Change], old: dict, new: dict) -> str:
    old_env, new_env = old["environment"], new["environment"]
    lines = [f"{name}: {env['device']}, {env.get('dtype')}, {env.get('size')} run, {env['date']}, commit "
             f"{env.get('commit')}" for name, env in (("old", old_env), ("new", new_env))] + [""]
    rows = [[*change.key, f"{change.old.median * 1e3:.3f} ({change.old.low * 1e3:.3f}–{change.old.high * 1e3:.3f})",
             f"{change.new.median * 1e3:.3f} ({change.new.low * 1e3:.3f}–{change.new.high * 1e3:.3f})",
             f"{change.ratio:.2f}x", change.verdict] for change in changes]
    lines += _table(["op", "case", "direction", "impl", f"old ms ({LOW}–{HIGH})", f"new ms ({LOW}–{HIGH})",
                     "new / old", "verdict"], rows)
    regressions = sum(change.verdict == "REGRESSION" for change in changes)
    lines += ["", f"{regressions} regression(s) beyond the measured spread, {len(changes)} compared."]
    old_groups, new_groups = ({group_key(r) for r in results["groups"]} for results in (old, new))
    for name, only in (("old", old_groups - new_groups), ("new", new_groups - old_groups)):
        if only:
            lines.append(f"{len(only)} group(s) only in the {name} run.")
    lines += [f"FAILED in the new run: {' '.join(key)}" for key in failed_in(new["groups"])]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- --readme

README_START = "<!-- performance: generated by `python -m transformer_kernels.bench --readme`; do not edit -->"
README_END = "<!-- end of performance -->"


def latest_results(results_dir: Path) -> list[tuple[Path, dict]]:
    """For each device type (CUDA first), the ``results.json`` files under ``results_dir`` to show,
    each with only the groups and targets it stands for, the newest file first.

    Per op: its newest whole run, whose groups all stand; a run of some suites (``--only``)
    supersedes the older runs' results for its ops and leaves the others' standing.  Partial runs
    of an op newer than that (:func:`partial`: some of its cases, ``--cases``, or cut short) stand
    for the groups they measured, the newest first.  When that whole run is of a smaller preset than
    ``--full`` (``--quick``, whose cases may differ: the CPU's quick models run times smaller
    models than the full run's seed models), the op's newest full run stands too, for the cases (and
    directions) the newer runs did not time, after the partial runs between the two (newer than
    it, they stand first).  Older runs of an op show nothing, so cases a suite no longer has do not
    come back."""
    runs: dict[tuple[str, str], list[tuple[Path, dict]]] = {}
    for path in sorted(results_dir.glob("*/results.json")):
        data = recounted_flops(read_results(path))
        for op in {group["op"] for group in data["groups"]}:
            runs.setdefault((data["environment"]["device_type"], op), []).append((path, data))
    # path -> (device type, data, the (op, case, direction) keys it stands for)
    shown: dict[Path, tuple[str, dict, set]] = {}

    def stand(path: Path, data: dict, kind: str, op: str, taken: set) -> None:
        keys = {_group_key(g) for g in data["groups"] if g["op"] == op} - taken
        shown.setdefault(path, (kind, data, set()))[2].update(keys)
        taken |= keys

    for (kind, op), op_runs in runs.items():
        op_runs.sort(key=lambda run: run[1]["environment"]["date"], reverse=True)
        taken: set = set()
        for index, (path, data) in enumerate(op_runs):
            stand(path, data, kind, op, taken)
            if partial(data):
                continue
            if data["environment"]["size"] != "full":
                between = []
                for older in op_runs[index + 1:]:
                    if partial(older[1]):
                        between.append(older)
                    elif older[1]["environment"]["size"] == "full":
                        for run in (*between, older):
                            stand(*run, kind, op, taken)
                        break
            break
    newest_first = sorted(shown.items(), key=lambda item: item[1][1]["environment"]["date"], reverse=True)
    return [
        (path, {**data, "groups": [g for g in data["groups"] if _group_key(g) in keys],
                "targets": [t for t in data["targets"] if _group_key(t) in keys]})
        for path, (kind, data, keys) in sorted(newest_first, key=lambda item: item[1][0] != "cuda")
        if keys
    ]


def partial(data: dict) -> bool:
    """Whether a results file measured only some of its suites' groups: those ``--cases`` picked,
    or those before a time limit (``--time-limit``, or a run stopped from outside) cut it short."""
    env = data["environment"]
    return bool(env.get("cases")) or bool(env.get("cut_short"))


def _group_key(entry: dict) -> tuple[str, str, str]:
    """What a group or a target measures: ``(op, case, direction)``."""
    return entry["op"], entry["case"], entry["direction"]


def readme_section(results: list[tuple[Path, dict]], root: Path) -> str:
    lines = [README_START]
    for path, data in results:
        env = data["environment"]
        statuses = [t["status"] for t in data["targets"]]
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("met", "within noise", "MISSED", "not measured")
                           if statuses.count(s))
        dirty = ", with uncommitted changes" if env.get("dirty") else ""
        folder = Path(os.path.relpath(path.resolve().parent, root)).as_posix()
        lines += [
            "", f"**{env['device']}** ({env['dtype']}, {env['size']} run, {env['threads']} torch thread(s), load "
            f"{env['load_average_1min_at_start']:.1f}), {env['date'][:10]}, "
            f"commit `{(env.get('commit') or 'unknown')[:7]}`{dirty}, torch {env['torch']}, "
            f"triton {env.get('triton') or '—'}{', some cases' if partial(data) else ''}: [`{folder}/report.md`]"
            f"({folder}/report.md). Targets: {counts or 'none evaluated (the run stopped before its report)'}.", "",
        ]
        measured = [r for r in data["groups"] if r["ours"]]
        failures = [f"- FAILED: {' '.join(group_key(group))} {impl}: {_shortened(reason)}"
                    for group in data["groups"] for impl, reason in group.get("failed", {}).items()]
        lines += [*(key_table(measured, _peak_tflops(env)) if measured else []),
                  *([""] if measured and failures else []), *failures]
    lines += ["", README_END]
    return "\n".join(lines)


def _shortened(reason: str, limit: int = 160) -> str:
    """A failure's reason for the README (its report.md has it whole)."""
    return reason if len(reason) <= limit else reason[:limit - 3].rstrip() + "..."


def update_readme(readme: Path, section: str) -> None:
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no performance markers ({README_START!r} ... {README_END!r})")
    before, rest = text.split(README_START, 1)
    _, after = rest.split(README_END, 1)
    readme.write_text(before + section + after)
