"""A step captured in a CUDA graph, for the benchmarks and tests that replay it.

Replaying a graph runs the step's kernels without its host path (argument checks, dispatch, the
building of each launch), which at the seeds' short sequences takes longer than the kernels.  A step
captures when nothing in it syncs with the host or reads a value back; dropout draws its
(seed, offset) from the CUDA generator as a device tensor, which a replay advances.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["captured"]


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
