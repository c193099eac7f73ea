"""Triton backend of ``scaled_dot_product_attention``: flash-style forward and
backward kernels with in-kernel masking and dropout.

Inputs arrive normalized by the op layer (see ``ops/attention.py``):
query ``[B, Hq, Lq, D]``, key ``[B, Hk, Lk, D]``, value ``[B, Hk, Lk, Dv]`` with
any strides, ``Hq % Hk == 0`` (grouped-query attention: query head ``h`` reads
kv head ``h // (Hq // Hk)``).  Every mask kind is a constexpr switch of one
kernel family:

* ``CAUSAL``: a :class:`~transformer_kernels.ops.attention.Causal`: none,
  top-left (query ``i`` sees keys ``j <= i``) or bottom-right
  (``j <= i + Lk - Lq``).  Key blocks wholly above the diagonal
  are never visited; only the blocks the diagonal crosses pay for the mask.
* ``HAS_KEY_PADDING``: bool ``[B, Lk]`` (True = padding) read one key block at
  a time; ``key_bounds`` ``[B, 3]`` int32 (first kept key, last kept key + 1,
  number of kept keys) lets the kernels skip whole key blocks of padding, and
  where the kept keys are contiguous, read no padding inside them.  A small
  kernel finds the bounds first (one launch, where torch ops would take a
  dozen).
* ``HAS_DENSE_MASK``: a ``[B, Hq, Lq, Lk]`` view (stride 0 where broadcast),
  bool (``MASK_IS_BOOL``, True = takes part) or float (added to the scaled
  scores).
* ``HAS_DROPOUT``: keep-mask from Philox keyed by the seed, one counter per
  (8 keys, query, batch*head, offset), so backward regenerates it exactly;
  the drop probability is quantized to 16 bits (``round(p * 2**16) / 2**16``)
  and kept weights are scaled by the inverse of the quantized keep probability.

The forward kernel splits its key blocks the way Triton's tutorial splits
its stages, by constexpr switches of one loop body: whole blocks of kept keys
that every row of the query block sees run without masks (no bounds, padding
or causal test, no column mask when the head dims fill their blocks
(``EVEN_HEAD_DIM``), and no guard for rows that have seen no key yet); only
the blocks at the edges (a partial tail, padding, the diagonal) pay for them.
dQ splits the same way under causality or key padding without a dense mask
or dropout (see the kernel).  dK/dV is not split so: it loads its key-side
masks once, outside its loop, and unmasking its loop's query rows would take
a third copy of the body of the kernel that is closest to spilling.

The launchers hand the kernels 16-byte aligned tensors whose head dims and
strides are multiples of 16 elements, copying (and zero-padding the head dim
of) the rare input that is not, so loads vectorize.

Scores are kept in base-2 units (``qk_scale = scale * log2(e)``) so the
softmax uses ``exp2``.  Rows where every key is excluded get output 0 and
``lse = +inf``, which makes every probability in backward exactly 0: such rows
never produce NaN and have zero gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ...ops.attention import (
    MAX_HEAD_DIM, AttentionArgs, Causal, dropout_threshold, empty_grads, empty_lse, empty_output,
)
from ...ops.attention import grads_like_inputs as grads_contiguous
from . import interpreter_enabled
from ._common import (
    COMPILE_CAPABILITIES,
    TORCH_TO_TRITON_DTYPE,
    CompileTarget,
    KernelConfig,
    KernelLaunch,
    LaunchTemplates,
    cdiv,
    compute_capability,
    input_precision,
    multiple_of_16,
    next_power_of_2,
    run_launches,
)

__all__ = ["unsupported_reason", "empty_saved", "grads_contiguous", "forward", "backward", "compile_targets"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# CUDA caps the second grid dimension; larger batch*heads are launched in chunks.
_MAX_GRID_Y = 65535

LOG2E = tl.constexpr(1.4426950408889634)
FP32_LOWEST = tl.constexpr(-3.4028234663852886e38)
LN2 = tl.constexpr(0.6931471805599453)
NO_CAUSAL = tl.constexpr(int(Causal.NONE))
BOTTOM_RIGHT = tl.constexpr(int(Causal.BOTTOM_RIGHT))


# ---------------------------------------------------------------------------
# Shared tile helpers
# ---------------------------------------------------------------------------


# Strides that are 1 in every launch (the launchers ensure it): Triton
# compiles them as the constant 1, so the loads along them vectorize.
_UNIT_STRIDES = (
    "stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_god", "stride_dqd", "stride_dkd", "stride_dvd",
    "stride_lsem", "stride_kpn", "stride_kbe", "stride_mn", "stride_gsn",
)


def _kernel(fn):
    """``triton.jit`` for a kernel whose compiled variant depends only on its
    constexprs and argument dtypes, never on argument values.

    The launchers guarantee 16-byte aligned q/k/v/out/gradient tensors whose
    strides and head dims are multiples of 16 elements (copying the rare input
    that is not), and the kernels state it (``_aligned_base``, ``multiple_of_16``)
    so their loads vectorize; so no argument is specialized on alignment, and
    none but ``_UNIT_STRIDES`` on being 1 (a head count or length of 1 would
    otherwise compile another variant).  Strides that can pass 2**31 are
    annotated ``tl.int64`` so their type does not depend on their value
    either.  Every launch thus compiles the variant ``compile_targets()``
    checks for its constexprs.  (The targets' head dims fill their blocks: a
    head dim that does not compiles ``EVEN_HEAD_DIM`` off, which adds only
    the column masks of the K and V loads.)
    """
    arguments = [name for name, p in inspect.signature(fn).parameters.items() if "constexpr" not in str(p.annotation)]
    return triton.jit(
        fn,
        do_not_specialize=[name for name in arguments if name not in _UNIT_STRIDES],
        do_not_specialize_on_alignment=arguments,
    )


@triton.jit
def _head_base(ptr, batch, stride_b, head, stride_h):
    # Start of (batch, head) in a [B, H, ...] tensor, in 64-bit offsets.
    return ptr + batch.to(tl.int64) * stride_b + tl.cast(head, tl.int64) * stride_h


@triton.jit
def _aligned_base(ptr, batch, stride_b, head, stride_h):
    # _head_base written out: the hint must sit on the address arithmetic itself.
    # On a call's result (triton 3.6) inlining drops it, and every 16-bit load
    # then goes 2 bytes at a time, too narrow for async copies: no pipelining.
    base = ptr + batch.to(tl.int64) * stride_b + tl.cast(head, tl.int64) * stride_h
    return tl.multiple_of(base, 16)


@triton.jit
def _masked_scores(
    qk, q_idx, k_idx, keep,
    mask_base, stride_mm, stride_mn,
    seq_len_q, causal_shift, qk_scale,
    APPLY_CAUSAL: tl.constexpr, HAS_DENSE_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
):
    # Scores of one tile in base-2 units, -inf where a key is excluded.  The tile
    # may be query-major (forward, dQ) or key-major (dK/dV): `q_idx` and `k_idx`
    # carry the orientation, already shaped to broadcast against `qk`, and
    # `keep` holds the key-side tests (bounds, padding) the caller made.
    s = qk * qk_scale
    if APPLY_CAUSAL:
        keep = keep & (k_idx <= q_idx + causal_shift)
    if HAS_DENSE_MASK:
        mask_tile = tl.load(
            mask_base + q_idx.to(tl.int64) * stride_mm + k_idx * stride_mn,
            mask=keep & (q_idx < seq_len_q),
            other=0,
        )
        if MASK_IS_BOOL:
            keep = keep & (mask_tile != 0)
        else:
            # finfo(float32).min * log2(e) overflows to -inf, which would drop the key; torch keeps
            # every finite mask value finite (a row all finfo.min averages uniformly), so clamp the
            # finite ones to the lowest float32 and let only a real -inf exclude a key.
            bias = mask_tile.to(tl.float32)
            s += tl.where(bias == float("-inf"), bias, tl.maximum(bias * LOG2E, FP32_LOWEST))
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _dropout_seed_and_offset(dropout_seed_ptr, HAS_DROPOUT: tl.constexpr):
    # The (seed, offset) pair the op layer drew on the device, read here rather
    # than passed by value (no host sync; CUDA graph replays draw new pairs),
    # as the 32-bit words Philox takes: the offset is one counter word.
    seed = 0
    offset = 0
    if HAS_DROPOUT:
        seed = tl.load(dropout_seed_ptr).to(tl.int32)
        offset = (tl.load(dropout_seed_ptr + 1) & 0x7FFFFFFF).to(tl.int32)
    return seed, offset


@triton.jit
def _dropout_keep(
    q_idx, key_start, head_batch, dropout_seed, dropout_offset, dropout_threshold,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Query-major keep-mask [BLOCK_Q, BLOCK_K] for queries `q_idx` and keys
    # key_start + arange(BLOCK_K) of one (batch, head).  Philox with counter
    # (key // 8, query, batch*head, offset) yields 4 x 32 random bits: 16 bits
    # for each of 8 consecutive keys, key % 8 choosing the word and its half.
    # Element (i, j) thus depends only on its coordinates, so forward and both
    # backward kernels regenerate the same mask whatever their tile shapes, and
    # a key is kept when its 16 bits are >= threshold = round(p * 2**16).
    # Each element computes its group's Philox itself: gathering 8 keys' bits
    # from one call needs a join + reshape, which triton 3.6 miscompiled on
    # sm_90 for 16-key float32 tiles (masks shuffled against the scores).
    keys = key_start + tl.arange(0, BLOCK_K)
    zero = q_idx[:, None] * 0 + keys[None, :] * 0
    lane = keys[None, :] % 8 + zero
    r0, r1, r2, r3 = tl.philox(
        dropout_seed, keys[None, :] // 8 + zero, q_idx[:, None] + zero, zero + head_batch, zero + dropout_offset
    )
    word = tl.where(lane < 4, tl.where(lane < 2, r0, r1), tl.where(lane < 6, r2, r3))
    bits = tl.where(lane % 2 == 0, word & 0xFFFF, word >> 16)
    return bits >= dropout_threshold


@triton.jit
def _key_range(
    row_start, seq_len_q, seq_len_k, causal_shift,
    key_bounds_ptr, stride_kbb, stride_kbe, batch,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
):
    # Keys that rows [row_start, row_start + BLOCK_M) can see: [lo, hi), split
    # at `full_end`.  [lo, full_end) is whole BLOCK_N blocks of kept keys that
    # every row of the block sees: they need no mask of any kind.  The blocks
    # of [full_end, hi) do: a partial tail, the diagonal, and, where padding
    # sits between kept keys (their count falls short of hi - lo), all of them.
    # Blocks start on any key: K and V rows are 16-element aligned each, and
    # dropout draws each element's bits from its own coordinates.
    lo = 0
    hi = seq_len_k
    holes = False
    if HAS_KEY_PADDING:
        lo = tl.load(key_bounds_ptr + batch * stride_kbb)
        hi = tl.load(key_bounds_ptr + batch * stride_kbb + stride_kbe)
        holes = hi - lo != tl.load(key_bounds_ptr + batch * stride_kbb + 2 * stride_kbe)
    seen_by_all = hi
    if CAUSAL != NO_CAUSAL:
        row_end = tl.minimum(row_start + BLOCK_M, seq_len_q)
        hi = tl.minimum(hi, row_end + causal_shift)
        seen_by_all = tl.minimum(hi, row_start + causal_shift + 1)
    hi = tl.maximum(hi, lo)
    full_end = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    if HAS_KEY_PADDING:
        full_end = tl.where(holes, lo, full_end)
    return lo, full_end, hi


@triton.jit
def _query_block_program(head_batch_start, num_q_heads, group_size, seq_len_q, seq_len_k, CAUSAL: tl.constexpr):
    # (query block, batch*heads index, batch, head, kv head, causal shift) of a program in a
    # (query blocks, batch*heads) grid.  Causal rows near the end do the most
    # work, so their blocks are launched first.
    block_m = tl.program_id(0)
    if CAUSAL != NO_CAUSAL:
        block_m = tl.num_programs(0) - 1 - block_m
    head_batch = tl.program_id(1) + head_batch_start
    batch = head_batch // num_q_heads
    head = head_batch % num_q_heads
    causal_shift = 0
    if CAUSAL == BOTTOM_RIGHT:
        causal_shift = seq_len_k - seq_len_q
    return block_m, head_batch, batch, head, head // group_size, causal_shift


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@triton.jit
def _tile_mask(rows_in, columns_in, MASK_ROWS: tl.constexpr, MASK_COLUMNS: tl.constexpr):
    # The load mask of a K or V tile from the tests that apply (the caller
    # loads without a mask when neither does, so interior blocks carry no
    # predicates).
    if MASK_ROWS and MASK_COLUMNS:
        mask = rows_in & columns_in
    elif MASK_ROWS:
        mask = rows_in
    else:
        mask = columns_in
    return mask


@triton.jit
def _forward_inner(
    acc, l_i, m_i, q, offs_m,
    k_base, v_base, key_padding_base, mask_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kpn, stride_mm, stride_mn,
    offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, causal_shift, qk_scale,
    head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
    key_start, key_end,
    MASKED: tl.constexpr, APPLY_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
    HAS_DENSE_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    EVEN_HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # MASKED off: whole blocks of kept keys that every row sees (see
    # `_key_range`), so no key-side test at all.
    q_idx = offs_m[:, None]
    for start_n in range(key_start, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_in = offs_n < key_end
        k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        if MASKED or not EVEN_HEAD_DIM:
            k_t = tl.load(
                k_ptrs,
                mask=_tile_mask(key_in[None, :], offs_d[:, None] < head_dim, MASKED, not EVEN_HEAD_DIM),
                other=0.0,
            )
        else:
            k_t = tl.load(k_ptrs)
        qk = tl.dot(q, k_t, input_precision=INPUT_PRECISION)
        if MASKED:
            keep = key_in
            if HAS_KEY_PADDING:
                padding = tl.load(key_padding_base + offs_n * stride_kpn, mask=key_in, other=1)
                keep = keep & (padding == 0)
        else:
            keep = tl.full([BLOCK_N], 1, tl.int1)
        s = _masked_scores(
            qk, q_idx, offs_n[None, :], keep[None, :], mask_base, stride_mm, stride_mn,
            seq_len_q, causal_shift, qk_scale, APPLY_CAUSAL, HAS_DENSE_MASK, MASK_IS_BOOL,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED or HAS_DENSE_MASK:
            # A row with no visible key so far keeps m = -inf; shifting by 0 then
            # gives p = exp2(-inf) = 0 instead of exp2(-inf - -inf) = NaN.  Only
            # masks make -inf scores: an unmasked block gives every row a
            # finite maximum.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            kept = _dropout_keep(
                offs_m, start_n, head_batch, dropout_seed, dropout_offset, dropout_threshold, BLOCK_M, BLOCK_N
            )
            p = tl.where(kept, p * dropout_scale, 0.0)
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if MASKED or not EVEN_HEAD_DIM:
            v = tl.load(
                v_ptrs,
                mask=_tile_mask(key_in[:, None], offs_dv[None, :] < head_dim_v, MASKED, not EVEN_HEAD_DIM),
                other=0.0,
            )
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Forward: one program per (query block, batch*head).
#   for each key block [n, n + BLOCK_N) the rows can see (causality and the
#   key bounds prune the range):
#       S   = Q Kᵀ · scale · log2(e)   (+ float mask · log2(e)); excluded → -inf
#       m'  = max(m, rowmax S);  P = exp2(S - m');  l = l · exp2(m - m') + rowsum P
#       acc = acc · exp2(m - m') + dropout(P) V
#   out = acc / l,  lse = (m + log2 l) · ln 2   (rows with l = 0: out 0, lse +inf)
# The loop runs in two stages: first the whole key blocks of kept keys that
# every row sees, without masks, then the blocks at the edges (the tail, the
# padding, the diagonal), with them.
@_kernel
def _attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, key_padding_ptr, key_bounds_ptr, mask_ptr,
    stride_qb: tl.int64, stride_qh: tl.int64, stride_qm, stride_qd,
    stride_kb: tl.int64, stride_kh: tl.int64, stride_kn, stride_kd,
    stride_vb: tl.int64, stride_vh: tl.int64, stride_vn, stride_vd,
    stride_ob: tl.int64, stride_oh: tl.int64, stride_om, stride_od,
    stride_lseb: tl.int64, stride_lseh: tl.int64, stride_lsem,
    stride_kpb: tl.int64, stride_kpn,
    stride_kbb: tl.int64, stride_kbe,
    stride_mb: tl.int64, stride_mh: tl.int64, stride_mm: tl.int64, stride_mn,
    num_q_heads, group_size, seq_len_q, seq_len_k, head_dim, head_dim_v, head_batch_start,
    qk_scale, dropout_seed_ptr, dropout_threshold, dropout_scale,
    CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    dropout_seed, dropout_offset = _dropout_seed_and_offset(dropout_seed_ptr, HAS_DROPOUT)
    block_m, head_batch, batch, head, kv_head, causal_shift = _query_block_program(
        head_batch_start, num_q_heads, group_size, seq_len_q, seq_len_k, CAUSAL
    )

    head_dim = multiple_of_16(head_dim)
    head_dim_v = multiple_of_16(head_dim_v)
    stride_qm = multiple_of_16(stride_qm)
    stride_kn = multiple_of_16(stride_kn)
    stride_vn = multiple_of_16(stride_vn)
    stride_om = multiple_of_16(stride_om)

    row_start = block_m * BLOCK_M
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < seq_len_q

    batch64 = batch.to(tl.int64)
    q_base = _aligned_base(q_ptr, batch, stride_qb, head, stride_qh)
    k_base = _aligned_base(k_ptr, batch, stride_kb, kv_head, stride_kh)
    v_base = _aligned_base(v_ptr, batch, stride_vb, kv_head, stride_vh)
    # An optional tensor whose switch is off arrives as None and stays None.
    key_padding_base = key_padding_ptr
    if HAS_KEY_PADDING:
        key_padding_base = _head_base(key_padding_ptr, batch, stride_kpb, 0, 0)
    mask_base = mask_ptr
    if HAS_DENSE_MASK:
        mask_base = _head_base(mask_ptr, batch, stride_mb, head, stride_mh)

    q = tl.load(
        q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_in[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    key_lo, key_full_end, key_hi = _key_range(
        row_start, seq_len_q, seq_len_k, causal_shift, key_bounds_ptr, stride_kbb, stride_kbe, batch,
        BLOCK_M, BLOCK_N, CAUSAL, HAS_KEY_PADDING,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # Stage 0: whole blocks of kept keys that every row sees, without masks;
    # stage 1: the rest, with the bounds, padding and (causal only) causal tests.
    for stage in tl.static_range(2):
        acc, l_i, m_i = _forward_inner(
            acc, l_i, m_i, q, offs_m, k_base, v_base, key_padding_base, mask_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kpn, stride_mm, stride_mn,
            offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, causal_shift, qk_scale,
            head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
            key_full_end if stage == 1 else key_lo, key_hi if stage == 1 else key_full_end,
            stage == 1, stage == 1 and CAUSAL != NO_CAUSAL, HAS_KEY_PADDING, HAS_DENSE_MASK, MASK_IS_BOOL,
            HAS_DROPOUT, EVEN_HEAD_DIM, BLOCK_M, BLOCK_N, INPUT_PRECISION,
        )

    no_key = l_i == 0.0
    out = acc / tl.where(no_key, 1.0, l_i)[:, None]
    lse = tl.where(no_key, float("inf"), (m_i + tl.math.log2(tl.where(no_key, 1.0, l_i))) * LN2)
    out_base = _aligned_base(out_ptr, batch, stride_ob, head, stride_oh)
    tl.store(
        out_base + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_in[:, None] & (offs_dv[None, :] < head_dim_v),
    )
    lse_base = lse_ptr + batch64 * stride_lseb + head.to(tl.int64) * stride_lseh
    tl.store(lse_base + offs_m * stride_lsem, lse, mask=row_in)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


# Key bounds: one program per batch row scans its padding row, BLOCK_N keys at a
# time, for the first kept key, the last one + 1 and the number of kept keys;
# (0, 0, 0) when all are padding.  The count tells the attention kernels
# whether padding sits between the bounds (see `_key_range`).
@_kernel
def _attention_key_bounds_kernel(
    key_padding_ptr, key_bounds_ptr,
    stride_kpb: tl.int64, stride_kpn, stride_kbb, stride_kbe,
    seq_len_k,
    BLOCK_N: tl.constexpr,
):
    batch = tl.program_id(0)
    row = key_padding_ptr + batch.to(tl.int64) * stride_kpb
    first = seq_len_k
    end = seq_len_k * 0
    count = seq_len_k * 0
    for start in range(0, seq_len_k, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        kept = tl.load(row + offs * stride_kpn, mask=offs < seq_len_k, other=1) == 0
        first = tl.minimum(first, tl.min(tl.where(kept, offs, seq_len_k), 0))
        end = tl.maximum(end, tl.max(tl.where(kept, offs + 1, 0), 0))
        count += tl.sum(kept.to(tl.int32), 0)
    tl.store(key_bounds_ptr + batch * stride_kbb, tl.where(end > 0, first, 0))
    tl.store(key_bounds_ptr + batch * stride_kbb + stride_kbe, end)
    tl.store(key_bounds_ptr + batch * stride_kbb + 2 * stride_kbe, count)


# Backward pre-pass: one program per (query block, batch*head).
#   delta_i = Σ_d dO_id · O_id   (= Σ_j P_ij dP_ij, also with dropout)
# so that dS = P ∘ (dP - delta) needs no second pass over the keys.
@_kernel
def _attention_delta_kernel(
    grad_out_ptr, out_ptr, delta_ptr,
    stride_gob: tl.int64, stride_goh: tl.int64, stride_gom, stride_god,
    stride_ob: tl.int64, stride_oh: tl.int64, stride_om, stride_od,
    num_q_heads, seq_len_q, head_dim_v, head_batch_start,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    head_batch = tl.program_id(1) + head_batch_start
    batch = head_batch // num_q_heads
    head = head_batch % num_q_heads
    head_dim_v = multiple_of_16(head_dim_v)
    stride_gom = multiple_of_16(stride_gom)
    stride_om = multiple_of_16(stride_om)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < seq_len_q) & (offs_dv[None, :] < head_dim_v)
    grad_out = tl.load(
        _aligned_base(grad_out_ptr, batch, stride_gob, head, stride_goh)
        + offs_m[:, None] * stride_gom + offs_dv[None, :] * stride_god,
        mask=mask, other=0.0,
    )
    out = tl.load(
        _aligned_base(out_ptr, batch, stride_ob, head, stride_oh)
        + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
        mask=mask, other=0.0,
    )
    delta = tl.sum(grad_out.to(tl.float32) * out.to(tl.float32), 1)
    tl.store(delta_ptr + head_batch.to(tl.int64) * seq_len_q + offs_m, delta, mask=offs_m < seq_len_q)


@triton.jit
def _grad_key_value_inner(
    dk, dv, k, v, k_idx, key_keep,
    q_base, grad_out_base, lse_base, delta_base, mask_base, grad_scores_base,
    stride_qm, stride_qd, stride_gom, stride_god, stride_mm, stride_mn, stride_gsm, stride_gsn,
    offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, seq_len_k, causal_shift, qk_scale,
    head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
    key_start, row_start, row_end,
    APPLY_CAUSAL: tl.constexpr, HAS_DENSE_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_GRAD_SCORES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    for start_m in range(row_start, row_end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_in = offs_m < row_end
        q_t = tl.load(
            q_base + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd,
            mask=row_in[None, :] & (offs_d[:, None] < head_dim),
            other=0.0,
        )
        # Rows outside the range get lse = +inf, hence P = 0.
        lse = tl.load(lse_base + offs_m, mask=row_in, other=float("inf")) * LOG2E
        qk_t = tl.dot(k, q_t, input_precision=INPUT_PRECISION)
        s_t = _masked_scores(
            qk_t, offs_m[None, :], k_idx, key_keep, mask_base, stride_mm, stride_mn,
            seq_len_q, causal_shift, qk_scale, APPLY_CAUSAL, HAS_DENSE_MASK, MASK_IS_BOOL,
        )
        p_t = tl.math.exp2(s_t - lse[None, :])
        grad_out = tl.load(
            grad_out_base + offs_m[:, None] * stride_gom + offs_dv[None, :] * stride_god,
            mask=row_in[:, None] & (offs_dv[None, :] < head_dim_v),
            other=0.0,
        )
        dp_t = tl.dot(v, tl.trans(grad_out), input_precision=INPUT_PRECISION)
        if HAS_DROPOUT:
            kept_t = tl.trans(_dropout_keep(
                offs_m, key_start, head_batch, dropout_seed, dropout_offset, dropout_threshold, BLOCK_M, BLOCK_N
            ))
            dv += tl.dot(tl.where(kept_t, p_t * dropout_scale, 0.0).to(grad_out.dtype), grad_out,
                         input_precision=INPUT_PRECISION)
            dp_t = tl.where(kept_t, dp_t * dropout_scale, 0.0)
        else:
            dv += tl.dot(p_t.to(grad_out.dtype), grad_out, input_precision=INPUT_PRECISION)
        delta = tl.load(delta_base + offs_m, mask=row_in, other=0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if STORE_GRAD_SCORES:
            tl.store(
                grad_scores_base + offs_m.to(tl.int64)[None, :] * stride_gsm + k_idx * stride_gsn,
                ds_t,
                mask=row_in[None, :] & (k_idx < seq_len_k),
            )
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=INPUT_PRECISION)
    return dk, dv


# dK/dV: one program per (key block, batch*kv head); K and V stay on chip.
#   for each query head h of the kv head's group, for each query block [m, m + BLOCK_M)
#   that can see the key block (causality prunes the start):
#       Sᵀ = K Qᵀ · scale · log2(e) (+ mask);  Pᵀ = exp2(Sᵀ - lse · log2(e))
#       dV += dropout(Pᵀ) dO;  dPᵀ = dropout(V dOᵀ);  dSᵀ = Pᵀ ∘ (dPᵀ - delta)
#       dK += dSᵀ Q        (and dS is stored when the float mask needs its grad)
#   dK *= scale.
# The group's heads are summed inside the program rather than with atomics:
# the result is deterministic, needs no fp32 scratch copy of dK/dV, and the
# grid (key blocks x B*Hk) still fills the GPU at the lengths where it matters.
# Key blocks outside the key bounds skip the loop and write zeros.
@_kernel
def _attention_grad_key_value_kernel(
    q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, grad_scores_ptr,
    key_padding_ptr, key_bounds_ptr, mask_ptr,
    stride_qb: tl.int64, stride_qh: tl.int64, stride_qm, stride_qd,
    stride_kb: tl.int64, stride_kh: tl.int64, stride_kn, stride_kd,
    stride_vb: tl.int64, stride_vh: tl.int64, stride_vn, stride_vd,
    stride_gob: tl.int64, stride_goh: tl.int64, stride_gom, stride_god,
    stride_dkb: tl.int64, stride_dkh: tl.int64, stride_dkn, stride_dkd,
    stride_dvb: tl.int64, stride_dvh: tl.int64, stride_dvn, stride_dvd,
    stride_gsb: tl.int64, stride_gsh: tl.int64, stride_gsm: tl.int64, stride_gsn,
    stride_kpb: tl.int64, stride_kpn,
    stride_kbb: tl.int64, stride_kbe,
    stride_mb: tl.int64, stride_mh: tl.int64, stride_mm: tl.int64, stride_mn,
    num_q_heads, group_size, seq_len_q, seq_len_k, head_dim, head_dim_v, num_kv_heads, head_batch_start,
    scale, qk_scale, dropout_seed_ptr, dropout_threshold, dropout_scale,
    CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_GRAD_SCORES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    dropout_seed, dropout_offset = _dropout_seed_and_offset(dropout_seed_ptr, HAS_DROPOUT)
    kv_head_batch = tl.program_id(1) + head_batch_start
    batch = kv_head_batch // num_kv_heads
    kv_head = kv_head_batch % num_kv_heads
    causal_shift = 0
    if CAUSAL == BOTTOM_RIGHT:
        causal_shift = seq_len_k - seq_len_q

    head_dim = multiple_of_16(head_dim)
    head_dim_v = multiple_of_16(head_dim_v)
    stride_qm = multiple_of_16(stride_qm)
    stride_kn = multiple_of_16(stride_kn)
    stride_vn = multiple_of_16(stride_vn)
    stride_gom = multiple_of_16(stride_gom)
    stride_dkn = multiple_of_16(stride_dkn)
    stride_dvn = multiple_of_16(stride_dvn)

    key_start = tl.program_id(0) * BLOCK_N
    offs_n = key_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_in = offs_n < seq_len_k
    batch64 = batch.to(tl.int64)

    k = tl.load(
        _aligned_base(k_ptr, batch, stride_kb, kv_head, stride_kh)
        + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=key_in[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    v = tl.load(
        _aligned_base(v_ptr, batch, stride_vb, kv_head, stride_vh)
        + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
        mask=key_in[:, None] & (offs_dv[None, :] < head_dim_v),
        other=0.0,
    )

    # Rows that see any key of this block: i + shift >= key_start.  Rows from
    # `row_full` on see all of it, so only [row_lo, row_full) needs the causal test.
    row_lo = 0
    row_full = 0
    key_keep = key_in
    if CAUSAL != NO_CAUSAL:
        row_lo = tl.minimum(tl.maximum(key_start - causal_shift, 0), seq_len_q)
        row_full = tl.minimum(tl.maximum(key_start + BLOCK_N - 1 - causal_shift, row_lo), seq_len_q)
    if HAS_KEY_PADDING:
        padding = tl.load(key_padding_ptr + batch64 * stride_kpb + offs_n * stride_kpn, mask=key_in, other=1)
        key_keep = key_keep & (padding == 0)
        first_key = tl.load(key_bounds_ptr + batch * stride_kbb)
        end_key = tl.load(key_bounds_ptr + batch * stride_kbb + stride_kbe)
        outside_bounds = (key_start >= end_key) | (key_start + BLOCK_N <= first_key)
        row_lo = tl.where(outside_bounds, seq_len_q, row_lo)
        row_full = tl.where(outside_bounds, seq_len_q, row_full)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for group_index in range(0, group_size):
        head = kv_head * group_size + group_index
        head_batch = batch * num_q_heads + head
        q_base = _aligned_base(q_ptr, batch, stride_qb, head, stride_qh)
        grad_out_base = _aligned_base(grad_out_ptr, batch, stride_gob, head, stride_goh)
        lse_base = lse_ptr + head_batch.to(tl.int64) * seq_len_q
        delta_base = delta_ptr + head_batch.to(tl.int64) * seq_len_q
        # An optional tensor whose switch is off arrives as None and stays None.
        mask_base = mask_ptr
        if HAS_DENSE_MASK:
            mask_base = _head_base(mask_ptr, batch, stride_mb, head, stride_mh)
        grad_scores_base = grad_scores_ptr
        if STORE_GRAD_SCORES:
            grad_scores_base = _head_base(grad_scores_ptr, batch, stride_gsb, head, stride_gsh)
        # Stage 0 (causal only): the rows the diagonal crosses, with the causal
        # test; stage 1: the rows that see the whole key block, without it.
        for stage in tl.static_range(0 if CAUSAL != NO_CAUSAL else 1, 2):
            dk, dv = _grad_key_value_inner(
                dk, dv, k, v, offs_n[:, None], key_keep[:, None],
                q_base, grad_out_base, lse_base, delta_base, mask_base, grad_scores_base,
                stride_qm, stride_qd, stride_gom, stride_god, stride_mm, stride_mn, stride_gsm, stride_gsn,
                offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, seq_len_k, causal_shift, qk_scale,
                head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
                key_start, row_lo if stage == 0 else row_full, row_full if stage == 0 else seq_len_q,
                stage == 0, HAS_DENSE_MASK, MASK_IS_BOOL, HAS_DROPOUT, STORE_GRAD_SCORES, BLOCK_M, BLOCK_N,
                INPUT_PRECISION,
            )

    dk *= scale
    tl.store(
        _aligned_base(dk_ptr, batch, stride_dkb, kv_head, stride_dkh)
        + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
        dk.to(dk_ptr.dtype.element_ty),
        mask=key_in[:, None] & (offs_d[None, :] < head_dim),
    )
    tl.store(
        _aligned_base(dv_ptr, batch, stride_dvb, kv_head, stride_dvh)
        + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
        dv.to(dv_ptr.dtype.element_ty),
        mask=key_in[:, None] & (offs_dv[None, :] < head_dim_v),
    )


@triton.jit
def _grad_query_inner(
    dq, q, grad_out, lse, delta, offs_m,
    k_base, v_base, key_padding_base, mask_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kpn, stride_mm, stride_mn,
    offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, causal_shift, qk_scale,
    head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
    key_start, key_end,
    MASKED: tl.constexpr, APPLY_CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
    HAS_DENSE_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    EVEN_HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # MASKED as in `_forward_inner`.
    q_idx = offs_m[:, None]
    for start_n in range(key_start, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_in = offs_n < key_end
        k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd
        if MASKED or not EVEN_HEAD_DIM:
            k_t = tl.load(
                k_ptrs,
                mask=_tile_mask(key_in[None, :], offs_d[:, None] < head_dim, MASKED, not EVEN_HEAD_DIM),
                other=0.0,
            )
            v_t = tl.load(
                v_ptrs,
                mask=_tile_mask(key_in[None, :], offs_dv[:, None] < head_dim_v, MASKED, not EVEN_HEAD_DIM),
                other=0.0,
            )
        else:
            k_t = tl.load(k_ptrs)
            v_t = tl.load(v_ptrs)
        qk = tl.dot(q, k_t, input_precision=INPUT_PRECISION)
        if MASKED:
            keep = key_in
            if HAS_KEY_PADDING:
                padding = tl.load(key_padding_base + offs_n * stride_kpn, mask=key_in, other=1)
                keep = keep & (padding == 0)
        else:
            keep = tl.full([BLOCK_N], 1, tl.int1)
        s = _masked_scores(
            qk, q_idx, offs_n[None, :], keep[None, :], mask_base, stride_mm, stride_mn,
            seq_len_q, causal_shift, qk_scale, APPLY_CAUSAL, HAS_DENSE_MASK, MASK_IS_BOOL,
        )
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(grad_out, v_t, input_precision=INPUT_PRECISION)
        if HAS_DROPOUT:
            kept = _dropout_keep(
                offs_m, start_n, head_batch, dropout_seed, dropout_offset, dropout_threshold, BLOCK_M, BLOCK_N
            )
            dp = tl.where(kept, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=INPUT_PRECISION)
    return dq


# dQ: one program per (query block, batch*head), same key range as forward.
#   for each visible key block:
#       P = exp2(S - lse · log2(e));  dP = dropout(dO Vᵀ);  dS = P ∘ (dP - delta)
#       dQ += dS K
#   dQ *= scale.
@_kernel
def _attention_grad_query_kernel(
    q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, dq_ptr,
    key_padding_ptr, key_bounds_ptr, mask_ptr,
    stride_qb: tl.int64, stride_qh: tl.int64, stride_qm, stride_qd,
    stride_kb: tl.int64, stride_kh: tl.int64, stride_kn, stride_kd,
    stride_vb: tl.int64, stride_vh: tl.int64, stride_vn, stride_vd,
    stride_gob: tl.int64, stride_goh: tl.int64, stride_gom, stride_god,
    stride_dqb: tl.int64, stride_dqh: tl.int64, stride_dqm, stride_dqd,
    stride_kpb: tl.int64, stride_kpn,
    stride_kbb: tl.int64, stride_kbe,
    stride_mb: tl.int64, stride_mh: tl.int64, stride_mm: tl.int64, stride_mn,
    num_q_heads, group_size, seq_len_q, seq_len_k, head_dim, head_dim_v, head_batch_start,
    scale, qk_scale, dropout_seed_ptr, dropout_threshold, dropout_scale,
    CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    dropout_seed, dropout_offset = _dropout_seed_and_offset(dropout_seed_ptr, HAS_DROPOUT)
    block_m, head_batch, batch, head, kv_head, causal_shift = _query_block_program(
        head_batch_start, num_q_heads, group_size, seq_len_q, seq_len_k, CAUSAL
    )

    head_dim = multiple_of_16(head_dim)
    head_dim_v = multiple_of_16(head_dim_v)
    stride_qm = multiple_of_16(stride_qm)
    stride_kn = multiple_of_16(stride_kn)
    stride_vn = multiple_of_16(stride_vn)
    stride_gom = multiple_of_16(stride_gom)
    stride_dqm = multiple_of_16(stride_dqm)

    row_start = block_m * BLOCK_M
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < seq_len_q

    q = tl.load(
        _aligned_base(q_ptr, batch, stride_qb, head, stride_qh)
        + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_in[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    grad_out = tl.load(
        _aligned_base(grad_out_ptr, batch, stride_gob, head, stride_goh)
        + offs_m[:, None] * stride_gom + offs_dv[None, :] * stride_god,
        mask=row_in[:, None] & (offs_dv[None, :] < head_dim_v),
        other=0.0,
    )
    lse = tl.load(lse_ptr + head_batch.to(tl.int64) * seq_len_q + offs_m, mask=row_in, other=float("inf")) * LOG2E
    delta = tl.load(delta_ptr + head_batch.to(tl.int64) * seq_len_q + offs_m, mask=row_in, other=0.0)
    k_base = _aligned_base(k_ptr, batch, stride_kb, kv_head, stride_kh)
    v_base = _aligned_base(v_ptr, batch, stride_vb, kv_head, stride_vh)
    # An optional tensor whose switch is off arrives as None and stays None.
    key_padding_base = key_padding_ptr
    if HAS_KEY_PADDING:
        key_padding_base = _head_base(key_padding_ptr, batch, stride_kpb, 0, 0)
    mask_base = mask_ptr
    if HAS_DENSE_MASK:
        mask_base = _head_base(mask_ptr, batch, stride_mb, head, stride_mh)

    key_lo, key_full_end, key_hi = _key_range(
        row_start, seq_len_q, seq_len_k, causal_shift, key_bounds_ptr, stride_kbb, stride_kbe, batch,
        BLOCK_M, BLOCK_N, CAUSAL, HAS_KEY_PADDING,
    )
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The stages of the forward kernel (whole blocks every row sees, without
    # masks, then the edge blocks, with them) where the interior sheds the
    # padding load or the causal test and no dense mask or dropout holds
    # registers.  Elsewhere it would shed little, and a second loop's
    # registers cost dQ programs per SM: one masked stage takes every block.
    split_keys: tl.constexpr = (CAUSAL != NO_CAUSAL or HAS_KEY_PADDING) and not (HAS_DENSE_MASK or HAS_DROPOUT)
    if not split_keys:
        key_full_end = key_lo
    for stage in tl.static_range(0 if split_keys else 1, 2):
        dq = _grad_query_inner(
            dq, q, grad_out, lse, delta, offs_m, k_base, v_base, key_padding_base, mask_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kpn, stride_mm, stride_mn,
            offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, causal_shift, qk_scale,
            head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
            key_full_end if stage == 1 else key_lo, key_hi if stage == 1 else key_full_end,
            stage == 1, stage == 1 and CAUSAL != NO_CAUSAL, HAS_KEY_PADDING, HAS_DENSE_MASK, MASK_IS_BOOL,
            HAS_DROPOUT, EVEN_HEAD_DIM, BLOCK_M, BLOCK_N, INPUT_PRECISION,
        )
    dq *= scale
    tl.store(
        _aligned_base(dq_ptr, batch, stride_dqb, head, stride_dqh)
        + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
        dq.to(dq_ptr.dtype.element_ty),
        mask=row_in[:, None] & (offs_d[None, :] < head_dim),
    )


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------


# ``block_m`` tiles queries and ``block_n`` keys, whichever of the two the
# kernel's program owns (forward and dQ own a query block, dK/dV a key block).
#
# Keyed by (kernel, head dim bucket): the bucket is max(BLOCK_D, BLOCK_DV)
# rounded up to 64, 128 or 256.  Each entry is compiled for sm_80 and sm_90 by
# tests/test_triton_compile.py (see compile_targets()): it fits in shared
# memory and does not spill (ptxas stack frame 0 as well as no local memory).
#
# FAST: 16-bit inputs without a dense mask or dropout (causal and key padding
# allowed) -- the cases the performance targets are about.  Starting points
# were the Triton flash-attention tutorial's tiles; they were shrunk, or given
# 8 warps, until the causal + key padding variant stayed within 255 registers
# on both architectures.
_FAST_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    ("forward", 128): KernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    ("forward", 256): KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    ("grad_key_value", 64): KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=16, block_n=64, num_warps=8, num_stages=2),
    ("grad_key_value", 256): KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
    ("grad_query", 64): KernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    ("grad_query", 128): KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=2),
    ("grad_query", 256): KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1),
}
# DENSE: FAST inputs with neither causal nor key padding.  Lighter switches
# do not always mean fewer registers: under triton 3.6 the FAST d128 forward
# and dK/dV tiles spill on sm_90 without them, so this table has its own
# entries there.  benchmarks/tune_attention.py on an H100 (triton 3.6) found
# faster tiles for every kernel; of those only the d64 forward compiles
# without spills under both triton versions on both architectures, and most
# others on sm_90 alone (the SM90 table below).
_DENSE_CONFIGS = {
    **_FAST_CONFIGS,
    ("forward", 64): KernelConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    ("forward", 128): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=2),
}
# MASKED: 16-bit inputs with a dense mask (a tile of mask pointers and values)
# or dropout (Philox state); smaller tiles keep them within registers.
_MASKED_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    ("forward", 128): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    ("forward", 256): KernelConfig(block_m=32, block_n=16, num_warps=8, num_stages=1),
    ("grad_key_value", 64): KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=16, block_n=16, num_warps=8, num_stages=2),
    ("grad_key_value", 256): KernelConfig(block_m=16, block_n=16, num_warps=8, num_stages=1),
    ("grad_query", 64): KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),
    ("grad_query", 128): KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=2),
    ("grad_query", 256): KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1),
}
# SHORT: FAST and DENSE inputs whose queries and keys are all at most
# SHORT_MAX_LENGTH long (the seeds' padded batches, 16-64 tokens).  A query
# tile of 128 rows would leave half to seven eighths of every program's rows
# empty there; 64 rows is the smallest tile that still lowers to wgmma on
# sm_90 (a dot's M must be a multiple of 64), and dK/dV at head dim 128 gets
# 64 keys for the same reason.  dK/dV at head dim 64 keeps its FAST tile on
# sm_80, where every 64-key tile tried (16 to 64 queries, 4 or 8 warps)
# spills; sm_90 has its own (the SM90 table's "short" entry).
# Chosen by compiling, not yet timed on a GPU: benchmarks/tune_attention.py
# --short sweeps them.
SHORT_MAX_LENGTH = 64
_SHORT_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("forward", 128): KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("grad_key_value", 128): KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=2),
    ("grad_query", 64): KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("grad_query", 128): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
}
# SM90: Hopper's own tiles, by (table, kernel, head dim bucket), over the
# tables above.  The H100 sweep (benchmarks/tune_attention.py, triton 3.6,
# bf16, B16 L1024 and B8 L2048) found these faster than the shared entries:
# forward d128 by 17%, dQ d64 by 10% and d128 by 29%, dK/dV d128 by 39%.
# They compile without spills on sm_90 under triton 3.6 and 3.9 (dK/dV d128
# without causal or padding only), every dot a wgmma; on sm_80 they spill.
_SM90_CONFIGS: dict[tuple[str, str, int], KernelConfig] = {
    **{(table, "forward", 128): KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=4)
       for table in ("dense", "fast")},
    **{(table, "grad_query", 64): KernelConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
       for table in ("dense", "fast")},
    **{(table, "grad_query", 128): KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
       for table in ("dense", "fast")},
    ("dense", "grad_key_value", 128): KernelConfig(block_m=32, block_n=128, num_warps=8, num_stages=3),
    # dK/dV at head dim 64 (the seeds'), whose shared 32-key tiles are too short for wgmma: the
    # sweep's fastest d64 tile, (16, 128, 4, 4), 35% faster, spills under triton 3.6; its 3-stage
    # twin does not without causal or padding, and with them 8 warps hold it.  Chosen by compiling
    # (0 stack, wgmma, operands 3 deep under triton 3.6 and 3.9), not timed themselves.
    ("dense", "grad_key_value", 64): KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
    ("fast", "grad_key_value", 64): KernelConfig(block_m=16, block_n=128, num_warps=8, num_stages=3),
    # ... and 64 keys for SHORT inputs (an entry "short" is looked up before the SHORT table).
    ("short", "grad_key_value", 64): KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=2),
    # MASKED backward tiles own 64 keys (dK/dV) or 64 queries (dQ), wgmma's smallest M, where the
    # shared ones own 16 or 32; chosen by compiling like the dK/dV d64 ones above.
    **{("masked", "grad_key_value", bucket): KernelConfig(block_m=16, block_n=64, num_warps=8, num_stages=2)
       for bucket in (64, 128)},
    ("masked", "grad_query", 64): KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("masked", "grad_query", 128): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    # Head dim 256: 64 queries for the forward and dQ, where the shared tiles' 16 or 32 rows do not
    # reach wgmma; two stages, which keep K and V in shared memory rather than registers.  (Neither
    # dK/dV at 256 nor the MASKED dQ at 256 has a 64-row tile that does not spill.)
    **{(table, "forward", 256): KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
       for table in ("dense", "fast")},
    ("masked", "forward", 256): KernelConfig(block_m=64, block_n=16, num_warps=8, num_stages=2),
    **{(table, "grad_query", 256): KernelConfig(block_m=64, block_n=16, num_warps=8, num_stages=2)
       for table in ("dense", "fast")},
}
# FLOAT32: tf32x3 dots (three tensor-core products, ~fp32 accuracy) hold a
# high and a low part of every operand, and each warp holds whole rows of the
# loop-invariant operand (Q, or K and V): past head dim 64 no tile shape stays
# within 255 registers, so on the GPU float32 is served up to head dim 64
# (``unsupported_reason``), with small tiles and every switch allowed.
_FLOAT32_CONFIGS: dict[tuple[str, int], KernelConfig] = {
    ("forward", 64): KernelConfig(block_m=32, block_n=16, num_warps=4, num_stages=1),
    ("grad_key_value", 64): KernelConfig(block_m=16, block_n=16, num_warps=8, num_stages=1),
    ("grad_query", 64): KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
}
MAX_FLOAT32_HEAD_DIM_ON_GPU = 64
# Triton before 3.9 (checked with 3.6) allocates registers differently: no
# single dK/dV tile serves head dim 256 under both without spilling, and with
# a dense mask or dropout none does under 3.6 at all (every tile of 16 to 32
# rows, 1 to 16 warps spills), so ``unsupported_reason`` refuses that case.
# Nor does one float32 dQ tile (with dropout's per-element Philox) serve both,
# nor, once 3.6 got the alignment hints that make its loads 16 bytes wide and
# pipelined (``_aligned_base``), the FAST dK/dV tile at head dim 64 and the
# MASKED forward at 256 (checked by tests/test_triton_compile.py).
_OLD_TRITON = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9)
if _OLD_TRITON:
    _FAST_CONFIGS[("grad_key_value", 64)] = KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
    _FAST_CONFIGS[("grad_key_value", 256)] = KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1)
    _DENSE_CONFIGS[("grad_key_value", 256)] = KernelConfig(block_m=16, block_n=32, num_warps=8, num_stages=1)
    _MASKED_CONFIGS[("forward", 256)] = KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=1)
    _FLOAT32_CONFIGS[("grad_query", 64)] = KernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    del _MASKED_CONFIGS[("grad_key_value", 256)]
MAX_MASKED_HEAD_DIM_ON_GPU = 128 if _OLD_TRITON else MAX_HEAD_DIM
# Under TRITON_INTERPRET=1 small, unequal tiles exercise the multi-block and
# diagonal paths at the short lengths the tests can afford.  Triton's jit chose
# interpreted or compiled kernels when this module was imported (the setting is
# read then, not per launch), so the tiles follow that choice; reading the
# environment on every launch cost host time.
_INTERPRETED = interpreter_enabled()
_INTERPRETER_CONFIGS = {
    "forward": KernelConfig(block_m=32, block_n=16, num_warps=1, num_stages=1),
    "grad_key_value": KernelConfig(block_m=16, block_n=32, num_warps=1, num_stages=1),
    "grad_query": KernelConfig(block_m=32, block_n=16, num_warps=1, num_stages=1),
}
# The delta pre-pass has no loop to pipeline: Triton's default stages.
_DELTA_CONFIG = KernelConfig(block_m=32, num_warps=4, num_stages=3)
_KEY_BOUNDS_CONFIG = KernelConfig(block_n=1024, num_warps=4, num_stages=1)


# The tables by mask variant (``_Masks.variant``) for 16-bit inputs.
_CONFIG_TABLES = {"dense": _DENSE_CONFIGS, "fast": _FAST_CONFIGS, "masked": _MASKED_CONFIGS}


def block_config(
    kernel: str, head_dim: int, head_dim_v: int, dtype: torch.dtype, variant: str, max_length: int,
    capability: Optional[int],
) -> KernelConfig:
    """The configuration ``kernel`` ("forward", "grad_key_value" or "grad_query") runs with;
    ``variant``: "dense", "fast" or "masked" (see ``_Masks.variant``); ``max_length``: the longer
    of the query and key lengths; ``capability``: the GPU's (``compute_capability``), None under
    the interpreter."""
    if _INTERPRETED:
        return _INTERPRETER_CONFIGS[kernel]
    bucket = max(64, next_power_of_2(head_dim), next_power_of_2(head_dim_v))
    return _table_config(kernel, bucket, dtype, variant, max_length, capability)


# Bounded: decoding meets a new length on every step.
@functools.lru_cache(maxsize=4096)
def _table_config(
    kernel: str, bucket: int, dtype: torch.dtype, variant: str, max_length: int, capability: Optional[int]
) -> KernelConfig:
    """:func:`block_config` on a GPU, for head dim ``bucket`` (64, 128 or 256)."""
    if dtype == torch.float32:
        return _FLOAT32_CONFIGS[(kernel, bucket)]
    sm90 = capability is not None and capability >= 90
    if variant != "masked" and max_length <= SHORT_MAX_LENGTH:
        if sm90 and ("short", kernel, bucket) in _SM90_CONFIGS:
            return _SM90_CONFIGS[("short", kernel, bucket)]
        if (kernel, bucket) in _SHORT_CONFIGS:
            return _SHORT_CONFIGS[(kernel, bucket)]
    if sm90 and (variant, kernel, bucket) in _SM90_CONFIGS:
        return _SM90_CONFIGS[(variant, kernel, bucket)]
    return _CONFIG_TABLES[variant][(kernel, bucket)]


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> Optional[str]:
    """Why the Triton kernels cannot serve these arguments, or ``None``."""
    if query.dtype not in SUPPORTED_DTYPES:
        return f"the triton backend supports float16, bfloat16 and float32, got {query.dtype}"
    if args.attn_mask is not None and args.attn_mask.dtype not in (torch.bool, query.dtype):
        return (f"the triton backend takes a float attn_mask of the query's dtype ({query.dtype}), "
                f"got {args.attn_mask.dtype}")
    head_dim = max(query.shape[-1], value.shape[-1])
    if head_dim > MAX_HEAD_DIM:
        return f"the triton backend supports head dims up to {MAX_HEAD_DIM}, got {head_dim}"
    if query.dtype == torch.float32 and query.is_cuda and head_dim > MAX_FLOAT32_HEAD_DIM_ON_GPU:
        return (
            f"the triton backend supports float32 on the GPU up to head dim {MAX_FLOAT32_HEAD_DIM_ON_GPU} "
            f"(its float32 kernels would spill registers), got {head_dim}; use float16/bfloat16 or backend='eager'"
        )
    if (args.attn_mask is not None or args.dropout_p > 0.0) and query.is_cuda and head_dim > MAX_MASKED_HEAD_DIM_ON_GPU:
        return (
            f"the triton backend supports a dense attn_mask or dropout on the GPU up to head dim "
            f"{MAX_MASKED_HEAD_DIM_ON_GPU} with triton {triton.__version__} (its dK/dV kernel would spill "
            f"registers; triton >= 3.9 serves up to {MAX_HEAD_DIM}), got {head_dim}; use backend='eager'"
        )
    return None


def _is_aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % 16 == 0 and _aligned_layout(tensor.shape, tensor.stride())


# Bounded: decoding meets a new length on every step.
@functools.lru_cache(maxsize=4096)
def _aligned_layout(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether a tensor of this shape and these strides meets ``_aligned``'s rules, its address
    aside (looked up once per layout: every tensor of every call is checked)."""
    return (
        strides[-1] == 1
        and shape[-1] % 16 == 0
        and all(stride % 16 == 0 for stride, size in zip(strides[:-1], shape[:-1]) if size > 1)
    )


