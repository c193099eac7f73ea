"""Triton kernels of the attention backend: flash-style forward and backward with in-kernel
masking and dropout (their launchers, tile configurations and compile targets are in
:mod:`.attention`).

The kernels take query ``[B, Hq, Lq, D]``, key ``[B, Hk, Lk, D]`` and value ``[B, Hk, Lk, Dv]``
with any strides, ``Hq % Hk == 0`` (grouped-query attention: query head ``h`` reads kv head
``h // (Hq // Hk)``).  Every mask kind is a constexpr switch of one kernel family:

* ``CAUSAL``: a :class:`~transformer_kernels.ops.attention.Causal`: none,
  top-left (query ``i`` sees keys ``j <= i``) or bottom-right
  (``j <= i + Lk - Lq``).  Key blocks wholly above the diagonal
  are never visited; only the blocks the diagonal crosses pay for the mask.
* ``HAS_KEY_PADDING``: bool ``[B, Lk]`` (True = padding) read one key block at
  a time; with ``KEY_BOUNDS``, ``key_bounds`` ``[B, 3]`` int32 (first kept key,
  last kept key + 1, number of kept keys) lets the kernels skip whole key blocks
  of padding, and where the kept keys are contiguous, read no padding inside
  them.  A small kernel finds the bounds first (one launch, where torch ops
  would take a dozen).  Keys too short for that to pay (a block or two) go
  without: every key block is masked and reads its padding, and dK/dV skips a
  block whose keys are all padding.
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
dQ splits the same way where the launcher asks (``SPLIT_KEYS``: without a
dense mask or dropout, and without any mask only where the second loop costs
no program per SM).  dK/dV is not split so: it loads its key-side
masks once, outside its loop, and unmasking its loop's query rows would take
a third copy of the body of the kernel that is closest to spilling.

The kernels assume 16-byte aligned tensors whose head dims and strides are
multiples of 16 elements (the launchers copy the rare input that is not), and
say so (``_aligned_base``, ``multiple_of_16``) so that their loads vectorize.

Scores are kept in base-2 units (``qk_scale = scale * log2(e)``) so the
softmax uses ``exp2``.  The forward without a dense mask never materializes
them: it takes each row's maximum of ``Q Kᵀ`` and scales that, which needs
``scale > 0`` (the launcher runs other scales on a negated or zeroed query), and
``exp2(qk · qk_scale - m)`` is one FMA per score; the backward folds its lse
shift into that FMA the same way.  Rows where every key is excluded get output 0 and
``lse = +inf``, which makes every probability in backward exactly 0: such rows
never produce NaN and have zero gradient.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from ...ops.attention import Causal
from ._common import as_float32, multiple_of_16

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
def _mask_tile(mask_base, q_idx, k_idx, keep, stride_mm, stride_mn, seq_len_q):
    # The dense mask's tile, read where `keep` and the row are in range.
    return tl.load(mask_base + q_idx.to(tl.int64) * stride_mm + k_idx * stride_mn,
                   mask=keep & (q_idx < seq_len_q), other=0)


@triton.jit
def _kept(
    q_idx, k_idx, keep, mask_base, stride_mm, stride_mn, seq_len_q, causal_shift,
    APPLY_CAUSAL: tl.constexpr, HAS_BOOL_MASK: tl.constexpr,
):
    # Which scores of one tile take part: `keep` (the key-side tests, bounds and
    # padding, the caller made), the causal test and a bool mask's.  The tile may
    # be query-major (forward, dQ) or key-major (dK/dV): `q_idx` and `k_idx` carry
    # the orientation, already shaped to broadcast against the scores.
    if APPLY_CAUSAL:
        keep = keep & (k_idx <= q_idx + causal_shift)
    if HAS_BOOL_MASK:
        keep = keep & (_mask_tile(mask_base, q_idx, k_idx, keep, stride_mm, stride_mn, seq_len_q) != 0)
    return keep


@triton.jit
def _masked_scores(
    qk, q_idx, k_idx, keep,
    mask_base, stride_mm, stride_mn,
    seq_len_q, causal_shift, qk_scale, shift,
    APPLY_CAUSAL: tl.constexpr, HAS_DENSE_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
):
    # Scores of one tile in base-2 units less `shift` (0, or the backward's
    # per-row lse: the scaling and the shift fuse into one FMA per score), -inf
    # where a key is excluded (see `_kept` for the arguments).
    keep = _kept(
        q_idx, k_idx, keep, mask_base, stride_mm, stride_mn, seq_len_q, causal_shift,
        APPLY_CAUSAL, HAS_DENSE_MASK and MASK_IS_BOOL,
    )
    if HAS_DENSE_MASK and not MASK_IS_BOOL:
        # finfo(float32).min * log2(e) overflows to -inf, which would drop the key; torch keeps
        # every finite mask value finite (a row all finfo.min averages uniformly), so clamp the
        # finite ones to the lowest float32 and let only a real -inf exclude a key.  (Shifted
        # last: shifting before the mask is added holds one more register, which spills the
        # d128 dK/dV kernel with every mask under triton 3.9.)
        bias = _mask_tile(mask_base, q_idx, k_idx, keep, stride_mm, stride_mn, seq_len_q).to(tl.float32)
        s = qk * qk_scale + tl.where(bias == float("-inf"), bias, tl.maximum(bias * LOG2E, FP32_LOWEST))
        return tl.where(keep, s, float("-inf")) - shift
    return tl.where(keep, qk * qk_scale - shift, float("-inf"))


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
    KEY_BOUNDS: tl.constexpr,
):
    # Keys that rows [row_start, row_start + BLOCK_M) can see: [lo, hi), split
    # at `full_end`, and whether padding sits between the kept keys (`holes`:
    # their count falls short of hi - lo).  [lo, full_end) is whole BLOCK_N
    # blocks of kept keys that every row of the block sees: they need no mask of
    # any kind.  The blocks of [full_end, hi) do: a partial tail, the diagonal,
    # and, with holes, all of them.  Without holes every key in [lo, hi) is
    # kept, so the masked blocks need not read the padding.  Key padding
    # without bounds counts as holes everywhere.
    # Blocks start on any key: K and V rows are 16-element aligned each, and
    # dropout draws each element's bits from its own coordinates.
    lo = 0
    hi = seq_len_k
    holes = False
    if HAS_KEY_PADDING:
        if KEY_BOUNDS:
            lo = tl.load(key_bounds_ptr + batch * stride_kbb)
            hi = tl.load(key_bounds_ptr + batch * stride_kbb + stride_kbe)
            holes = hi - lo != tl.load(key_bounds_ptr + batch * stride_kbb + 2 * stride_kbe)
        else:
            holes = True
    seen_by_all = hi
    if CAUSAL != NO_CAUSAL:
        row_end = tl.minimum(row_start + BLOCK_M, seq_len_q)
        hi = tl.minimum(hi, row_end + causal_shift)
        seen_by_all = tl.minimum(hi, row_start + causal_shift + 1)
    hi = tl.maximum(hi, lo)
    full_end = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    if HAS_KEY_PADDING:
        full_end = tl.where(holes, lo, full_end)
    return lo, full_end, hi, holes


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
def _load_tile(ptrs, rows_in, columns_in, MASK_ROWS: tl.constexpr, MASK_COLUMNS: tl.constexpr):
    # A K or V tile, zero outside the rows and columns whose tests apply; with
    # neither, a load without a mask, so interior blocks carry no predicates.
    if MASK_ROWS and MASK_COLUMNS:
        tile = tl.load(ptrs, mask=rows_in & columns_in, other=0.0)
    elif MASK_ROWS:
        tile = tl.load(ptrs, mask=rows_in, other=0.0)
    elif MASK_COLUMNS:
        tile = tl.load(ptrs, mask=columns_in, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _key_keep(
    offs_n, key_in, key_padding_base, stride_kpn, holes,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
):
    # The key-side tests of one key block: none in a MASKED-off block (whole
    # kept keys, see `_key_range`); else the bounds and, only with holes, the
    # padding (a load predicated off costs no memory access, and keys outside
    # [lo, hi) already fail key_in).
    if MASKED:
        keep = key_in
        if HAS_KEY_PADDING:
            padding = tl.load(
                key_padding_base + offs_n * stride_kpn, mask=tl.where(holes, key_in, False), other=0
            )
            keep = keep & (padding == 0)
    else:
        keep = tl.full([BLOCK_N], 1, tl.int1)
    return keep


@triton.jit
def _forward_inner(
    acc, l_i, m_i, q, offs_m,
    k_base, v_base, key_padding_base, mask_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kpn, stride_mm, stride_mn,
    offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, causal_shift, qk_scale,
    head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
    key_start, key_end, holes,
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
        k_t = _load_tile(k_ptrs, key_in[None, :], offs_d[:, None] < head_dim, MASKED, not EVEN_HEAD_DIM)
        qk = tl.dot(q, k_t, input_precision=INPUT_PRECISION)
        keep = _key_keep(offs_n, key_in, key_padding_base, stride_kpn, holes, BLOCK_N, MASKED, HAS_KEY_PADDING)
        if HAS_DENSE_MASK:
            s = _masked_scores(
                qk, q_idx, offs_n[None, :], keep[None, :], mask_base, stride_mm, stride_mn,
                seq_len_q, causal_shift, qk_scale, 0.0, APPLY_CAUSAL, HAS_DENSE_MASK, MASK_IS_BOOL,
            )
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key so far keeps m = -inf; shifting by 0 then
            # gives p = exp2(-inf) = 0 instead of exp2(-inf - -inf) = NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_shift[:, None])
        else:
            # Without a dense mask the scaled scores are never materialized: with
            # qk_scale > 0 (the launcher makes it so) the row maximum of the scaled
            # scores is the scaled row maximum, an excluded -inf stays -inf when
            # scaled, and the scaling fuses with the shift into one FMA per score.
            if MASKED:
                kept = _kept(
                    q_idx, offs_n[None, :], keep[None, :], mask_base, stride_mm, stride_mn, seq_len_q,
                    causal_shift, APPLY_CAUSAL, False,
                )
                qk = tl.where(kept, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if MASKED:
                # As above; only masks make -inf scores: an unmasked block gives
                # every row a finite maximum.
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_shift = m_new
            p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            kept = _dropout_keep(
                offs_m, start_n, head_batch, dropout_seed, dropout_offset, dropout_threshold, BLOCK_M, BLOCK_N
            )
            p = tl.where(kept, p * dropout_scale, 0.0)
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        v = _load_tile(v_ptrs, key_in[:, None], offs_dv[None, :] < head_dim_v, MASKED, not EVEN_HEAD_DIM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Forward: one program per (query block, batch*head).
#   for each key block [n, n + BLOCK_N) the rows can see (causality and the
#   key bounds prune the range):
#       S   = Q Kᵀ · scale · log2(e)   (+ float mask · log2(e)); excluded → -inf
#       m'  = max(m, rowmax S);  P = exp2(S - m');  l = l · exp2(m - m') + rowsum P
#       acc = acc · exp2(m - m') + dropout(P) V
#   out = acc · (1 / l),  lse = (m + log2 l) · ln 2   (rows with l = 0: out 0, lse +inf)
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
    CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, KEY_BOUNDS: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    qk_scale, dropout_scale = as_float32(qk_scale), as_float32(dropout_scale)
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
    key_lo, key_full_end, key_hi, holes = _key_range(
        row_start, seq_len_q, seq_len_k, causal_shift, key_bounds_ptr, stride_kbb, stride_kbe, batch,
        BLOCK_M, BLOCK_N, CAUSAL, HAS_KEY_PADDING, KEY_BOUNDS,
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
            key_full_end if stage == 1 else key_lo, key_hi if stage == 1 else key_full_end, holes,
            stage == 1, stage == 1 and CAUSAL != NO_CAUSAL, HAS_KEY_PADDING, HAS_DENSE_MASK, MASK_IS_BOOL,
            HAS_DROPOUT, EVEN_HEAD_DIM, BLOCK_M, BLOCK_N, INPUT_PRECISION,
        )

    no_key = l_i == 0.0
    # A reciprocal per row and a multiply per element: a division per element takes several
    # instructions (the seeds' one-block program, d64 on sm_90: 1656 -> 1568 in all).
    out = acc * (1.0 / tl.where(no_key, 1.0, l_i))[:, None]
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
    INPUT_PRECISION: tl.constexpr, GRAD_KEY: tl.constexpr, GRAD_VALUE: tl.constexpr,
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
        p_t = tl.math.exp2(_masked_scores(
            qk_t, offs_m[None, :], k_idx, key_keep, mask_base, stride_mm, stride_mn,
            seq_len_q, causal_shift, qk_scale, lse[None, :], APPLY_CAUSAL, HAS_DENSE_MASK, MASK_IS_BOOL,
        ))
        grad_out = tl.load(
            grad_out_base + offs_m[:, None] * stride_gom + offs_dv[None, :] * stride_god,
            mask=row_in[:, None] & (offs_dv[None, :] < head_dim_v),
            other=0.0,
        )
        if GRAD_KEY:
            dp_t = tl.dot(v, tl.trans(grad_out), input_precision=INPUT_PRECISION)
        if HAS_DROPOUT:
            kept_t = tl.trans(_dropout_keep(
                offs_m, key_start, head_batch, dropout_seed, dropout_offset, dropout_threshold, BLOCK_M, BLOCK_N
            ))
            if GRAD_VALUE:
                dv += tl.dot(tl.where(kept_t, p_t * dropout_scale, 0.0).to(grad_out.dtype), grad_out,
                             input_precision=INPUT_PRECISION)
            if GRAD_KEY:
                dp_t = tl.where(kept_t, dp_t * dropout_scale, 0.0)
        elif GRAD_VALUE:
            dv += tl.dot(p_t.to(grad_out.dtype), grad_out, input_precision=INPUT_PRECISION)
        if GRAD_KEY:
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
# Key blocks outside the key bounds (without bounds: all padding) skip the
# loop and write zeros.  GRAD_KEY and GRAD_VALUE (both by default) pick the
# gradients a launch accumulates and stores: a pass each where both would not
# fit in registers.
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
    CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, KEY_BOUNDS: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_GRAD_SCORES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, GRAD_KEY: tl.constexpr = True, GRAD_VALUE: tl.constexpr = True,
):
    scale, qk_scale, dropout_scale = as_float32(scale), as_float32(qk_scale), as_float32(dropout_scale)
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
        if KEY_BOUNDS:
            first_key = tl.load(key_bounds_ptr + batch * stride_kbb)
            end_key = tl.load(key_bounds_ptr + batch * stride_kbb + stride_kbe)
            skipped = (key_start >= end_key) | (key_start + BLOCK_N <= first_key)
        else:  # the block's own padding, just read: no kept key in it
            skipped = tl.max(key_keep.to(tl.int32), 0) == 0
        row_lo = tl.where(skipped, seq_len_q, row_lo)
        row_full = tl.where(skipped, seq_len_q, row_full)

    # Each key's dK and dV rows take only its own scores, so the scores of keys
    # outside the sequence or of padding need no -inf in the loop (rows past the
    # end are not stored, padding rows are zeroed below) unless a dense mask is
    # read or dS stored: a select per score saved, with causality or key padding.
    # (Without any mask the compiler schedules the select-free loop into spills:
    # d64 and d256 on sm_80, d128 on sm_90, under triton 3.9.)
    score_keep = key_keep
    if not HAS_DENSE_MASK and (CAUSAL != NO_CAUSAL or HAS_KEY_PADDING):
        score_keep = tl.full([BLOCK_N], 1, tl.int1)
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
                dk, dv, k, v, offs_n[:, None], score_keep[:, None],
                q_base, grad_out_base, lse_base, delta_base, mask_base, grad_scores_base,
                stride_qm, stride_qd, stride_gom, stride_god, stride_mm, stride_mn, stride_gsm, stride_gsn,
                offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, seq_len_k, causal_shift, qk_scale,
                head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
                key_start, row_lo if stage == 0 else row_full, row_full if stage == 0 else seq_len_q,
                stage == 0, HAS_DENSE_MASK, MASK_IS_BOOL, HAS_DROPOUT, STORE_GRAD_SCORES, BLOCK_M, BLOCK_N,
                INPUT_PRECISION, GRAD_KEY, GRAD_VALUE,
            )

    if HAS_KEY_PADDING and not HAS_DENSE_MASK:
        # (A padding key's scores may even overflow: the select drops what they gave.)
        dk = tl.where(key_keep[:, None], dk, 0.0)
        dv = tl.where(key_keep[:, None], dv, 0.0)
    if GRAD_KEY:
        dk *= scale
        tl.store(
            _aligned_base(dk_ptr, batch, stride_dkb, kv_head, stride_dkh)
            + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
            dk.to(dk_ptr.dtype.element_ty),
            mask=key_in[:, None] & (offs_d[None, :] < head_dim),
        )
    if GRAD_VALUE:
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
    key_start, key_end, holes,
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
        k_t = _load_tile(k_ptrs, key_in[None, :], offs_d[:, None] < head_dim, MASKED, not EVEN_HEAD_DIM)
        v_t = _load_tile(v_ptrs, key_in[None, :], offs_dv[:, None] < head_dim_v, MASKED, not EVEN_HEAD_DIM)
        qk = tl.dot(q, k_t, input_precision=INPUT_PRECISION)
        keep = _key_keep(offs_n, key_in, key_padding_base, stride_kpn, holes, BLOCK_N, MASKED, HAS_KEY_PADDING)
        p = tl.math.exp2(_masked_scores(
            qk, q_idx, offs_n[None, :], keep[None, :], mask_base, stride_mm, stride_mn,
            seq_len_q, causal_shift, qk_scale, lse[:, None], APPLY_CAUSAL, HAS_DENSE_MASK, MASK_IS_BOOL,
        ))
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
    CAUSAL: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, KEY_BOUNDS: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr, SPLIT_KEYS: tl.constexpr,
):
    scale, qk_scale, dropout_scale = as_float32(scale), as_float32(qk_scale), as_float32(dropout_scale)
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

    key_lo, key_full_end, key_hi, holes = _key_range(
        row_start, seq_len_q, seq_len_k, causal_shift, key_bounds_ptr, stride_kbb, stride_kbe, batch,
        BLOCK_M, BLOCK_N, CAUSAL, HAS_KEY_PADDING, KEY_BOUNDS,
    )
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # SPLIT_KEYS: the stages of the forward kernel (whole blocks every row sees,
    # without masks, then the edge blocks, with them); else one masked stage
    # takes every block (the launcher chooses, see `_grad_query_splits_keys`).
    if not SPLIT_KEYS:
        key_full_end = key_lo
    for stage in tl.static_range(0 if SPLIT_KEYS else 1, 2):
        dq = _grad_query_inner(
            dq, q, grad_out, lse, delta, offs_m, k_base, v_base, key_padding_base, mask_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kpn, stride_mm, stride_mn,
            offs_d, offs_dv, head_dim, head_dim_v, seq_len_q, causal_shift, qk_scale,
            head_batch, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
            key_full_end if stage == 1 else key_lo, key_hi if stage == 1 else key_full_end, holes,
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
