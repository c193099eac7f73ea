// The attention kernels' masking and dropout logic as plain __host__ __device__ functions, so that
// tests/test_cuda_host.py compiles this header for the host and checks it against the op layer's
// definitions (transformer_kernels/ops/attention.py) and the Triton backend's kernels
// (backends/triton/attention.py): which key blocks a query block visits and which of them need
// per-element masks, the query steps of a key block (dK/dV), the float mask's contribution to a
// score, and the dropout keep-mask (Philox
// counters laid out as the Triton backend lays them out, so both backends drop the same weights).
#pragma once

#include <cstdint>

#include "index.h"

namespace tk::attention {

// transformer_kernels.ops.attention.Causal.
enum class Causal : int { kNone = 0, kTopLeft = 1, kBottomRight = 2 };

// Query i sees keys j <= i + shift: 0 for top-left, Lk - Lq for bottom-right.
TK_HOST_DEVICE int causal_shift(Causal causal, int seq_len_q, int seq_len_k) {
  return causal == Causal::kBottomRight ? seq_len_k - seq_len_q : 0;
}

// ------------------------------------------------------------------------------------------------
// The keys one batch row may see, from its key padding: [first_key, end_key) and whether padding
// sits between them (holes: then each key's padding is tested).  `key_bounds` is that row's
// (first kept key, last kept key + 1, count of kept keys), or null: without key padding every key,
// and for key padding without bounds (keys too short for them to pay: a block or two, which the
// caller masks key by key rather than spend launches on bounds) every key, each tested.

struct RowKeys {
  int first_key, end_key;
  bool holes;
};

TK_HOST_DEVICE RowKeys row_keys(const int32_t* key_bounds, bool has_padding, int seq_len_k) {
  if (key_bounds == nullptr) return RowKeys{0, seq_len_k, has_padding};
  return RowKeys{key_bounds[0], key_bounds[1], key_bounds[2] != key_bounds[1] - key_bounds[0]};
}

// A batch row's key bounds (key_padding_bounds in transformer_kernels/ops/attention.py: first kept
// key, last kept key + 1, count of kept keys; (0, 0, 0) for a row of padding only) as the bounds
// kernel reduces them: each thread adds the keys it reads, then the threads' partial bounds merge in
// any order (min, max and sum).
struct KeyBounds {
  int first, end, count;  // first is seq_len_k until a kept key is added

  TK_HOST_DEVICE static KeyBounds none(int seq_len_k) { return KeyBounds{seq_len_k, 0, 0}; }

  TK_HOST_DEVICE void add_key(int key, bool padding) {
    if (padding) return;
    first = key < first ? key : first;
    end = key + 1 > end ? key + 1 : end;
    ++count;
  }

  TK_HOST_DEVICE void merge(const KeyBounds& other) {
    first = other.first < first ? other.first : first;
    end = other.end > end ? other.end : end;
    count += other.count;
  }

  TK_HOST_DEVICE void store(int32_t* bounds) const {
    bounds[0] = count > 0 ? first : 0;
    bounds[1] = end;
    bounds[2] = count;
  }
};

// ------------------------------------------------------------------------------------------------
// Key blocks of one query block.  Query rows [row_start, row_start + block_m) (those < Lq) see key j
// when first_key <= j < end_key (the key bounds, [0, Lk) without key padding) and, if causal,
// j <= i + shift.  The block visits key blocks [begin, end) of block_n keys; the blocks in
// [full_begin, full_end) are interior: every key of them is visible to every row of the block, so
// they run without per-element masks (holes in the key padding and a dense mask still apply: they
// are per-element by nature).  begin == end when no row of the block sees any key.

struct KeyBlocks {
  int begin, end;            // visited key blocks
  int full_begin, full_end;  // interior key blocks (full_begin >= full_end: none)

