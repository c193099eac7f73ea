"""Sweep the tile configurations of the Triton GLU convolution kernels on the present GPU.

    python benchmarks/tune_glu.py [--out DIR] [--budget SECONDS]

The H200 report of 2026-11-27 (benchmarks/results/nvidia-h200-2026-11-27-c3c60f6) timed the
Triton forward ahead of every peer, but its backward (the pre-activation's gradient, then the input
and weight gradients) at a third to a half of fairseq's per-tap cuBLAS GEMMs (``torch.conv_tbc``)
at long sequences; its sm_90 tiles were chosen by compiling only.  For each kernel (forward,
grad_input, grad_weight) and shape, every candidate ``KernelConfig`` is timed
(``triton.testing.do_bench``, median) with the other kernels at their table entries, next to
``torch.conv_tbc``: the forward alone under ``no_grad``, a gradient kernel as the whole backward
pass.  A candidate that fails to compile (shared memory) is reported as such.  The fastest is only
a proposal: a table entry must also pass ``tests/test_triton_compile.py`` (no spills, under every
supported triton) before it lands.  Then, for each shape, the weight gradient's split count (its
float32 partial sums are written and read back, which ``_split_sum.split_count``'s wave model does
not count): the count it picks ("auto") against each of ``SPLITS``, the backward pass timed.
Results go to stdout and, row by row, to ``DIR/tune_glu.csv``, so a run cut short keeps what it
measured.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import transformer_kernels as tk
from _sweep import median_ms, summary, time_tiles
from transformer_kernels.backends.triton import glu_conv as triton_glu_conv
from transformer_kernels.backends.triton._common import compute_capability
from transformer_kernels.ops import glu_conv as glu_op
from transformer_kernels.ops._call_plans import CallPlans

# The KernelConfig fields a candidate sets, in the order of the CANDIDATES tuples.
FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
CANDIDATES = {
    # Forward: rows (positions) x output channels (two accumulators each) x input channels per step.
    "forward": [(64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (128, 64, 32, 8, 4), (128, 128, 64, 8, 3),
                (64, 128, 64, 8, 3)],
    # Input gradient: rows x input channels x 2C-channel steps.
    "grad_input": [(64, 64, 32, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4),
                   (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)],
    # Weight gradient: 2C channels x input channels x row steps.
    "grad_weight": [(64, 64, 32, 4, 3), (128, 128, 32, 8, 4), (128, 128, 64, 8, 3), (128, 64, 64, 8, 3),
                    (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)],
}
# (batch, channels, length, kernel size): the seeds' encoder layer and long sequences, as in the
# benchmark's glu_conv1d suite (x channel-last, "same" padding, x its own residual).
SHAPES = [(128, 512, 40, 3), (16, 512, 1024, 3), (8, 512, 4096, 3)]
# Weight-gradient split counts timed against split_count's choice.
SPLITS = (1, 2, 3, 4, 6, 8)
SCALE = math.sqrt(0.5)


def _inputs(batch: int, channels: int, length: int, kernel_size: int, dtype: torch.dtype):
    x = torch.randn(batch, length, channels, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    weight = (torch.randn(2 * channels, channels, kernel_size, device="cuda", dtype=dtype)
              / math.sqrt(channels * kernel_size)).requires_grad_()
    bias = torch.zeros(2 * channels, device="cuda", dtype=dtype, requires_grad=True)
    return x, weight, bias


def _ours(x, weight, bias):
    return tk.glu_conv1d(x, weight, bias, residual=x, residual_scale=SCALE, backend="triton")


def _conv_tbc(x, weight_tbc, bias):
    """fairseq's ConvTBC layer: ``weight_tbc`` ``[k, C_in, 2C]``, its own parameter there."""
    h = x.permute(2, 0, 1)  # [T, B, C]
    z = torch.conv_tbc(h.contiguous(), weight_tbc, bias, (weight_tbc.shape[0] - 1) // 2)
    return (F.glu(z, dim=2) + h) * SCALE


def _ms(kernel: str, function, *leaves) -> float:
    return median_ms(lambda: function(*leaves), leaves, kernel != "forward", warmup=10, rep=60)


def _timed_splits(x, weight, bias) -> list[tuple[float, object]]:
    """``(ms, splits)`` of the backward pass with the weight gradient split as ``split_count``
    chooses ("auto"), then into each of ``SPLITS`` ranges."""
    chosen = triton_glu_conv.split_count
    results = []
    for splits in ("auto", *SPLITS):
        if splits != "auto":
            triton_glu_conv.split_count = lambda *args, _splits=splits, **kwargs: _splits
        try:
            glu_op._PLANS = CallPlans()  # no backward prepared with another split
            results.append((_ms("grad_weight", _ours, x, weight, bias), splits))
        finally:
            triton_glu_conv.split_count = chosen
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--budget", type=float, default=300.0, help="stop starting new sweeps after this")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(args.out / "tune_glu.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["kernel", "shape", "config", "ms", "conv_tbc_ms", "table_entry"])
        for kernel in CANDIDATES:
            for shape in SHAPES:
                if time.perf_counter() - started > args.budget:
                    print("budget spent; stopping")
                    return
                x, weight, bias = _inputs(*shape, dtype)
                current = triton_glu_conv.kernel_config(kernel, dtype, compute_capability(x.device))
                weight_tbc = weight.detach().permute(2, 1, 0).contiguous().requires_grad_()
                peer_ms = _ms(kernel, _conv_tbc, x, weight_tbc, bias)

                def timed():
                    glu_op._PLANS = CallPlans()  # no forward prepared with another candidate's tiles
                    return _ms(kernel, _ours, x, weight, bias)

                def record(ms, tile, is_table_entry):
                    rows.writerow([kernel, shape, tile, f"{ms:.4f}", f"{peer_ms:.4f}", is_table_entry])
                    f.flush()

                results = time_tiles(triton_glu_conv, "kernel_config", kernel, current, CANDIDATES[kernel], FIELDS,
                                     timed, record)
                print(f"{kernel} B{shape[0]} C{shape[1]} L{shape[2]}: conv_tbc {peer_ms:.3f} ms; " + summary(results))
        for shape in SHAPES:
            if time.perf_counter() - started > args.budget:
                print("budget spent; stopping")
                return
            results = _timed_splits(*_inputs(*shape, dtype))
            for ms, splits in results:
                rows.writerow(["grad_weight_splits", shape, splits, f"{ms:.4f}", "", splits == "auto"])
            f.flush()
            print(f"grad_weight splits B{shape[0]} C{shape[1]} L{shape[2]}: "
                  + ", ".join(f"{splits}:{ms:.3f} ms" for ms, splits in results))


if __name__ == "__main__":
    main()