def _one_broadcast_slice(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with each broadcast (stride-0) leading dimension cut to one
    slice: all that a copy of it needs to hold before expanding again."""
    return tensor[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in tensor.stride()[:-1])]


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` [B, H, L, E] as the kernels require it: 16-byte aligned, unit
    stride along E, other strides and E multiples of 16 elements.  Anything
    else (an odd head dim, an odd view) is copied with E zero-padded: zero
    columns change no dot product, and padded output columns are cut off.
    Broadcast (stride-0) dimensions stay broadcast: only one slice along
    them is copied, then expanded again."""
    if _is_aligned(tensor):
        return tensor
    source = _one_broadcast_slice(tensor)
    padded = source.new_zeros((*source.shape[:-1], cdiv(tensor.shape[-1], 16) * 16))
    padded[..., : tensor.shape[-1]] = source
    return padded.expand(*tensor.shape[:-1], padded.shape[-1])


def _unit_last_stride(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A mask with stride 1 along its last dimension, so every launch matches
    a compiled-and-checked variant (Triton turns a stride of 1 into a
    constant).  Broadcast (stride-0) leading dimensions stay broadcast."""
    if tensor is None or tensor.stride(-1) == 1:
        return tensor
    if tensor.shape[-1] == 1:
        return tensor.as_strided(tensor.shape, (*tensor.stride()[:-1], 1))
    return _one_broadcast_slice(tensor).contiguous().expand(tensor.shape)


def _mask_arguments(
    key_padding_mask: Optional[torch.Tensor],
    key_bounds: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
) -> tuple[list, dict]:
    """The strides (in kernel order, from stride_kpb on) and the constexpr
    switches of the optional masks, as ``_Masks.pointers`` holds them; absent
    tensors have zero strides."""
    if key_padding_mask is None:
        padding_strides = (0, 0, 0, 0)  # the mask's and key_bounds'
    else:
        padding_strides = (*key_padding_mask.stride(), *key_bounds.stride())
    strides = [*padding_strides, *(attn_mask.stride() if attn_mask is not None else (0, 0, 0, 0))]
    switches = dict(
        HAS_KEY_PADDING=key_padding_mask is not None,
        HAS_DENSE_MASK=attn_mask is not None,
        MASK_IS_BOOL=attn_mask is not None and attn_mask.dtype == torch.bool,
    )
    return strides, switches


def _dropout_arguments(dropout_p: float, dropout_seed: Optional[torch.Tensor]) -> dict:
    if dropout_p == 0.0:
        return dict(dropout_seed_ptr=None, dropout_threshold=0, dropout_scale=1.0, HAS_DROPOUT=False)
    threshold, scale = dropout_threshold(dropout_p)
    return dict(dropout_seed_ptr=dropout_seed, dropout_threshold=threshold, dropout_scale=scale, HAS_DROPOUT=True)


@functools.lru_cache(maxsize=None)
def _config_arguments(config: KernelConfig, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> dict:
    """The launch keyword arguments that follow from the configuration and the head dims; one
    dict per configuration, shared by its calls, which copy it and never change it."""
    return dict(
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_DV=next_power_of_2(head_dim_v),
        # float32 inputs: three tf32 products recover ~fp32 accuracy on tensor
        # cores (plain tf32 errs near 3e-4, far from torch's float32 math).
        INPUT_PRECISION=input_precision(dtype, allow_tf32=True),
        **config.launch_kwargs(),
    )


def _even_head_dim(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether both head dims fill their power-of-two blocks, so the forward
    and dQ kernels load K and V tiles without a column mask."""
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    return head_dim == next_power_of_2(head_dim) and head_dim_v == next_power_of_2(head_dim_v)


def _chunked_launches(
    kernel, num_blocks: int, num_head_batches: int, config_args: dict, args: tuple, kwargs: dict
) -> list[KernelLaunch]:
    """The launches of ``kernel`` over a (blocks, batch*heads) grid, split
    where batch*heads passes CUDA's grid limit."""
    kwargs = {**kwargs, **config_args}
    if num_head_batches <= _MAX_GRID_Y:  # one launch, nearly always
        return [KernelLaunch(kernel, (num_blocks, num_head_batches), args, dict(kwargs, head_batch_start=0))]
    return [
        KernelLaunch(
            kernel,
            (num_blocks, min(_MAX_GRID_Y, num_head_batches - start)),
            args,
            dict(kwargs, head_batch_start=start),
        )
        for start in range(0, num_head_batches, _MAX_GRID_Y)
    ]


class _Masks:
    """A call's :class:`AttentionArgs` and the kernel arguments built from them;
    ``key_bounds`` ``[B, 3]`` int32 with a key padding mask, which
    :func:`_key_bounds_launches` fills: the ``[B, 2]`` of
    :func:`~transformer_kernels.ops.attention.key_padding_bounds` (which the
    other backends plan with) and a column counting the kept keys;
    ``capability``: the GPU's the launches are for (``compute_capability``),
    which picks the tiles.

    Worked out once per call, shared by its launches:

    - ``pointers``: the masks' tensors in kernel order (key padding, key
      bounds, attn_mask; None where absent), each with stride 1 along its last
      dimension (a mask without is copied once, and the backward's kernels
      share the copy);
    - ``layout``: what the launches take from the masks besides their
      tensors' addresses, hashable: part of every launch template's key;
    - ``call_kwargs``: the keyword arguments that change from call to call
      (dropout's (seed, offset) tensor).
    """

    __slots__ = ("args", "key_bounds", "capability", "pointers", "layout", "call_kwargs")

    def __init__(self, args: AttentionArgs, key_bounds: Optional[torch.Tensor], capability: Optional[int]) -> None:
        if (args.key_padding_mask is None) != (key_bounds is None):
            raise ValueError("key_bounds must accompany key_padding_mask, and only it")
        self.args, self.key_bounds, self.capability = args, key_bounds, capability
        padding, attn_mask = _unit_last_stride(args.key_padding_mask), _unit_last_stride(args.attn_mask)
        self.pointers = (padding, key_bounds, attn_mask)
        self.layout = (
            None if padding is None else (padding.stride(), key_bounds.stride()),
            None if attn_mask is None else (attn_mask.stride(), attn_mask.dtype),
            args.causal, args.scale, args.dropout_p, capability,
        )
        self.call_kwargs = {} if args.dropout_p == 0.0 else {"dropout_seed_ptr": args.dropout_seed}

    @classmethod
    def of(cls, args: AttentionArgs, device: torch.device) -> "_Masks":
        padding = args.key_padding_mask
        key_bounds = None if padding is None else padding.new_empty((padding.shape[0], 3), dtype=torch.int32)
        return cls(args, key_bounds, compute_capability(device))

    def arguments(self) -> tuple[list, dict]:
        """(mask strides, the scalar and constexpr keyword arguments that
        forward, dK/dV and dQ share), for building a launch template."""
        args = self.args
        strides, switches = _mask_arguments(*self.pointers)
        dropout = _dropout_arguments(args.dropout_p, args.dropout_seed)
        kwargs = dict(qk_scale=args.scale * math.log2(math.e), **dropout, CAUSAL=int(args.causal), **switches)
        return strides, kwargs

    @property
    def variant(self) -> str:
        """Which configuration table serves these masks: "masked" (a dense mask
        or dropout), "fast" (causal or key padding) or "dense" (none)."""
        args = self.args
        if args.attn_mask is not None or args.dropout_p > 0.0:
            return "masked"
        if args.causal != Causal.NONE or args.key_padding_mask is not None:
            return "fast"
        return "dense"


_KERNELS = {
    "forward": _attention_forward_kernel,
    "grad_key_value": _attention_grad_key_value_kernel,
    "grad_query": _attention_grad_query_kernel,
}

# The kernels that load K and V tiles without a column mask where the head dims allow it.
_EVEN_HEAD_DIM_KERNELS = ("forward", "grad_query")
# Every launch of this backend, by layout (see ``LaunchTemplates``).
_TEMPLATES = LaunchTemplates()


def _masked_kernel_launches(
    kernel_name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masks: _Masks,
    pointers: tuple, strides: tuple[int, ...], *extra_args, **extra_kwargs,
) -> list[KernelLaunch]:
    """Launches of the forward, dK/dV or dQ kernel, whose arguments run:
    ``pointers``, the masks' pointers, ``strides`` (every stride of each tensor
    in turn), the masks' strides, the problem's sizes, ``extra_args``;
    then the shared scalars and switches (``EVEN_HEAD_DIM`` for the kernels of
    ``_EVEN_HEAD_DIM_KERNELS``) and ``extra_kwargs`` by name.
    ``query``/``key``/``value`` as ``_aligned`` returns them.  Built once per
    layout: the sizes, strides, dtype, masks, ``extra_*`` and the tile
    configuration are its key (the configuration is looked up on every call,
    so a table or ``block_config`` changed at run time, as the tile sweep
    does, takes effect)."""
    batch, num_q_heads, seq_len_q, head_dim = query.shape
    num_kv_heads, seq_len_k, head_dim_v = key.shape[1], key.shape[2], value.shape[3]
    config = block_config(
        kernel_name, head_dim, head_dim_v, query.dtype, masks.variant, max(seq_len_q, seq_len_k), masks.capability
    )
    layout = (
        kernel_name, query.shape, key.shape, value.shape, query.dtype, strides, masks.layout, config,
        extra_args, *extra_kwargs.values(),
    )

    def build() -> list[KernelLaunch]:
        mask_strides, kwargs = masks.arguments()
        if kernel_name in _EVEN_HEAD_DIM_KERNELS:
            kwargs["EVEN_HEAD_DIM"] = _even_head_dim(query, value)
        if kernel_name == "grad_key_value":  # a program per key block of a kv head
            num_blocks, num_head_batches = cdiv(seq_len_k, config.block_n), batch * num_kv_heads
        else:  # a program per query block of a query head
            num_blocks, num_head_batches = cdiv(seq_len_q, config.block_m), batch * num_q_heads
        return _chunked_launches(
            _KERNELS[kernel_name],
            num_blocks,
            num_head_batches,
            _config_arguments(config, query.dtype, head_dim, head_dim_v),
            (
                *pointers, *masks.pointers, *strides, *mask_strides,
                num_q_heads, num_q_heads // num_kv_heads, seq_len_q, seq_len_k, head_dim, head_dim_v,
                *extra_args,
            ),
            {**kwargs, **extra_kwargs},
        )

    return _TEMPLATES.launches(layout, (*pointers, *masks.pointers), build, **masks.call_kwargs)


def _forward_launches(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, masks: _Masks
) -> list[KernelLaunch]:
    """Launches of the forward kernel; ``out`` as ``_aligned`` returns it,
    ``lse`` ``[B, Hq, Lq]`` float32."""
    return _masked_kernel_launches(
        "forward", query, key, value, masks,
        [query, key, value, out, lse],
        (*query.stride(), *key.stride(), *value.stride(), *out.stride(), *lse.stride()),
    )


def _key_bounds_launches(masks: _Masks) -> list[KernelLaunch]:
    """The launch filling ``masks.key_bounds``; none without key padding."""
    padding, bounds, _ = masks.pointers
    if padding is None:
        return []

    def build() -> list[KernelLaunch]:
        return [KernelLaunch(
            _attention_key_bounds_kernel,
            (padding.shape[0],),
            (padding, bounds, *padding.stride(), *bounds.stride(), padding.shape[1]),
            dict(_KEY_BOUNDS_CONFIG.launch_kwargs()),
        )]

    layout = ("key_bounds", padding.shape, padding.stride(), bounds.stride())
    return _TEMPLATES.launches(layout, (padding, bounds), build)


@functools.lru_cache(maxsize=None)
def _delta_config_arguments(head_dim_v: int) -> dict:
    """The delta kernel's launch keyword arguments for a head dim, shared like ``_config_arguments``'s."""
    return dict(BLOCK_DV=next_power_of_2(head_dim_v), **_DELTA_CONFIG.launch_kwargs())


def _delta_launches(grad_out: torch.Tensor, out: torch.Tensor, delta: torch.Tensor) -> list[KernelLaunch]:
    """Launches of the backward pre-pass writing ``delta`` ``[B, Hq, Lq]``."""
    batch, num_q_heads, seq_len_q, head_dim_v = out.shape

    def build() -> list[KernelLaunch]:
        return _chunked_launches(
            _attention_delta_kernel,
            cdiv(seq_len_q, _DELTA_CONFIG.block_m),
            batch * num_q_heads,
            _delta_config_arguments(head_dim_v),
            (grad_out, out, delta, *grad_out.stride(), *out.stride(), num_q_heads, seq_len_q, head_dim_v),
            {},
        )

    layout = ("delta", out.shape, grad_out.stride(), out.stride())
    return _TEMPLATES.launches(layout, (grad_out, out, delta), build)


def _grad_key_value_launches(
    query, key, value, grad_out, lse, delta, dk, dv, grad_scores: Optional[torch.Tensor], masks: _Masks
) -> list[KernelLaunch]:
    """Launches of the dK/dV kernel; ``grad_scores`` ``[B, Hq, Lq, Lk]``
    float32 receives dS when given (its strides are zeros otherwise)."""
    scores_strides = grad_scores.stride() if grad_scores is not None else (0, 0, 0, 0)
    return _masked_kernel_launches(
        "grad_key_value", query, key, value, masks,
        [query, key, value, grad_out, lse, delta, dk, dv, grad_scores],
        (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
         *scores_strides),
        key.shape[1],
        scale=masks.args.scale, STORE_GRAD_SCORES=grad_scores is not None,
    )


def _grad_query_launches(query, key, value, grad_out, lse, delta, dq, masks: _Masks) -> list[KernelLaunch]:
    """Launches of the dQ kernel."""
    return _masked_kernel_launches(
        "grad_query", query, key, value, masks,
        [query, key, value, grad_out, lse, delta, dq],
        (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *dq.stride()),
        scale=masks.args.scale,
    )


def _into(target: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``target`` holding ``result``, which a kernel wrote with its last dim possibly zero-padded
    (see ``_aligned``): ``result`` itself when it is ``target``."""
    return target if result is target else target.copy_(result[..., : target.shape[-1]])


def _writable(target: torch.Tensor, width: int) -> torch.Tensor:
    """What a kernel writes for ``target``, whose input ``_aligned`` gave head dim ``width``:
    ``target`` itself when it has that width and is aligned, else a contiguous buffer."""
    if target.shape[-1] == width and _is_aligned(target):
        return target
    return target.new_empty((*target.shape[:-1], width))


def empty_saved(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool):
    """The forward keeps the row log-sum-exps for the backward pass, whether or not one runs."""
    return empty_lse(query)


def forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: AttentionArgs, needs_backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward: ``out`` and ``lse`` (+inf on rows that see no key) in the layouts
    of :func:`~transformer_kernels.ops.attention.empty_output` and ``empty_lse``."""
    out, lse = empty_output(query, value), empty_lse(query)
    query, key, value = _aligned(query), _aligned(key), _aligned(value)
    padded_out = _writable(out, value.shape[-1])
    masks = _Masks.of(args, query.device)
    run_launches([*_key_bounds_launches(masks), *_forward_launches(query, key, value, padded_out, lse, masks)], query)
    return _into(out, padded_out), lse


def backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    args: AttentionArgs,
    attn_mask_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward: ``dq, dk, dv`` in the layouts of
    :func:`~transformer_kernels.ops.attention.empty_grads` (GQA heads summed into their kv head)
    and ``dmask``, the float32 ``[B, Hq, Lq, Lk]`` gradient of the scaled, masked scores when
    ``attn_mask_needs_grad`` (else an empty tensor)."""
    grads = empty_grads(query, key, value)
    grad_out, query, key, value, out = (_aligned(t) for t in (grad_out, query, key, value, out))
    dq, dk, dv = (_writable(grad, aligned.shape[-1]) for grad, aligned in zip(grads, (query, key, value)))
    batch, num_q_heads, seq_len_q, _ = query.shape
    delta = torch.empty_like(lse)
    grad_scores = None
    if attn_mask_needs_grad:
        # Entries the kernels skip (above the diagonal, padded key blocks) have dS = 0.
        grad_scores = query.new_zeros((batch, num_q_heads, seq_len_q, key.shape[2]), dtype=torch.float32)
    masks = _Masks.of(args, query.device)
    run_launches(
        [
            *_key_bounds_launches(masks),
            *_delta_launches(grad_out, out, delta),
            *_grad_key_value_launches(query, key, value, grad_out, lse, delta, dk, dv, grad_scores, masks),
            *_grad_query_launches(query, key, value, grad_out, lse, delta, dq, masks),
        ],
        query,
    )
    if grad_scores is None:
        grad_scores = query.new_empty(0, dtype=torch.float32)
    return (*(_into(grad, result) for grad, result in zip(grads, (dq, dk, dv))), grad_scores)


# ---------------------------------------------------------------------------
# Compile targets
# ---------------------------------------------------------------------------

# The representative problem compiled for every target: grouped-query heads,
# lengths and head dims that are multiples of the tiles.  The kernels
# specialize on no argument value (see ``_kernel``), so the shape matters only
# through the table entry it selects.
_TARGET_BATCH, _TARGET_HEADS, _TARGET_KV_HEADS, _TARGET_LENGTH = 2, 4, 2, 256


# Representative switches per compile target: which of causal (bottom-right),
# key padding and "all" (also a float mask whose gradient is stored, and
# dropout) are on.
_TARGET_VARIANTS = {
    "dense": (False, False, False),
    "causal_padding": (True, True, False),
    "all_masks": (True, True, True),
}


def _target_launch(
    kernel_name: str, head_dim: int, dtype: torch.dtype, variant: str, length: int, capability: Optional[int]
) -> KernelLaunch:
    """The launch the backend makes on a GPU of compute ``capability`` for the
    representative problem with the switches of ``variant`` (a key of
    ``_TARGET_VARIANTS``), sequences ``length`` long."""
    causal, padded, all_masks = _TARGET_VARIANTS[variant]
    batch, heads, kv_heads = _TARGET_BATCH, _TARGET_HEADS, _TARGET_KV_HEADS
    query, grad_out, out, dq = (torch.empty(batch, heads, length, head_dim, dtype=dtype) for _ in range(4))
    key, value, dk, dv = (torch.empty(batch, kv_heads, length, head_dim, dtype=dtype) for _ in range(4))
    lse, delta = (torch.empty(batch, heads, length) for _ in range(2))
    key_padding_mask = key_bounds = attn_mask = grad_scores = None
    if padded:
        key_padding_mask = torch.zeros(batch, length, dtype=torch.bool)
        key_bounds = torch.tensor([[0, length, length]] * batch, dtype=torch.int32)
    dropout_p, dropout_seed = 0.0, None
    if all_masks:
        attn_mask = torch.empty(batch, 1, length, length, dtype=dtype).expand(batch, heads, length, length)
        grad_scores = torch.empty(batch, heads, length, length)
        dropout_p, dropout_seed = 0.1, torch.tensor([1234567, 89], dtype=torch.int64)
    masks = _Masks(
        AttentionArgs(
            key_padding_mask, attn_mask, Causal.BOTTOM_RIGHT if causal else Causal.NONE, head_dim**-0.5,
            dropout_p, dropout_seed,
        ),
        key_bounds,
        capability,
    )
    if kernel_name == "forward":
        launches = _forward_launches(query, key, value, out, lse, masks)
    elif kernel_name == "grad_key_value":
        launches = _grad_key_value_launches(query, key, value, grad_out, lse, delta, dk, dv, grad_scores, masks)
    elif kernel_name == "grad_query":
        launches = _grad_query_launches(query, key, value, grad_out, lse, delta, dq, masks)
    elif kernel_name == "key_bounds":
        launches = _key_bounds_launches(masks)
    else:
        launches = _delta_launches(grad_out, out, delta)
    return launches[0]


# Which problems the compile targets stand for, each with the heaviest
# switches its table can be chosen with (lighter switches only remove code):
# (table variant, dtype, target switches, length, name suffix).  DENSE and
# FAST/SHORT compile in bfloat16, MASKED in float16, so both 16-bit types are
# covered.
_TARGET_PROBLEMS = (
    ("dense", torch.bfloat16, "dense", _TARGET_LENGTH, ""),
    ("fast", torch.bfloat16, "causal_padding", _TARGET_LENGTH, ""),
    ("fast", torch.bfloat16, "causal_padding", SHORT_MAX_LENGTH, "_short"),
    ("masked", torch.float16, "all_masks", _TARGET_LENGTH, ""),
    ("masked", torch.float32, "all_masks", _TARGET_LENGTH, ""),
)


def compile_targets() -> list[CompileTarget]:
    """Every configuration the dispatcher can choose, on each architecture the
    one ``block_config`` picks there (``_table_config``): DENSE configs with no switch, FAST and
    SHORT ones with bottom-right causal and key padding, MASKED and FLOAT32
    ones with every switch on (bottom-right causal, key padding, float mask,
    dropout, dS store).  A SHORT target only where the SHORT table, or the SM90 table's "short"
    entries, have one."""
    targets = []
    kernels_and_buckets = list(itertools.product(("forward", "grad_key_value", "grad_query"), (64, 128, 256)))
    for (variant, dtype, switches, length, suffix), (kernel_name, bucket) in itertools.product(
        _TARGET_PROBLEMS, kernels_and_buckets
    ):
        if suffix:
            if (kernel_name, bucket) not in _SHORT_CONFIGS and ("short", kernel_name, bucket) not in _SM90_CONFIGS:
                continue
        elif (kernel_name, bucket) not in (_FLOAT32_CONFIGS if dtype == torch.float32 else _CONFIG_TABLES[variant]):
            continue
        by_config: dict[KernelConfig, list[int]] = {}
        for capability in COMPILE_CAPABILITIES:
            config = _table_config(kernel_name, bucket, dtype, variant, length, capability)
            by_config.setdefault(config, []).append(capability)
        name = f"attention_{kernel_name}_{TORCH_TO_TRITON_DTYPE[dtype]}_d{bucket}_{switches}{suffix}"
        for capabilities in by_config.values():
            launch = functools.partial(_target_launch, kernel_name, bucket, dtype, switches, length, capabilities[0])
            targets.append(CompileTarget(name, launch, tuple(capabilities)))
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.float16, 256)):
        targets.append(CompileTarget(
            f"attention_delta_{TORCH_TO_TRITON_DTYPE[dtype]}_d{head_dim}",
            functools.partial(_target_launch, "delta", head_dim, dtype, "dense", _TARGET_LENGTH, None),
        ))
    targets.append(CompileTarget(
        "attention_key_bounds",
        functools.partial(_target_launch, "key_bounds", 64, torch.float16, "causal_padding", _TARGET_LENGTH, None),
    ))
    return targets
