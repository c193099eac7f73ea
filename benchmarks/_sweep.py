"""What the tile sweeps (tune_attention.py, tune_glu.py) share: timing a call forward or backward,
and a kernel's table entry and candidate tiles, each put in turn behind the backend's tile lookup."""

from __future__ import annotations

from typing import Callable

import torch
import triton.testing


def median_ms(forward: Callable[[], torch.Tensor], leaves: tuple, backward: bool, **bench_options) -> float:
    """Median milliseconds (``triton.testing.do_bench``) of ``forward()`` under ``no_grad``, or with
    ``backward``, of the gradient with respect to ``leaves`` of its output, computed once."""
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(forward, return_mode="median", **bench_options)
    out = forward()
    grad_out = torch.randn_like(out)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True),
                                   return_mode="median", **bench_options)


def time_tiles(module, lookup: str, kernel: str, current, candidates: list[tuple], fields: tuple[str, ...],
               timed: Callable[[], float], record: Callable[[float, tuple, bool], None]) -> list[tuple[float, tuple]]:
    """``(ms, tile)`` of the table's tile ``current`` (first) and of each of ``candidates`` (tuples of
    ``fields``): while ``timed()`` runs, ``module.<lookup>(kernel, ...)`` answers with that tile (other
    kernels keep the table's).  NaN where it fails (out of shared memory, too many registers).
    ``record(ms, tile, is_table_entry)`` gets each result as it comes, so a sweep cut short keeps
    what it measured."""
    table = getattr(module, lookup)
    results = []
    for tile in [tuple(getattr(current, field) for field in fields)] + candidates:
        candidate = type(current)(**dict(zip(fields, tile)))

        def patched(name, *rest, _candidate=candidate, **options):
            return _candidate if name == kernel else table(name, *rest, **options)

        setattr(module, lookup, patched)
        try:
            ms = timed()
        except Exception as error:  # noqa: BLE001 (reported, and the sweep goes on)
            ms = float("nan")
            print(f"  {kernel} {tile}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        finally:
            setattr(module, lookup, table)
        results.append((ms, tile))
        record(ms, tile, candidate == current)
    return results


def summary(results: list[tuple[float, tuple]]) -> str:
    """The table entry's time, the fastest tile and the three after it."""
    timed = sorted(result for result in results if result[0] == result[0])
    return (f"table {results[0][1]} {results[0][0]:.3f} ms; best {timed[0][1]} {timed[0][0]:.3f} ms; "
            + ", ".join(f"{tile}:{ms:.3f}" for ms, tile in timed[1:4]))
