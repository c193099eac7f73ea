"""A training step of the seeds' layer, eager and replayed from a CUDA graph, against the seed's math
and torch's own ops (issue 9's host-path targets).

The layer at the seeds' sizes: batch 128 padded to 40 tokens (lengths uniform in 8-40), embed 512 in
8 heads, bfloat16: the packed QKV projection, self-attention with key padding, a GLU convolution
(kernel 3) with a residual, a loss, and the gradient of every weight.  At these sizes the kernels
take microseconds and the host path (checks, dispatch, building each launch) sets the step's
wall-clock; a CUDA graph replays the kernels alone.  Implementations, timed interleaved round by
round (``transformer_kernels.bench.timing``; the layer is
``transformer_kernels.bench.graphs.SeedLayer``):

- ``ours``, ``ours_graphed``: ``transformer_kernels``' ops on ``--backend`` (default triton);
- ``ours_compiled`` (``--compiled``): the loss through ``torch.compile`` (Inductor traces into the
  Triton kernels, ``ops/_library.py``), then its gradients; compiled before the timing starts;
- ``seed``: the seeds' naive math (``transformer_kernels.reference``): three GEMMs and head splits,
  ``masked_fill`` + softmax attention, ``conv1d`` + GLU;
- ``torch``, ``torch_graphed``: torch's own ops: one packed ``F.linear`` + ``chunk``,
  ``F.scaled_dot_product_attention`` with the padding as a bool mask, ``conv1d`` + GLU.

Targets: ``ours`` faster than ``seed``; ``ours_graphed`` faster than ``torch`` (and than
``torch_graphed``, for a like-for-like graph).

Usage: ``python benchmarks/graphed_step.py [--out DIR] [--backend triton|cuda] [--compiled]`` on a CUDA
machine;
prints each implementation's median ms and its speed-up over the others (median of per-round
ratios, p10-p90), and writes them with every round's time to ``DIR/graphed_step.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from transformer_kernels.bench.graphs import PATHS, SeedLayer, captured
from transformer_kernels.bench.timing import Schedule, Summary, measure, ratio_summary

SHAPE = dict(batch=128, length=40, embed=512, heads=8, min_length=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--compiled", action="store_true", help="time ours through torch.compile too")
    args = parser.parse_args()
    device = torch.device("cuda")
    layer = SeedLayer(**SHAPE, device=device, dtype=torch.bfloat16)
    steps = {path: (lambda path=path: layer.step(path, args.backend)) for path in PATHS}
    for name in ("ours", "torch"):
        graph, _ = captured(steps[name])
        steps[f"{name}_graphed"] = graph.replay
    if args.compiled:
        loss = torch.compile(lambda: layer.loss("ours", args.backend))
        steps["ours_compiled"] = lambda: layer.step(loss=loss)
        steps["ours_compiled"]()  # compiles, outside the timing
    result = measure(steps, device, Schedule.for_device(device))
    times = result["times_s"]
    print(f"one training step, {torch.cuda.get_device_name(device)}, backend {args.backend}: median ms")
    speedups = {}
    for name in steps:
        summary = Summary.of([t * 1e3 for t in times[name]])
        against = {other: ratio_summary(times, other, name) for other in steps if other != name}
        speedups[name] = {other: vars(ratio) for other, ratio in against.items()}
        print(f"  {name:14s} {summary.median:8.3f}  (p10-p90 {summary.low:.3f}-{summary.high:.3f})  "
              + ", ".join(f"{ratio.median:.2f}x vs {other}" for other, ratio in against.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "backend": args.backend,
              "shape": SHAPE, "times_s": times, "speedups": speedups}
    (args.out / "graphed_step.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
