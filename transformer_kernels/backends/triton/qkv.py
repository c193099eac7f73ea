"""Triton kernels for the fused QKV projection.

Layout (shared with ``ops/qkv.py`` and the eager backend): ``x`` is read as
``[B, L, E_in]`` with any strides, ``weight`` is ``[n*E, E_in]`` with packed
row blocks (q | k | v) and any strides, and every output is its own
contiguous ``[B, H, L, Dh]`` tensor.  The op requires ``E_in == E``; the
kernels keep the two apart (``in_features``, ``embed_dim``) only for
readability.  Three kernels, each a tiled GEMM over "tokens" ``t = b*L + l``:

* ``_qkv_forward_kernel``          out = x @ weightᵀ + bias, stored head-split.
* ``_qkv_grad_input_kernel``       grad_x = Σ_i grad_i @ weight_i.
* ``_qkv_grad_weight_kernel``      grad_weight = gradᵀ @ x and grad_bias =
  column sums of grad, in one pass over the gradients (optionally split over
  tokens into fp32 partial sums that the launcher adds up).

The head-split gradients are read in place: all ``n`` of them must share one
set of strides with a unit stride along ``Dh`` (``backward`` copies only a
gradient that breaks this, e.g. a stride-0 gradient of ``out.sum()``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ...ops.qkv import QkvProjectionArgs
from ..eager import qkv as eager_qkv
from ._common import (
    INT32_MAX,
    ROW_SUM_WIDTH,
    TORCH_TO_TRITON_DTYPE,
    CompileTarget,
    KernelConfig,
    KernelLaunch,
    LaunchTemplates,
    TensorLayout,
    TensorLayouts,
    WantedGradients,
    cdiv,
    check_prepared_launches,
    filled,
    filled_all,
    row_sum_operand,
    run_launches,
    strided_layout,
)
# Imported under its own name: tests replace this module attribute to force a tile configuration.
from ._common import num_sms as multiprocessor_count
from ._split_sum import split_count, split_sum_pointers, split_sum_template, wanted_sums

__all__ = [
    "KERNELS", "backward", "compile_targets", "forward", "gemm_config", "grad_weight_splits", "prepare_forward",
    "unsupported_reason",
]

# ---------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------


@triton.jit
def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped ordering: consecutive programs walk GROUP_M row tiles down one
    # column of tiles before moving right, so the GROUP_M row panels and the
    # column panels they pair with stay resident in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _select_projection(proj, q_ptr, k_ptr, v_ptr, NUM_PROJ: tl.constexpr):
    # The n head-split tensors are separate allocations; a program works on
    # one of them, picked at run time from its tile index.
    ptr = q_ptr
    if NUM_PROJ >= 2:
        if proj == 1:
            ptr = k_ptr
    if NUM_PROJ >= 3:
        if proj == 2:
            ptr = v_ptr
    return ptr


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------
# Algorithm: a standard tiled GEMM  out[t, f] = Σ_e x[t, e] · weight[f, e]
# over M = tokens, N = n·E output features, K = E_in.  Column tiles never
# straddle two projections (each projection gets cdiv(E, BLOCK_N) tiles), so
# a program stores into exactly one of q / k / v.  Out-of-range rows and
# columns are wrapped back into range for the loads (no masks in the inner
# loop except along E_in) and masked at the store.  The epilogue adds the
# bias in fp32, then maps feature f to (head, d) = (f // Dh, f % Dh) and
# token t to (b, l) = (t // L, t % L) and writes straight into the
# contiguous [B, H, L, Dh] output: no transpose or copy pass afterwards.
# ---------------------------------------------------------------------------


@triton.jit
def _qkv_forward_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    num_tokens,
    seq_len,
    embed_dim,
    in_features,
    head_dim,
    stride_xb,
    stride_xl,
    stride_xe,
    stride_wf,
    stride_we,
    stride_ob,
    stride_oh,
    stride_ol,
    stride_bias,
    NUM_PROJ: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tiles_per_proj = tl.cdiv(embed_dim, BLOCK_N)
    pid_m, pid_n = _grouped_tile(
        tl.program_id(0), tl.cdiv(num_tokens, BLOCK_M), NUM_PROJ * tiles_per_proj, GROUP_M
    )
    proj = pid_n // tiles_per_proj

    offs_t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_f = (pid_n % tiles_per_proj) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    t_in = offs_t % num_tokens
    f_in = offs_f % embed_dim

    x_rows = (t_in // seq_len) * stride_xb + (t_in % seq_len) * stride_xl
    x_ptrs = x_ptr + x_rows[:, None] + offs_k[None, :] * stride_xe
    w_ptrs = weight_ptr + ((proj * embed_dim + f_in) * stride_wf)[None, :] + offs_k[:, None] * stride_we

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k_mask = offs_k < in_features - k0
        a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xe
        w_ptrs += BLOCK_K * stride_we

    if HAS_BIAS:
        acc += tl.load(bias_ptr + (proj * embed_dim + f_in) * stride_bias).to(tl.float32)[None, :]

    out_ptr = _select_projection(proj, q_ptr, k_ptr, v_ptr, NUM_PROJ)
    out_rows = (offs_t // seq_len) * stride_ob + (offs_t % seq_len) * stride_ol
    out_cols = (offs_f // head_dim) * stride_oh + offs_f % head_dim
    mask = (offs_t < num_tokens)[:, None] & (offs_f < embed_dim)[None, :]
    tl.store(out_ptr + out_rows[:, None] + out_cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------
# Backward, input gradient
# ---------------------------------------------------------------------------
# Algorithm: grad_x[t, e] = Σ_i Σ_f grad_i[t, f] · weight[i·E + f, e], a GEMM
# over M = tokens, N = E_in whose reduction runs over the n projections one
# after another; each projection's A tiles are gathered from its head-split
# gradient ((b, h, l, d) addressing) inside the loop, so no packed [T, n·E]
# gradient is ever materialized.
# ---------------------------------------------------------------------------


@triton.jit
def _accumulate_grad_input(
    acc,
    grad_ptr,
    weight_ptr,
    proj,
    grad_rows,
    e_in,
    embed_dim,
    head_dim,
    stride_gh,
    stride_wf,
    stride_we,
    BLOCK_K: tl.constexpr,
):
    offs_f = tl.arange(0, BLOCK_K)
    for f0 in range(0, embed_dim, BLOCK_K):
        f = f0 + offs_f
        f_mask = f < embed_dim
        g = tl.load(
            grad_ptr + grad_rows[:, None] + ((f // head_dim) * stride_gh + f % head_dim)[None, :],
            mask=f_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            weight_ptr + ((proj * embed_dim + f) * stride_wf)[:, None] + (e_in * stride_we)[None, :],
            mask=f_mask[:, None],
            other=0.0,
        )
        acc = tl.dot(g, w, acc)
    return acc


@triton.jit
def _qkv_grad_input_kernel(
    grad_q_ptr,
    grad_k_ptr,
    grad_v_ptr,
    weight_ptr,
    grad_x_ptr,
    num_tokens,
    seq_len,
    embed_dim,
    in_features,
    head_dim,
    stride_gb,
    stride_gh,
    stride_gl,
    stride_wf,
    stride_we,
    stride_dxt,
    NUM_PROJ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(
        tl.program_id(0), tl.cdiv(num_tokens, BLOCK_M), tl.cdiv(in_features, BLOCK_N), GROUP_M
    )
    offs_t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_in = offs_t % num_tokens
    e_in = offs_e % in_features
    grad_rows = (t_in // seq_len) * stride_gb + (t_in % seq_len) * stride_gl

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate_grad_input(
        acc, grad_q_ptr, weight_ptr, 0, grad_rows, e_in, embed_dim, head_dim, stride_gh, stride_wf, stride_we,
        BLOCK_K,
    )
    if NUM_PROJ >= 2:
        acc = _accumulate_grad_input(
            acc, grad_k_ptr, weight_ptr, 1, grad_rows, e_in, embed_dim, head_dim, stride_gh, stride_wf, stride_we,
            BLOCK_K,
        )
    if NUM_PROJ >= 3:
        acc = _accumulate_grad_input(
            acc, grad_v_ptr, weight_ptr, 2, grad_rows, e_in, embed_dim, head_dim, stride_gh, stride_wf, stride_we,
            BLOCK_K,
        )

    mask = (offs_t < num_tokens)[:, None] & (offs_e < in_features)[None, :]
    grad_x_ptrs = grad_x_ptr + (offs_t * stride_dxt)[:, None] + offs_e[None, :]
    tl.store(grad_x_ptrs, acc.to(grad_x_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------
# Backward, weight and bias gradients
# ---------------------------------------------------------------------------
# Algorithm: grad_weight[i·E + f, e] = Σ_t grad_i[t, f] · x[t, e], a GEMM over
# M = n·E features (row tiles never straddle two projections), N = E_in,
# reducing over tokens.  The A operand is the transposed head-split gradient
# gathered in place.  Every program also sums its A tiles over tokens, which is
# grad_bias (the first column of tiles stores it), so the gradients are read
# once for both.  When the output grid is too small to fill the GPU, the
# token range is split over program_id(1) and each split writes fp32 partial
# sums to its own slice of a workspace, which the launcher adds up
# (deterministic, unlike atomics).
# ---------------------------------------------------------------------------


@triton.jit
def _qkv_grad_weight_kernel(
    grad_q_ptr,
    grad_k_ptr,
    grad_v_ptr,
    x_ptr,
    grad_w_ptr,
    grad_b_ptr,
    num_tokens,
    seq_len,
    embed_dim,
    in_features,
    head_dim,
    tokens_per_split,
    stride_gb,
    stride_gh,
    stride_gl,
    stride_xb,
    stride_xl,
    stride_xe,
    stride_dws,
    stride_dwf,
    stride_dbs,
    NUM_PROJ: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tiles_per_proj = tl.cdiv(embed_dim, BLOCK_M)
    pid_m, pid_n = _grouped_tile(
        tl.program_id(0), NUM_PROJ * tiles_per_proj, tl.cdiv(in_features, BLOCK_N), GROUP_M
    )
    split = tl.program_id(1)
    proj = pid_m // tiles_per_proj

    offs_f = (pid_m % tiles_per_proj) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    e_in = offs_e % in_features

    grad_ptr = _select_projection(proj, grad_q_ptr, grad_k_ptr, grad_v_ptr, NUM_PROJ)
    # Unwrapped feature offsets plus a row mask (rather than wrapping them like
    # e_in) keep the head-split addresses provably contiguous along Dh, so the
    # gradient tile is fetched with 16-byte vector copies.
    f_mask = offs_f < embed_dim
    grad_cols = (offs_f // head_dim) * stride_gh + offs_f % head_dim
    token_start = split * tokens_per_split
    token_end = min(token_start + tokens_per_split, num_tokens)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # grad_bias as a second dot (see row_sum_operand), without reloading g in another layout.
    # Every program runs it: summing only in the first column's programs made each of their
    # steps 1.8x as long as the others' on sm_90 (SASS: 360 against 201 instructions; now 225
    # for all), and with the short token loops of the seeds' batches one wave of programs
    # waits for its slowest.
    bias_acc = tl.zeros((BLOCK_M, ROW_SUM_WIDTH), dtype=tl.float32)
    ones_column = row_sum_operand(BLOCK_K, grad_q_ptr.dtype.element_ty)
    for t0 in range(token_start, token_end, BLOCK_K):
        t = t0 + offs_k
        t_mask = t < token_end
        b_idx = t // seq_len
        l_idx = t % seq_len
        g = tl.load(
            grad_ptr + grad_cols[:, None] + (b_idx * stride_gb + l_idx * stride_gl)[None, :],
            mask=f_mask[:, None] & t_mask[None, :],
            other=0.0,
        )
        xt = tl.load(
            x_ptr + (b_idx * stride_xb + l_idx * stride_xl)[:, None] + (e_in * stride_xe)[None, :],
            mask=t_mask[:, None],
            other=0.0,
        )
        acc = tl.dot(g, xt, acc)
        if HAS_BIAS:
            bias_acc = tl.dot(g, ones_column, bias_acc)

    rows = proj * embed_dim + offs_f
    mask = f_mask[:, None] & (offs_e < in_features)[None, :]
    grad_w_ptrs = grad_w_ptr + split * stride_dws + (rows * stride_dwf)[:, None] + offs_e[None, :]
    tl.store(grad_w_ptrs, acc.to(grad_w_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        if pid_n == 0:
            grad_b_ptrs = grad_b_ptr + split * stride_dbs + rows
            tl.store(grad_b_ptrs, tl.sum(bias_acc, axis=1).to(grad_b_ptr.dtype.element_ty), mask=f_mask)


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------


# 128x128 tiles with 8 warps keep the fp32 accumulator at 64 registers per
# thread (no spills on sm_80's mma.sync path) and map onto two warpgroups for
# sm_90's wgmma.  Three stages of 16-bit 128x64 operand tiles are 96 KiB of
# shared memory.  The
# forward GEMM, measured against cuBLAS, uses 128x256 16-bit tiles (the
# Triton matmul tutorial's best A100/H100 shape, 144 KiB, 238 registers on
# sm_80); the backward kernels keep 128x128, where 128x256 reaches 255
# registers and spills.  A forward whose 128x256 grid would leave SMs idle
# takes 128x128 where that grid fills them (the seeds' 2048 tokens of
# 3 x 512 features: 96 tiles of 128x256 against an H100's 132 SMs, 192 of
# 128x128); problems too small for either use 64x64 tiles.
_WIDE_16BIT = KernelConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
_LARGE_16BIT = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
_SMALL = KernelConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
KERNELS = ("forward", "grad_input", "grad_weight")


def _large_config(kernel: str) -> KernelConfig:
    return _WIDE_16BIT if kernel == "forward" else _LARGE_16BIT


@functools.lru_cache(maxsize=4096)  # bounded: the token count changes with every batch shape
def gemm_config(kernel: str, m: int, n: int, num_sms: int) -> KernelConfig:
    """Tile configuration of ``kernel`` (one of ``KERNELS``) for an ``[m, n]``
    output."""
    for config in (_large_config(kernel), _LARGE_16BIT):
        if cdiv(m, config.block_m) * cdiv(n, config.block_n) >= num_sms:
            return config
    return _SMALL


def grad_weight_splits(output_tiles: int, num_tokens: int, block_k: int, num_sms: int) -> int:
    """Number of token splits for the weight-gradient GEMM (:func:`._split_sum.split_count`):
    only while the grid is under two waves, and with at least 16 reduction steps per split so the
    fp32 partial sums stay a small share of the traffic."""
    if output_tiles >= 2 * num_sms:
        return 1
    return split_count(output_tiles, cdiv(num_tokens, block_k), num_sms, min_steps=16,
                       max_splits=cdiv(2 * num_sms, output_tiles))


def _uses_torch_matmul(dtype: torch.dtype) -> bool:
    """float32 runs as torch matmuls (the eager backend), which follow torch's
    TF32 setting exactly.  Without TF32 a Triton FMA loop would be slower than
    cuBLAS's float32 GEMM; with it, Triton's single-TF32 dots truncate their
    operands (on an H100 their error measured more than twice cuBLAS's), and
    the 3xTF32 dots that fix that spill at the 128x128 tiles on sm_80."""
    return dtype == torch.float32


# ---------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------

# Every launch of this backend, by layout (see ``LaunchTemplates``).
_TEMPLATES = LaunchTemplates()


def _max_offset(t: torch.Tensor) -> int:
    """Largest element offset a kernel computes into ``t`` (the kernels index in int32)."""
    return _layout_max_offset(t.shape, t.stride())


@functools.lru_cache(maxsize=4096)  # bounded: the token count changes with every batch shape
def _layout_max_offset(shape: torch.Size, strides: tuple[int, ...]) -> int:
    if 0 in shape:
        return 0
    return sum((size - 1) * stride for size, stride in zip(shape, strides))


def unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: QkvProjectionArgs
) -> Optional[str]:
    if x.dtype not in TORCH_TO_TRITON_DTYPE:
        return f"the triton backend supports float16, bfloat16 and float32, got {x.dtype}"
    # Each output (and each gradient) has x.numel() elements.
    if max(_max_offset(x), _max_offset(weight), x.numel()) > INT32_MAX:
        return f"the triton kernels index with int32: tensors must span at most {INT32_MAX} elements"
    return None


def _with_one_batch_dim(tensor: torch.Tensor, inner_dims: int) -> torch.Tensor:
    """``tensor`` with its leading dimensions merged into one before its last ``inner_dims``, a
    view whenever the strides allow; ``tensor`` itself when it has that shape (a reshape is host
    time even when it changes nothing)."""
    if tensor.dim() == inner_dims + 1:
        return tensor
    return tensor.reshape(-1, *tensor.shape[tensor.dim() - inner_dims :])


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """``[*batch, L, E]`` -> ``[B, L, E]``."""
    return _with_one_batch_dim(x, 2)


def _forward_launch(
    x3: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], outputs: list[torch.Tensor],
    cfg: KernelConfig,
) -> KernelLaunch:
    """The forward GEMM: ``x3`` ``[B, L, E_in]``, ``outputs`` the ``n``
    ``[B, H, L, Dh]`` contiguous results."""
    pointers = _forward_pointers(x3, weight, bias, outputs)
    (launch,) = filled(_forward_template(x3, weight, bias, outputs, cfg), pointers, {})
    return launch


def _forward_pointers(x3, weight, bias, outputs: list[torch.Tensor]) -> tuple:
    """The forward GEMM's tensor arguments (an absent bias or output slot repeats another tensor)."""
    return (x3, weight, weight if bias is None else bias, *outputs, *[outputs[0]] * (3 - len(outputs)))


def _forward_template(x3, weight, bias, outputs: list[torch.Tensor], cfg: KernelConfig) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_forward_launch`, whose pointers are :func:`_forward_pointers`'."""
    num_proj = len(outputs)
    pointers = _forward_pointers(x3, weight, bias, outputs)
    layout = ("forward", x3.shape, x3.stride(), weight.shape, weight.stride(), None if bias is None else bias.stride(),
              num_proj, outputs[0].shape, outputs[0].stride(), cfg)

    def build() -> KernelLaunch:
        _, seq_len, in_features = x3.shape
        _, num_heads, _, head_dim = outputs[0].shape
        embed_dim = num_heads * head_dim
        num_tokens = x3.shape[0] * seq_len
        grid = (cdiv(num_tokens, cfg.block_m) * num_proj * cdiv(embed_dim, cfg.block_n),)
        return KernelLaunch(
            _qkv_forward_kernel,
            grid,
            (
                *pointers,
                num_tokens, seq_len, embed_dim, in_features, head_dim,
                *x3.stride(), *weight.stride(), *outputs[0].stride()[:3], 1 if bias is None else bias.stride(0),
            ),
            dict(NUM_PROJ=num_proj, HAS_BIAS=bias is not None, **cfg.launch_kwargs()),
        )

    return _TEMPLATES.template(layout, pointers, lambda: [build()], {})


def forward(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: QkvProjectionArgs
) -> list[torch.Tensor]:
    if _uses_torch_matmul(x.dtype):
        return eager_qkv.forward(x, weight, bias, args)
    *batch, seq_len, embed_dim = x.shape
    num_proj = weight.shape[0] // embed_dim
    output_shape = args.output_shape(x)
    outputs = [x.new_empty(output_shape) for _ in range(num_proj)]
    x3 = _as_3d(x)
    num_tokens = x3.shape[0] * seq_len
    if num_tokens == 0:
        return outputs
    out3 = [_with_one_batch_dim(o, 3) for o in outputs]
    run_launches([_forward_launch(x3, weight, bias, out3, _forward_config(x3, weight))], x3)
    return outputs


def _forward_config(x3: torch.Tensor, weight: torch.Tensor) -> KernelConfig:
    """The forward GEMM's tiles for ``x3`` ``[B, L, E_in]``."""
    return gemm_config("forward", x3.shape[0] * x3.shape[1], weight.shape[0], multiprocessor_count(x3.device))


def prepare_forward(x, weight, bias, args: QkvProjectionArgs) -> Optional["_PreparedForward"]:
    """:func:`forward` prepared for the calls of this one's layout (see :class:`_PreparedForward`), or
    None for a call that the eager backend runs, has no tokens, or whose ``x`` is not ``[B, L, E]``."""
    if _uses_torch_matmul(x.dtype) or x.dim() != 3 or x.numel() == 0:
        return None
    return _PreparedForward(x, weight, bias, args)


class _PreparedForward:
    """:func:`forward` for the calls of one layout: the tensors' shapes, strides, dtypes and device and
    ``num_heads``, which the caller's call plan holds fixed (``ops/_call_plans.py``).  The first call
    works out the launch template and the outputs' layout; a later call allocates its outputs and
    puts its tensors into the template (Triton's specialization on 16-byte alignment is the direct
    launch's, per call), or runs :func:`forward` if the tiles chosen for it differ (the tests force
    tiles through the SM count).  With ``LaunchTemplates.verify`` set (the test suite sets it),
    every call also builds its launch as :func:`forward` would, and fails unless it is the same."""

    __slots__ = ("template", "sm_count", "output_layout", "num_proj", "prepared_backward")

    def __init__(self, x, weight, bias, args: QkvProjectionArgs) -> None:
        self.num_proj = weight.shape[0] // x.shape[-1]
        outputs = [x.new_empty(args.output_shape(x)) for _ in range(self.num_proj)]
        self.output_layout = TensorLayout.of(outputs[0])
        # The tiles follow from the layout and the SM count, which only the tests change (replacing
        # multiprocessor_count): an identity check per call, not the tile choice again.
        self.sm_count = multiprocessor_count
        self.template = _forward_template(x, weight, bias, outputs, _forward_config(x, weight))
        self.prepared_backward: Optional[_PreparedBackward] = None

    def __call__(self, x, weight, bias, args: QkvProjectionArgs, backend: str) -> list[torch.Tensor]:
        """The registered op's implementation for this layout (same signature)."""
        if multiprocessor_count is not self.sm_count:
            return forward(x, weight, bias, args)
        outputs = [self.output_layout.empty() for _ in range(self.num_proj)]
        launches = filled(self.template, _forward_pointers(x, weight, bias, outputs), {})
        if LaunchTemplates.verify:
            expected = _forward_launch(x, weight, bias, outputs, _forward_config(x, weight))
            check_prepared_launches(launches, [expected], "QKV forward")
        run_launches(launches, x)
        return outputs

    def backward(self, grads, x, weight, args: QkvProjectionArgs, has_bias: bool, needs_grad_x: bool,
                 needs_grad_weight: bool, needs_grad_bias: bool, backend: str):
        """The registered backward's implementation (same signature) for the calls this forward
        ran, which the op's autograd hands it (``ctx.runner``): :class:`_PreparedBackward`, made for
        the first of them whose gradients the kernels read in place, where a later one's have
        those layouts and it asks for the same gradients, else :func:`backward`."""
        wanted = WantedGradients(needs_grad_x, needs_grad_weight, has_bias and needs_grad_bias)
        prepared = self.prepared_backward
        if prepared is None and _read_in_place(grads):
            prepared = self.prepared_backward = _PreparedBackward(grads, x, weight, wanted)
        if prepared is None or not prepared.takes(grads, x, wanted):
            return backward(grads, x, weight, args, has_bias, needs_grad_x, needs_grad_weight, needs_grad_bias)
        return prepared(grads, x, weight)


def _shared_layout(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients as ``[B, H, L, Dh]`` views sharing one set of strides with unit stride along Dh.

    The kernels read every gradient with one stride set; only a gradient
    that does not fit (typically a stride-0 broadcast) is copied.
    """
    grads = [_with_one_batch_dim(g, 3) for g in grads]
    return grads if _one_stride_set(grads) else [g.contiguous() for g in grads]


def _one_stride_set(grads4: list[torch.Tensor]) -> bool:
    """Whether the ``[B, H, L, Dh]`` gradients share one set of strides the kernels index (unit
    along Dh, int32 offsets)."""
    first = grads4[0]
    return (
        first.stride(-1) == 1
        and all(g.stride() == first.stride() for g in grads4[1:])
        and _max_offset(first) <= INT32_MAX
    )


def _read_in_place(grads: list[torch.Tensor]) -> bool:
    """Whether :func:`_shared_layout` returns ``grads`` themselves (4-D, one stride set), which
    the prepared backward's templates take: asked without the copies it would make otherwise."""
    return all(g.dim() == 4 for g in grads) and _one_stride_set(grads)


def _grad_input_launch(
    grads4: list[torch.Tensor], weight: torch.Tensor, grad_x: torch.Tensor, cfg: KernelConfig
) -> KernelLaunch:
    """The input-gradient GEMM: ``grads4`` as ``_shared_layout`` returns
    them, ``grad_x`` contiguous ``[*batch, L, E_in]``."""
    pointers = _grad_input_pointers(grads4, weight, grad_x)
    (launch,) = filled(_grad_input_template(grads4, weight, grad_x, cfg), pointers, {})
    return launch


def _padded_grads(grads4: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The gradient pointers of the backward kernels, which take three (an absent one repeats the first)."""
    return (*grads4, *[grads4[0]] * (3 - len(grads4)))


def _grad_input_pointers(grads4: list[torch.Tensor], weight: torch.Tensor, grad_x: torch.Tensor) -> tuple:
    return (*_padded_grads(grads4), weight, grad_x)


def _grad_input_template(
    grads4: list[torch.Tensor], weight: torch.Tensor, grad_x: torch.Tensor, cfg: KernelConfig
) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_grad_input_launch`, whose pointers are :func:`_grad_input_pointers`'."""
    pointers = _grad_input_pointers(grads4, weight, grad_x)
    layout = ("grad_input", grads4[0].shape, grads4[0].stride(), len(grads4), weight.shape, weight.stride(),
              grad_x.shape, cfg)

    def build() -> KernelLaunch:
        batch, num_heads, seq_len, head_dim = grads4[0].shape
        embed_dim = num_heads * head_dim
        in_features = grad_x.shape[-1]
        num_tokens = batch * seq_len
        stride_gb, stride_gh, stride_gl, _ = grads4[0].stride()
        grid = (cdiv(num_tokens, cfg.block_m) * cdiv(in_features, cfg.block_n),)
        return KernelLaunch(
            _qkv_grad_input_kernel,
            grid,
            (
                *pointers,
                num_tokens, seq_len, embed_dim, in_features, head_dim,
                stride_gb, stride_gh, stride_gl, *weight.stride(), in_features,
            ),
            dict(NUM_PROJ=len(grads4), **cfg.launch_kwargs()),
        )

    return _TEMPLATES.template(layout, pointers, lambda: [build()], {})


def _grad_weight_launch(
    grads4: list[torch.Tensor], x3: torch.Tensor, grad_w_out: torch.Tensor, grad_b_out: torch.Tensor,
    has_bias: bool, tokens_per_split: int, cfg: KernelConfig,
) -> KernelLaunch:
    """The weight/bias-gradient GEMM: ``grad_w_out`` ``[n*E, E_in]`` (one
    split) or ``[splits, n*E, E_in]`` float32 partial sums, ``grad_b_out``
    likewise (any tensor when ``has_bias`` is False)."""
    template = _grad_weight_template(grads4, x3, grad_w_out, grad_b_out, has_bias, tokens_per_split, cfg)
    (launch,) = filled(template, _grad_weight_pointers(grads4, x3, grad_w_out, grad_b_out), {})
    return launch


def _grad_weight_pointers(grads4, x3, grad_w_out, grad_b_out) -> tuple:
    return (*_padded_grads(grads4), x3, grad_w_out, grad_b_out)


def _grad_weight_template(
    grads4: list[torch.Tensor], x3: torch.Tensor, grad_w_out: torch.Tensor, grad_b_out: torch.Tensor,
    has_bias: bool, tokens_per_split: int, cfg: KernelConfig,
) -> tuple[KernelLaunch, ...]:
    """The template of :func:`_grad_weight_launch`, whose pointers are :func:`_grad_weight_pointers`'."""
    num_proj = len(grads4)
    pointers = _grad_weight_pointers(grads4, x3, grad_w_out, grad_b_out)
    layout = ("grad_weight", grads4[0].shape, grads4[0].stride(), num_proj, x3.shape, x3.stride(),
              grad_w_out.shape, has_bias, tokens_per_split, cfg)

    def build() -> KernelLaunch:
        batch, seq_len, in_features = x3.shape
        _, num_heads, _, head_dim = grads4[0].shape
        embed_dim = num_heads * head_dim
        num_tokens = batch * seq_len
        features = num_proj * embed_dim
        stride_gb, stride_gh, stride_gl, _ = grads4[0].stride()
        tiles = num_proj * cdiv(embed_dim, cfg.block_m) * cdiv(in_features, cfg.block_n)
        return KernelLaunch(
            _qkv_grad_weight_kernel,
            (tiles, cdiv(num_tokens, tokens_per_split)),
            (
                *pointers,
                num_tokens, seq_len, embed_dim, in_features, head_dim, tokens_per_split,
                stride_gb, stride_gh, stride_gl, *x3.stride(), features * in_features, in_features, features,
            ),
            dict(NUM_PROJ=num_proj, HAS_BIAS=has_bias, **cfg.launch_kwargs()),
        )

    return _TEMPLATES.template(layout, pointers, lambda: [build()], {})


def backward(
    grads: list[torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    args: QkvProjectionArgs,
    has_bias: bool,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight, grad_bias)``; a gradient not asked for is an empty tensor.

    ``grad_x = sum_i grad_i @ weight_i`` (contiguous) is one GEMM kernel over the n projections;
    ``grad_weight = grad^T @ x`` another, whose first column of tiles also sums the bias, split over
    token ranges when one range would not fill the GPU (float32 partial sums, reduced afterwards).
    """
    if _uses_torch_matmul(x.dtype):
        return eager_qkv.backward(
            grads, x, weight, args, has_bias, needs_grad_x, needs_grad_weight, needs_grad_bias
        )
    wanted = WantedGradients(needs_grad_x, needs_grad_weight, has_bias and needs_grad_bias)
    x3, grads4 = _as_3d(x), _shared_layout(grads)
    num_tokens = x3.shape[0] * x3.shape[1]
    if num_tokens == 0:
        return (torch.empty_like(x, memory_format=torch.contiguous_format) if wanted.x else x.new_empty(0),
                torch.zeros_like(weight) if wanted.weight else x.new_empty(0),
                weight.new_zeros(weight.shape[0]) if wanted.bias else x.new_empty(0))
    tiles = _BackwardTiles.of(num_tokens, weight, len(grads4), multiprocessor_count(x.device))
    buffers = _backward_buffers(x, weight, wanted, tiles)
    run_launches(_backward_launches(grads4, x3, weight, buffers, wanted, tiles), x3)
    return buffers.grad_x, buffers.grad_weight, buffers.grad_bias


@dataclasses.dataclass(frozen=True)
class _BackwardTiles:
    """A backward call's GEMM tiles, and the weight gradient's split into ``splits`` token ranges
    of ``tokens_per_split`` (a multiple of its K step)."""

    grad_input: KernelConfig
    grad_weight: KernelConfig
    splits: int
    tokens_per_split: int

    @classmethod
    def of(cls, num_tokens: int, weight: torch.Tensor, num_proj: int, num_sms: int) -> "_BackwardTiles":
        features, in_features = weight.shape
        grad_weight = gemm_config("grad_weight", features, in_features, num_sms)
        tiles = num_proj * cdiv(in_features, grad_weight.block_m) * cdiv(in_features, grad_weight.block_n)
        splits = grad_weight_splits(tiles, num_tokens, grad_weight.block_k, num_sms)
        tokens_per_split = cdiv(cdiv(num_tokens, splits), grad_weight.block_k) * grad_weight.block_k
        return cls(gemm_config("grad_input", num_tokens, in_features, num_sms), grad_weight,
                   cdiv(num_tokens, tokens_per_split), tokens_per_split)


class _BackwardBuffers(NamedTuple):
    """What a backward call allocates: the three gradients (an empty tensor for one not asked for)
    and what the weight-gradient kernel writes, ``weight_sums`` and ``bias_sums``: with one split
    the gradients themselves (a scratch for the weight's where only the bias's is wanted), else
    float32 partial sums ``[splits, ...]``; ``bias_sums`` is ``weight_sums`` where no bias gradient
    is wanted, both None where neither gradient is."""

    grad_x: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor
    weight_sums: Optional[torch.Tensor]
    bias_sums: Optional[torch.Tensor]


def _backward_buffers(x, weight, wanted: WantedGradients, tiles: _BackwardTiles) -> _BackwardBuffers:
    features, in_features = weight.shape
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if wanted.x else x.new_empty(0)
    grad_weight = weight.new_empty(weight.shape if wanted.weight else (0,))
    grad_bias = weight.new_empty((features,) if wanted.bias else (0,))
    weight_sums = bias_sums = None
    if wanted.weight_or_bias and tiles.splits == 1:
        weight_sums = grad_weight if wanted.weight else weight.new_empty(weight.shape)
        bias_sums = grad_bias if wanted.bias else weight_sums
    elif wanted.weight_or_bias:
        weight_sums = weight.new_empty(tiles.splits, features, in_features, dtype=torch.float32)
        bias_sums = weight.new_empty(tiles.splits, features, dtype=torch.float32) if wanted.bias else weight_sums
    return _BackwardBuffers(grad_x, grad_weight, grad_bias, weight_sums, bias_sums)


def _backward_templates(grads4, x3, weight, buffers: _BackwardBuffers, wanted: WantedGradients,
                        tiles: _BackwardTiles) -> list[tuple[KernelLaunch, ...]]:
    """The templates of a backward call's launches, in order, whose pointers
    :func:`_backward_pointers` gives."""
    templates = []
    if wanted.x:
        templates.append(_grad_input_template(grads4, weight, buffers.grad_x, tiles.grad_input))
    if wanted.weight_or_bias:
        templates.append(_grad_weight_template(grads4, x3, buffers.weight_sums, buffers.bias_sums, wanted.bias,
                                               tiles.tokens_per_split, tiles.grad_weight))
        if tiles.splits > 1:
            templates.append(split_sum_template(*wanted_sums(buffers, wanted)))
    return templates


def _backward_pointers(grads4, x3, weight, buffers: _BackwardBuffers, wanted: WantedGradients,
                       tiles: _BackwardTiles) -> list[tuple]:
    """The pointers of :func:`_backward_templates`'s templates, in the same order."""
    pointers = []
    if wanted.x:
        pointers.append(_grad_input_pointers(grads4, weight, buffers.grad_x))
    if wanted.weight_or_bias:
        pointers.append(_grad_weight_pointers(grads4, x3, buffers.weight_sums, buffers.bias_sums))
        if tiles.splits > 1:
            pointers.append(split_sum_pointers(*wanted_sums(buffers, wanted)))
    return pointers


def _backward_launches(grads4, x3, weight, buffers: _BackwardBuffers, wanted: WantedGradients,
                       tiles: _BackwardTiles) -> list[KernelLaunch]:
    return filled_all(_backward_templates(grads4, x3, weight, buffers, wanted, tiles),
                      _backward_pointers(grads4, x3, weight, buffers, wanted, tiles))


class _PreparedBackward:
    """:func:`backward` for the calls of one layout, those of a :class:`_PreparedForward` whose
    gradients have the layouts of the first one's (which the kernels read in place) and that ask
    for the same gradients: its tiles, the templates of its launches and the layouts of what it
    allocates, worked out once.  A call on a GPU of another SM count (the tests force tiles
    through it) runs :func:`backward`.  Under ``LaunchTemplates.verify`` every call also builds
    its launches as :func:`backward` would, and fails unless they are the same."""

    __slots__ = ("grads_layout", "wanted", "num_sms", "tiles", "templates", "buffer_layouts")

    def __init__(self, grads4, x, weight, wanted: WantedGradients) -> None:
        self.grads_layout = [strided_layout(g) for g in grads4]
        self.wanted, self.num_sms = wanted, multiprocessor_count(x.device)
        self.tiles = _BackwardTiles.of(x.shape[0] * x.shape[1], weight, len(grads4), self.num_sms)
        buffers = _backward_buffers(x, weight, wanted, self.tiles)
        self.templates = _backward_templates(grads4, x, weight, buffers, wanted, self.tiles)
        self.buffer_layouts = TensorLayouts(buffers)

    def takes(self, grads: list[torch.Tensor], x: torch.Tensor, wanted: WantedGradients) -> bool:
        return ([strided_layout(g) for g in grads] == self.grads_layout and wanted == self.wanted
                and multiprocessor_count(x.device) == self.num_sms)

    def __call__(self, grads, x, weight):
        buffers = _BackwardBuffers._make(self.buffer_layouts.empty())
        launches = filled_all(self.templates, _backward_pointers(grads, x, weight, buffers, self.wanted, self.tiles))
        if LaunchTemplates.verify:
            tiles = _BackwardTiles.of(x.shape[0] * x.shape[1], weight, len(grads), multiprocessor_count(x.device))
            expected = _backward_launches(_shared_layout(grads), x, weight, buffers, self.wanted, tiles)
            check_prepared_launches(launches, expected, "QKV backward")
        run_launches(launches, x)
        return buffers.grad_x, buffers.grad_weight, buffers.grad_bias


# ---------------------------------------------------------------------------
# Compile targets
# ---------------------------------------------------------------------------

# The representative problems: E = 1024 in 16 heads of 64, contiguous tensors (unit strides along
# E_in and Dh), n = 3 projections with bias; batch 4 of length 512 (sizes divisible by 16), or
# "ragged": batch 1 of an odd length.  The kernels are plain triton.jit: Triton specializes them on
# every integer equal to 1 and on divisibility by 16, so the ragged problem compiles the variant a
# decoding batch of 1 or an odd token count launches.
_TARGET_EMBED, _TARGET_HEADS = 1024, 16
_TARGET_SHAPES = {False: (4, 512), True: (1, 37)}


def _target_launch(kernel: str, dtype: torch.dtype, cfg: KernelConfig, split: bool, ragged: bool) -> KernelLaunch:
    (batch, length), embed, heads = _TARGET_SHAPES[ragged], _TARGET_EMBED, _TARGET_HEADS
    x3 = torch.empty(batch, length, embed, dtype=dtype)
    weight = torch.empty(3 * embed, embed, dtype=dtype)
    heads_split = [torch.empty(batch, heads, length, embed // heads, dtype=dtype) for _ in range(3)]
    if kernel == "forward":
        return _forward_launch(x3, weight, torch.empty(3 * embed, dtype=dtype), heads_split, cfg)
    if kernel == "grad_input":
        return _grad_input_launch(heads_split, weight, torch.empty_like(x3), cfg)
    splits = 2 if split else 1
    out_dtype = torch.float32 if split else dtype
    grad_w_out = torch.empty(splits, 3 * embed, embed, dtype=out_dtype).squeeze(0)
    grad_b_out = torch.empty(splits, 3 * embed, dtype=out_dtype).squeeze(0)
    return _grad_weight_launch(heads_split, x3, grad_w_out, grad_b_out, True, batch * length // splits, cfg)


def compile_targets() -> list[CompileTarget]:
    """Each kernel with each configuration ``gemm_config`` can return, for
    each representative problem (the weight gradient also with split-token
    float32 partial sums)."""
    targets = []
    for kernel, dtype, ragged in itertools.product(KERNELS, (torch.float16, torch.bfloat16), (False, True)):
        for cfg in dict.fromkeys((_large_config(kernel), _LARGE_16BIT, _SMALL)):
            label = f"qkv_{kernel}-{TORCH_TO_TRITON_DTYPE[dtype]}-{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
            splits = (False, True) if kernel == "grad_weight" else (False,)
            for split in splits:
                suffix = ("-fp32partials" if split else "-direct") if kernel == "grad_weight" else ""
                targets.append(CompileTarget(
                    label + suffix + ("-ragged" if ragged else ""),
                    functools.partial(_target_launch, kernel, dtype, cfg, split, ragged),
                ))
    return targets