  TK_HOST_DEVICE bool interior(int block) const { return block >= full_begin && block < full_end; }
};

TK_HOST_DEVICE int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

TK_HOST_DEVICE KeyBlocks key_blocks(int row_start, int block_m, int block_n, int seq_len_q, bool causal, int shift,
                                    int first_key, int end_key) {
  int row_last = (row_start + block_m < seq_len_q ? row_start + block_m : seq_len_q) - 1;
  int hi = end_key;      // keys below hi are visible to some row
  int full_hi = end_key;  // keys below full_hi are visible to every row (past first_key)
  if (causal) {
    if (row_last + shift + 1 < hi) hi = row_last + shift + 1;
    if (row_start + shift + 1 < full_hi) full_hi = row_start + shift + 1;
  }
  KeyBlocks blocks;
  if (hi <= first_key || row_last < row_start) {
    blocks.begin = blocks.end = blocks.full_begin = blocks.full_end = 0;
    return blocks;
  }
  blocks.begin = first_key / block_n;
  blocks.end = ceil_div(hi, block_n);
  blocks.full_begin = ceil_div(first_key, block_n);
  blocks.full_end = floor_div(full_hi, block_n);
  return blocks;
}

// Query rows of one key block (the dK/dV pass loops over queries): key columns
// [key_start, key_start + block_n) are seen by rows >= row_begin, and by every row >= row_full
// (causal: the diagonal lies above row_full).  Rows [row_begin, Lq) are visited.
struct QueryRows {
  int row_begin, row_full;
};

TK_HOST_DEVICE QueryRows query_rows(int key_start, int block_n, int seq_len_q, bool causal, int shift) {
  if (!causal) return QueryRows{0, 0};
  auto clamp = [seq_len_q](int row) { return row < 0 ? 0 : (row > seq_len_q ? seq_len_q : row); };
  return QueryRows{clamp(key_start - shift), clamp(key_start + block_n - 1 - shift)};
}

// The steps of one key block's query loop: the query blocks from `q_first` (row_begin rounded down to
// a block) to Lq, for each query head of the kv head's GQA group in turn, starting at
// {first head, q_first} and ending when `head` passes the group's last.
struct QueryStep {
  int head, q_start;
};

TK_HOST_DEVICE QueryStep next_query_step(QueryStep step, int block_q, int seq_len_q, int q_first) {
  return step.q_start + block_q < seq_len_q ? QueryStep{step.head, step.q_start + block_q}
                                             : QueryStep{step.head + 1, q_first};
}

// ------------------------------------------------------------------------------------------------
// Scores in base-2 units (scale folded with log2(e), so the softmax uses exp2).

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kFloat32Lowest = -3.4028234663852886e38f;

// What a float attn_mask value adds to a base-2 score: only -inf excludes a key; a finite value,
// even finfo(float32).min (whose product with log2(e) would overflow to -inf), stays finite, as
// in torch (a row of finfo.min averages its values uniformly).
TK_HOST_DEVICE float mask_bias_log2(float bias) {
  if (bias < kFloat32Lowest) return bias;  // -inf (nothing finite lies below the lowest float)
  float scaled = bias * kLog2e;
  return scaled > kFloat32Lowest ? scaled : kFloat32Lowest;
}

// ------------------------------------------------------------------------------------------------
// Philox4x32-10, as triton.language.philox computes it: counter (c0, c1, c2, c3), key (seed's low
// and high 32 bits).

struct Philox4 {
  uint32_t r[4];
};

TK_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * uint64_t(b)) >> 32);
#endif
}

TK_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint64_t seed) {
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  constexpr uint32_t kKeyA = 0x9E3779B9u, kKeyB = 0xBB67AE85u;
  constexpr uint32_t kRoundA = 0xD2511F53u, kRoundB = 0xCD9E8D57u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t old_c0 = c0, old_c2 = c2;
    c0 = mulhi32(kRoundB, old_c2) ^ c1 ^ k0;
    c2 = mulhi32(kRoundA, old_c0) ^ c3 ^ k1;
    c1 = kRoundB * old_c2;
    c3 = kRoundA * old_c0;
    k0 += kKeyA;
    k1 += kKeyB;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// triton.language.random.uint_to_uniform_float for 32-bit values: [0, 1).
TK_HOST_DEVICE float uniform_float(uint32_t x) {
  int32_t i = int32_t(x);
  if (i < 0) i = ~i;
  return float(i) * 4.6566127342e-10f;
}

// tl.rand(seed, offset) for a 32-bit offset: Philox of counter (offset, 0, 0, 0), the first word.
// The seed is an int32 widened to 64 bits (sign-extended) as tl.philox widens it.
TK_HOST_DEVICE float triton_rand(int32_t seed, uint32_t offset) {
  return uniform_float(philox4x32_10(offset, 0, 0, 0, uint64_t(int64_t(seed))).r[0]);
}

// ------------------------------------------------------------------------------------------------
// Dropout, the Triton backend's layout: the op layer's (seed, offset) int64 pair read as int32
// seed and 31-bit offset; Philox counter (key / 8, query, batch * Hq + head, offset) gives 16 bits
// for each of 8 consecutive keys (word (key % 8) / 2, low half for even keys); a weight is kept
// when its bits are >= threshold = round(p * 2^16).  One element depends on its coordinates only,
// so every kernel and tile shape regenerates the same keep-mask.

struct DropoutKey {
  int32_t seed;
  uint32_t offset;
};

TK_HOST_DEVICE DropoutKey dropout_key(int64_t seed, int64_t offset) {
  return DropoutKey{int32_t(uint32_t(uint64_t(seed))), uint32_t(offset & 0x7FFFFFFF)};
}

TK_HOST_DEVICE uint32_t dropout_bits(const Philox4& group, int key) {
  // Selected, not indexed: a runtime index into r would put the group in local memory.
  const int which = (key & 7) >> 1;
  const uint32_t word = which < 2 ? (which == 0 ? group.r[0] : group.r[1]) : (which == 2 ? group.r[2] : group.r[3]);
  return (key & 1) ? word >> 16 : word & 0xFFFFu;
}

// The Philox group of keys [key8 * 8, key8 * 8 + 8) of one query row.
TK_HOST_DEVICE Philox4 dropout_group(const DropoutKey& key, int head_batch, int query, int key8) {
  return philox4x32_10(uint32_t(key8), uint32_t(query), uint32_t(head_batch), key.offset,
                       uint64_t(int64_t(key.seed)));
}

TK_HOST_DEVICE bool dropout_keep(const DropoutKey& key, int head_batch, int query, int key_index, uint32_t threshold) {
  return dropout_bits(dropout_group(key, head_batch, query, key_index >> 3), key_index) >= threshold;
}

}  // namespace tk::attention
