"""Run the benchmark suites on the present device and write a report.

    python benchmarks/report.py                    # every suite, into benchmarks/results/<device>/
    python benchmarks/report.py --suites attention --out /tmp/bench
    python benchmarks/report.py --suites qkv -- -k seeds   # extra pytest arguments after --
    python benchmarks/report.py --report-only      # rewrite report.md from the JSON already there

Each suite ``benchmarks/bench_<name>.py`` runs in its own pytest process.  A
benchmark group (op, case, direction) times its implementations interleaved,
round by round (``benchmarks/interleaved.py``), so every ratio is a median of
per-round ratios, shown with its spread.  Written into the output folder:

- ``<name>.json``: every group's per-round times (seconds per call), calls per
  sample, peak memory, and the implementations left out and why,
- ``results.csv``: one row per group and implementation (median time, spread,
  rounds, peak memory),
- ``report.md``: every ``TARGETS`` entry of the suites for this device with its
  measured speedup (median and spread of the per-round ratios) and status,
  then per group each implementation's median time and its per-round speedup
  over every other implementation.  A target is met only when the spread's
  lower end is at or above it.

Numbers in the report come only from the JSON the run wrote.  The exit code
is 1 when a suite's pytest failed (the report then says which).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

import interleaved

BENCH_DIR = Path(__file__).resolve().parent
SUITES = ("attention", "qkv", "glu_conv", "nn")


def _device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _environment() -> dict:
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # Other processes on the machine skew every timing; the report keeps how busy it was.
        "load_average_1min_at_start": os.getloadavg()[0],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def run_suite(name: str, out_dir: Path, extra_args: list[str]) -> int:
    """Runs one suite into ``out_dir/<name>.json``; returns pytest's exit code."""
    command = [
        sys.executable, "-m", "pytest", str(BENCH_DIR / f"bench_{name}.py"),
        "-q", "-p", "no:cacheprovider", f"--results-json={out_dir / f'{name}.json'}", *extra_args,
    ]
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=False, cwd=BENCH_DIR.parent).returncode


def load_groups(json_paths: list[Path]) -> list[dict]:
    groups = []
    for path in json_paths:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if "groups" not in data:
            print(f"skipping {path}: not written by this harness (no interleaved groups)", file=sys.stderr)
            continue
        groups.extend(data["groups"])
    return groups


def load_targets(suites: list[str]) -> list[dict]:
    targets = []
    sys.path.insert(0, str(BENCH_DIR))
    try:
        for name in suites:
            spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"bench_{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up there
            spec.loader.exec_module(module)
            targets.extend(getattr(module, "TARGETS", []))
    finally:
        sys.path.remove(str(BENCH_DIR))
    return targets


def _key(group: dict) -> tuple[str, str, str]:
    return group["op"], group["case"], group["direction"]


def _median_ms(group: dict, impl: str) -> float:
    return interleaved.quantile(group["times_s"][impl], 0.5) * 1e3


def _ratio_text(summary: Optional[interleaved.Summary]) -> str:
    if summary is None:
        return "—"
    return f"{summary.median:.2f}x ({summary.low:.2f}–{summary.high:.2f})"


def evaluate_targets(targets: list[dict], groups: list[dict], device: str) -> list[dict]:
    by_key = {_key(group): group for group in groups}
    results = []
    for target in targets:
        if target["device"] != device:
            continue
        group = by_key.get((target["op"], target["case"], target["direction"]))
        ours, baseline = target["impl"], target["baseline"]
        speedup = None if group is None else interleaved.ratio_summary(group["times_s"], baseline, ours)
        met = speedup is not None and speedup.low >= target["min_speedup"]
        memory_ratio = None
        if "max_memory_ratio" in target and speedup is not None and group["peak_mem_bytes"][baseline] > 0:
            memory_ratio = group["peak_mem_bytes"][ours] / group["peak_mem_bytes"][baseline]
            met = met and memory_ratio <= target["max_memory_ratio"]
        status = "not measured" if speedup is None else ("met" if met else "MISSED")
        times = {impl: _median_ms(group, impl) for impl in (ours, baseline)} if speedup is not None else {}
        results.append({**target, "speedup": speedup, "memory_ratio": memory_ratio, "status": status,
                        "ours_ms": times.get(ours), "baseline_ms": times.get(baseline)})
    return results


def _csv_rows(groups: list[dict]) -> list[dict]:
    rows = []
    for group in groups:
        for impl, times in group["times_s"].items():
            spread = interleaved.Summary.of([t * 1e3 for t in times])
            rows.append({
                "op": group["op"], "case": group["case"], "direction": group["direction"], "impl": impl,
                "device": group["device"], "median_ms": spread.median, "low_ms": spread.low, "high_ms": spread.high,
                "rounds": group["rounds"], "calls_per_sample": group["calls"][impl],
                "peak_mem_mb": group["peak_mem_bytes"][impl] / 2**20,
            })
    return rows


