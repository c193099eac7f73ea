"""The benchmark command ``python -m transformer_kernels.bench``: a tiny run reports every case with
a finite time and error and draws its plots, ``--check`` passes here and catches a wrong op,
``--compare`` flags only changes beyond the measured spread, ``--readme`` writes its section.  All on
the CPU, also on a GPU machine (whose runs are benchmarks/gpu_check.sh's)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import pathlib
import platform
import re
import sys
from typing import Optional

import pytest
import torch

from _helpers import script_output

from transformer_kernels.bench import check, cli, graphs, report, run, suites, timing

CPU = torch.device("cpu")


@pytest.fixture
def one_thread():
    """The command runs with ``--threads 1`` (a loaded 2-core machine times tiny ops better on one
    thread); the rest of the session keeps torch's thread count."""
    threads = torch.get_num_threads()
    yield ["--threads", "1"]
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One ``--tiny`` run of every suite on the CPU (where every case runs on eager), shared by the
    tests that read its output."""
    out = tmp_path_factory.mktemp("tiny")
    threads = torch.get_num_threads()
    try:
        code = cli.main(["--tiny", "--device", "cpu", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, out


def _expected_groups() -> list[tuple[str, str, str]]:
    setting = suites.Setting(CPU, torch.float32, "tiny")
    expected = []
    for name in suites.SUITES:
        try:
            module = suites.load(name)
        except suites.SuiteUnavailable:
            continue
        expected += [(group.op, group.case, group.direction) for group in module.groups(setting)]
    return expected


def test_tiny_run_reports_every_case_with_finite_time_and_error(tiny_run):
    code, out = tiny_run
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    env = results["environment"]
    for key in ("device", "torch", "triton", "commit", "dirty", "date", "threads", "malloc"):
        assert key in env, key
    assert env["threads"] == 1
    records = {(r["op"], r["case"], r["direction"]): r for r in results["groups"]}
    expected = _expected_groups()
    assert expected and set(expected) <= set(records)
    report_md = (out / "report.md").read_text()
    assert not re.search(r"\{[A-Za-z_]+\}", report_md), "a placeholder left unformatted"
    for key in expected:
        record = records[key]
        assert record["ours"] == ["eager"], (key, record["unavailable"], record["failed"])
        for impl in record["ours"] + [record["reference"]]:
            assert len(record["times_s"][impl]) == record["rounds"] >= 2
            design = len(timing.round_orders(len(record["times_s"])))
            assert record["rounds"] % design == 0 or design > 3, "the tiny schedule's 3 rounds hold a design"
            assert all(math.isfinite(t) and t > 0 for t in record["times_s"][impl]), (key, impl)
            assert math.isfinite(record["errors"][impl]) and record["errors"][impl] < 1e-3, (key, impl)
        median = report.median_ms(record, "eager")
        assert f"| {key[0]} | {key[1]} | {key[2]} | eager | {median:.3f} |" in report_md


def test_groups_picked_first_run_first_taking_turns_between_suites(monkeypatch):
    # The CLI picks the groups with a target here, so that a run cut off by a time limit measured
    # some of every op's: the first picked group of each suite, then the second of each, ...
    monkeypatch.setattr(run, "measure_group", lambda group, device, schedule: (group.op, group.case, group.direction))
    setting = suites.Setting(CPU, torch.float32, "tiny")
    measured = []
    run.run_suites(["attention", "glu"], setting, timing.Schedule.for_device(CPU, "tiny"), measured.append,
                   first=lambda group: group.direction == "fwd+bwd")
    in_order = [key for key in _expected_groups()
                if key[0] in ("attention", "glu_conv1d", "glu_conv1d_step", "glu_conv1d_update")]
    attention = [key for key in in_order if key[0] == "attention" and key[2] == "fwd+bwd"]
    glu = [key for key in in_order if key[0] != "attention" and key[2] == "fwd+bwd"]
    assert len(attention) > len(glu) >= 2
    turns = [key for pair in zip(attention, glu) for key in pair] + attention[len(glu):]
    assert measured == turns + [key for key in in_order if key[2] != "fwd+bwd"]


def test_no_group_starts_after_the_deadline(monkeypatch):
    """``--time-limit``: the bench stops by itself, so that its report is written however the
    command around it would have been stopped."""
    clock = iter(range(100))
    monkeypatch.setattr(run.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(run, "measure_group", lambda group, device, schedule: group.case)
    setting = suites.Setting(CPU, torch.float32, "tiny")
    measured = []
    schedule = timing.Schedule.for_device(CPU, "tiny")
    assert run.run_suites(["glu"], setting, schedule, measured.append, deadline=2) is False
    assert len(measured) == 2  # the clock read 0 and 1 before the first two groups, 2 before the third
    measured.clear()
    assert run.run_suites(["glu"], setting, schedule, measured.append) is True
    assert len(measured) == len(suites.load("glu").groups(setting))


def test_cases_selects_groups_by_name_and_says_why_a_target_is_absent(monkeypatch, tmp_path):
    keys = []
    monkeypatch.setattr(run, "measure_group", lambda group, device, schedule: keys.append(
        (group.op, group.case, group.direction)) or _group(group.op, group.case, {"eager": OLD_TIMES}))
    assert cli.main(["--device", "cpu", "--only", "glu", "--cases", "_L60_.* fwd$", "--out", str(tmp_path)]) == 0
    assert keys and all("_L60_" in case and direction == "fwd" for _, case, direction in keys)
    results = json.loads((tmp_path / "results.json").read_text())
    planned = report.planned_keys(["glu"], suites.Setting(CPU, torch.float32, "quick"))
    whys = {(t["op"], t["case"], t["direction"]): t["why_not"] for t in results["targets"]}
    left_out = [key for key in whys if key in planned and key not in keys]
    assert left_out and all(whys[key] == report.NOT_SELECTED for key in left_out)
    for bad in ("(", "no_such_case"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--device", "cpu", "--only", "glu", "--cases", bad, "--out", str(tmp_path / "unmade")])
        assert exit_info.value.code == 2 and not (tmp_path / "unmade").exists()
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            cli.main(["--device", "cpu", "--time-limit", bad])
    for mode in (["--check"], ["--readme", str(tmp_path / "README.md")]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*mode, "--cases", "glu", "--device", "cpu"])
        assert exit_info.value.code == 2


def test_materializing_implementations_sit_out_long_cases_on_cuda():
    """On CUDA the naive math, SDPA's math backend and the eager backend hold [B, H, L, L] scores:
    past L = 2048 they say so instead of running out of memory (the eager backward of L = 16384
    did on an H200) and failing the run."""
    from transformer_kernels.bench.suites import attention

    for group in _groups_by_case("attention", device="cuda").values():
        length = group.params["length"]
        for impl in ("reference", "torch_sdpa_math", "eager"):
            skipped = group.unavailable.get(impl, "").startswith("materializes")
            assert skipped == (length > attention.MATERIALIZED_MAX_LENGTH), (group.case, impl)


def test_attention_implementations_end_at_the_merged_context():
    """Every attention implementation is timed up to the ``[B, L, H * D]`` context the seeds' output
    projection takes (the naive math paying its head merge), and agrees with the exact math there."""
    setting = suites.Setting(CPU, torch.float32, "tiny")
    attention = suites.load("attention")
    group = next(g for g in attention.groups(setting) if g.case.startswith("padded") and g.direction == "fwd")
    case = next(c for c in attention.cases(setting) if c.name == group.case)
    for name in ("eager", "reference", "torch_sdpa"):
        impl = group.setups[name]()
        with torch.no_grad():
            out = impl.forward()
        assert out.shape == (case.batch, case.length, case.heads * case.head_dim), name
        assert group.error(out) < 1e-5, name


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_cpu_runs_keep_freed_memory_mapped(tiny_run):
    # The allocator's page faults otherwise swing millisecond-scale CPU ratios by +-20% (timing.py).
    _, out = tiny_run
    malloc = json.loads((out / "results.json").read_text())["environment"]["malloc"]
    assert malloc.startswith("glibc keeps freed memory mapped"), malloc
    assert f"- memory: {malloc}" in (out / "report.md").read_text()


def test_unavailable_suite_shows_why(tmp_path, monkeypatch):
    monkeypatch.setitem(suites.SUITES, "ghost", "transformer_kernels.bench.suites.no_such_suite")
    assert cli.main(["--tiny", "--device", "cpu", "--threads", "1", "--only", "ghost", "--out", str(tmp_path)]) == 0
    reason = "transformer_kernels.bench.suites.no_such_suite cannot be imported: No module named"
    [record] = json.loads((tmp_path / "results.json").read_text())["groups"]
    assert record["op"] == "ghost" and record["unavailable"]["ghost"].startswith(reason)
    assert f"ghost: n/a: {reason}" in (tmp_path / "report.md").read_text()


def test_unavailable_peers_show_why(tiny_run):
    _, out = tiny_run
    results = json.loads((out / "results.json").read_text())
    report_md = (out / "report.md").read_text()
    padded = next(r for r in results["groups"] if r["op"] == "attention" and r["case"].startswith("padfrac"))
    assert padded["unavailable"]["varlen_attn"] == "varlen_attn runs on CUDA only"
    assert "`varlen_attn`: n/a: varlen_attn runs on CUDA only" in report_md


def test_tiny_run_draws_plots(tiny_run):
    pytest.importorskip("matplotlib", reason="the plots need the test extra's matplotlib")
    _, out = tiny_run
    for name in ("attention_time_vs_length.png", "speedup_vs_padding.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, name
        assert f"![{name}]({name})" in (out / "report.md").read_text()


def test_check_passes(one_thread, capsys):
    assert cli.main(["--check", "--device", "cpu", *one_thread]) == 0
    printed = capsys.readouterr().out
    assert "| attention | eager | padded_causal_B2_H2_L17_D33 | float32 |" in printed
    assert " 0 failed" in printed


def test_check_fails_on_a_wrong_op(one_thread, monkeypatch, capsys):
    right = check.GRID[-1]
    wrong = dataclasses.replace(right, name="off_by_one_percent",
                                ours=lambda backend: lambda *args: right.ours(backend)(*args) * 1.01)
    monkeypatch.setattr(check, "GRID", [right, wrong])
    assert cli.main(["--check", "--device", "cpu", "--dtype", "float64", *one_thread]) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if "| eager |" in line]
    assert [row.rsplit("|", 2)[-2].strip() for row in rows] == ["pass", "FAIL"]


def _group(op: str, case: str, times_by_impl: dict[str, list[float]], flops: Optional[float] = 1e9) -> dict:
    ours = [impl for impl in ("eager", "triton") if impl in times_by_impl]  # a run lists only what it timed
    return {"op": op, "case": case, "direction": "fwd", "device": "cpu", "ours": ours, "reference": "reference",
            "params": {}, "flops": flops, "rounds": len(next(iter(times_by_impl.values()), [])), "calls": {},
            "times_s": times_by_impl, "peak_mem_bytes": {}, "errors": {}, "unavailable": {}, "failed": {}}


def _results(times_by_impl: dict[str, list[float]]) -> dict:
    env = {"device": "test", "device_type": "cpu", "dtype": "float32", "size": "quick",
           "date": "2026-01-01T00:00:00+00:00", "commit": "0" * 40, "torch": "2.13.0", "threads": 1,
           "load_average_1min_at_start": 0.0}
    return {"format": report.RESULTS_FORMAT, "flop_count": report.FLOP_COUNT, "environment": env, "targets": [],
            "groups": [_group("attention", "c", times_by_impl)]}


OLD_TIMES = [1.00, 1.02, 0.98, 1.05, 0.95, 1.01, 0.99, 1.03, 0.97, 1.00]


@pytest.mark.parametrize("scale, verdict", [(1.03, "within noise"), (0.97, "within noise"), (1.5, "REGRESSION"),
                                            (0.6, "faster")])
def test_compare_flags_only_changes_beyond_the_spread(scale, verdict):
    old = _results({"eager": OLD_TIMES})
    new = _results({"eager": [t * scale for t in OLD_TIMES], "triton": OLD_TIMES})
    (change,) = report.compare(old, new)  # triton was not in the old run
    assert change.key == ("attention", "c", "fwd", "eager")
    assert change.ratio == pytest.approx(scale)
    assert change.verdict == verdict


def test_compare_command_exits_non_zero_on_a_regression(tmp_path, capsys):
    old, same, slower = tmp_path / "old.json", tmp_path / "same.json", tmp_path / "slower.json"
    old.write_text(json.dumps(_results({"eager": OLD_TIMES})))
    same.write_text(json.dumps(_results({"eager": OLD_TIMES[::-1]})))
    slower.write_text(json.dumps(_results({"eager": [2 * t for t in OLD_TIMES]})))
    assert cli.main(["--compare", str(old), str(same)]) == 0
    assert cli.main(["--compare", str(old), str(slower)]) == 1
    assert "| attention | c | fwd | eager |" in capsys.readouterr().out


def test_compare_names_what_it_cannot_compare_and_what_failed(tmp_path, capsys):
    old, new, other_dtype = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "float16.json"
    old.write_text(json.dumps(_results({"eager": OLD_TIMES})))
    failing = _results({"eager": OLD_TIMES})
    failing["groups"][0]["failed"] = {"triton": "RuntimeError: boom"}
    failing["groups"].append(_group("qkv_projection", "d", {}))
    new.write_text(json.dumps(failing))
    assert cli.main(["--compare", str(old), str(new)]) == 1  # no regression, but ours failed
    printed = capsys.readouterr().out
    assert "FAILED in the new run: attention c fwd triton" in printed and "1 group(s) only in the new run." in printed
    float16 = _results({"eager": OLD_TIMES})
    float16["environment"]["dtype"] = "float16"
    other_dtype.write_text(json.dumps(float16))
    not_json = tmp_path / "report.md"
    not_json.write_text("# a report")
    for paths, message in (((old, other_dtype), "the runs differ in dtype"), ((old, tmp_path / "missing.json"),
                           "cannot read it as JSON"), ((not_json, old), "cannot read it as JSON"),
                           ((tmp_path, old), "cannot read it as JSON")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--compare", *map(str, paths)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(SystemExit):
        cli.main(["--compare", str(listed), str(old)])
    assert "not a results.json" in capsys.readouterr().err


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda data: data["environment"].pop("device"), "the environment lacks device"),
    (lambda data: data["groups"][0].pop("times_s"), "group 0 lacks one of"),
    (lambda data: data["groups"][0]["times_s"].update(triton=[]), "has an implementation of ours without times"),
    (lambda data: data["groups"][0]["times_s"].clear(), "has an implementation of ours without times"),
    (lambda data: data.update(groups={}), "no list of groups"),
    (lambda data: data.pop("targets"), "no list of groups or of targets"),
    (lambda data: data["targets"].append({"op": "attention"}), "target 0 lacks one of"),
])
def test_compare_refuses_a_results_file_missing_what_it_reads(damage, problem, tmp_path, capsys):
    good, damaged = tmp_path / "good.json", tmp_path / "damaged.json"
    good.write_text(json.dumps(_results({"eager": OLD_TIMES})))
    data = _results({"eager": OLD_TIMES})
    damage(data)
    damaged.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--compare", str(good), str(damaged)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "not a results.json" in err and problem in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "foo"], "--device"),
    (["--device", "cuda:7"], "CUDA device(s)"),
    (["--device", "meta"], "expected cpu, cuda or cuda:N"),
    (["--threads", "0"], "expected a positive integer"),
    (["--only", ""], "--only: no suite"),
    (["--only", "qkv,ghost"], "unknown suite(s) ['ghost']"),
    (["--check", "--only", "nn,models"], "--check covers the suites"),
    (["--check", "--only", "qkv,models"], "--only names models"),
    (["--check", "--out", "somewhere", "--full"], "--out and --quick/--full apply to a benchmark run, not to --check"),
    (["--compare", "old.json", "new.json", "--only", "glu"], "--only applies to a benchmark run, not to --compare"),
    (["--readme", "--device", "cpu", "--malloc-defaults"], "--device and --malloc-defaults apply to a benchmark run"),
])
def test_the_command_refuses_what_it_cannot_take_as_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_the_command_refuses_an_output_folder_it_cannot_write_as_a_usage_error(where, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--tiny", "--device", "cpu", "--only", "qkv", "--out", str(tmp_path / where)])
    assert exit_info.value.code == 2 and "cannot write there" in capsys.readouterr().err


def test_readme_refuses_what_it_cannot_rewrite_as_a_usage_error(tmp_path, capsys):
    results_dir = tmp_path / "results"
    (results_dir / "run").mkdir(parents=True)
    (results_dir / "run" / "results.json").write_text(json.dumps(_results({"eager": OLD_TIMES})))
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text("# no markers")
    empty = tmp_path / "empty"
    empty.mkdir()
    for readme, results, message in ((tmp_path / "missing.md", results_dir, "No such file"),
                                     (unmarked, results_dir, "has no performance markers"),
                                     (unmarked, empty, "no results.json with a measured group under")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--readme", str(readme), "--results", str(results)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_readme_outside_the_results_folders_root_links_them_relatively(tmp_path):
    results_dir = tmp_path / "benchmarks" / "results"
    (results_dir / "run").mkdir(parents=True)
    (results_dir / "run" / "results.json").write_text(json.dumps(_results({"eager": OLD_TIMES})))
    readme = tmp_path / "docs" / "README.md"
    readme.parent.mkdir()
    readme.write_text(f"{report.README_START}\n{report.README_END}\n")
    assert cli.main(["--readme", str(readme), "--results", str(results_dir)]) == 0
    assert "(../benchmarks/results/run/report.md)" in readme.read_text()


def test_check_table_rules_stay_in_their_markdown_cell():
    result = check.CheckResult(op="qkv", backend="eager", case="c", dtype="float64", status="pass", tensor="x",
                               error=0.0, bound=1.0, rule="≤ 1e-09·(1 + max|exact|)", reason=None)
    row = check.check_table([result]).splitlines()[-1]
    assert row.count(" | ") == 8 and "max\\|exact\\|" in row


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6])
def test_rounds_run_every_implementation_right_after_every_other_equally_often(count):
    """Over ``len(round_orders(n))`` rounds ``timing.measure`` times each implementation once per
    round, in every position equally often, and right after each other implementation (within a
    round) equally often, so that no implementation always pays for the same predecessor."""
    ran = []
    fns = {index: (lambda index=index: ran.append(index)) for index in range(count)}
    rounds = len(timing.round_orders(count))
    schedule = timing.Schedule(min_rounds=rounds, max_rounds=rounds, budget_s=0.0, min_sample_s=0.0)
    timing.measure(fns, torch.device("cpu"), schedule)
    timed = ran[-rounds * count:]  # after the warm-up, estimate and peak-memory calls
    orders = [timed[r * count:(r + 1) * count] for r in range(rounds)]
    assert all(sorted(order) == list(range(count)) for order in orders)
    positions = {(position, index) for order in orders for position, index in enumerate(order)}
    assert len(positions) == count * count
    followers = [(a, b) for order in orders for a, b in zip(order, order[1:])]
    assert len(set(followers)) == count * (count - 1)
    assert len(followers) == len(set(followers)) * (1 if count % 2 == 0 else 2)


@pytest.mark.parametrize(("rounds", "design", "min_rounds", "max_rounds", "expected"),
                         [(5, 4, 5, 9, 8), (5, 4, 3, 9, 4), (7, 4, 5, 9, 8), (9, 4, 5, 9, 8), (5, 2, 5, 9, 6),
                          (5, 6, 5, 9, 6), (9, 6, 5, 9, 6), (7, 6, 7, 11, 6), (3, 2, 3, 3, 2), (5, 10, 5, 9, 5),
                          (30, 10, 10, 30, 30), (14, 10, 10, 30, 10), (16, 10, 10, 30, 20)])
def test_a_group_runs_whole_round_order_designs_where_its_round_limit_holds_one(rounds, design, min_rounds,
                                                                              max_rounds, expected):
    """The nearest whole number of designs, no fewer rounds than ``min_rounds`` where that many
    designs fit in ``max_rounds``; one design longer than ``max_rounds``: the rounds as they were."""
    assert timing._whole_designs(rounds, design, min_rounds, max_rounds) == expected


@pytest.mark.parametrize("low, high, status", [(1.1, 1.3, "met"), (0.9, 1.2, "within noise"), (0.7, 0.95, "MISSED")])
def test_target_status_from_the_ratio_spread(low, high, status):
    assert report.target_status(timing.Summary((low + high) / 2, low, high), 1.0) == status


@pytest.mark.parametrize(("low", "high", "text"), [
    (0.9712, 0.9961, "0.98x (0.97–0.996)"), (0.9951, 1.0312, "0.98x (0.995–1.03)"),
    (1.0, 1.2, "0.98x (1.00–1.20)"), (0.99994, 1.2, "0.98x (0.9999–1.20)"), (0.9, 0.95, "0.98x (0.90–0.95)"),
])
def test_a_targets_ratio_ends_show_the_side_of_it_they_are_on(low, high, text):
    assert report.ratio_text(timing.Summary(0.98, low, high), 1.0) == text
    assert report.ratio_text(timing.Summary(0.98, low, high)).startswith("0.98x (")


def test_a_targets_ratio_median_shows_the_side_of_it_it_is_on():
    assert report.ratio_text(timing.Summary(0.996, 0.99, 0.998), 1.0) == "0.996x (0.99–0.998)"
    assert report.ratio_text(timing.Summary(0.996, 0.99, 0.998)) == "1.00x (0.99–1.00)"


@pytest.mark.parametrize("cut_short", [False, True], ids=["complete", "cut_short"])
def test_a_target_without_a_record_says_why(monkeypatch, tmp_path, cut_short):
    """A run that ends early (``timeout`` sends SIGTERM) still writes its report, whose targets left
    unmeasured say that the run was cut short, not that the case needs --full."""
    quick_case = suites.load("glu").groups(suites.Setting(CPU, torch.float32, "quick"))[0].case
    target = suites.Target("glu_conv1d", quick_case, "fwd", "eager", "seed", 1.0, "cpu")
    monkeypatch.setattr(report, "load_targets", lambda names: [target])

    def run_suites(*args, **kwargs):
        if cut_short:
            raise SystemExit(124)
        return True

    monkeypatch.setattr(run, "run_suites", run_suites)
    with pytest.raises(SystemExit) if cut_short else contextlib.nullcontext():
        cli.main(["--device", "cpu", "--only", "glu", "--out", str(tmp_path)])
    (result,) = json.loads((tmp_path / "results.json").read_text())["targets"]
    assert result["status"] == "not measured"
    assert result["why_not"] == (report.CUT_SHORT if cut_short else "its group recorded nothing")


def _groups_by_case(name: str, size: str = "full", device: str = "cpu") -> dict:
    setting = suites.Setting(torch.device(device), torch.float32, size)
    return {(g.case, g.direction): g for g in suites.load(name).groups(setting)}


def test_attention_flops_count_real_query_rows_against_the_keys_each_sees():
    from transformer_kernels.bench.suites import attention

    groups = _groups_by_case("attention", device="cuda")
    sweep = [c for c in attention.cases(suites.Setting(torch.device("cuda"), torch.float32, "full"))
             if c.padding is not None]
    dense = 4 * sweep[0].batch * sweep[0].heads * sweep[0].length**2 * sweep[0].head_dim
    for case in sweep:  # every sequence n = L (1 - padding) real tokens: n² (query, key) pairs
        real = round(case.length * (1 - case.padding))
        assert groups[case.name, "fwd"].flops == pytest.approx(dense * real**2 / case.length**2)
    causal = next(c for c in attention.CPU_TARGET_CASES if c.causal and c.padded)
    lengths = causal.lengths().double()
    pairs = (lengths * (lengths + 1) / 2).sum().item()
    group = _groups_by_case("attention")[causal.name, "fwd+bwd"]
    assert group.flops == pytest.approx(3.5 * 4 * causal.heads * causal.head_dim * pairs)


def test_module_and_model_flops_count_real_tokens_and_decoding_none():
    nn_groups = _groups_by_case("nn")
    self_padded, causal = (nn_groups[f"seeds_B128_L8-40_{kind}", "fwd"] for kind in ("self", "causal"))
    assert self_padded.flops < 0.75 * causal.flops  # lengths uniform in [8, 40]: about 60% real tokens
    model_groups = _groups_by_case("models")
    greedy = [g for (case, _), g in model_groups.items() if "greedy" in case]
    assert greedy and all(g.flops is None for g in greedy)
    record = {**_group("models", "greedy", {"eager": OLD_TIMES}, flops=None), "errors": {"eager": 0.0}}
    (row,) = [line for line in report.key_table([record], 100.0) if "| greedy |" in line]
    assert row.split(" | ")[6:8] == ["—", "—"]  # TFLOP/s and % of peak


def test_readme_shows_results_of_an_older_flop_count_with_the_suites_present_counts():
    case = next(iter(_groups_by_case("attention", size="quick").values()))
    old = _results({"eager": OLD_TIMES})
    old.pop("flop_count")
    old["groups"] = [_group(case.op, case.case, {"eager": OLD_TIMES}, flops=123.0),
                     _group(case.op, "a case the suite no longer has", {"eager": OLD_TIMES}, flops=123.0)]
    recounted = report.recounted_flops(old)
    assert [g["flops"] for g in recounted["groups"]] == [case.flops, None]
    assert report.recounted_flops(recounted) is recounted


def test_a_target_of_another_size_or_none_says_so():
    setting = suites.Setting(CPU, torch.float32, "full")
    why = report.absent_reasons(["glu", "models"], setting, cut_short=True)
    full_case = next(g for g in suites.load("glu").groups(setting))
    assert why((full_case.op, full_case.case, full_case.direction)) == report.CUT_SHORT
    quick_models = suites.load("models").groups(dataclasses.replace(setting, size="quick"))
    quick_only = next(g for g in quick_models if "small" in g.case)
    assert why((quick_only.op, quick_only.case, quick_only.direction)) == "not in this run (the case is in --quick)"
    assert why(("glu_conv1d", "no_such_case", "fwd")) == "not a case of this run's suites, device or dtype"


def test_readme_section_names_device_date_and_commit(tiny_run, tmp_path):
    _, out = tiny_run
    results_dir = tmp_path / "benchmarks" / "results"
    (results_dir / "cpu-run").mkdir(parents=True)
    (results_dir / "cpu-run" / "results.json").write_text((out / "results.json").read_text())
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{report.README_START}\nstale\n{report.README_END}\n\nafter\n")
    assert cli.main(["--readme", str(readme), "--results", str(results_dir)]) == 0
    text = readme.read_text()
    env = json.loads((out / "results.json").read_text())["environment"]
    assert "stale" not in text and text.startswith("# title") and text.endswith("after\n")
    assert env["device"] in text and env["date"][:10] in text and (env["commit"] or "unknown")[:7] in text
    assert "(benchmarks/results/cpu-run/report.md)" in text


def test_readme_keeps_each_ops_newest_run(tiny_run, tmp_path):
    """A run of some suites (--only) supersedes older runs for its ops only: the README shows every
    op once, from the newest run that measured it."""
    _, out = tiny_run
    full = json.loads((out / "results.json").read_text())
    ops = sorted({group["op"] for group in full["groups"]})
    newer = {**full, "environment": {**full["environment"], "date": "9999-01-01T00:00:00+00:00"},
             "groups": [g for g in full["groups"] if g["op"] == ops[0]],
             "targets": [t for t in full["targets"] if t["op"] == ops[0]]}
    results_dir = tmp_path / "results"
    for name, data in (("cpu-full", full), ("cpu-only", newer)):
        (results_dir / name).mkdir(parents=True)
        (results_dir / name / "results.json").write_text(json.dumps(data))
    latest = report.latest_results(results_dir)
    assert [path.parent.name for path, _ in latest] == ["cpu-only", "cpu-full"]
    assert [{g["op"] for g in data["groups"]} for _, data in latest] == [{ops[0]}, set(ops[1:])]
    assert all(t["op"] != ops[0] for t in latest[1][1]["targets"])


def test_readme_shows_each_group_from_the_newest_run_that_measured_it(tiny_run, tmp_path):
    """A newer run of some of an op's cases (--cases, or cut short by --time-limit) supersedes the
    older run for those groups only; runs older than an op's newest whole run show none of it."""
    _, out = tiny_run
    run = json.loads((out / "results.json").read_text())
    op = run["groups"][0]["op"]
    keys = sorted({(g["op"], g["case"], g["direction"]) for g in run["groups"] if g["op"] == op})
    assert len(keys) >= 2
    gone = {**run["groups"][0], "case": "a case the suite no longer has"}
    oldest = {**run, "environment": {**run["environment"], "date": "2000-01-01T00:00:00+00:00"},
              "groups": [gone], "targets": []}
    newer = {**run, "environment": {**run["environment"], "date": "9999-01-01T00:00:00+00:00", "cases": "x"},
             "groups": [g for g in run["groups"] if (g["op"], g["case"], g["direction"]) == keys[0]],
             "targets": []}
    results_dir = tmp_path / "results"
    for name, data in (("oldest", oldest), ("older", run), ("newer", newer)):
        (results_dir / name).mkdir(parents=True)
        (results_dir / name / "results.json").write_text(json.dumps(data))
    (new_path, new_data), (old_path, old_data) = report.latest_results(results_dir)
    assert (new_path.parent.name, old_path.parent.name) == ("newer", "older")
    shown_old = {(g["op"], g["case"], g["direction"]) for g in old_data["groups"] if g["op"] == op}
    assert keys[0] not in shown_old and set(keys[1:]) == shown_old
    cut_short = {**newer, "environment": {**run["environment"], "date": "9999-01-01T00:00:00+00:00",
                                          "cut_short": True}}
    (results_dir / "newer" / "results.json").write_text(json.dumps(cut_short))
    assert [path.parent.name for path, _ in report.latest_results(results_dir)] == ["newer", "older"]
    newer_whole = {**newer, "environment": {**run["environment"], "date": "9999-01-01T00:00:00+00:00"}}
    (results_dir / "newer" / "results.json").write_text(json.dumps(newer_whole))
    (_, shown), *rest = report.latest_results(results_dir)
    assert all(g["op"] != op for _, data in rest for g in data["groups"])


