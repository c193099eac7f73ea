"""The GLU convolution's decoding step on Triton: one output position, no padding.

A step's window ``[B, C_in, k]`` is the whole receptive field of its one output position, so its
pre-activation is a batched GEMV over ``K = C_in * k``: ``z[b, o] = sum_j window[b, j] * weight[o, j]``,
both read as the rows they are in memory (the weight as ``nn.Conv1d`` holds it).  The whole-sequence
kernels read the weight repacked as ``[k, C_in, 2C]``, a copy made on every call: for a step, that
copy is a launch and a pass over the weight as long as the step itself.  The step's forward saves
``z`` (``[B, 1, 2C]``, a few values per row) for backward, which runs the eager backend's on it.

The same kernel runs :func:`~transformer_kernels.glu_conv1d_update` (``RING``): the window's first
``k - 1`` inputs come from the ring ``conv_state`` (position ``p`` in slot ``p % k``), its last from
``x_t``, and the programs of the first channel block store ``x_t`` into its slot, which no program
of the launch reads (it holds position ``p - k``); inference only, no ``z``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.glu_conv import GluConvArgs, empty_output
from ..eager import glu_conv as eager_glu_conv
from ._common import (
    TORCH_TO_TRITON_DTYPE,
    CompileTarget,
    KernelConfig,
    KernelLaunch,
    LaunchTemplates,
    TensorLayout,
    as_float32,
    cdiv,
    check_prepared_launches,
    filled,
    run_launches,
)

__all__ = ["uses_step_kernel", "empty_saved", "forward", "backward", "PreparedStep", "ring_launch", "as_rows",
           "MAX_LAUNCH_ROWS", "compile_targets"]

# Up to this many rows a step runs on FMAs, each program reading its weight rows once for its rows;
# a larger batch (a beam search over a large batch) takes the whole-sequence kernels' tensor-core
# GEMM, which reads the weight once per 128 rows but only after repacking it.  At the seeds' greedy
# decoding (128 sequences, C = 512, k = 3) the FMAs, about 0.2 G, take about as long
# as that GEMM's eight programs, without the repacking's launch (an estimate: not yet timed on a GPU).
MAX_BATCH = 128
# A step is bound by the latency of its weight loads, not by bandwidth: the whole weight (3 MB at
# C = 512, k = 3 in 16 bits) is about what an H100/H200 must have in flight to reach its memory
# bandwidth.  So each program keeps a large slice of K in flight per iteration (in per-lane partial
# sums, 32 registers each for both halves), and four channels per program make 128 programs at
# C = 512.  Rows per program: one for a batch of one (greedy decoding of one sequence), whose
# iterations load 8 KB of weight; else eight, whose iterations load 2 KB of weight and 2 KB of window.
_ONE_ROW = KernelConfig(block_m=1, block_n=4, block_k=512, num_warps=4, num_stages=1)
_ROWS = KernelConfig(block_m=8, block_n=4, block_k=128, num_warps=4, num_stages=1)
# The most rows a launch takes: a grid's second dimension holds at most 65535 programs.
MAX_LAUNCH_ROWS = _ROWS.block_m * 65535


# Each program owns BLOCK_M rows times BLOCK_N output channels of both GLU halves, and reduces over K
# in BLOCK_K slices with FMAs: a decoding batch is too short for a tensor-core tile, and the step is
# bound by reading the weight, which each program streams once for its rows.
#   for j0 in range(0, K, BLOCK_K):
#       acc_a[b, c] += sum_j window[b, j] * W[c, j];  acc_g[b, c] += sum_j window[b, j] * W[C + c, j]
# Epilogue (fp32), as the whole-sequence forward's: z = acc + bias, stored for backward;
# out = (a * sigmoid(g) + residual) * residual_scale.
# RING: window[b, j] (j = channel * k + tap) is conv_state[b, channel, (p + 1 + tap) % k] for the
# row's position p and tap < k - 1, and x_t[b, channel] for tap k - 1; no z; the programs of
# channel block 0 then store x_t[b, :] into conv_state[b, :, p % k].
@triton.jit
def _glu_step_kernel(
    window_ptr,  # RING: the ring conv_state [B, C_in, k]
    weight_ptr,
    bias_ptr,
    residual_ptr,
    out_ptr,
    z_ptr,
    new_input_ptr,  # RING: x_t [B, C_in]
    position_ptr,  # RING: the rows' positions, [B] or one (stride 0)
    batch,
    channels_out,
    reduction,
    residual_scale,
    stride_window_row,
    stride_weight_row,
    stride_rb,
    stride_rc,
    stride_ob,
    stride_oc,
    stride_bias,
    channels_in,
    stride_state_c,
    stride_state_s,
    stride_new_b,
    stride_new_c,
    stride_position,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RING: tl.constexpr,
    KERNEL_SIZE: tl.constexpr,  # RING: k (a constant, so that the slot arithmetic needs no division)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    residual_scale = as_float32(residual_scale)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < batch
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < channels_out
    window_rows = window_ptr + rows.to(tl.int64) * stride_window_row
    value_rows = weight_ptr + cols.to(tl.int64) * stride_weight_row
    gate_rows = weight_ptr + (cols.to(tl.int64) + channels_out) * stride_weight_row
    if RING:
        new_rows = new_input_ptr + rows.to(tl.int64) * stride_new_b
        # p % k in the position's own width (int64 positions past 2**31 too), then narrowed; negative
        # positions break the contract, but are taken modulo k the floor way so no slot is out of
        # range.  Tap t of a row at position p reads slot (p + 1 + t) % k: t + rotation, wrapped once.
        positions = tl.load(position_ptr + rows * stride_position, mask=row_ok, other=0)
        residues = (positions % KERNEL_SIZE).to(tl.int32)
        residues = tl.where(residues < 0, residues + KERNEL_SIZE, residues)
        rotation = (residues + 1) % KERNEL_SIZE

    # Per-lane partial sums over the K slice, reduced across lanes once after the loop.
    partial_a = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    partial_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, reduction, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        j_ok = j < reduction
        if RING:
            channel = j // KERNEL_SIZE
            tap = j - channel * KERNEL_SIZE
            is_new = tap == KERNEL_SIZE - 1
            slot = tap[None, :] + rotation[:, None]
            slot = tl.where(slot >= KERNEL_SIZE, slot - KERNEL_SIZE, slot)
            old = tl.load(window_rows[:, None] + channel[None, :] * stride_state_c + slot * stride_state_s,
                          mask=row_ok[:, None] & (j_ok & ~is_new)[None, :], other=0.0)
            new = tl.load(new_rows[:, None] + channel[None, :] * stride_new_c,
                          mask=row_ok[:, None] & (j_ok & is_new)[None, :], other=0.0)
            x = tl.where(is_new[None, :], new, old)
        else:
            x = tl.load(window_rows[:, None] + j[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & j_ok[None, :]
        w_value = tl.load(value_rows[:, None] + j[None, :], mask=w_mask, other=0.0)
        w_gate = tl.load(gate_rows[:, None] + j[None, :], mask=w_mask, other=0.0)
        x = x.to(tl.float32)[:, None, :]
        partial_a += x * w_value.to(tl.float32)[None, :, :]
        partial_g += x * w_gate.to(tl.float32)[None, :, :]
    acc_a = tl.sum(partial_a, axis=2)
    acc_g = tl.sum(partial_g, axis=2)

    if HAS_BIAS:
        acc_a += tl.load(bias_ptr + cols * stride_bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(bias_ptr + (channels_out + cols) * stride_bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tile_mask = row_ok[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    if not RING:
        z_ptrs = z_ptr + (rows * 2 * channels_out)[:, None] + cols[None, :]
        tl.store(z_ptrs, acc_a.to(z_ptr.dtype.element_ty), mask=tile_mask)
        tl.store(z_ptrs + channels_out, acc_g.to(z_ptr.dtype.element_ty), mask=tile_mask)
    y = acc_a * tl.sigmoid(acc_g)
    if HAS_RESIDUAL:
        y += tl.load(
            residual_ptr + (rows * stride_rb)[:, None] + cols[None, :] * stride_rc, mask=tile_mask, other=0.0
        ).to(tl.float32)
    y = y * residual_scale
    tl.store(out_ptr + (rows * stride_ob)[:, None] + cols[None, :] * stride_oc, y.to(out_ptr.dtype.element_ty),
             mask=tile_mask)
    if RING:
        if tl.program_id(0) == 0:
            new_slot = residues * stride_state_s
            for start in range(0, channels_in, BLOCK_K):
                channel = start + tl.arange(0, BLOCK_K)
                mask = row_ok[:, None] & (channel < channels_in)[None, :]
                value = tl.load(new_rows[:, None] + channel[None, :] * stride_new_c, mask=mask)
                tl.store(window_rows[:, None] + channel[None, :] * stride_state_c + new_slot[:, None], value, mask=mask)


def uses_step_kernel(x: torch.Tensor, weight: torch.Tensor, args: GluConvArgs) -> bool:
    """A decoding step (one output position, no padding) of a batch the step kernel takes."""
    return args.pad_left == 0 and args.pad_right == 0 and x.shape[2] == weight.shape[2] and x.shape[0] <= MAX_BATCH


def empty_saved(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What a step's forward saves: its pre-activation ``[B, 1, 2C]``."""
    return x.new_empty(x.shape[0], 1, weight.shape[0])