def write_report(out_dir: Path, groups: list[dict], target_results: list[dict], env: dict,
                 suite_failures: dict[str, int]) -> Path:
    rows = _csv_rows(groups)
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["op"])
        writer.writeheader()
        writer.writerows(rows)
    low, high = (f"p{round(q * 100)}" for q in interleaved.SPREAD)
    lines = ["# transformer_kernels benchmark report", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += [
        "",
        "Each group's implementations ran interleaved: after warm-up, every round times each of them once "
        "(a sample of back-to-back calls, reported per call), in an order that rotates each round. "
        f"Times are medians over rounds with their {low}–{high} range; a speedup is the median of the per-round "
        f"ratios (other's time / this one's, same round) with the {low}–{high} range of those ratios in "
        f"parentheses. A target is met only when the ratio's {low} is at or above it.",
        "",
    ]
    for suite, code in suite_failures.items():
        lines.append(f"- **suite `{suite}` exited with pytest code {code}**: groups it did not finish are missing.")
    if suite_failures:
        lines.append("")
    if target_results:
        lines += [
            "## Targets", "",
            f"| op | case | direction | ours | baseline | ours ms | baseline ms | speedup ({low}–{high}) | target "
            "| peak memory vs baseline | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in target_results:
            memory = "—" if t["memory_ratio"] is None else f"{t['memory_ratio']:.2f}x"
            if "max_memory_ratio" in t:
                memory += f" (≤ {t['max_memory_ratio']}x)"
            ours_ms = "—" if t["ours_ms"] is None else f"{t['ours_ms']:.3f}"
            baseline_ms = "—" if t["baseline_ms"] is None else f"{t['baseline_ms']:.3f}"
            lines.append(
                f"| {t['op']} | {t['case']} | {t['direction']} | {t['impl']} | {t['baseline']} | {ours_ms} "
                f"| {baseline_ms} | {_ratio_text(t['speedup'])} | ≥ {t['min_speedup']}x | {memory} | {t['status']} |"
            )
        lines.append("")
    lines += ["## All measurements", ""]
    for group in groups:
        times = group["times_s"]
        impls = sorted(times, key=lambda impl: _median_ms(group, impl))
        lines += [f"### {group['op']} — {group['case']} — {group['direction']}", "", f"{group['rounds']} rounds.", ""]
        lines += [f"- `{impl}` not measured: {reason}" for impl, reason in group["unavailable"].items()]
        if group["unavailable"]:
            lines.append("")
        if not impls:
            continue
        lines.append(f"| impl | median ms | {low}–{high} ms | calls per sample | peak MiB (CUDA) | "
                     + " | ".join(f"vs {impl}" for impl in impls) + " |")
        lines.append("|---" * (5 + len(impls)) + "|")
        for impl in impls:
            spread = interleaved.Summary.of([t * 1e3 for t in times[impl]])
            ratios = " | ".join(
                "—" if other == impl else _ratio_text(interleaved.ratio_summary(times, other, impl)) for other in impls
            )
            peak = f"{group['peak_mem_bytes'][impl] / 2**20:.1f}" if group["device"] == "cuda" else "—"
            lines.append(
                f"| {impl} | {spread.median:.3f} | {spread.low:.3f}–{spread.high:.3f} | {group['calls'][impl]} "
                f"| {peak} | {ratios} |"
            )
        lines.append("")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    (out_dir / "environment.json").write_text(json.dumps(env, indent=2))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<device>)")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument("--report-only", action="store_true",
                        help="do not run the suites: rewrite report.md and results.csv from the JSON in the output folder")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    device = _device_type()
    out_dir = args.out or BENCH_DIR / "results" / device
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = load_targets(args.suites)
    json_paths = [out_dir / f"{name}.json" for name in args.suites]
    suite_failures: dict[str, int] = {}

    def report() -> tuple[Path, list[dict]]:
        groups = load_groups(json_paths)
        target_results = evaluate_targets(targets, groups, device)
        return write_report(out_dir, groups, target_results, env, suite_failures), target_results

    if args.report_only:
        env_path = out_dir / "environment.json"
        env = json.loads(env_path.read_text()) if env_path.exists() else _environment()
    else:
        env = _environment()
        for path in json_paths:  # never report a previous run's numbers
            path.unlink(missing_ok=True)
        for name in args.suites:
            code = run_suite(name, out_dir, args.pytest_args)
            if code != 0:
                suite_failures[name] = code
            report()  # after every suite, so a run cut short still leaves a report of what it measured
    report_path, target_results = report()
    print(f"\nwrote {report_path}")
    for t in target_results:
        speedup = "not measured" if t["speedup"] is None else _ratio_text(t["speedup"])
        print(f"{t['status']:>12}  {t['op']} {t['case']} {t['direction']}: {t['impl']} vs {t['baseline']} "
              f"{speedup} (target {t['min_speedup']}x)")
    return 1 if suite_failures else 0


if __name__ == "__main__":
    sys.exit(main())
