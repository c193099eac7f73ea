"""Triton kernels for the fused GLU convolution (conv1d + bias + GLU + residual, scaled).

Notation: ``x`` ``[B, C_in, L]``, ``weight`` ``[2C, C_in, k]``, pre-activation
``z = conv1d(pad(x), weight) + bias`` ``[B, 2C, L_out]`` split into the value
half ``a = z[:, :C]`` and the gate half ``g = z[:, C:]``;
``out = (a * sigmoid(g) + residual) * residual_scale``.  Padding puts
``pad_left`` positions holding ``pad_value`` before ``x`` (and enough after it
for ``L_out``), so ``xpad[b, ci, s + tap] = x[b, ci, s + tap - pad_left]``.

Every tensor is addressed through its own strides, so ``[B, C, L]`` tensors
may be channel-first (contiguous) or channel-last (a contiguous ``[B, L, C]``
transposed) without a copy.  The launchers pass the weight repacked as
``[k, C_in, 2C]`` so that weight tiles are contiguous along output channels.

Kernels:

* ``_glu_conv_forward_kernel``: implicit GEMM producing both GLU halves, then
  the epilogue.  With ``COMPUTE_GRAD`` it is the first backward step: it
  recomputes ``a`` and ``g`` from ``x`` and writes ``grad_z`` instead of
  ``out`` (forward keeps no pre-activation for backward).
* ``_glu_conv_grad_input_kernel``: ``grad_x``, a transposed convolution of
  ``grad_z``.
* ``_glu_conv_grad_weight_kernel``: ``grad_weight`` per tap and
  ``grad_bias``, as split-K partial sums that ``_split_sum``'s kernel adds up.
* A decoding step (one output position, no padding, a batch of up to
  ``_glu_step.MAX_BATCH``) runs ``_glu_step._glu_step_kernel`` on the weight
  as it is instead (:mod:`._glu_step`).

Each kernel is a GEMM of ``BLOCK_M x BLOCK_N`` output tiles reducing
``BLOCK_K`` at a time; its comment says what M, N and K are.  Strides are
named ``stride_<tensor><dim>``, dims ``b``, ``c``, ``l`` for ``[B, C, L]``
tensors and ``k`` (tap), ``i`` (input channel), ``o`` (output channel),
``s`` (split) for weights and their partial sums.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ...ops.glu_conv import GluConvArgs, empty_output
from ...ops.glu_conv import results_in_x_layout as results_channel_last
from ._common import (
    COMPILE_CAPABILITIES,
    ROW_SUM_WIDTH,
    TORCH_TO_TRITON_DTYPE,
    CompileTarget,
    KernelConfig,
    KernelLaunch,
    LaunchTemplates,
    TensorLayout,
    TensorLayouts,
    WantedGradients,
    as_float32,
    cdiv,
    check_prepared_launches,
    compute_capability,
    filled,
    filled_all,
    fp32_conv_allows_tf32,
    input_precision,
    num_sms,
    row_sum_operand,
    run_launches,
    strided_layout,
)
from . import _glu_step
from ._split_sum import split_count, split_sum_pointers, split_sum_template, wanted_sums

__all__ = [
    "forward", "prepare_forward", "backward", "unsupported_reason", "empty_saved", "results_channel_last",
    "compile_targets",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Forward / recompute kernel.
#
# One program owns BLOCK_M output rows (M: flattened (batch, position), so short
# sequences of a large batch fill a tile) times BLOCK_N channels (N: C) of BOTH GLU
# halves: it accumulates a = xpad * W[:C] and g = xpad * W[C:] in two fp32
# accumulators that share every x tile, so the gate never leaves registers.
#   for (tap, BLOCK_K slice ci of C_in):    # implicit GEMM over K = (C_in x k), one flat
#                                           # loop so the pipeliner overlaps across taps
#       rows' input position p = s + tap - pad_left (pad_value where p is outside [0, L))
#       acc_a += x[rows, p, ci] @ W[tap, ci, c];  acc_g += x[rows, p, ci] @ W[tap, ci, C + c]
# Epilogue (fp32): add bias; gate = sigmoid(acc_g); then either
#   forward:       out = (acc_a * gate + residual) * residual_scale
#   COMPUTE_GRAD:  gy = grad_out * residual_scale
#                  grad_z[:, c] = gy * gate;  grad_z[:, C + c] = gy * acc_a * gate * (1 - gate)
@triton.jit
def _glu_conv_forward_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    residual_ptr,
    grad_out_ptr,
    out_ptr,
    batch,
    length_in,
    length_out,
    channels_in,
    channels_out,
    kernel_size,
    pad_left,
    pad_value,
    residual_scale,
    stride_xb,
    stride_xc,
    stride_xl,
    stride_wk,
    stride_wi,
    stride_wo,
    stride_rb,
    stride_rc,
    stride_rl,
    stride_gob,
    stride_goc,
    stride_gol,
    stride_ob,
    stride_oc,
    stride_ol,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    PAD_BY_FILL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # out_ptr / stride_o*: the tensor written, ``out`` [B, C, L_out] in the
    # forward; with COMPUTE_GRAD ``grad_z`` [B, 2C, L_out] (gate half at +C).
    pad_value, residual_scale = as_float32(pad_value), as_float32(residual_scale)
    pid_row = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_row * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < batch * length_out
    b = (rows // length_out).to(tl.int64)
    s = rows % length_out
    cols = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < channels_out

    x_rows = x_ptr + b * stride_xb
    ci_blocks = tl.cdiv(channels_in, BLOCK_K)

    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(kernel_size * ci_blocks):
        tap = step // ci_blocks
        ci = (step % ci_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        ci_ok = ci < channels_in
        position = s + tap - pad_left
        in_sequence = (position >= 0) & (position < length_in)
        # Padding positions read pad_value; rows past the end and channels past C_in read 0, which
        # meets zero weights (an infinite or NaN pad_value there would make every sum NaN).
        # PAD_BY_FILL: pad_value is +0.0, the asynchronous copy's own fill, so the 16-bit tile
        # goes from shared memory straight to the dot; any other value is selected in registers.
        x_tile = tl.load(
            (x_rows + position.to(tl.int64) * stride_xl)[:, None] + ci[None, :] * stride_xc,
            mask=(row_ok & in_sequence)[:, None] & ci_ok[None, :],
            other=0.0,
        )
        if not PAD_BY_FILL:
            x_tile = tl.where((row_ok & ~in_sequence)[:, None] & ci_ok[None, :], pad_value, x_tile)
        x_tile = x_tile.to(x_ptr.dtype.element_ty)
        w_ptrs = weight_ptr + tap * stride_wk + ci[:, None] * stride_wi + cols[None, :] * stride_wo
        w_mask = ci_ok[:, None] & col_ok[None, :]
        w_value = tl.load(w_ptrs, mask=w_mask, other=0.0)
        w_gate = tl.load(w_ptrs + channels_out * stride_wo, mask=w_mask, other=0.0)
        acc_a = tl.dot(x_tile, w_value, acc_a, input_precision=INPUT_PRECISION)
        acc_g = tl.dot(x_tile, w_gate, acc_g, input_precision=INPUT_PRECISION)

    if HAS_BIAS:
        acc_a += tl.load(bias_ptr + cols * stride_bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(bias_ptr + (channels_out + cols) * stride_bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    gate = tl.sigmoid(acc_g)
    tile_mask = row_ok[:, None] & col_ok[None, :]
    s = s.to(tl.int64)
    out_ptrs = out_ptr + (b * stride_ob + s * stride_ol)[:, None] + cols[None, :] * stride_oc
    if COMPUTE_GRAD:
        grad_out = tl.load(
            grad_out_ptr + (b * stride_gob + s * stride_gol)[:, None] + cols[None, :] * stride_goc,
            mask=tile_mask,
            other=0.0,
        ).to(tl.float32)
        grad_value = grad_out * residual_scale * gate
        grad_gate = grad_value * acc_a * (1.0 - gate)
        tl.store(out_ptrs, grad_value.to(out_ptr.dtype.element_ty), mask=tile_mask)
        tl.store(out_ptrs + channels_out * stride_oc, grad_gate.to(out_ptr.dtype.element_ty), mask=tile_mask)
    else:
        y = acc_a * gate
        if HAS_RESIDUAL:
            y += tl.load(
                residual_ptr + (b * stride_rb + s * stride_rl)[:, None] + cols[None, :] * stride_rc,
                mask=tile_mask,
                other=0.0,
            ).to(tl.float32)
        y = y * residual_scale
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=tile_mask)


# grad_x: the transposed convolution of grad_z.
#   grad_x[b, ci, t] = sum_{tap, co < 2C} grad_z[b, co, t + pad_left - tap] * W[co, ci, tap]
# One program owns BLOCK_M input rows (M: flattened (batch, position)) times
# BLOCK_N input channels (N: C_in) and reduces over K = (2C x k); output positions
# t + pad_left - tap outside [0, L_out) contribute nothing (padding is a
# constant, it takes no gradient).
@triton.jit
def _glu_conv_grad_input_kernel(
    grad_z_ptr,
    weight_ptr,
    grad_x_ptr,
    batch,
    length_in,
    length_out,
    channels_in,
    channels_z,
    kernel_size,
    pad_left,
    stride_dzb,
    stride_dzc,
    stride_dzl,
    stride_wk,
    stride_wi,
    stride_wo,
    stride_dxb,
    stride_dxc,
    stride_dxl,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_row = tl.program_id(0)
    pid_ci = tl.program_id(1)
    rows = pid_row * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < batch * length_in
    b = (rows // length_in).to(tl.int64)
    t = rows % length_in
    ci = pid_ci * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_ok = ci < channels_in

    grad_z_rows = grad_z_ptr + b * stride_dzb
    cz_blocks = tl.cdiv(channels_z, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(kernel_size * cz_blocks):  # one flat loop over (tap, 2C slice), as in the forward
        tap = step // cz_blocks
        cz = (step % cz_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        cz_ok = cz < channels_z
        s = t + pad_left - tap
        in_output = (s >= 0) & (s < length_out)
        grad_z_tile = tl.load(
            (grad_z_rows + s.to(tl.int64) * stride_dzl)[:, None] + cz[None, :] * stride_dzc,
            mask=(row_ok & in_output)[:, None] & cz_ok[None, :],
            other=0.0,
        )
        w_tile = tl.load(
            weight_ptr + tap * stride_wk + cz[:, None] * stride_wo + ci[None, :] * stride_wi,
            mask=cz_ok[:, None] & ci_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(grad_z_tile, w_tile, acc, input_precision=INPUT_PRECISION)

    grad_x_ptrs = grad_x_ptr + (b * stride_dxb + t.to(tl.int64) * stride_dxl)[:, None] + ci[None, :] * stride_dxc
    tl.store(grad_x_ptrs, acc.to(grad_x_ptr.dtype.element_ty), mask=row_ok[:, None] & ci_ok[None, :])


# grad_weight and grad_bias, split-K over the flattened (batch, position) rows.
#   grad_W[co, ci, tap] = sum_{b, s} grad_z[b, co, s] * xpad[b, ci, s + tap]
#   grad_bias[co]       = sum_{b, s} grad_z[b, co, s]
# Program (tile, tap, split) owns a BLOCK_M x BLOCK_N tile (M: 2C, N: C_in) of one
# tap and reduces over its split's contiguous range of rows (K), BLOCK_K at a time,
# re-reading x (with pad_value in the padding) rather than an unfolded copy.
# grad_z's rows are evenly strided (stride_dzr: the backward allocates it so), so only x's
# address needs a row's batch and position.
# Each split writes fp32 partial sums; the launcher adds the splits, which
# keeps the result deterministic (no atomics).  Only the programs of tap 0
# and the first C_in tile write grad_bias partials.
@triton.jit
def _glu_conv_grad_weight_kernel(
    x_ptr,
    grad_z_ptr,
    grad_weight_partial_ptr,
    grad_bias_partial_ptr,
    batch,
    length_in,
    length_out,
    channels_in,
    channels_z,
    pad_left,
    rows_per_split,
    pad_value,
    stride_xb,
    stride_xc,
    stride_xl,
    stride_dzc,
    stride_dzr,
    stride_dws,
    stride_dwo,
    stride_dwi,
    stride_dwk,
    stride_dbs,
    HAS_BIAS: tl.constexpr,
    PAD_BY_FILL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pad_value = as_float32(pad_value)
    pid_tile = tl.program_id(0)
    tap = tl.program_id(1)
    split = tl.program_id(2)
    num_ci_blocks = tl.cdiv(channels_in, BLOCK_N)
    pid_cz = pid_tile // num_ci_blocks
    pid_ci = pid_tile % num_ci_blocks
    cz = pid_cz * BLOCK_M + tl.arange(0, BLOCK_M)
    cz_ok = cz < channels_z
    ci = pid_ci * BLOCK_N + tl.arange(0, BLOCK_N)
    ci_ok = ci < channels_in

    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, batch * length_out)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 16-bit grad_bias as a second dot (see row_sum_operand), without reloading grad_z in
    # another layout: SASS steps 25-30% shorter.  float32's dots would take three TF32 products
    # or FMAs for it, longer than its row sums.
    BIAS_BY_DOT: tl.constexpr = grad_z_ptr.dtype.element_ty != tl.float32
    if BIAS_BY_DOT:
        bias_acc = tl.zeros((BLOCK_M, ROW_SUM_WIDTH), dtype=tl.float32)
        ones_column = row_sum_operand(BLOCK_K, grad_z_ptr.dtype.element_ty)
    else:
        bias_acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # Each row's position in its sequence and x's offset of that sequence, advanced by BLOCK_K rows
    # a step without dividing: BLOCK_K rows are step_b whole sequences and step_s positions more.
    rows = row_start + tl.arange(0, BLOCK_K)
    s = rows % length_out
    x_rows = (rows // length_out).to(tl.int64) * stride_xb
    step_b, step_s = BLOCK_K // length_out, BLOCK_K % length_out
    for row_block in range(row_start, row_end, BLOCK_K):
        rows = row_block + tl.arange(0, BLOCK_K)
        row_ok = rows < row_end
        grad_z_tile = tl.load(
            grad_z_ptr + cz[:, None] * stride_dzc + (rows.to(tl.int64) * stride_dzr)[None, :],
            mask=cz_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        position = s + tap - pad_left
        in_sequence = (position >= 0) & (position < length_in)
        x_tile = tl.load(
            x_ptr + (x_rows + position.to(tl.int64) * stride_xl)[:, None] + ci[None, :] * stride_xc,
            mask=(row_ok & in_sequence)[:, None] & ci_ok[None, :],
            other=0.0,
        )
        if not PAD_BY_FILL:  # see the forward kernel
            x_tile = tl.where((row_ok & (~in_sequence))[:, None] & ci_ok[None, :], pad_value, x_tile)
        x_tile = x_tile.to(x_ptr.dtype.element_ty)
        acc = tl.dot(grad_z_tile, x_tile, acc, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            if BIAS_BY_DOT:
                bias_acc = tl.dot(grad_z_tile, ones_column, bias_acc)
            else:
                bias_acc += tl.sum(grad_z_tile, axis=1)
        s += step_s  # the next step's rows
        wrapped = s >= length_out
        s = tl.where(wrapped, s - length_out, s)
        x_rows += (step_b + wrapped.to(tl.int64)) * stride_xb

    partial_ptrs = (
        grad_weight_partial_ptr
        + split * stride_dws
        + tap * stride_dwk
        + cz[:, None] * stride_dwo
        + ci[None, :] * stride_dwi
    )
    tl.store(partial_ptrs, acc, mask=cz_ok[:, None] & ci_ok[None, :])
    if HAS_BIAS:
        # Every program summed its grad_z rows; one program per channel block writes them.
        bias_channels = tl.where((pid_ci == 0) & (tap == 0), channels_z, 0)
        if BIAS_BY_DOT:
            bias_acc = tl.sum(bias_acc, axis=1)
        tl.store(grad_bias_partial_ptr + split * stride_dbs + cz, bias_acc, mask=cz < bias_channels)


# Forward: two 64 x 64 fp32 accumulators (value and gate halves) need 8 warps
# to stay clear of spills; the backward GEMMs hold one and fit in 4 warps with
# 16-bit operands (8 for fp32, whose "ieee" FMA path needs more registers).
# fp32 operands take twice the shared memory per stage, so they use a narrower
# reduction slice, and the fp32 backward two stages: with three, its channel-last
# variants (x as [B, L, C], the seeds' layout) spilled 8 bytes on sm_90 with
# "ieee" dots (grad_weight under triton 3.9, grad_input under 3.6).  Checked on
# sm_80 and sm_90, for channel-first and channel-last x, by
# tests/test_triton_compile.py.
# One configuration per (kernel, dtype class) serves every channel count:
# partial tiles are masked.
_CONFIGS = {
    # kernel: (config for 16-bit inputs, config for fp32 inputs)
    "forward": (
        KernelConfig(block_m=64, block_n=64, block_k=32, num_warps=8, num_stages=3),
        KernelConfig(block_m=64, block_n=64, block_k=16, num_warps=8, num_stages=3),
    ),
    "grad_input": (
        KernelConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3),
        KernelConfig(block_m=64, block_n=64, block_k=16, num_warps=8, num_stages=2),
    ),
    "grad_weight": (
        KernelConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3),
        KernelConfig(block_m=64, block_n=64, block_k=16, num_warps=8, num_stages=2),
    ),
}


# sm_90, 16-bit: the tiles above give each warpgroup an m64n32 wgmma (forward) or one warpgroup
# per program (backward), too little to keep Hopper's tensor cores busy.  These are the Triton
# matmul tutorial's Hopper shapes (two warpgroups, 128 rows, 64-wide K steps; the forward's two
# accumulators keep it at 64 channels): compiled without spills under triton 3.6 and 3.9, every
# dot wgmma and the weight operands pipelined (tests/test_triton_compile.py).  The H200 profile of
# 2026-11-27 (benchmarks/results/nvidia-h200-2026-11-27-03ce1d0) timed the weight gradient, then
# with 32-wide K steps, at 2.9x the input gradient's time for the same products: its main loop
# issued about twice the instructions its wgmmas needed (channel-last x, 259 per step, the x tile
# passing through registers for the padding value).  With zero padding left to the copies' fill,
# grad_z addressed by its row stride, x's rows advanced without a division and 64-wide steps it
# issues 262 per step of twice the work (triton 3.9; 251 under 3.6).
_SM90_16BIT_CONFIGS = {
    "forward": KernelConfig(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3),
    "grad_input": KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    "grad_weight": KernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
}


# x channel-first with ragged rows (output length or channel stride not a multiple of 16, see
# _Dots.of): Triton cannot prove a row of the x tile contiguous, so each element of it takes its
# own 64-bit address, and the tiles above spilled at length 40 (the seeds' padded length): the
# sm_90 16-bit forward 184 bytes, on sm_80 the float32 tf32x3 forward with its gradient 24 and
# weight gradient 8, the float32 "ieee" forward 8 on sm_90 under triton 3.6.  Half the tile's
# rows or channels, or the weight gradient's warps, compile without spills under triton 3.6 and
# 3.9 (narrower K steps would too, but triton 3.6 refuses a dot's K under 16).  Keyed by kernel
# and by sm_90 16-bit or the float32 dots' precision; the others keep the tables above.
_RAGGED_FLOAT32_FORWARD = KernelConfig(block_m=64, block_n=32, block_k=16, num_warps=8, num_stages=3)
_RAGGED_X_CONFIGS = {
    ("forward", "sm90_16bit"): KernelConfig(block_m=64, block_n=64, block_k=64, num_warps=8, num_stages=3),
    ("forward", "tf32x3"): _RAGGED_FLOAT32_FORWARD,
    ("forward", "ieee"): _RAGGED_FLOAT32_FORWARD,
    ("grad_weight", "tf32x3"): KernelConfig(block_m=64, block_n=32, block_k=16, num_warps=4, num_stages=2),
    # 32-wide K steps, as the sm_90 weight gradient took before its 64-wide ones: with those, its
    # variant for a padding value other than zero spilled 8 bytes under triton 3.9.
    ("grad_weight", "sm90_16bit"): KernelConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4),
}


def kernel_config(
    kernel: str, dtype: torch.dtype, capability: Optional[int], precision: str = "ieee", ragged_x: bool = False
) -> KernelConfig:
    """The configuration of ``kernel`` ("forward", "grad_input", "grad_weight") for inputs of
    ``dtype`` on a GPU of compute ``capability`` (None under the interpreter), float32 dots of
    ``precision``, ``x`` channel-first with ragged rows or not (see ``_RAGGED_X_CONFIGS``)."""
    sm90_16bit = dtype != torch.float32 and capability is not None and capability >= 90
    if ragged_x:
        family = precision if dtype == torch.float32 else "sm90_16bit" if sm90_16bit else None
        config = _RAGGED_X_CONFIGS.get((kernel, family))
        if config is not None:
            return config
    if sm90_16bit:
        return _SM90_16BIT_CONFIGS[kernel]
    return _CONFIGS[kernel][dtype == torch.float32]


@dataclasses.dataclass(frozen=True)
class _Dots:
    """How a call's dots run: their ``input_precision``, the GPU's compute ``capability`` (None
    under the interpreter) and whether ``x`` is channel-first with ragged rows, which pick the
    tiles (:func:`kernel_config`)."""

    precision: str
    capability: Optional[int]
    ragged_x: bool = False

    @classmethod
    def of(cls, x: torch.Tensor, length_out: int) -> "_Dots":
        """``x`` ``[B, C_in, L]`` convolved into ``length_out`` positions.  Its rows are ragged when
        positions are its contiguous dimension and the kernels' row arithmetic (``length_out``,
        the channel stride) loses Triton's divisibility-by-16 specialization."""
        channel_first = x.stride(2) == 1 and x.stride(1) != 1
        ragged_x = channel_first and (length_out % 16 != 0 or x.stride(1) % 16 != 0)
        return cls(_input_precision(x.dtype), compute_capability(x.device), ragged_x)

    def config(self, kernel: str, dtype: torch.dtype) -> KernelConfig:
        return kernel_config(kernel, dtype, self.capability, self.precision, self.ragged_x)