def test_readme_keeps_a_full_runs_cases_that_a_newer_quick_run_did_not_time(tiny_run, tmp_path):
    """A newer --quick run of an op shows all it timed; the op's older full run still shows the
    cases the quick one did not time (the CPU's quick and full models runs time different models),
    and an op's runs older than those show nothing."""
    _, out = tiny_run
    run = json.loads((out / "results.json").read_text())
    op = run["groups"][0]["op"]
    cases = sorted({g["case"] for g in run["groups"] if g["op"] == op})
    assert len(cases) >= 2

    def of_size(size: str, date: str, kept_cases) -> dict:
        return {**run, "environment": {**run["environment"], "size": size, "date": date},
                "groups": [g for g in run["groups"] if g["op"] == op and g["case"] in kept_cases],
                "targets": [t for t in run["targets"] if t["op"] == op]}

    results_dir = tmp_path / "results"
    for name, data in (("old-quick", of_size("quick", "2000-01-01T00:00:00+00:00", cases)),
                       ("full", of_size("full", "2001-01-01T00:00:00+00:00", cases)),
                       ("new-quick", of_size("quick", "2002-01-01T00:00:00+00:00", cases[:1]))):
        (results_dir / name).mkdir(parents=True)
        (results_dir / name / "results.json").write_text(json.dumps(data))
    latest = report.latest_results(results_dir)
    assert [path.parent.name for path, _ in latest] == ["new-quick", "full"]
    assert {g["case"] for g in latest[0][1]["groups"]} == {cases[0]}
    assert {g["case"] for g in latest[1][1]["groups"]} == set(cases[1:])
    assert {t["case"] for t in latest[1][1]["targets"]} <= set(cases[1:])