def _rows_in_place(t: torch.Tensor) -> bool:
    """Whether ``t`` ``[N, C_in, k]`` holds each of its ``N`` rows as ``C_in * k`` consecutive elements
    (the rows themselves at any stride, which the kernel takes)."""
    _, channels_in, kernel_size = t.shape
    return (kernel_size == 1 or t.stride(2) == 1) and (channels_in == 1 or t.stride(1) == kernel_size)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    return t if _rows_in_place(t) else t.contiguous()


def _pointers(window, weight, bias, residual, out, z, new_input=None, position=None) -> tuple:
    """``_glu_step_kernel``'s tensor arguments (an absent one repeats another tensor)."""
    return (window, weight, weight if bias is None else bias, out if residual is None else residual, out, z,
            window if new_input is None else new_input, window if position is None else position)


def _template(window, weight, bias, residual, out, z, args: GluConvArgs) -> tuple[KernelLaunch, ...]:
    """The launch template of a step of these tensors' layouts (window and weight rows in place)."""
    pointers = _pointers(window, weight, bias, residual, out, z)
    layout = ("step", window.shape, window.stride(0), weight.shape, weight.stride(0),
              None if bias is None else bias.stride(),
              None if residual is None else residual.stride(), out.stride(), z.dtype, args.residual_scale)
    return _TEMPLATES.template(layout, pointers, lambda: [_build(pointers, window, weight, bias, residual, out,
                                                                 args.residual_scale, ring=None)], {})