def _input_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of this op's dots on inputs of ``dtype``: float32
    follows torch's convolution setting (cuDNN uses TF32 unless disabled), read only for float32
    (16-bit dots ignore it)."""
    return input_precision(dtype, dtype == torch.float32 and fp32_conv_allows_tf32())


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> Optional[str]:
    if x.dtype not in _SUPPORTED_DTYPES:
        return f"the Triton kernels support float16, bfloat16 and float32, got {x.dtype}"
    return None


# Every launch of this backend, by layout (see ``LaunchTemplates``).
_TEMPLATES = LaunchTemplates()


def empty_saved(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs) -> torch.Tensor:
    """What ``forward`` returns for backward: the packed weight (see :func:`_packed_weight`), so
    backward does not pack it again; the pre-activation is recomputed, never kept.  A decoding
    step's: its pre-activation ``[B, 1, 2C]`` (see :mod:`._glu_step`)."""
    if _glu_step.uses_step_kernel(x, weight, args):
        return _glu_step.empty_saved(x, weight)
    channels_z, channels_in, kernel_size = weight.shape
    return weight.new_empty(kernel_size, channels_in, channels_z)


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[2C, C_in, k]`` as ``[k, C_in, 2C]`` contiguous (output channels fastest):
    always a copy, since an op's output may not alias its input."""
    return weight.permute(2, 1, 0).clone(memory_format=torch.contiguous_format)


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    args: GluConvArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, packed weight)``: backward reuses the packed weight and recomputes the pre-activation
    (a decoding step's: ``(out, pre-activation)``, see :mod:`._glu_step`)."""
    if _glu_step.uses_step_kernel(x, weight, args):
        return _glu_step.forward(x, weight, bias, residual, args)
    length_out = args.output_length(x.shape[2], weight.shape[2])
    out = empty_output(x, weight.shape[0] // 2, length_out)
    packed = _packed_weight(weight)
    if x.shape[0] > 0:
        launch = _preactivation_launch(x, packed, bias, residual, None, out, args, length_out, _Dots.of(x, length_out))
        run_launches([launch], x)
    return out, packed


def prepare_forward(x, weight, bias, residual, args: GluConvArgs):
    """:func:`forward` prepared for the calls of this one's layout (see :class:`_PreparedForward`,
    and for a decoding step :class:`._glu_step.PreparedStep`), or None for an empty batch, which
    launches nothing."""
    if x.shape[0] == 0:
        return None
    if _glu_step.uses_step_kernel(x, weight, args):
        return _glu_step.PreparedStep(x, weight, bias, residual, args)
    return _PreparedForward(x, weight, bias, residual, args)


class _PreparedForward:
    """:func:`forward` for the calls of one layout: the tensors' shapes, strides, dtypes and device and
    the scalars, which the caller's call plan holds fixed (``ops/_call_plans.py``).  The first call
    works out how its dots run (:class:`_Dots`), the launch template and the output's layout; a
    later call allocates its output, packs the weight and puts its tensors into the template
    (Triton's specialization on 16-byte alignment is the direct launch's, per call), or runs
    :func:`forward` where the dots would now run otherwise (:meth:`dots_hold`).  It prepares the
    backward of its calls too (:meth:`backward`).  With ``LaunchTemplates.verify`` set (the test
    suite sets it), every call also builds its launches as :func:`forward` would, and fails unless
    they are the same."""

    __slots__ = ("length_out", "dots", "config", "template", "out_layout", "prepared_backward")

    def __init__(self, x, weight, bias, residual, args: GluConvArgs) -> None:
        self.length_out = args.output_length(x.shape[2], weight.shape[2])
        self.dots = _Dots.of(x, self.length_out)
        self.config = self.dots.config("forward", x.dtype)
        out = empty_output(x, weight.shape[0] // 2, self.length_out)
        packed = empty_saved(x, weight, args)
        self.template = _preactivation_template(x, packed, bias, residual, None, out, args, self.length_out, self.dots)
        self.out_layout = TensorLayout.of(out)
        self.prepared_backward: Optional[_PreparedBackward] = None

    def dots_hold(self, dtype: torch.dtype) -> bool:
        """Whether a call's dots run as this layout's first call's did: float32's precision follows
        torch's TF32 setting, read per call, and the tile tables are the ones the templates were
        built from (tests swap them)."""
        return _input_precision(dtype) == self.dots.precision and self.dots.config("forward", dtype) is self.config

    def __call__(self, x, weight, bias, residual, args: GluConvArgs, backend: str):
        """The registered op's implementation for this layout (same signature)."""
        if not self.dots_hold(x.dtype):
            return forward(x, weight, bias, residual, args)
        out, packed = self.out_layout.empty(), _packed_weight(weight)
        launches = filled(self.template, _preactivation_pointers(x, packed, bias, residual, None, out), {})
        if LaunchTemplates.verify:
            expected = _preactivation_launch(
                x, packed, bias, residual, None, out, args, self.length_out, _Dots.of(x, self.length_out)
            )
            check_prepared_launches(launches, [expected], "GLU convolution forward")
        run_launches(launches, x)
        return out, packed

    def backward(self, grad_out, x, weight, bias, packed, args: GluConvArgs, needs_grad_x: bool,
                 needs_grad_weight: bool, needs_grad_bias: bool, backend: str):
        """The registered backward's implementation (same signature) for the calls this forward
        ran, which the op's autograd hands it (``ctx.runner``): :class:`_PreparedBackward`, made for
        the first of them, where a later one's ``grad_out`` has its layout and it asks for the same
        gradients, else :func:`backward`."""
        wanted = WantedGradients(needs_grad_x, needs_grad_weight, needs_grad_bias and bias is not None)
        if self.dots_hold(x.dtype):
            prepared = self.prepared_backward
            if prepared is None:
                prepared = self.prepared_backward = _PreparedBackward(grad_out, x, weight, bias, packed, args,
                                                                      wanted, self.dots)
            if prepared.takes(grad_out, wanted):
                return prepared(grad_out, x, bias, packed, args)
        return backward(grad_out, x, weight, bias, packed, args, needs_grad_x, needs_grad_weight, needs_grad_bias)


def _pads_by_fill(args: GluConvArgs, dtype: torch.dtype) -> bool:
    """The kernels' ``PAD_BY_FILL``: the padding is +0.0 (-0.0 keeps its sign) around 16-bit ``x``.
    float32 tiles pass through registers anyway (TF32 splitting or FMA), and without the select
    the "ieee" weight gradient spilled on sm_80 under triton 3.6."""
    return dtype != torch.float32 and args.pad_value == 0.0 and math.copysign(1.0, args.pad_value) > 0


def _preactivation_pointers(x, packed, bias, residual, grad_out, destination) -> tuple:
    """``_glu_conv_forward_kernel``'s tensor arguments (an absent one repeats another tensor)."""
    return (
        x,
        packed,
        bias if bias is not None else packed,
        residual if residual is not None else destination,
        grad_out if grad_out is not None else destination,
        destination,
    )


def _preactivation_launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    grad_out: Optional[torch.Tensor],
    destination: torch.Tensor,
    args: GluConvArgs,
    length_out: int,
    dots: _Dots,
) -> KernelLaunch:
    """``_glu_conv_forward_kernel`` (``packed``: the weight as ``[k, C_in, 2C]``)
    for a non-empty batch; ``grad_out`` given selects the ``COMPUTE_GRAD``
    epilogue."""
    template = _preactivation_template(x, packed, bias, residual, grad_out, destination, args, length_out, dots)
    (launch,) = filled(template, _preactivation_pointers(x, packed, bias, residual, grad_out, destination), {})
    return launch


def _preactivation_template(
    x, packed, bias, residual, grad_out, destination, args: GluConvArgs, length_out: int, dots: _Dots
) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_preactivation_launch`, whose pointers are :func:`_preactivation_pointers`'."""
    config = dots.config("forward", x.dtype)
    pointers = _preactivation_pointers(x, packed, bias, residual, grad_out, destination)
    layout = (
        "forward", x.shape, x.stride(), packed.shape, packed.stride(), None if bias is None else bias.stride(),
        None if residual is None else residual.stride(), None if grad_out is None else grad_out.stride(),
        destination.stride(), args.pad_left, length_out, args.pad_value, _pads_by_fill(args, x.dtype),
        args.residual_scale, dots.precision, config,
    )

    def build() -> KernelLaunch:
        batch, channels_in, length_in = x.shape
        kernel_size, _, channels_z = packed.shape
        unused_strides = (0, 0, 0)
        grid = (cdiv(batch * length_out, config.block_m), cdiv(channels_z // 2, config.block_n))
        return KernelLaunch(_glu_conv_forward_kernel, grid, (
            *pointers,
            batch,
            length_in,
            length_out,
            channels_in,
            channels_z // 2,
            kernel_size,
            args.pad_left,
            float(args.pad_value),
            float(args.residual_scale),
            *x.stride(),
            *packed.stride(),
            *(residual.stride() if residual is not None else unused_strides),
            *(grad_out.stride() if grad_out is not None else unused_strides),
            *destination.stride(),
            1 if bias is None else bias.stride(0),
        ), dict(
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            COMPUTE_GRAD=grad_out is not None,
            PAD_BY_FILL=_pads_by_fill(args, x.dtype),
            INPUT_PRECISION=dots.precision,
            **config.launch_kwargs(),
        ))

    return _TEMPLATES.template(layout, pointers, lambda: [build()], {})


def backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    packed: torch.Tensor,
    args: GluConvArgs,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)``; an output not asked for is an empty tensor.

    ``packed`` is what forward saved, the packed weight; the first kernel recomputes the
    pre-activation from ``x`` (:func:`_backward_templates` says what each kernel does).  A decoding
    step saved its pre-activation instead (see :mod:`._glu_step`).
    """
    if _glu_step.uses_step_kernel(x, weight, args):
        return _glu_step.backward(grad_out, x, weight, bias, packed, args, needs_grad_x, needs_grad_weight,
                                  needs_grad_bias)
    wanted = WantedGradients(needs_grad_x, needs_grad_weight, needs_grad_bias and bias is not None)
    dots = _Dots.of(x, grad_out.shape[2])
    split = _WeightSplit.of(x, grad_out, weight, dots)
    buffers = _backward_buffers(grad_out, x, weight, wanted, split)
    run_launches(_backward_launches(grad_out, x, bias, packed, args, buffers, wanted, split, dots), x)
    return buffers.grad_x, buffers.grad_weight, buffers.grad_bias


@dataclasses.dataclass(frozen=True)
class _WeightSplit:
    """How the weight-gradient kernel splits the ``B * L_out`` output rows: ``count`` ranges of
    ``rows`` each (a multiple of its K step), as :func:`._split_sum.split_count` finds the grid
    ending soonest, up to four programs per SM and at least two K steps per range; one range
    (writing zeros) for an empty batch."""

    count: int
    rows: int

    @classmethod
    def of(cls, x: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor, dots: _Dots) -> "_WeightSplit":
        channels_z, channels_in, kernel_size = weight.shape
        rows_out = x.shape[0] * grad_out.shape[2]
        config = dots.config("grad_weight", x.dtype)
        tiles = cdiv(channels_z, config.block_m) * cdiv(channels_in, config.block_n) * kernel_size
        steps = cdiv(rows_out, config.block_k)
        sms = num_sms(x.device)
        splits = split_count(tiles, steps, sms, min_steps=2, max_splits=cdiv(4 * sms, tiles))
        rows = max(1, cdiv(steps, splits)) * config.block_k
        return cls(max(1, cdiv(rows_out, rows)), rows)


class _BackwardBuffers(NamedTuple):
    """What a backward allocates: the pre-activation's gradient ``grad_z`` ``[B, 2C, L_out]``
    (channel-last: both GEMMs after it read it along channels), the three gradients (an empty
    tensor for one not asked for, ``grad_x`` in the op's output layout for ``x``), and the weight
    gradient's float32 partial sums ``[splits, 2C, C_in, k]`` and ``[splits, 2C]`` (the weight's
    stand in for the bias's without a bias gradient; None where neither gradient is wanted)."""

    grad_z: torch.Tensor
    grad_x: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor
    weight_sums: Optional[torch.Tensor]
    bias_sums: Optional[torch.Tensor]


def _backward_buffers(grad_out, x, weight, wanted: WantedGradients, split: _WeightSplit) -> _BackwardBuffers:
    batch, length_out, (channels_z, channels_in, kernel_size) = x.shape[0], grad_out.shape[2], weight.shape
    grad_z = x.new_empty_strided((batch, channels_z, length_out), (length_out * channels_z, 1, channels_z))
    grad_x = empty_output(x, channels_in, x.shape[2]) if wanted.x else x.new_empty(0)
    weight_partial = bias_partial = None
    if wanted.weight_or_bias:
        weight_partial = x.new_empty(split.count, channels_z, channels_in, kernel_size, dtype=torch.float32)
        bias_partial = (x.new_empty(split.count, channels_z, dtype=torch.float32) if wanted.bias
                        else weight_partial)
    return _BackwardBuffers(
        grad_z, grad_x, weight.new_empty(weight.shape if wanted.weight else (0,)),
        weight.new_empty((channels_z,) if wanted.bias else (0,)), weight_partial, bias_partial,
    )


def _backward_templates(
    grad_out, x, bias, packed, args: GluConvArgs, buffers: _BackwardBuffers, wanted: WantedGradients,
    split: _WeightSplit, dots: _Dots,
) -> list[tuple[KernelLaunch, ...]]:
    """The templates of a backward's launches, in order, whose pointers :func:`_backward_pointers`
    gives: for a non-empty batch, ``grad_z`` (the forward kernel's ``COMPUTE_GRAD`` form, which
    recomputes the pre-activation from ``x``) and ``grad_x`` from it; then, where the weight's or
    the bias's gradient is wanted, one kernel computing float32 partial sums of both (the bias's
    is its row sum) over the row ranges of ``split``, and their reductions
    (:func:`._split_sum.split_sum_launch`): deterministic, no atomics."""
    templates = []
    if x.shape[0] > 0:
        templates.append(_preactivation_template(x, packed, bias, None, grad_out, buffers.grad_z, args,
                                                 grad_out.shape[2], dots))
        if wanted.x:
            templates.append(_grad_input_template(buffers.grad_z, packed, buffers.grad_x, args.pad_left, dots))
    if wanted.weight_or_bias:
        templates.append(_grad_weight_template(
            x, buffers.grad_z, buffers.weight_sums, buffers.bias_sums, args, split.rows,
            wanted.bias, dots,
        ))
        templates.append(split_sum_template(*wanted_sums(buffers, wanted)))
    return templates


def _backward_pointers(
    grad_out, x, bias, packed, buffers: _BackwardBuffers, wanted: WantedGradients
) -> list[tuple]:
    """The pointers of :func:`_backward_templates`'s templates, in the same order."""
    pointers = []
    if x.shape[0] > 0:
        pointers.append(_preactivation_pointers(x, packed, bias, None, grad_out, buffers.grad_z))
        if wanted.x:
            pointers.append((buffers.grad_z, packed, buffers.grad_x))
    if wanted.weight_or_bias:
        pointers.append((x, buffers.grad_z, buffers.weight_sums, buffers.bias_sums))
        pointers.append(split_sum_pointers(*wanted_sums(buffers, wanted)))
    return pointers


def _backward_launches(
    grad_out, x, bias, packed, args: GluConvArgs, buffers: _BackwardBuffers, wanted: WantedGradients,
    split: _WeightSplit, dots: _Dots,
) -> list[KernelLaunch]:
    templates = _backward_templates(grad_out, x, bias, packed, args, buffers, wanted, split, dots)
    return filled_all(templates, _backward_pointers(grad_out, x, bias, packed, buffers, wanted))


class _PreparedBackward:
    """:func:`backward` for the calls of one layout, those of a :class:`_PreparedForward` whose
    ``grad_out`` has the layout of the first one's and that ask for the same gradients: the
    templates of its launches, the row split of its weight gradient and the layouts of what it
    allocates, worked out once.  Under ``LaunchTemplates.verify`` every call also builds its
    launches as :func:`backward` would, and fails unless they are the same."""

    __slots__ = ("grad_out_layout", "wanted", "split", "templates", "buffer_layouts")

    def __init__(self, grad_out, x, weight, bias, packed, args: GluConvArgs, wanted: WantedGradients,
                 dots: _Dots) -> None:
        self.grad_out_layout = strided_layout(grad_out)
        self.wanted = wanted
        self.split = _WeightSplit.of(x, grad_out, weight, dots)
        buffers = _backward_buffers(grad_out, x, weight, wanted, self.split)
        self.templates = _backward_templates(grad_out, x, bias, packed, args, buffers, wanted, self.split, dots)
        self.buffer_layouts = TensorLayouts(buffers)

    def takes(self, grad_out: torch.Tensor, wanted: WantedGradients) -> bool:
        return strided_layout(grad_out) == self.grad_out_layout and wanted == self.wanted

    def __call__(self, grad_out, x, bias, packed, args: GluConvArgs):
        buffers = _BackwardBuffers._make(self.buffer_layouts.empty())
        launches = filled_all(self.templates, _backward_pointers(grad_out, x, bias, packed, buffers, self.wanted))
        if LaunchTemplates.verify:
            expected = _backward_launches(grad_out, x, bias, packed, args, buffers, self.wanted, self.split,
                                          _Dots.of(x, grad_out.shape[2]))
            check_prepared_launches(launches, expected, "GLU convolution backward")
        run_launches(launches, x)
        return buffers.grad_x, buffers.grad_weight, buffers.grad_bias


def _grad_input_template(
    grad_z: torch.Tensor, packed: torch.Tensor, grad_x: torch.Tensor, pad_left: int, dots: _Dots
) -> tuple[KernelLaunch, ...]:
    """``_glu_conv_grad_input_kernel`` writing ``grad_x`` ``[B, C_in, L]`` from
    ``grad_z`` ``[B, 2C, L_out]`` and the packed weight ``[k, C_in, 2C]``; pointers
    ``(grad_z, packed, grad_x)``."""
    config = dots.config("grad_input", grad_x.dtype)
    pointers = (grad_z, packed, grad_x)
    layout = ("grad_input", grad_z.shape, grad_z.stride(), packed.shape, packed.stride(), grad_x.shape,
              grad_x.stride(), pad_left, dots.precision, config)

    def build() -> KernelLaunch:
        batch, channels_in, length_in = grad_x.shape
        kernel_size, _, channels_z = packed.shape
        grid = (cdiv(batch * length_in, config.block_m), cdiv(channels_in, config.block_n))
        return KernelLaunch(_glu_conv_grad_input_kernel, grid, (
            *pointers,
            batch, length_in, grad_z.shape[2], channels_in, channels_z, kernel_size, pad_left,
            *grad_z.stride(), *packed.stride(), *grad_x.stride(),
        ), dict(INPUT_PRECISION=dots.precision, **config.launch_kwargs()))

    return _TEMPLATES.template(layout, pointers, lambda: [build()], {})


def _grad_weight_template(
    x: torch.Tensor,
    grad_z: torch.Tensor,
    grad_weight_partial: torch.Tensor,
    grad_bias_partial: torch.Tensor,
    args: GluConvArgs,
    rows_per_split: int,
    has_bias: bool,
    dots: _Dots,
) -> tuple[KernelLaunch, ...]:
    """``_glu_conv_grad_weight_kernel`` writing float32 partial sums ``[splits, 2C, C_in, k]`` and
    ``[splits, 2C]``; pointers ``(x, grad_z, grad_weight_partial, grad_bias_partial)``, ``grad_z``'s
    (batch, position) rows evenly strided, as :func:`_backward_buffers` allocates it."""
    assert grad_z.stride(0) == grad_z.shape[2] * grad_z.stride(2) or grad_z.shape[0] <= 1, grad_z.stride()
    config = dots.config("grad_weight", x.dtype)
    pointers = (x, grad_z, grad_weight_partial, grad_bias_partial)
    layout = ("grad_weight", x.shape, x.stride(), grad_z.shape, grad_z.stride(), grad_weight_partial.shape,
              grad_weight_partial.stride(), grad_bias_partial.stride(0), args.pad_left, rows_per_split,
              args.pad_value, _pads_by_fill(args, x.dtype), has_bias, dots.precision, config)

    def build() -> KernelLaunch:
        batch, channels_in, length_in = x.shape
        splits, channels_z, _, kernel_size = grad_weight_partial.shape
        tiles = cdiv(channels_z, config.block_m) * cdiv(channels_in, config.block_n)
        return KernelLaunch(_glu_conv_grad_weight_kernel, (tiles, kernel_size, splits), (
            *pointers,
            batch, length_in, grad_z.shape[2], channels_in, channels_z, args.pad_left, rows_per_split,
            float(args.pad_value),
            *x.stride(), grad_z.stride(1), grad_z.stride(2), *grad_weight_partial.stride(), grad_bias_partial.stride(0),
        ), dict(HAS_BIAS=has_bias, PAD_BY_FILL=_pads_by_fill(args, x.dtype), INPUT_PRECISION=dots.precision,
                **config.launch_kwargs()))

    return _TEMPLATES.template(layout, pointers, lambda: [build()], {})


# The representative problems: C_in = C = 256, kernel size 4, channel-first or channel-last x;
# batch 4, length 512, "same" padding (a left pad of 1), or "ragged": batch 1, an odd length, causal
# padding (a left pad of 3).  The kernels are plain triton.jit: Triton specializes them on every
# integer equal to 1 (batch, pad_left) and on divisibility by 16 (lengths, strides along them),
# so the ragged problem compiles the variants a decoding batch of 1 or an odd length launches.
_TARGET_CHANNELS, _TARGET_KERNEL_SIZE = 256, 4
_TARGET_SHAPES = {False: (4, 512, (_TARGET_KERNEL_SIZE - 1) // 2), True: (1, 37, _TARGET_KERNEL_SIZE - 1)}


def _target_launch(
    kind: str, dtype: torch.dtype, compute_grad: bool, channel_last: bool, ragged: bool, pad_value: float,
    dots: _Dots,
) -> KernelLaunch:
    """The launch for a representative problem, ``x`` (and the residual, output and ``grad_x``
    in its layout) channel-first or channel-last: the kernels are specialized on which of x's
    strides is 1, so each layout compiles its own variant; so is each on a zero padding."""
    channels, kernel_size = _TARGET_CHANNELS, _TARGET_KERNEL_SIZE
    batch, length, pad_left = _TARGET_SHAPES[ragged]
    if channel_last:  # the seeds' model holds its activations as [B, L, C]
        x = torch.empty(batch, length, channels, dtype=dtype).transpose(1, 2)
    else:
        x = torch.empty(batch, channels, length, dtype=dtype)
    packed = torch.empty(kernel_size, channels, 2 * channels, dtype=dtype)
    grad_z = torch.empty(batch, length, 2 * channels, dtype=dtype).transpose(1, 2)
    args = GluConvArgs(pad_left, kernel_size - 1 - pad_left, pad_value, 0.5)
    if kind == "forward":
        bias = torch.empty(2 * channels, dtype=dtype)
        if compute_grad:
            return _preactivation_launch(x, packed, bias, None, torch.empty_like(x), grad_z, args, length, dots)
        residual, out = torch.empty_like(x), torch.empty_like(x)
        return _preactivation_launch(x, packed, bias, residual, None, out, args, length, dots)
    if kind == "grad_input":
        pointers = (grad_z, packed, torch.empty_like(x))
        template = _grad_input_template(*pointers, pad_left, dots)
    else:
        splits = 2
        pointers = (x, grad_z, torch.empty(splits, 2 * channels, channels, kernel_size),
                    torch.empty(splits, 2 * channels))
        template = _grad_weight_template(*pointers, args, batch * length // splits, True, dots)
    (launch,) = filled(template, pointers, {})
    return launch


def compile_targets() -> list[CompileTarget]:
    """Every (kernel, dtype, TF32 choice) the launchers can pick, with the heaviest
    constexpr flags (the forward kernel also in its COMPUTE_GRAD form), for each representative
    problem with ``x`` channel-first and channel-last, padded with zeros and (16-bit ``x``, the
    kernels that read the padding) with another value, on each architecture with the
    configuration :func:`kernel_config` picks there; and the decoding step's kernel
    (:func:`._glu_step.compile_targets`)."""
    # float32 as the dispatcher runs it: "tf32x3" when TF32 is allowed, else "ieee" (input_precision).
    variants = [(torch.float16, "tf32"), (torch.bfloat16, "tf32"), (torch.float32, "tf32x3"), (torch.float32, "ieee")]
    kernels = [("forward", False), ("forward", True), ("grad_input", False), ("grad_weight", False)]
    targets = []
    for (dtype, precision), (kind, compute_grad), channel_last, ragged, pad_value in itertools.product(
        variants, kernels, (False, True), (False, True), (0.0, 1.0)
    ):
        if pad_value and (kind == "grad_input" or dtype == torch.float32):  # no other variant there
            continue
        ragged_x = ragged and not channel_last
        by_config: dict[KernelConfig, list[int]] = {}
        for capability in COMPILE_CAPABILITIES:
            by_config.setdefault(kernel_config(kind, dtype, capability, precision, ragged_x), []).append(capability)
        name = (f"glu_conv_{kind}{'-grad' if compute_grad else ''}{'-pad1' if pad_value else ''}"
                f"-{TORCH_TO_TRITON_DTYPE[dtype]}-{precision}{'-channel_last' if channel_last else ''}"
                f"{'-ragged' if ragged else ''}")
        targets.extend(
            CompileTarget(
                name,
                functools.partial(
                    _target_launch, kind, dtype, compute_grad, channel_last, ragged, pad_value,
                    _Dots(precision, capabilities[0], ragged_x),
                ),
                tuple(capabilities),
            )
            for capabilities in by_config.values()
        )
    return targets + _glu_step.compile_targets()