def test_readme_lets_a_partial_run_between_a_full_and_a_newer_quick_run_stand(tiny_run, tmp_path):
    """full (oldest) < some cases, timed again (--cases) < quick: the cases the quick run did not
    time come from the partial run where it timed them, the full run's older rows of them hidden."""
    _, out = tiny_run
    run = json.loads((out / "results.json").read_text())
    op = run["groups"][0]["op"]
    cases = sorted({g["case"] for g in run["groups"] if g["op"] == op})
    assert len(cases) >= 2

    def of_size(size: str, date: str, kept_cases, **env) -> dict:
        return {**run, "environment": {**run["environment"], "size": size, "date": date, **env},
                "groups": [g for g in run["groups"] if g["op"] == op and g["case"] in kept_cases],
                "targets": [t for t in run["targets"] if t["op"] == op and t["case"] in kept_cases]}

    results_dir = tmp_path / "results"
    for name, data in (("full", of_size("full", "2001-01-01T00:00:00+00:00", cases)),
                       ("between", of_size("full", "2001-06-01T00:00:00+00:00", cases[-1:], cases="x")),
                       ("new-quick", of_size("quick", "2002-01-01T00:00:00+00:00", cases[:1]))):
        (results_dir / name).mkdir(parents=True)
        (results_dir / name / "results.json").write_text(json.dumps(data))
    shown = {path.parent.name: {g["case"] for g in data["groups"]} for path, data in report.latest_results(results_dir)}
    assert shown.pop("new-quick") == {cases[0]} and shown.pop("between") == {cases[-1]}
    assert shown.get("full", set()) == set(cases[1:-1])


