"""The reduction after a split weight-gradient GEMM, shared by the QKV projection and the GLU
convolution: their weight-gradient kernels split the token (or position) range over programs
that each write float32 partial sums ``[splits, *shape]`` of the weight's gradient and of the
bias's, and one launch of :func:`split_sum_launch` adds up both and casts them to the gradients'
dtype, where ``partials.sum(0).to(dtype)`` would be two torch ops per gradient, each a kernel
launch on a GPU.  Deterministic: the splits are added in order, no atomics.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (
    TORCH_TO_TRITON_DTYPE, CompileTarget, KernelConfig, KernelLaunch, LaunchTemplates, cdiv, filled,
)

__all__ = ["split_count", "wanted_sums", "split_sum_pointers", "split_sum_launch", "split_sum_template",
           "compile_targets"]

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
def _split_sum_kernel(
    partials_ptr, out_ptr, second_partials_ptr, second_out_ptr, numel, second_numel, num_splits,
    BLOCK_M: tl.constexpr,
):
    # out[i] = sum over s of partials[s, i], accumulated in float32 in split order; the programs
    # past the first array's blocks do the same for the second array (a bias beside its weight),
    # so one launch reduces both.
    block = tl.program_id(0)
    first_blocks = tl.cdiv(numel, BLOCK_M)
    in_first = block < first_blocks
    partials_ptr = tl.where(in_first, partials_ptr, second_partials_ptr)
    out_ptr = tl.where(in_first, out_ptr, second_out_ptr)
    numel = tl.where(in_first, numel, second_numel)
    block = tl.where(in_first, block, block - first_blocks)
    offsets = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = offsets < numel
    partial_ptrs = partials_ptr + offsets
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for _ in range(num_splits):
        total += tl.load(partial_ptrs, mask=in_range, other=0.0)
        partial_ptrs += numel  # the next split's row: pointer arithmetic, 64-bit
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=in_range)


# Every launch of this kernel, by layout (see ``LaunchTemplates``).
_TEMPLATES = LaunchTemplates()


def wanted_sums(buffers, wanted) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(partials, gradient)`` pairs a backward's split sum reduces, from its ``buffers``
    (``weight_sums``, ``grad_weight``, ``bias_sums``, ``grad_bias``): the weight's and the bias's,
    those ``wanted`` (a :class:`._common.WantedGradients`)."""
    return [pair for pair, want in (((buffers.weight_sums, buffers.grad_weight), wanted.weight),
                                    ((buffers.bias_sums, buffers.grad_bias), wanted.bias)) if want]


def split_sum_pointers(*sums: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The pointers of :func:`split_sum_template`'s launch for one or two ``(partials, out)`` pairs:
    an absent second pair repeats the first (the kernel reduces no element of it)."""
    (partials, out), (second_partials, second_out) = sums[0], sums[-1]
    return partials, out, second_partials, second_out


def split_sum_template(*sums: tuple[torch.Tensor, torch.Tensor]) -> tuple[KernelLaunch, ...]:
    """The template (:meth:`LaunchTemplates.template`) of :func:`split_sum_launch`, whose pointers
    are :func:`split_sum_pointers`'."""
    pointers = split_sum_pointers(*sums)
    partials, out, _, second_out = pointers
    numel, second_numel, num_splits = out.numel(), second_out.numel() if len(sums) > 1 else 0, partials.shape[0]

    def build() -> KernelLaunch:
        grid = (cdiv(numel, _CONFIG.block_m) + cdiv(second_numel, _CONFIG.block_m),)
        return KernelLaunch(_split_sum_kernel, grid, (*pointers, numel, second_numel, num_splits),
                            _CONFIG.launch_kwargs())

    return _TEMPLATES.template((numel, second_numel, num_splits), pointers, lambda: [build()], {})


def split_sum_launch(*sums: tuple[torch.Tensor, torch.Tensor]) -> KernelLaunch:
    """For each of one or two ``(partials, out)`` pairs, ``out = partials.sum(0)`` cast to
    ``out``'s dtype: ``partials`` a contiguous float32 ``[splits, *out.shape]`` (the same
    ``splits`` for both), ``out`` contiguous (the same dtype for both)."""
    (launch,) = filled(split_sum_template(*sums), split_sum_pointers(*sums), {})
    return launch


# Triton specializes the kernel on each size's divisibility by 16: a QKV weight's and bias's
# gradients (3 * 512 x 512 and 3 * 512), a ragged GLU convolution's (an odd channel count, 37:
# 2 * 37 x 37 x 3 and 2 * 37), and either size alone beside the other's kind.
_TARGET_SIZES = {False: (3 * 512, 512), True: (2 * 37, 37, 3)}
_TARGET_SPLITS = 4


def _target_launch(dtype: torch.dtype, ragged: bool, second_ragged: bool) -> KernelLaunch:
    def sums(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(_TARGET_SPLITS, *shape), torch.empty(*shape, dtype=dtype)

    return split_sum_launch(sums(_TARGET_SIZES[ragged]), sums(_TARGET_SIZES[second_ragged][:1]))


def compile_targets() -> list[CompileTarget]:
    """The reduction into each gradient dtype, of sizes divisible by 16 or not (a second size of 0,
    where one gradient is wanted, specializes as a multiple of 16)."""
    return [
        CompileTarget(f"split_sum-{TORCH_TO_TRITON_DTYPE[dtype]}{'-ragged' if ragged else ''}"
                      f"{'-ragged_second' if second_ragged else ''}",
                      functools.partial(_target_launch, dtype, ragged, second_ragged))
        for dtype in TORCH_TO_TRITON_DTYPE for ragged in (False, True) for second_ragged in (False, True)
    ]
