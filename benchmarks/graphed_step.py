"""A training step of the seeds' layer, eager and replayed from a CUDA graph, against the seed's math
and torch's own ops (issue 9's host-path targets).

The layer at the seeds' sizes: batch 128 padded to 40 tokens (lengths uniform in 8-40), embed 512 in
8 heads, bfloat16: the packed QKV projection, self-attention with key padding, a GLU convolution
(kernel 3) with a residual, a loss, and the gradient of every weight.  At these sizes the kernels
take microseconds and the host path (checks, dispatch, building each launch) sets the step's
wall-clock; a CUDA graph replays the kernels alone.  Implementations, timed interleaved round by
round (``transformer_kernels.bench.timing``):

- ``ours``, ``ours_graphed``: ``transformer_kernels``' ops on ``--backend`` (default triton);
- ``seed``: the seeds' naive math (``transformer_kernels.reference``): three GEMMs and head splits,
  ``masked_fill`` + softmax attention, ``conv1d`` + GLU;
- ``torch``, ``torch_graphed``: torch's own ops: one packed ``F.linear`` + ``chunk``,
  ``F.scaled_dot_product_attention`` with the padding as a bool mask, ``conv1d`` + GLU.

Targets: ``ours`` faster than ``seed``; ``ours_graphed`` faster than ``torch`` (and than
``torch_graphed``, for a like-for-like graph).

Usage: ``python benchmarks/graphed_step.py [--out DIR] [--backend triton|cuda]`` on a CUDA machine;
prints each implementation's median ms and its speed-up over the others (median of per-round
ratios, p10-p90), and writes them with every round's time to ``DIR/graphed_step.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import transformer_kernels as tk
from transformer_kernels import reference
from transformer_kernels.bench.graphs import captured
from transformer_kernels.bench.timing import Schedule, Summary, measure, ratio_summary

BATCH, LENGTH, EMBED, HEADS, KERNEL_SIZE = 128, 40, 512, 8, 3
SCALE = math.sqrt(0.5)


class Layer:
    """Static inputs and weights; ``step(path)`` is one training step of ``path``."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        generator = torch.Generator(device=device).manual_seed(0)
        options = dict(device=device, dtype=dtype)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(shape, generator=generator, device=device) * scale).to(dtype)

        self.x = randn(BATCH, LENGTH, EMBED)
        lengths = torch.randint(8, LENGTH + 1, (BATCH,), generator=generator, device=device)
        self.padding = torch.arange(LENGTH, device=device)[None, :] >= lengths[:, None]  # True = padding
        self.weights = [
            randn(3 * EMBED, EMBED, scale=EMBED**-0.5).requires_grad_(),
            torch.zeros(3 * EMBED, **options).requires_grad_(),
            randn(2 * EMBED, EMBED, KERNEL_SIZE, scale=(KERNEL_SIZE * EMBED) ** -0.5).requires_grad_(),
            torch.zeros(2 * EMBED, **options).requires_grad_(),
        ]

    def step(self, path: str, backend: str) -> list[torch.Tensor]:
        """The loss and every weight's gradient."""
        qkv_weight, qkv_bias, conv_weight, conv_bias = self.weights
        if path == "ours":
            query, key, value = tk.qkv_projection(self.x, qkv_weight, qkv_bias, num_heads=HEADS, backend=backend)
            attended = tk.scaled_dot_product_attention(query, key, value, key_padding_mask=self.padding,
                                                       backend=backend)
        elif path == "seed":
            query, key, value = reference.qkv_projection(self.x, qkv_weight, qkv_bias, HEADS)
            attended = reference.attention(query, key, value, key_padding_mask=self.padding)
        else:
            packed = F.linear(self.x, qkv_weight, qkv_bias)
            query, key, value = (t.view(BATCH, LENGTH, HEADS, -1).transpose(1, 2) for t in packed.chunk(3, -1))
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=~self.padding[:, None, None, :])
        h = attended.transpose(1, 2).reshape(BATCH, LENGTH, EMBED).transpose(1, 2)  # [B, E, L] channel-last
        if path == "ours":
            y = tk.glu_conv1d(h, conv_weight, conv_bias, residual=h, residual_scale=SCALE, backend=backend)
        else:
            y = (F.glu(F.conv1d(h, conv_weight, conv_bias, padding=KERNEL_SIZE // 2), dim=1) + h) * SCALE
        loss = y.float().square().mean()
        return [loss, *torch.autograd.grad(loss, self.weights)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--backend", default="triton")
    args = parser.parse_args()
    device = torch.device("cuda")
    layer = Layer(device, torch.bfloat16)
    steps = {
        "ours": lambda: layer.step("ours", args.backend),
        "seed": lambda: layer.step("seed", args.backend),
        "torch": lambda: layer.step("torch", args.backend),
    }
    for name in ("ours", "torch"):
        graph, _ = captured(steps[name])
        steps[f"{name}_graphed"] = graph.replay
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
              "shape": dict(batch=BATCH, length=LENGTH, embed=EMBED, heads=HEADS, kernel_size=KERNEL_SIZE),
              "times_s": times, "speedups": speedups}
    (args.out / "graphed_step.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