def test_readme_names_each_of_our_implementations_that_failed(tiny_run, tmp_path):
    """A group where ours failed shows no row: the README says so and why."""
    _, out = tiny_run
    run = json.loads((out / "results.json").read_text())
    group = {**run["groups"][0], "ours": [], "failed": {"eager": "RuntimeError: boom"}}
    data = {**run, "groups": [group], "targets": []}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(data))
    section = report.readme_section(report.latest_results(tmp_path), tmp_path)
    key = " ".join(report.group_key(group))
    assert f"- FAILED: {key} eager: RuntimeError: boom" in section and "| op | case |" not in section


def test_every_save_before_the_end_marks_the_run_cut_short(monkeypatch, tmp_path):
    """A run killed between two groups (no report written after it) leaves a results.json that says
    it was cut short, so --readme does not take it for a whole run."""
    out = tmp_path / "out"
    seen = []

    def run_suites(names, setting, schedule, on_record, **kwargs):
        on_record(run.unavailable_suite_record("qkv", "a stand-in record", CPU))
        seen.append(json.loads((out / "results.json").read_text())["environment"]["cut_short"])
        return True

    monkeypatch.setattr(run, "run_suites", run_suites)
    assert cli.main(["--tiny", "--device", "cpu", "--only", "qkv", "--out", str(out)]) == 0
    assert seen == [True]
    assert json.loads((out / "results.json").read_text())["environment"]["cut_short"] is False


