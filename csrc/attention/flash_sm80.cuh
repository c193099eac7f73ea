// Building blocks of the sm_80 flash-attention kernels: the tile traits (CuTe mma.sync m16n8k16
// atoms, warps stacked along the query rows so each row lives in one warp's quad of lanes, ldmatrix
// from swizzled shared memory), views of an accumulator as rows x columns, quad reductions and
// exp2.  Shared by the forward and backward kernels.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include <cute/tensor.hpp>

#include "../common/attention_masks.h"
#include "../common/gemm_sm80.cuh"
#include "attention.h"

namespace tk::attention {

using namespace cute;

// Shared-memory atom for a K-major tile whose rows are the head dim: 64-element rows (128 bytes,
// Swizzle<3,3,3>) where the head dim allows, else 32-element rows (gemm_sm80.cuh's atom).
template <int kHeadDim>
using HeadDimSmemAtom = std::conditional_t<
    kHeadDim % 64 == 0, decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{})),
    typename SmemOperand<Major::K>::Atom>;

// The most dynamic shared memory a block may opt in to on sm_80 (sm_90 allows 227 KiB): every
// kernel here is built for both.
constexpr int kMaxSmemBytes = 163 * 1024;

template <class T, int kHeadDim_, int kBlockM_, int kBlockN_>
struct FlashTraits {
  using Element = T;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;

