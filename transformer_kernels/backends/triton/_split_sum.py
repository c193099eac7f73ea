"""The reduction after a split weight-gradient GEMM, shared by the QKV projection and the GLU
convolution: their weight-gradient kernels split the token (or position) range over programs
that each write float32 partial sums ``[splits, *shape]``, and one launch of
:func:`split_sum_launch` adds them up and casts them to the gradient's dtype, where
``partials.sum(0).to(dtype)`` would be two torch ops, each a kernel launch on a GPU.
Deterministic: the splits are added in order, no atomics.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (
    TORCH_TO_TRITON_DTYPE, CompileTarget, KernelConfig, KernelLaunch, LaunchTemplates, cdiv, filled,
)

__all__ = ["split_count", "split_sum_launch", "split_sum_template", "compile_targets"]

_CONFIG = KernelConfig(block_m=1024, num_warps=4, num_stages=1)


def split_count(tiles: int, steps: int, num_sms: int, min_steps: int, max_splits: int) -> int:
    """Into how many ranges a weight-gradient GEMM of ``tiles`` output tiles splits its ``steps``
    K steps: the count, at most ``max_splits`` and leaving each range ``min_steps`` or more, whose
    grid ends soonest, counted as waves (``tiles * splits`` programs, one per SM at a time) times
    the steps of a range; the fewest splits among equals, since each writes and reads back a
    float32 partial sum.  A grid's last wave runs as long as a full one: the GLU convolution's 96
    tiles at the seeds' sizes on 132 SMs end after 3 waves of 27 steps in 3 ranges, 3 of 20 in 4."""
    best, best_cost = 1, cdiv(tiles, num_sms) * steps
    for splits in range(2, max_splits + 1):
        if cdiv(steps, splits) < min_steps:
            break
        cost = cdiv(tiles * splits, num_sms) * cdiv(steps, splits)
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


@triton.jit
def _split_sum_kernel(partials_ptr, out_ptr, numel, num_splits, BLOCK_M: tl.constexpr):
    # out[i] = sum over s of partials[s, i], accumulated in float32 in split order.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = offsets < numel
    partial_ptrs = partials_ptr + offsets
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for _ in range(num_splits):
        total += tl.load(partial_ptrs, mask=in_range, other=0.0)
        partial_ptrs += numel  # the next split's row: pointer arithmetic, 64-bit
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=in_range)


# Every launch of this kernel, by layout (see ``LaunchTemplates``).
_TEMPLATES = LaunchTemplates()


def split_sum_template(partials: torch.Tensor, out: torch.Tensor) -> tuple[KernelLaunch, ...]:
    """The template (:meth:`LaunchTemplates.template`) of :func:`split_sum_launch`, whose pointers
    are ``(partials, out)``."""
    numel, num_splits = out.numel(), partials.shape[0]

    def build() -> KernelLaunch:
        grid = (cdiv(numel, _CONFIG.block_m),)
        return KernelLaunch(_split_sum_kernel, grid, (partials, out, numel, num_splits), _CONFIG.launch_kwargs())

    return _TEMPLATES.template((numel, num_splits), (partials, out), lambda: [build()], {})


def split_sum_launch(partials: torch.Tensor, out: torch.Tensor) -> KernelLaunch:
    """``out = partials.sum(0)`` cast to ``out``'s dtype: ``partials`` a contiguous float32
    ``[splits, *out.shape]``, ``out`` contiguous."""
    (launch,) = filled(split_sum_template(partials, out), (partials, out), {})
    return launch


# A QKV weight gradient's partial sums, and a ragged GLU bias gradient's (an odd channel count):
# Triton specializes the kernel on numel's divisibility by 16.
_TARGET_SHAPES = {False: (4, 3 * 512, 512), True: (2, 2 * 37)}


def _target_launch(dtype: torch.dtype, ragged: bool) -> KernelLaunch:
    splits, *shape = _TARGET_SHAPES[ragged]
    return split_sum_launch(torch.empty(splits, *shape), torch.empty(*shape, dtype=dtype))


def compile_targets() -> list[CompileTarget]:
    """The reduction into each gradient dtype, of sizes divisible by 16 or not."""
    return [
        CompileTarget(f"split_sum-{TORCH_TO_TRITON_DTYPE[dtype]}{'-ragged' if ragged else ''}",
                      functools.partial(_target_launch, dtype, ragged))
        for dtype in TORCH_TO_TRITON_DTYPE for ragged in (False, True)
    ]
