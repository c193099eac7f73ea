"""Sweep the tile configurations of the Triton attention kernels on the present GPU.

    python benchmarks/tune_attention.py [--out DIR] [--budget SECONDS] [--short]

For each kernel (forward, dK/dV, dQ), head dim and causal switch, every candidate ``KernelConfig``
is timed (``triton.testing.do_bench``, median) with the other two kernels at their table entries,
next to torch SDPA.  A candidate that fails to compile (shared memory) is reported as such.  The
fastest candidate is only a proposal: a table entry must also pass ``tests/test_triton_compile.py``
(no spills, under every supported triton) before it lands.  Results go to stdout and, row by row,
to ``DIR/tune_attention.csv`` so a run cut short keeps what it measured.  ``--short`` sweeps the
seeds' short sequences instead (the SHORT table, lengths up to ``SHORT_MAX_LENGTH``).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

import transformer_kernels as tk
from _sweep import median_ms, summary, time_tiles
from transformer_kernels.backends.triton import attention as triton_attention
from transformer_kernels.backends.triton._common import compute_capability

# The KernelConfig fields a candidate sets, in the order of the CANDIDATES tuples.
FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
CANDIDATES = {
    # Forward and dQ own block_m queries, dK/dV block_n keys.
    "forward": [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3),
                (128, 32, 4, 3), (64, 128, 4, 3)],
    # (16, 64, 8, 2): the shared d128 tile that causal and padding ran on sm_90 until the SM90 table's
    # (16, 128, 8, 2), chosen by compiling after the H200's causal backward ran slower than the dense.
    "grad_key_value": [(32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 5), (32, 128, 8, 3), (64, 64, 4, 3),
                       (64, 128, 8, 3), (16, 128, 4, 4), (16, 64, 8, 2), (16, 128, 8, 2)],
    "grad_query": [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2)],
}
# (head dim, batch, heads, length): 16k tokens per batch, 2048 model width, as in bench_attention.
SHAPES = [(64, 16, 32, 1024), (128, 8, 16, 2048)]
# The seeds' batches: 128 sentences of at most 64 tokens, 8 heads of 64 (and a 128 head-dim twin).
SHORT_SHAPES = [(64, 128, 8, triton_attention.SHORT_MAX_LENGTH), (128, 128, 8, triton_attention.SHORT_MAX_LENGTH)]
SHORT_CANDIDATES = {
    "forward": [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 3)],
    "grad_key_value": [(32, 64, 4, 2), (64, 64, 4, 2), (32, 64, 8, 2), (32, 32, 4, 2)],
    "grad_query": [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 3)],
}


def _inputs(head_dim: int, batch: int, heads: int, length: int, dtype: torch.dtype, grad: bool):
    # [B, L, H, D] storage seen as [B, H, L, D], as a projection's output is.
    return [
        torch.randn(batch, length, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_(grad)
        for _ in range(3)
    ]


def _timed(kernel: str, q, k, v, causal: bool) -> float:
    return median_ms(lambda: tk.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="triton"),
                     (q, k, v), kernel != "forward", warmup=10, rep=60)


def _sdpa_ms(kernel: str, q, k, v, causal: bool) -> float:
    return median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                     (q, k, v), kernel != "forward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--budget", type=float, default=300.0, help="stop starting new sweeps after this")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--short", action="store_true", help="the seeds' short sequences (the SHORT table)")
    args = parser.parse_args()
    shapes, candidates = (SHORT_SHAPES, SHORT_CANDIDATES) if args.short else (SHAPES, CANDIDATES)
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(args.out / "tune_attention.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["kernel", "head_dim", "causal", "config", "ms", "sdpa_ms", "table_entry"])
        for kernel in candidates:
            for head_dim, batch, heads, length in shapes:
                for causal in (False, True):
                    if time.perf_counter() - started > args.budget:
                        print("budget spent; stopping")
                        return
                    q, k, v = _inputs(head_dim, batch, heads, length, dtype, kernel != "forward")
                    current = triton_attention.block_config(kernel, head_dim, head_dim, dtype,
                                                            "fast" if causal else "dense", length,
                                                            compute_capability(q.device))
                    sdpa_ms = _sdpa_ms(kernel, q, k, v, causal)

                    def record(ms, tile, is_table_entry):
                        rows.writerow([kernel, head_dim, causal, tile, f"{ms:.4f}", f"{sdpa_ms:.4f}", is_table_entry])
                        f.flush()

                    results = time_tiles(triton_attention, "block_config", kernel, current, candidates[kernel],
                                         FIELDS, lambda: _timed(kernel, q, k, v, causal), record)
                    print(f"{kernel} d{head_dim} L{length} causal={causal}: sdpa {sdpa_ms:.3f} ms; "
                          + summary(results))


if __name__ == "__main__":
    main()
