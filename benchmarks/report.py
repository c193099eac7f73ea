"""Run the benchmark suites on the present device and write a report.

    python benchmarks/report.py                 # every suite, into benchmarks/results/<device>/
    python benchmarks/report.py --suites attention --out /tmp/bench

Each suite ``benchmarks/bench_<name>.py`` runs in its own pytest process with
``--benchmark-json``; this script then writes, into the output folder:

- ``<name>.json``: pytest-benchmark's raw results (every round),
- ``results.csv``: one row per measurement (median, IQR, peak memory),
- ``report.md``: per benchmark group, each implementation's median time and
  its speedup over every other implementation in the group, then every
  ``TARGETS`` entry of the suites for this device with its measured speedup
  and whether it was met.

Numbers in the report come only from the JSON the run wrote.
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

BENCH_DIR = Path(__file__).resolve().parent
SUITES = ("attention", "qkv", "glu_conv")


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


def run_suite(name: str, out_dir: Path, extra_args: list[str]) -> Path:
    json_path = out_dir / f"{name}.json"
    command = [
        sys.executable, "-m", "pytest", str(BENCH_DIR / f"bench_{name}.py"),
        "-q", "-p", "no:cacheprovider", f"--benchmark-json={json_path}", *extra_args,
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=False, cwd=BENCH_DIR.parent)
    return json_path


def load_rows(json_paths: list[Path]) -> list[dict]:
    rows = []
    for path in json_paths:
        if not path.exists():
            continue
        for bench in json.loads(path.read_text())["benchmarks"]:
            info, stats = bench["extra_info"], bench["stats"]
            rows.append({
                "op": info["op"], "case": info["case"], "direction": info["direction"], "impl": info["impl"],
                "device": info["device"], "median_ms": stats["median"] * 1e3, "iqr_ms": stats["iqr"] * 1e3,
                "rounds": stats["rounds"], "peak_mem_mb": info.get("peak_mem_bytes", 0) / 2**20,
            })
    return rows


def load_targets(suites: list[str]) -> list[dict]:
    targets = []
    for name in suites:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"bench_{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        sys.path.insert(0, str(BENCH_DIR))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(BENCH_DIR))
        targets.extend(getattr(module, "TARGETS", []))
    return targets


def _groups(rows: list[dict]) -> dict:
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        groups.setdefault((row["op"], row["case"], row["direction"]), {})[row["impl"]] = row
    return groups


def evaluate_targets(targets: list[dict], rows: list[dict], device: str) -> list[dict]:
    groups = _groups(rows)
    results = []
    for target in targets:
        if target["device"] != device:
            continue
        group = groups.get((target["op"], target["case"], target["direction"]), {})
        ours, baseline = group.get(target["impl"]), group.get(target["baseline"])
        speedup = baseline["median_ms"] / ours["median_ms"] if ours and baseline else None
        met = speedup is not None and speedup >= target["min_speedup"]
        memory_ratio = None
        if "max_memory_ratio" in target and ours and baseline and baseline["peak_mem_mb"] > 0:
            memory_ratio = ours["peak_mem_mb"] / baseline["peak_mem_mb"]
            met = met and memory_ratio <= target["max_memory_ratio"]
        status = "not measured" if speedup is None else ("met" if met else "MISSED")
        results.append({**target, "speedup": speedup, "memory_ratio": memory_ratio, "status": status})
    return results


def write_report(out_dir: Path, rows: list[dict], target_results: list[dict], env: dict) -> Path:
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["op"])
        writer.writeheader()
        writer.writerows(rows)
    lines = ["# transformer_kernels benchmark report", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += ["", "Times are medians over the rounds pytest-benchmark ran; speedup = other impl's median / this impl's median.", ""]
    if target_results:
        lines += ["## Targets", "", "| op | case | direction | ours | baseline | speedup | target | peak memory vs baseline | status |", "|---|---|---|---|---|---|---|---|---|"]
        for t in target_results:
            speedup = "—" if t["speedup"] is None else f"{t['speedup']:.2f}x"
            target = f"≥ {t['min_speedup']}x"
            memory = "—" if t["memory_ratio"] is None else f"{t['memory_ratio']:.2f}x"
            if "max_memory_ratio" in t:
                memory += f" (≤ {t['max_memory_ratio']}x)"
            lines.append(f"| {t['op']} | {t['case']} | {t['direction']} | {t['impl']} | {t['baseline']} | {speedup} | {target} | {memory} | {t['status']} |")
        lines.append("")
    lines += ["## All measurements", ""]
    for (op, case, direction), impls in sorted(_groups(rows).items()):
        lines += [f"### {op} — {case} — {direction}", "", "| impl | median ms | IQR ms | peak MiB | " + " | ".join(f"vs {i}" for i in impls) + " |"]
        lines.append("|---" * (4 + len(impls)) + "|")
        for impl, row in sorted(impls.items(), key=lambda item: item[1]["median_ms"]):
            ratios = " | ".join(f"{other['median_ms'] / row['median_ms']:.2f}x" for other in impls.values())
            lines.append(f"| {impl} | {row['median_ms']:.3f} | {row['iqr_ms']:.3f} | {row['peak_mem_mb']:.1f} | {ratios} |")
        lines.append("")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    (out_dir / "environment.json").write_text(json.dumps(env, indent=2))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<device>)")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    device = _device_type()
    out_dir = args.out or BENCH_DIR / "results" / device
    out_dir.mkdir(parents=True, exist_ok=True)
    json_paths = [run_suite(name, out_dir, args.pytest_args) for name in args.suites]
    rows = load_rows(json_paths)
    target_results = evaluate_targets(load_targets(args.suites), rows, device)
    report = write_report(out_dir, rows, target_results, _environment())
    print(f"\nwrote {report}")
    for t in target_results:
        speedup = "not measured" if t["speedup"] is None else f"{t['speedup']:.2f}x"
        print(f"{t['status']:>12}  {t['op']} {t['case']} {t['direction']}: {t['impl']} vs {t['baseline']} {speedup} (target {t['min_speedup']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
