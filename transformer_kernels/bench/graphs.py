"""The seeds' layer as one training step, and that step captured in a CUDA graph: for
``benchmarks/graphed_step.py`` and ``tests/test_cuda_graphs.py``.

Replaying a graph runs the step's kernels without its host path (argument checks, dispatch, the
building of each launch), which at the seeds' short sequences takes longer than the kernels.  A step
captures when nothing in it syncs with the host or reads a value back; dropout draws its
(seed, offset) from the CUDA generator as a device tensor, which a replay advances.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import transformer_kernels as tk
from transformer_kernels import reference

__all__ = ["SeedLayer", "captured", "PATHS"]

# The ways to compute the step: ours (transformer_kernels' ops), the seeds' naive math, torch's ops.
PATHS = ("ours", "seed", "torch")


class SeedLayer:
    """Static inputs and weights of the seeds' layer: the packed QKV projection, self-attention with
    key padding (``dropout_p`` on its weights), a GLU convolution (kernel 3) with a residual scaled
    by sqrt(1/2), then a loss.  ``x`` ``[batch, length, embed]``; sequence lengths uniform in
    ``[min_length, length]``, the rest padding."""

    def __init__(self, batch: int, length: int, embed: int, heads: int, min_length: int, *,
                 device: torch.device, dtype: torch.dtype, dropout_p: float = 0.0) -> None:
        self.batch, self.length, self.embed, self.heads = batch, length, embed, heads
        self.min_length, self.dropout_p = min_length, dropout_p
        self.kernel_size = 3
        self.x = torch.empty(batch, length, embed, device=device, dtype=dtype)
        self.padding = torch.empty(batch, length, device=device, dtype=torch.bool)  # True = padding
        self.set_inputs(seed=0)
        generator = torch.Generator(device=device).manual_seed(1)

        def randn(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(shape, generator=generator, device=device) * scale).to(dtype).requires_grad_()

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, device=device, dtype=dtype).requires_grad_()

        self.weights = [
            randn(3 * embed, embed, scale=embed**-0.5), zeros(3 * embed),
            randn(2 * embed, embed, self.kernel_size, scale=(self.kernel_size * embed) ** -0.5), zeros(2 * embed),
        ]

    def set_inputs(self, seed: int) -> None:
        """New values in the static inputs (a batch and its padding), as a training loop copies
        each batch in."""
        device = self.x.device
        generator = torch.Generator(device=device).manual_seed(seed)
        self.x.copy_(torch.randn(self.x.shape, generator=generator, device=device))
        lengths = torch.randint(self.min_length, self.length + 1, (self.batch,), generator=generator, device=device)
        self.padding.copy_(torch.arange(self.length, device=device)[None, :] >= lengths[:, None])

    def loss(self, path: str = "ours", backend: str = "auto") -> torch.Tensor:
        """The layer's loss, computed the ``path`` way (one of ``PATHS``; ours on ``backend``): what
        ``torch.compile`` takes of a step (:meth:`step` adds the gradients).  The seed's and torch's
        attention take no dropout."""
        qkv_weight, qkv_bias, conv_weight, conv_bias = self.weights
        batch, length, embed, heads = self.batch, self.length, self.embed, self.heads
        if path == "ours":
            query, key, value = tk.qkv_projection(self.x, qkv_weight, qkv_bias, num_heads=heads, backend=backend)
            attended = tk.scaled_dot_product_attention(
                query, key, value, dropout_p=self.dropout_p, key_padding_mask=self.padding, backend=backend
            )
        elif path == "seed":
            query, key, value = reference.qkv_projection(self.x, qkv_weight, qkv_bias, heads)
            attended = reference.attention(query, key, value, key_padding_mask=self.padding)
        else:
            packed = F.linear(self.x, qkv_weight, qkv_bias)
            query, key, value = (t.view(batch, length, heads, -1).transpose(1, 2) for t in packed.chunk(3, -1))
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=~self.padding[:, None, None, :])
        h = attended.transpose(1, 2).reshape(batch, length, embed).transpose(1, 2)  # [B, E, L] channel-last
        scale = math.sqrt(0.5)
        if path == "ours":
            y = tk.glu_conv1d(h, conv_weight, conv_bias, residual=h, residual_scale=scale, backend=backend)
        else:
            y = (F.glu(F.conv1d(h, conv_weight, conv_bias, padding=self.kernel_size // 2), dim=1) + h) * scale
        return y.float().square().mean()

    def step(self, path: str = "ours", backend: str = "auto",
             loss: Optional[Callable[[], torch.Tensor]] = None) -> list[torch.Tensor]:
        """The loss and every weight's gradient, the loss computed the ``path`` way (:meth:`loss`), or
        by ``loss()`` when given (a compiled :meth:`loss`)."""
        value = self.loss(path, backend) if loss is None else loss()
        return [value, *torch.autograd.grad(value, self.weights)]


def captured(step: Callable[[], Sequence[torch.Tensor]], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, list]:
    """``step`` captured in a CUDA graph, after ``warmup`` eager runs on a side stream (they compile
    the kernels and fill every cache), and the tensors it returned: each replay rewrites them from
    what the step's input tensors hold then."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = list(step())
    return graph, results