def test_a_run_without_out_keeps_that_days_earlier_run(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "run_suites", lambda *args, **kwargs: True)
    assert cli.main(["--tiny", "--device", "cpu", "--only", "qkv"]) == 0
    assert cli.main(["--tiny", "--device", "cpu", "--only", "qkv", "--cases", "fwd"]) == 0
    folders = sorted((tmp_path / "benchmarks" / "results").iterdir())
    assert len(folders) == 2 and all((folder / "results.json").exists() for folder in folders)
    assert folders[1].name.startswith(folders[0].name + "-")


@pytest.mark.parametrize("who", ["ours", "peer"])
def test_an_implementation_raising_while_timed_is_left_out_and_the_rest_timed(who):
    """One that runs at its setup and raises later (out of memory at its third call, say) is recorded
    as failed (ours) or unavailable (a peer), with the reason, and the others are timed without it."""
    x = torch.randn(8, 8, requires_grad=True)
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("out of memory (simulated)")
        return x * 2

    name = "eager" if who == "ours" else "flaky_peer"
    setups = {"reference": lambda: suites.Impl(lambda: x * 2, (x,)), name: lambda: suites.Impl(flaky, (x,))}
    group = suites.Group(op="op", case="case", direction="fwd", setups=setups, unavailable={},
                         error=lambda outputs: 0.0, flops=None, ours=("eager",) if who == "ours" else ())
    record = run.measure_group(group, CPU, timing.Schedule.for_device(CPU, "tiny"))
    assert set(record["times_s"]) == {"reference"} and record["rounds"] >= 2
    reasons = record["failed"] if who == "ours" else record["unavailable"]
    assert reasons == {name: "RuntimeError: out of memory (simulated)"} and name not in record["errors"]


