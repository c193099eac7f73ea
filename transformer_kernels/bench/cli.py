"""The command line of ``python -m transformer_kernels.bench`` (also ``transformer-kernels-bench``).

    python -m transformer_kernels.bench                         # the report for this device
    python -m transformer_kernels.bench --full --only attention,qkv --out DIR
    python -m transformer_kernels.bench --check                 # outputs and gradients vs float64
    python -m transformer_kernels.bench --compare OLD.json NEW.json
    python -m transformer_kernels.bench --readme                # README's performance section

Exit status: 2 for a usage error (an argument this machine or command cannot take); 1 when one of
our implementations failed (report, or the new run of ``--compare``), a check failed (``--check``) or
a regression beyond the measured spread was found (``--compare``); 0 otherwise.  Missed targets do
not change it: the report's Targets table shows them.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from .._checks import machine_device
from . import check, environment, plots, report, run, suites, timing

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
# --only names -> the ops --check knows them by.
CHECK_OPS = {"attention": ("attention",), "qkv": ("qkv",), "glu": ("glu_conv", "glu_conv_update")}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m transformer_kernels.bench",
        description="Benchmark transformer_kernels against the naive reference and torch's own paths, or check "
                    "its gradients.")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick",
                      help="a subset of the cases and shorter rounds (the default on CPU; minutes on 2 cores)")
    size.add_argument("--full", dest="size", action="store_const", const="full",
                      help="every case of this device (the default on CUDA)")
    size.add_argument("--tiny", dest="size", action="store_const", const="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--only", default=",".join(suites.SUITES),
                        help=f"comma-separated suites (default all: {','.join(suites.SUITES)})")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default benchmarks/results/<device>-<date> under the current folder, or "
                             "<device>-<date>-<time> where that one holds a run already)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default cuda when available)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="benchmark dtype (default bfloat16 on CUDA, float32 on CPU); with --check, the one "
                             "dtype to check (default float64 and float32, and float16 and bfloat16 on CUDA)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch CPU threads (default torch's own choice)")
    parser.add_argument("--cases", type=_pattern, default=None, metavar="REGEX",
                        help="only the groups whose \"op case direction\" (as the report names them, e.g. "
                             "\"attention padded_B8_L2048_D64 fwd+bwd\") this regular expression matches "
                             "(re.search)")
    parser.add_argument("--time-limit", type=_positive_float, default=None, metavar="SECONDS",
                        help="start no group after this many seconds; the group in flight finishes, and the "
                             "report covers what was measured (its other targets: cut short)")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="on a CPU, time with the C library allocator's own settings (default: glibc keeps "
                             "freed memory mapped, so that page faults do not decide the ratios)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="no timing: compare every op's outputs and gradients with a float64 reference")
    mode.add_argument("--compare", nargs=2, type=Path, metavar=("OLD.json", "NEW.json"),
                      help="per-case ratios of two results.json, flagging regressions beyond the measured spread")
    mode.add_argument("--readme", nargs="?", type=Path, const=Path("README.md"), metavar="README",
                      help="rewrite the performance section of README (default README.md) from the newest "
                           "results.json per device type under benchmarks/results")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"), help=argparse.SUPPRESS)
    return parser


def _suite_names(parser: argparse.ArgumentParser, only: str) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in only.split(",") if name.strip()))
    unknown = [name for name in names if name not in suites.SUITES]
    if unknown or not names:
        parser.error(f"--only: {f'unknown suite(s) {unknown}' if unknown else 'no suite'}; expected a "
                     f"comma-separated subset of {','.join(suites.SUITES)}")
    return names


def _device(parser: argparse.ArgumentParser, name: Optional[str]) -> torch.device:
    """The device to run on: ``name``, or CUDA where available; a usage error for one this
    machine does not have."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return machine_device(name)
    except ValueError as error:
        parser.error(f"--device: {error}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _pattern(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"not a regular expression ({error}): {text}")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _make_folder(parser: argparse.ArgumentParser, out: Path) -> None:
    """``out`` created and writable, or a usage error saying why not."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        parser.error(f"--out {out}: cannot write there ({error.strerror or error})")


def _benchmark(parser: argparse.ArgumentParser, args, device: torch.device, names: list[str],
               deadline: Optional[float]) -> int:
    size = args.size or ("full" if device.type == "cuda" else "quick")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    setting = suites.Setting(device, dtype, size)
    selected = (lambda key: True) if args.cases is None else (lambda key: bool(args.cases.search(" ".join(key))))
    if args.cases is not None and not any(map(selected, report.planned_keys(names, setting))):
        parser.error(f"--cases: {args.cases.pattern!r} matches no group of this run ({size}, on {device.type}, "
                     f"suites {','.join(names)}); a group is named \"op case direction\", as in the report")
    if args.out is not None:  # before the environment is measured (oneDNN's speed-up takes seconds on a CPU)
        _make_folder(parser, args.out)
    env = environment.environment(device, dtype, size)
    env["cases"] = None if args.cases is None else args.cases.pattern
    if device.type == "cpu":
        env["malloc"] = timing.cpu_malloc(keep_freed_memory=not args.malloc_defaults)
    kind = env["device"] if device.type == "cuda" else f"cpu-{env['device']}"
    out = args.out
    if out is None:
        out = Path("benchmarks/results") / f"{_slug(kind)}-{env['date'][:10]}"
        if (out / "results.json").exists():  # that day's earlier run stays (--readme composes them)
            out = out.with_name(f"{out.name}-{env['date'][11:19].replace(':', '')}")
        _make_folder(parser, out)
    print(f"{env['device']}, {env['dtype']}, {size} run, {env['threads']} torch threads; writing {out}",
          file=sys.stderr)
    targets = report.load_targets(names)
    records: list[dict] = []

    def save(record: dict) -> None:  # after every group, so a run cut short keeps what it measured
        records.append(record)
        report.write_results(out / "results.json", env, records, [])

    targeted = {(t.op, t.case, t.direction) for t in targets if t.device == device.type}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: still write the report below
    # Every save before the end says the run is cut short: one killed (SIGKILL, out of memory, a lost
    # machine) never reaches the report below, and its results.json must not pass for a whole run.
    cut_short = env["cut_short"] = True
    try:
        cut_short = not run.run_suites(
            names, setting, timing.Schedule.for_device(device, size), save,
            first=lambda group: (group.op, group.case, group.direction) in targeted,
            select=lambda group: selected((group.op, group.case, group.direction)),
            deadline=deadline)
    finally:
        env["cut_short"] = cut_short
        target_results = report.evaluate_targets(targets, records, device.type,
                                                 report.absent_reasons(names, setting, cut_short, selected))
        report.write_results(out / "results.json", env, records, target_results)
        plot_names, no_plots = plots.write_plots(out, records)
        report.write_report(out / "report.md", env, records, target_results, plot_names)
        print(f"\nwrote {out / 'report.md'}, {out / 'results.json'} and {len(plot_names)} plot(s)"
              + (f" (no plots: {no_plots})" if no_plots else ""))
        for t in (t for t in target_results if t["status"] != "not measured"):
            speedup = None if t["speedup"] is None else timing.Summary(**t["speedup"])
            print(f"{t['status']:>12}  {t['op']} {t['case']} {t['direction']}: {t['impl']} vs {t['baseline']} "
                  f"{report.ratio_text(speedup, t['min_speedup'])} (target {t['min_speedup']}x)")
    failed = report.failed_in(records)
    for failure in failed:
        print("FAILED: " + " ".join(failure), file=sys.stderr)
    return 1 if failed else 0


def _check(args, device: torch.device, ops: list[str]) -> int:
    dtypes = (DTYPES[args.dtype],) if args.dtype else check.check_dtypes(device)
    print(f"gradient self-check on {environment.device_name(device)}, torch {torch.__version__}", flush=True)
    results = check.run_check(device, dtypes, ops)
    print(check.check_table(results))
    unavailable = {(r.backend, r.dtype, r.reason) for r in results if r.status == "n/a"}
    for backend, dtype, reason in sorted(unavailable):
        print(f"n/a: {backend} {dtype}: {reason}")
    failures = sum(r.status == "FAIL" for r in results)
    passes = sum(r.status == "pass" for r in results)
    print(f"\n{passes} passed, {failures} failed, {len(results) - passes - failures} n/a")
    return 1 if failures or not passes else 0


def _compare(parser: argparse.ArgumentParser, old_path: Path, new_path: Path) -> int:
    try:
        old, new = report.read_results(old_path), report.read_results(new_path)
    except ValueError as error:
        parser.error(f"--compare: {error}")
    why_not = report.comparable(old["environment"], new["environment"])
    if why_not:
        parser.error(f"--compare: {why_not}")
    changes = report.compare(old, new)
    print(report.compare_text(changes, old, new))
    regressed = any(change.verdict == "REGRESSION" for change in changes)
    return 1 if regressed or report.failed_in(new["groups"]) else 0


def _readme(parser: argparse.ArgumentParser, readme: Path, results_dir: Path) -> int:
    try:
        latest = report.latest_results(results_dir)
        if not latest:
            parser.error(f"--readme: no results.json with a measured group under {results_dir}/*/")
        report.update_readme(readme, report.readme_section(latest, readme.resolve().parent))
    except (OSError, ValueError) as error:
        parser.error(f"--readme {readme}: {error}")
    print(f"rewrote the performance section of {readme} from " + ", ".join(str(path) for path, _ in latest))
    return 0


def _refuse_what_the_mode_ignores(parser: argparse.ArgumentParser, args) -> None:
    """A usage error for an option the chosen mode would ignore: ``--compare`` and ``--readme``
    read results files and take no run option; ``--check`` takes ``--only``, ``--device``,
    ``--dtype`` and ``--threads``."""
    mode = next((name for name, given in (("--check", args.check), ("--compare", args.compare),
                                           ("--readme", args.readme)) if given), None)
    if mode is None:
        return
    given = {"--only": args.only != parser.get_default("only"), "--device": args.device is not None,
             "--dtype": args.dtype is not None, "--threads": args.threads is not None,
             "--out": args.out is not None, "--quick/--full": args.size is not None,
             "--cases": args.cases is not None, "--time-limit": args.time_limit is not None,
             "--malloc-defaults": args.malloc_defaults}
    taken = ("--only", "--device", "--dtype", "--threads") if mode == "--check" else ()
    ignored = [name for name, was_given in given.items() if was_given and name not in taken]
    if ignored:
        parser.error(f"{' and '.join(ignored)} {'apply' if len(ignored) > 1 else 'applies'} to a benchmark run, "
                     f"not to {mode}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    _refuse_what_the_mode_ignores(parser, args)
    if args.compare:
        return _compare(parser, *args.compare)
    if args.readme:
        return _readme(parser, args.readme, args.results)
    names = _suite_names(parser, args.only)
    device = _device(parser, args.device)
    check_ops = [op for name in names if name in CHECK_OPS for op in CHECK_OPS[name]]
    unchecked = [name for name in names if name not in CHECK_OPS]
    if args.check and (not check_ops or (unchecked and args.only != parser.get_default("only"))):
        parser.error(f"--check covers the suites {','.join(CHECK_OPS)}; --only names "
                     f"{','.join(unchecked) if check_ops else 'none of them'}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr)
    if args.check:
        return _check(args, device, check_ops)
    return _benchmark(parser, args, device, names, deadline)


if __name__ == "__main__":
    sys.exit(main())