def _ring_template(x_t, conv_state, position, weight, bias, residual, out, residual_scale: float):
    """The launch template of a :func:`~transformer_kernels.glu_conv1d_update` of these tensors'
    layouts (weight rows in place; the ring, ``x_t`` and ``position`` of any strides)."""
    pointers = _pointers(conv_state, weight, bias, residual, out, out, x_t, position)
    layout = ("ring", conv_state.shape, conv_state.stride(), x_t.stride(), position.shape, position.stride(),
              weight.shape, weight.stride(0), None if bias is None else bias.stride(),
              None if residual is None else residual.stride(), out.stride(), residual_scale)
    ring = (x_t, conv_state, position)
    return _TEMPLATES.template(layout, pointers, lambda: [_build(pointers, conv_state, weight, bias, residual, out,
                                                                 residual_scale, ring)], {})


def _build(pointers, window, weight, bias, residual, out, residual_scale: float, ring) -> KernelLaunch:
    """The kernel's launch on ``pointers`` (:func:`_pointers`): a step's (``ring`` None; ``window`` ``[B, C_in, k]``
    rows in place) or, with ``ring = (x_t, conv_state, position)``, an update's (``window`` the ring)."""
    batch, channels_in, kernel_size = window.shape
    channels_out = weight.shape[0] // 2
    config = _ONE_ROW if batch == 1 else _ROWS
    grid = (cdiv(channels_out, config.block_n), cdiv(batch, config.block_m))
    if ring is None:
        ring_arguments = (channels_in, 0, 0, 0, 0, 0)
    else:
        x_t, conv_state, position = ring
        ring_arguments = (channels_in, conv_state.stride(1), conv_state.stride(2), *x_t.stride(),
                          position.stride(0) if position.dim() else 0)
    return KernelLaunch(_glu_step_kernel, grid, (
        *pointers,
        batch,
        channels_out,
        channels_in * kernel_size,
        float(residual_scale),
        window.stride(0),
        weight.stride(0),
        *((residual.stride(0), residual.stride(1)) if residual is not None else (0, 0)),
        out.stride(0),
        out.stride(1),
        1 if bias is None else bias.stride(0),
        *ring_arguments,
    ), dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, RING=ring is not None,
            KERNEL_SIZE=1 if ring is None else kernel_size, **config.launch_kwargs()))


def _launch(window, weight, bias, residual, out, z, args: GluConvArgs) -> KernelLaunch:
    (launch,) = filled(_template(window, weight, bias, residual, out, z, args),
                       _pointers(window, weight, bias, residual, out, z), {})
    return launch


def ring_launch(x_t, conv_state, position, weight, bias, residual, out, residual_scale: float) -> KernelLaunch:
    """The launch of a :func:`~transformer_kernels.glu_conv1d_update` (weight rows in place)."""
    (launch,) = filled(_ring_template(x_t, conv_state, position, weight, bias, residual, out, residual_scale),
                       _pointers(conv_state, weight, bias, residual, out, out, x_t, position), {})
    return launch


# Every launch of this kernel, by layout (see ``LaunchTemplates``).
_TEMPLATES = LaunchTemplates()


