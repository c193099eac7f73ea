"""PNG plots of a run's records (matplotlib, the ``bench`` extra): time and peak memory vs sequence
length per op and implementation, and speed-up vs padding fraction for the padding sweep."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional

from . import timing
from .report import HIGH, LOW, median_ms


def _series(records: list[dict], x_param: str) -> dict[tuple[str, str, str], list[dict]]:
    """(op, family, direction) -> its records sorted by ``params[x_param]``, for families with 2+ points."""
    series = defaultdict(list)
    for record in records:
        family = record["params"].get("family")
        if family and record["times_s"] and x_param in record["params"]:
            series[record["op"], family, record["direction"]].append(record)
    return {key: sorted(rs, key=lambda r: r["params"][x_param]) for key, rs in series.items()
            if len({r["params"][x_param] for r in rs}) > 1}


def _figure(panels: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(panels, 3)
    rows = -(-panels // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.8 * rows), squeeze=False)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return plt, figure, list(axes.flat)


def _save(plt, figure, path: Path) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path.name


def _by_length(out_dir: Path, records: list[dict], op: str, quantity: str) -> Optional[str]:
    series = {key: rs for key, rs in _series(records, "length").items()
              if key[0] == op}
    if not series:
        return None
    plt, figure, axes = _figure(len(series))
    for ax, ((_, family, direction), rs) in zip(axes, sorted(series.items())):
        impls = sorted({impl for r in rs for impl in r["times_s"]})
        for impl in impls:
            points = [(r["params"]["length"], median_ms(r, impl) if quantity == "time"
                       else r["peak_mem_bytes"][impl] / 2**20) for r in rs if impl in r["times_s"]]
            style = "-o" if any(impl in r["ours"] for r in rs) else "--."
            ax.plot(*zip(*points), style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("median ms per call" if quantity == "time" else "peak MiB")
        ax.set_title(f"{family} {direction}", fontsize=9)
        ax.legend(fontsize=7)
    figure.suptitle(f"{op}: {'time' if quantity == 'time' else 'peak memory'} vs sequence length")
    return _save(plt, figure, out_dir / f"{op}_{quantity}_vs_length.png")


def _speedup_vs_padding(out_dir: Path, records: list[dict]) -> Optional[str]:
    series = {key: rs for key, rs in _series(records, "padding").items() if key[1].startswith("sweep_padding")}
    if not series:
        return None
    plt, figure, axes = _figure(len(series))
    for ax, ((op, family, direction), rs) in zip(axes, sorted(series.items())):
        ours = rs[0]["ours"]
        others = sorted({impl for r in rs for impl in r["times_s"]} - set(ours))
        for mine in ours:
            for other in others:
                points = [(r["params"]["padding"], timing.ratio_summary(r["times_s"], other, mine)) for r in rs
                          if other in r["times_s"] and mine in r["times_s"]]
                x = [p for p, _ in points]
                ax.errorbar(x, [s.median for _, s in points], fmt="-o", capsize=3, label=f"{mine} vs {other}",
                            yerr=[[s.median - s.low for _, s in points], [s.high - s.median for _, s in points]])
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xlabel("fraction of keys padded")
        ax.set_ylabel(f"speed-up (median, {LOW}–{HIGH} of rounds)")
        ax.set_title(f"{op} {family} {direction}", fontsize=9)
        ax.legend(fontsize=7)
    figure.suptitle("speed-up vs padding fraction")
    return _save(plt, figure, out_dir / "speedup_vs_padding.png")


def write_plots(out_dir: Path, records: list[dict]) -> tuple[list[str], Optional[str]]:
    """Writes the plots into ``out_dir``; returns their file names and, when none could be drawn,
    why (matplotlib missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [], "matplotlib is not installed (pip install 'transformer_kernels[bench]')"
    names = []
    cuda = any(r["device"] == "cuda" for r in records)
    for op in sorted({r["op"] for r in records}):
        names.append(_by_length(out_dir, records, op, "time"))
        if cuda:  # peak memory is measured on CUDA only
            names.append(_by_length(out_dir, records, op, "memory"))
    names.append(_speedup_vs_padding(out_dir, records))
    return [name for name in names if name], None
