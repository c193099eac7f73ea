"""Helpers shared by the Triton kernels of every op.

``CompileTarget`` is how a kernel module lists every configuration its
dispatcher can choose, so ``tests/test_triton_compile.py`` can build each one
for sm_80 and sm_90 without a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton

TORCH_TO_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """One kernel launch configuration, as ``triton.compile`` takes it.

    ``signature`` maps every argument name to its Triton type ("*fp16",
    "i32", "fp32", "constexpr", ...); ``constexprs`` gives the constexpr
    values; ``name`` is a readable test id.
    """

    name: str
    kernel: Any
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int


def next_power_of_2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))