def forward(x, weight, bias, residual, args: GluConvArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, z)``: ``out`` ``[B, C, 1]`` in ``x``'s layout and the pre-activation ``z`` ``[B, 1, 2C]``."""
    out, z = empty_output(x, weight.shape[0] // 2, 1), empty_saved(x, weight)
    if x.shape[0] > 0:
        run_launches([_launch(as_rows(x), as_rows(weight), bias, residual, out, z, args)], x)
    return out, z


def backward(grad_out, x, weight, bias, z, args: GluConvArgs, needs_grad_x: bool, needs_grad_weight: bool,
             needs_grad_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's gradients from its saved pre-activation: the eager backend's backward (an im2col GEMM
    of at most ``MAX_BATCH`` rows)."""
    return eager_glu_conv.backward(grad_out, x, weight, bias, z, args, needs_grad_x, needs_grad_weight,
                                   needs_grad_bias)


class PreparedStep:
    """:func:`forward` for the steps of one layout (the call plan holds the tensors' layouts and the
    scalars fixed): the launch template and the outputs' layouts, worked out once.  A layout whose
    window or weight rows are not in place takes :func:`forward`, which copies them."""

    __slots__ = ("template", "out_layout", "z_layout", "in_place")

    def __init__(self, x, weight, bias, residual, args: GluConvArgs) -> None:
        out, z = empty_output(x, weight.shape[0] // 2, 1), empty_saved(x, weight)
        self.in_place = _rows_in_place(x) and _rows_in_place(weight)
        self.template = _template(x, weight, bias, residual, out, z, args) if self.in_place else None
        self.out_layout, self.z_layout = TensorLayout.of(out), TensorLayout.of(z)

    def __call__(self, x, weight, bias, residual, args: GluConvArgs, backend: str):
        """The registered op's implementation for this layout (same signature)."""
        if not self.in_place:
            return forward(x, weight, bias, residual, args)
        out, z = self.out_layout.empty(), self.z_layout.empty()
        launches = filled(self.template, _pointers(x, weight, bias, residual, out, z), {})
        if LaunchTemplates.verify:
            check_prepared_launches(launches, [_launch(x, weight, bias, residual, out, z, args)], "GLU step")
        run_launches(launches, x)
        return out, z

    def backward(self, grad_out, x, weight, bias, z, args: GluConvArgs, needs_grad_x: bool, needs_grad_weight: bool,
                 needs_grad_bias: bool, backend: str):
        """The registered backward's implementation (same signature)."""
        return backward(grad_out, x, weight, bias, z, args, needs_grad_x, needs_grad_weight, needs_grad_bias)


# The representative steps: C_in = C = 256, k = 4 (K = 1024) for a batch of 16; a batch of 1 (an
# integer Triton specializes as the constant 1, and one row per program) of C_in = 37, k = 3
# (K = 111: no divisibility by 16).
_TARGET_PROBLEMS = {"B16": (16, 256, 4), "B1-ragged": (1, 37, 3)}


def _target_launch(dtype: torch.dtype, problem: str, ring: bool) -> KernelLaunch:
    batch, channels_in, kernel_size = _TARGET_PROBLEMS[problem]
    channels = 256
    window = torch.empty(batch, channels_in, kernel_size, dtype=dtype)
    weight = torch.empty(2 * channels, channels_in, kernel_size, dtype=dtype)
    bias = torch.empty(2 * channels, dtype=dtype)
    if ring:  # glu_conv1d_update: a ring, x_t and a position per row
        x_t, residual, out = (torch.empty(batch, size, dtype=dtype) for size in (channels_in, channels, channels))
        return ring_launch(x_t, window, torch.empty(batch, dtype=torch.int64), weight, bias, residual, out, 0.5)
    residual, out = torch.empty(batch, channels, 1, dtype=dtype), torch.empty(batch, channels, 1, dtype=dtype)
    return _launch(window, weight, bias, residual, out, empty_saved(window, weight), GluConvArgs(0, 0, 0.0, 0.5))


def compile_targets() -> list[CompileTarget]:
    """The step kernel for each dtype and representative problem, with bias and residual, as
    :func:`~transformer_kernels.glu_conv1d_step` and as :func:`~transformer_kernels.glu_conv1d_update`
    (``RING``) launch it."""
    return [
        CompileTarget(f"glu_step{'_ring' if ring else ''}-{TORCH_TO_TRITON_DTYPE[dtype]}-{problem}",
                      lambda dtype=dtype, problem=problem, ring=ring: _target_launch(dtype, problem, ring))
        for dtype in (torch.float16, torch.bfloat16, torch.float32) for problem in _TARGET_PROBLEMS
        for ring in (False, True)
    ]