  using TiledMma =
      TiledMMA<MMA_Atom<typename Sm80MmaAtom<T>::type>, Layout<Shape<Int<kWarps>, _1, _1>>, Tile<Int<16 * kWarps>, _16, _16>>;
  using SmemLayoutQ = decltype(tile_to_shape(HeadDimSmemAtom<kHeadDim>{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(HeadDimSmemAtom<kHeadDim>{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V read as the B operand of P V: (head dim, keys), contiguous along the head dim.
  using SmemLayoutVt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using LdsmK = Copy_Atom<SM75_U32x4_LDSM_N, T>;
  using LdsmT = Copy_Atom<SM75_U16x8_LDSM_T, T>;

  // A [block N rows, head dim] shared-memory tile read as (head dim, rows): a B operand.
  template <class Tile>
  static __device__ __forceinline__ auto transposed(const Tile& tile) {
    return make_tensor(tile.data(), SmemLayoutVt{});
  }

  static constexpr int kSmemElementsQ = cosize_v<SmemLayoutQ>;
  static constexpr int kSmemElementsKV = cosize_v<SmemLayoutKV>;
  static constexpr int kSmemBytes = (kSmemElementsQ + 2 * kSmemElementsKV) * int(sizeof(T));
  static_assert(kBlockM % (16 * kWarps) == 0, "whole MMA rows per warp");
};

// A CTA's tiled MMA, this thread's slice of it, and the copies that load its operand fragments from
// shared memory: A and B as stored (ldmatrix) and B transposed (ldmatrix.trans).  Every kernel starts
// with them: `auto [mma, thr_mma, a_copy, b_copy, bt_copy] = mma_and_copies<Traits>(tid);`.
template <class Mma, class ThrMma, class CopyA, class CopyB, class CopyBt>
struct MmaAndCopies {
  Mma mma;
  ThrMma thr_mma;
  CopyA a_copy;
  CopyB b_copy;
  CopyBt bt_copy;
};

template <class Traits>
__device__ __forceinline__ auto mma_and_copies(int tid) {
  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_slice(tid);
  auto a_copy = make_tiled_copy_A(typename Traits::LdsmK{}, mma);
  auto b_copy = make_tiled_copy_B(typename Traits::LdsmK{}, mma);
  auto bt_copy = make_tiled_copy_B(typename Traits::LdsmT{}, mma);
  return MmaAndCopies<decltype(mma), decltype(thr_mma), decltype(a_copy), decltype(b_copy), decltype(bt_copy)>{
      mma, thr_mma, a_copy, b_copy, bt_copy};
}

// An m16n8 accumulator (MMA=(2,2), MMA_M, MMA_N) viewed as (rows=(2, MMA_M), cols=(2, MMA_N)).
template <class Layout>
__device__ __forceinline__ auto rowcol(Layout acc) {
  auto l = logical_divide(acc, Shape<_2>{});
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The same accumulator as the A operand of a following m16n8k16 MMA: (MMA=(2,2,2), MMA_M, MMA_N/2).
template <class Layout>
__device__ __forceinline__ auto as_a_operand(Layout acc) {
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// `dst` (a register tensor of T laid out like the accumulator `acc`) = acc, rounded.
template <class Dst, class Acc>
__device__ __forceinline__ void round_into(Dst& dst, const Acc& acc) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) dst(i) = typename Dst::value_type(acc(i));
}

// acc += A B, one K slice at a time, each slice of both operands loaded from shared memory (sA, sB)
// into its register fragment (rA, rB) by ldmatrix (the tiled copies copy_a, copy_b) just before its
// MMA.
template <class Mma, class Acc, class RA, class SA, class CopyA, class RB, class SB, class CopyB>
__device__ __forceinline__ void gemm_smem(const Mma& mma, Acc& acc, RA& rA, const SA& sA, const CopyA& copy_a, RB& rB,
                                          const SB& sB, const CopyB& copy_b, int tid) {
  auto thr_a = copy_a.get_slice(tid);
  auto thr_b = copy_b.get_slice(tid);
  Tensor sA_part = thr_a.partition_S(sA);
  Tensor sB_part = thr_b.partition_S(sB);
  Tensor rA_view = thr_a.retile_D(rA);
  Tensor rB_view = thr_b.retile_D(rB);
  CUTE_UNROLL
  for (int kk = 0; kk < size<2>(rA); ++kk) {
    copy(copy_a, sA_part(_, _, kk), rA_view(_, _, kk));
    copy(copy_b, sB_part(_, _, kk), rB_view(_, _, kk));
    gemm(mma, rA(_, _, kk), rB(_, _, kk), acc);
  }
}

// acc += A B with A in registers already (a previous product, as_a_operand), B as in gemm_smem.
template <class Mma, class Acc, class RA, class RB, class SB, class CopyB>
__device__ __forceinline__ void gemm_registers_smem(const Mma& mma, Acc& acc, const RA& rA, RB& rB, const SB& sB,
                                                    const CopyB& copy_b, int tid) {
  auto thr_b = copy_b.get_slice(tid);
  Tensor sB_part = thr_b.partition_S(sB);
  Tensor rB_view = thr_b.retile_D(rB);
  CUTE_UNROLL
  for (int kk = 0; kk < size<2>(rA); ++kk) {
    copy(copy_b, sB_part(_, _, kk), rB_view(_, _, kk));
    gemm(mma, rA(_, _, kk), rB(_, _, kk), acc);
  }
}

// A row's values are spread over the 4 lanes of a quad: reduce over them.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// 2^x, one MUFU instruction (exp2(-inf) = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Rows [row0, row0 + ROWS) of one head of a [B, H, L, X] tensor as 16-byte chunks for
// gemm_sm80.cuh's load_tile: rows past `rows` and columns past `cols` are zero-filled.
template <class T>
struct HeadRows {
  static constexpr Major kMajor = Major::K;
  using Line = ContiguousLine<T>;
  const T* base;
  int64_t stride_l;
  int rows, cols;

  // Rows [row_start, seq_len) and columns [0, cols) of (batch, head) of the [B, H, L, X] tensor at
  // `tensor` with strides `stride`.
  static __device__ __forceinline__ HeadRows of(const void* tensor, const HeadStrides& stride, int batch, int head,
                                                int row_start, int seq_len, int cols) {
    return HeadRows{static_cast<const T*>(tensor) + batch * stride.b + head * stride.h + row_start * stride.l, stride.l,
                    seq_len - row_start, cols};
  }

  __device__ __forceinline__ Line line(int row) const {
    const bool in_range = row < rows;
    return Line{in_range ? base + row * stride_l : base, cols, in_range};
  }
};

// The masks of one (batch, query head), applied to a score in base-2 units: -inf where the key is
// excluded (outside the key bounds, a padding hole, causal, a False bool mask), the float mask's
// bias added otherwise.  Full tests, for blocks that are not interior.  The padding mask is read
// only for a batch row with holes (row_keys): otherwise the bounds hold every kept key and nothing else.
template <class T>
struct ScoreMasks {
  int first_key, end_key, seq_len_q, shift;
  bool causal;
  bool holes;              // padding between the kept keys of this batch row
  const uint8_t* padding;  // this batch row's [Lk], or null
  const char* mask;        // this (batch, head)'s [Lq, Lk] slice, or null
  bool mask_is_bool;
  int64_t stride_m, stride_n;

  __device__ __forceinline__ ScoreMasks(const ForwardProblem& p, int batch, int head) {
    causal = p.causal != int(Causal::kNone);
    shift = causal_shift(Causal(p.causal), p.seq_len_q, p.seq_len_k);
    seq_len_q = p.seq_len_q;
    const RowKeys keys =
        row_keys(p.key_bounds != nullptr ? p.key_bounds + 3 * batch : nullptr, p.key_padding != nullptr, p.seq_len_k);
    first_key = keys.first_key;
    end_key = keys.end_key;
    holes = keys.holes;
    padding = p.key_padding != nullptr ? p.key_padding + int64_t(batch) * p.seq_len_k : nullptr;
    mask_is_bool = p.mask_is_bool;
    mask = head_mask(p, batch, head);
    stride_m = p.mask_stride[2];
    stride_n = p.mask_stride[3];
  }

  // The same masks for another query head of the batch row: only the dense mask's slice moves.
  __device__ __forceinline__ ScoreMasks for_head(const ForwardProblem& p, int batch, int head) const {
    ScoreMasks masks = *this;
    masks.mask = head_mask(p, batch, head);
    return masks;
  }

  __device__ __forceinline__ const char* head_mask(const ForwardProblem& p, int batch, int head) const {
    const char* base = static_cast<const char*>(p.attn_mask);
    const int64_t element = mask_is_bool ? 1 : int64_t(sizeof(T));
    return base == nullptr ? nullptr : base + (batch * p.mask_stride[0] + head * p.mask_stride[1]) * element;
  }

  // Whether every block needs the full tests (holes and dense masks are per element).
  __device__ __forceinline__ bool per_element() const { return holes || mask != nullptr; }

  __device__ __forceinline__ float operator()(float s, int query, int key) const {
    bool keep = key >= first_key && key < end_key && (!causal || key <= query + shift);
    if (keep && holes) keep = padding[key] == 0;
    if (keep && mask != nullptr && query < seq_len_q) {
      const int64_t at = query * stride_m + key * stride_n;
      if (mask_is_bool) {
        keep = mask[at] != 0;
      } else {
        s += mask_bias_log2(float(reinterpret_cast<const T*>(mask)[at]));
      }
    }
    return keep ? s : -INFINITY;
  }
};

// Scales a tile of scores into base-2 units and, where `needs_mask`, applies `masks` to it, with one
// branch around the whole tile: an interior block runs none of the masks' tests.  (Tested score by
// score, each score kept its own branch and address arithmetic on the unmasked path too.)
// `query_key(r, c)` gives the (query, key) of score (r, c).
template <class Scores, class Masks, class QueryKey>
__device__ __forceinline__ void scale_and_mask(Scores& s_rc, float qk_scale, bool needs_mask, const Masks& masks,
                                               QueryKey&& query_key) {
  if (needs_mask) {
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s_rc); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const int2 at = query_key(r, c);
        s_rc(r, c) = masks(s_rc(r, c) * qk_scale, at.x, at.y);
      }
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(s_rc); ++i) s_rc(i) *= qk_scale;
  }
}

// What a CTA of the forward or of the dQ pass owns, from its grid position (query block, batch *
// query head): its rows, its (batch, head) and the key-value head that head reads, their masks and
// the key blocks its rows see.  Causal grids run their last query blocks first: those rows see the
// most keys.
template <class T, int BM, int BN>
struct QueryBlock {
  int head_batch, batch, head, kv_head, row_start;
  ScoreMasks<T> masks;
  KeyBlocks blocks;

  __device__ __forceinline__ explicit QueryBlock(const ForwardProblem& p)
      : head_batch(blockIdx.y),
        batch(head_batch / p.heads_q),
        head(head_batch % p.heads_q),
        kv_head(head / (p.heads_q / p.heads_k)),
        row_start((p.causal != int(Causal::kNone) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x)) * BM),
        masks(p, batch, head),
        blocks(key_blocks(row_start, BM, BN, p.seq_len_q, masks.causal, masks.shift, masks.first_key,
                          masks.end_key)) {}
};

// Dropout keep bits of `count` scores (bit i: score i is kept), `at(i)` giving score i's (query,
// key).  A rolled loop: unrolled Philox rounds beside the accumulators would spill.
template <class At>
__device__ __forceinline__ uint32_t dropout_keep_bits(const DropoutKey& key, uint32_t threshold, int head_batch,
                                                      int count, At&& at) {
  uint32_t kept = 0;
#pragma unroll 1
  for (int i = 0; i < count; ++i) {
    const int2 query_key = at(i);
    kept |= uint32_t(dropout_keep(key, head_batch, query_key.x, query_key.y, threshold)) << i;
  }
  return kept;
}

}  // namespace tk::attention