def test_progress_without_tqdm_prints_lines(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    progress = run.Progress(2)
    progress.begin("attention c fwd")
    progress.end()
    progress.close()
    assert capsys.readouterr().err == "[1/2] attention c fwd\n"


def test_seed_layer_paths_compute_one_step():
    """``benchmarks/graphed_step.py`` (CUDA) times three paths to one training step of the seeds'
    layer (``bench.graphs.SeedLayer``); run eagerly here, they give one loss and the same
    gradients, so it compares like with like."""
    layer = graphs.SeedLayer(128, 40, 512, 8, min_length=8, device=CPU, dtype=torch.float32)
    ours, *others = (layer.step(path, "eager") for path in graphs.PATHS)
    for other in others:
        for got, expected in zip(ours, other):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_host_time_script_prints_every_call_and_launch():
    """``benchmarks/host_time.py`` (timings, no target asserted here) still runs end to end: the
    host's speed at a call's kinds of work, a host time per call, then Triton's and the direct
    launch preparation per launch."""
    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "host_time.py"
    text = script_output(script, "--rounds", "1", timeout=300)
    calls = re.findall(r"^  (.+?) +([0-9.]+) us  \(p10-p90", text, re.MULTILINE)
    launches = re.findall(r"kernel\[grid\] +([0-9.]+) us, direct +([0-9.]+) us$", text, re.MULTILINE)
    speeds = re.findall(r"(?:a Python call|torch\.empty\(16\)|a transpose) ([0-9.]+) us", text.splitlines()[0])
    assert len(speeds) == 3 and all(float(us) > 0.0 for us in speeds), text
    assert len(calls) == 11 and all(math.isfinite(float(us)) for _, us in calls), text
    assert len(launches) == 13 and all(math.isfinite(float(us)) for pair in launches for us in pair), text
