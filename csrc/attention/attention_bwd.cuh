// Flash-attention backward on sm_80 tensor cores (flash_sm80.cuh), two kernels after the dO . O
// row-sum pre-pass (delta, its own small memory-bound kernel, row_dot_kernel):
// * dQ: one CTA per (query block, batch * query head), the forward's key loop and masks:
//   P = exp2(S - lse log2 e), dP = dO V^T, dS = P (dP - delta), dQ += dS K; the next key block's K
//   (a second buffer) and V land while the current block's products run.  A separate pass rather
//   than atomics from the dK/dV kernel: deterministic, and no fp32 dQ buffer to convert.
// * dK/dV: one CTA per (key block, batch * kv head), the queries looped inside, the query heads of a
//   GQA group summed in order inside the program (deterministic): S^T = K Q^T, dV += P^T dO,
//   dP^T = V dO^T, dK += dS^T Q; it also writes dS, the float mask's gradient.  The next query
//   step's Q and dO land (cp.async, a second buffer) while the current step's products run.  Past
//   head dim 128 (192 runs as 256) the two [keys, D] fp32 accumulators would take every register a
//   thread has, so that kernel runs twice, once per gradient (KvGrads), recomputing S^T.
// Every product keeps its result in registers as the next MMA's A operand; the transposed B
// operands (K^T, Q^T, dO^T) are read from shared memory by ldmatrix.trans.  Rows without any key
// have lse = +inf, hence P = 0 and zero gradients.
#pragma once

#include <cmath>

#include "attention.h"
#include "flash_sm80.cuh"

namespace tk::attention {
namespace {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) grad_query_kernel(const __grid_constant__ BackwardProblem bp) {
  using T = typename Traits::Element;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN, D = Traits::kHeadDim, kThreads = Traits::kThreads;
  const ForwardProblem& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* smem = reinterpret_cast<T*>(smem_bytes);
  const int tid = threadIdx.x;

  const auto& [head_batch, batch, head, kv_head, row_start, masks, blocks] = QueryBlock<T, BM, BN>(p);

  const auto q_rows = HeadRows<T>::of(p.q, p.q_stride, batch, head, row_start, p.seq_len_q, p.head_dim);
  const auto do_rows =
      HeadRows<T>::of(bp.grad_out, bp.grad_out_stride, batch, head, row_start, p.seq_len_q, p.head_dim_v);
  const auto k_rows = HeadRows<T>::of(p.k, p.k_stride, batch, kv_head, 0, p.seq_len_k, p.head_dim);
  const auto v_rows = HeadRows<T>::of(p.v, p.v_stride, batch, kv_head, 0, p.seq_len_k, p.head_dim_v);

  // Shared memory (grad_query_smem_bytes): Q, dO, V and two buffers of K.  K(n) is read until dQ's
  // product, V(n) only by dP's: K(n - 1) lands while this block's products run, V(n - 1) while dS
  // and dQ += dS K(n) do.
  constexpr int kQ = Traits::kSmemElementsQ, kKV = Traits::kSmemElementsKV;
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem + kQ), typename Traits::SmemLayoutQ{});
  Tensor sV = make_tensor(make_smem_ptr(smem + 2 * kQ), typename Traits::SmemLayoutKV{});
  auto sK_at = [&](int stage) {
    return make_tensor(make_smem_ptr(smem + 2 * kQ + (1 + stage) * kKV), typename Traits::SmemLayoutKV{});
  };
  Tensor sK = sK_at(0);  // stage 0 gives the register fragments their shapes
  Tensor sKt = Traits::transposed(sK);

  auto [mma, thr_mma, a_copy, b_copy, bt_copy] = mma_and_copies<Traits>(tid);
  Tensor rQ = thr_mma.partition_fragment_A(sQ);
  Tensor rdO = thr_mma.partition_fragment_A(sdO);
  Tensor rK = thr_mma.partition_fragment_B(sK);
  Tensor rV = thr_mma.partition_fragment_B(sV);
  Tensor rKt = thr_mma.partition_fragment_B(sKt);

  Tensor acc_dq = partition_fragment_C(mma, Shape<Int<BM>, Int<D>>{});
  Tensor acc_s = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
  Tensor acc_dp = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
  clear(acc_dq);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  Tensor c_rc = make_tensor(coords.data(), rowcol(coords.layout()));
  Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
  Tensor dp_rc = make_tensor(acc_dp.data(), rowcol(acc_dp.layout()));
  constexpr int kRows = size<0>(decltype(s_rc.layout()){});
  constexpr int kCols = size<1>(decltype(s_rc.layout()){});
  static_assert(kCols <= 32, "one keep bit per column in a word");

  const int64_t row_base = int64_t(head_batch) * p.seq_len_q;
  float lse_log2[kRows], delta[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = row_start + get<0>(c_rc(r, 0));
    lse_log2[r] = row < p.seq_len_q ? p.lse[row_base + row] * kLog2e : INFINITY;
    delta[r] = row < p.seq_len_q ? bp.delta[row_base + row] : 0.f;
  }
  const float qk_scale = p.scale * kLog2e;
  DropoutKey dropout{};
  if (p.dropout_seed != nullptr) dropout = dropout_key(p.dropout_seed[0], p.dropout_seed[1]);
  const float dropout_scale = p.dropout_seed != nullptr ? p.dropout_scale : 1.f;

  // cp.async groups in flight at the top of block n's step: K(n) (with Q and dO at the first), then
  // V(n).
  if (blocks.begin < blocks.end) {
    load_tile<Major::K, BM, D, kThreads>(q_rows, sQ, 0, 0, tid);
    load_tile<Major::K, BM, D, kThreads>(do_rows, sdO, 0, 0, tid);
    load_tile<Major::K, BN, D, kThreads>(k_rows, sK, (blocks.end - 1) * BN, 0, tid);
    cp_async_fence();
    load_tile<Major::K, BN, D, kThreads>(v_rows, sV, (blocks.end - 1) * BN, 0, tid);
    cp_async_fence();
  }
  int stage = 0;
  for (int n_block = blocks.end - 1; n_block >= blocks.begin; --n_block) {
    const int key_start = n_block * BN;
    const bool more = n_block > blocks.begin;
    cp_async_wait<1>();
    __syncthreads();  // K(n) has landed; every thread is done with K(n + 1), in the other buffer
    if (more) {
      load_tile<Major::K, BN, D, kThreads>(k_rows, sK_at(stage ^ 1), key_start - BN, 0, tid);
      cp_async_fence();
    }
    clear(acc_s);
    clear(acc_dp);
    gemm_smem(mma, acc_s, rQ, sQ, a_copy, rK, sK_at(stage), b_copy, tid);
    if (more) {
      cp_async_wait<1>();  // all but K(n - 1)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // V(n) has landed
    gemm_smem(mma, acc_dp, rdO, sdO, a_copy, rV, sV, b_copy, tid);
    __syncthreads();  // every thread is done with V(n)
    if (more) {
      load_tile<Major::K, BN, D, kThreads>(v_rows, sV, key_start - BN, 0, tid);
      cp_async_fence();
    }

    const bool needs_mask = !blocks.interior(n_block) || masks.per_element();
    scale_and_mask(s_rc, qk_scale, needs_mask, masks, [&](int r, int c) {
      return make_int2(row_start + get<0>(c_rc(r, c)), key_start + get<1>(c_rc(r, c)));
    });
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = row_start + get<0>(c_rc(r, 0));
      uint32_t kept = ~0u;
      if (p.dropout_seed != nullptr) {
        kept = dropout_keep_bits(dropout, p.dropout_threshold, head_batch, kCols,
                                 [&](int c) { return make_int2(row, key_start + get<1>(c_rc(r, c))); });
      }
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const float prob = fast_exp2(s_rc(r, c) - lse_log2[r]);
        const float dp = (kept >> c & 1) ? dp_rc(r, c) * dropout_scale : 0.f;
        s_rc(r, c) = prob * (dp - delta[r]);  // dS
      }
    }

    Tensor ds = make_tensor<T>(acc_s.layout());
    round_into(ds, acc_s);
    Tensor ds_a = make_tensor(ds.data(), as_a_operand(ds.layout()));
    gemm_registers_smem(mma, acc_dq, ds_a, rKt, Traits::transposed(sK_at(stage)), bt_copy, tid);
    stage ^= 1;
  }

  Tensor o_coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
  Tensor oc_rc = make_tensor(o_coords.data(), rowcol(o_coords.layout()));
  Tensor dq_rc = make_tensor(acc_dq.data(), rowcol(acc_dq.layout()));
  T* dq = static_cast<T*>(bp.dq) + batch * bp.dq_stride.b + head * bp.dq_stride.h;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = row_start + get<0>(oc_rc(r, 0));
    if (row >= p.seq_len_q) continue;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(dq_rc); c += 2) {
      const int col = get<1>(oc_rc(r, c));
      if (col < p.head_dim) {
        const uint32_t pair =
            uint32_t(T(dq_rc(r, c) * p.scale).raw()) | uint32_t(T(dq_rc(r, c + 1) * p.scale).raw()) << 16;
        *reinterpret_cast<uint32_t*>(dq + row * bp.dq_stride.l + col) = pair;
      }
    }
  }
}

// Stores rows [key_start, ...) of an accumulator [keys, head dim] times `scale` into a [B, H, L, X]
// tensor's (batch, head) slice.
template <class T, int BM, int D, class Acc, class ThrMma>
__device__ __forceinline__ void store_rows(const Acc& acc, const ThrMma& thr_mma, T* base, int64_t stride_l,
                                           int key_start, int rows, int cols, float scale) {
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
  Tensor c_rc = make_tensor(coords.data(), rowcol(coords.layout()));
  Tensor a_rc = make_tensor(acc.data(), rowcol(acc.layout()));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(a_rc); ++r) {
    const int row = key_start + get<0>(c_rc(r, 0));
    if (row >= rows) continue;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(a_rc); c += 2) {
      const int col = get<1>(c_rc(r, c));
      if (col < cols) {
        const uint32_t pair = uint32_t(T(a_rc(r, c) * scale).raw()) | uint32_t(T(a_rc(r, c + 1) * scale).raw()) << 16;
        *reinterpret_cast<uint32_t*>(base + row * stride_l + col) = pair;
      }
    }
  }
}

// Which gradients a dK/dV program accumulates: both, or one of them (a pass of its own).
enum class KvGrads { kBoth, kKey, kValue };

// Traits::kBlockM keys per CTA (the MMA rows), Traits::kBlockN queries per step (the columns).
template <class Traits, KvGrads kGrads>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    grad_key_value_kernel(const __grid_constant__ BackwardProblem bp) {
  using T = typename Traits::Element;
  constexpr int BK = Traits::kBlockM, BQ = Traits::kBlockN, D = Traits::kHeadDim, kThreads = Traits::kThreads;
  constexpr bool kKey = kGrads != KvGrads::kValue, kValue = kGrads != KvGrads::kKey;
  const ForwardProblem& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* smem = reinterpret_cast<T*>(smem_bytes);
  const int tid = threadIdx.x;

  const int key_start = blockIdx.x * BK;
  const int batch = blockIdx.y / p.heads_k, kv_head = blockIdx.y % p.heads_k;
  const int group = p.heads_q / p.heads_k;

  // Shared memory (grad_key_value_smem_bytes): K and V, then Q and dO of two query steps, one step's
  // being read while the next one's land.
  constexpr int kKeys = Traits::kSmemElementsQ, kQueries = Traits::kSmemElementsKV;
  Tensor sK = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sV = make_tensor(make_smem_ptr(smem + kKeys), typename Traits::SmemLayoutQ{});
  auto sQ_at = [&](int stage) {
    return make_tensor(make_smem_ptr(smem + 2 * kKeys + 2 * stage * kQueries), typename Traits::SmemLayoutKV{});
  };
  auto sdO_at = [&](int stage) {
    return make_tensor(make_smem_ptr(smem + 2 * kKeys + (2 * stage + 1) * kQueries), typename Traits::SmemLayoutKV{});
  };
  Tensor sQ = sQ_at(0);  // stage 0 gives the register fragments their shapes
  Tensor sdO = sdO_at(0);
  Tensor sQt = Traits::transposed(sQ);
  Tensor sdOt = Traits::transposed(sdO);

  auto [mma, thr_mma, a_copy, b_copy, bt_copy] = mma_and_copies<Traits>(tid);
  Tensor rK = thr_mma.partition_fragment_A(sK);
  Tensor rV = thr_mma.partition_fragment_A(sV);
  Tensor rQ = thr_mma.partition_fragment_B(sQ);
  Tensor rdO = thr_mma.partition_fragment_B(sdO);
  Tensor rQt = thr_mma.partition_fragment_B(sQt);
  Tensor rdOt = thr_mma.partition_fragment_B(sdOt);

  // A pass that does not accumulate a gradient leaves its accumulator untouched: no registers.
  Tensor acc_dk = partition_fragment_C(mma, Shape<Int<BK>, Int<D>>{});
  Tensor acc_dv = partition_fragment_C(mma, Shape<Int<BK>, Int<D>>{});
  Tensor acc_s = partition_fragment_C(mma, Shape<Int<BK>, Int<BQ>>{});
  Tensor acc_dp = partition_fragment_C(mma, Shape<Int<BK>, Int<BQ>>{});
  if constexpr (kKey) clear(acc_dk);
  if constexpr (kValue) clear(acc_dv);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<BK>, Int<BQ>>{}));
  Tensor c_rc = make_tensor(coords.data(), rowcol(coords.layout()));
  Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
  Tensor dp_rc = make_tensor(acc_dp.data(), rowcol(acc_dp.layout()));
  constexpr int kRows = size<0>(decltype(s_rc.layout()){});
  constexpr int kCols = size<1>(decltype(s_rc.layout()){});
  static_assert(kCols <= 32, "one keep bit per column in a word");

  const auto k_rows = HeadRows<T>::of(p.k, p.k_stride, batch, kv_head, 0, p.seq_len_k, p.head_dim);
  const auto v_rows = HeadRows<T>::of(p.v, p.v_stride, batch, kv_head, 0, p.seq_len_k, p.head_dim_v);
  const ScoreMasks<T> bounds(p, batch, 0);  // the key bounds and causal shift, shared by the heads (for_head)
  const bool outside_bounds = key_start >= bounds.end_key || key_start + BK <= bounds.first_key;
  const bool keys_inside = key_start >= bounds.first_key && key_start + BK <= bounds.end_key;
  const QueryRows rows = query_rows(key_start, BK, p.seq_len_q, bounds.causal, bounds.shift);
  const float qk_scale = p.scale * kLog2e;
  DropoutKey dropout{};
  if (p.dropout_seed != nullptr) dropout = dropout_key(p.dropout_seed[0], p.dropout_seed[1]);
  const float dropout_scale = p.dropout_seed != nullptr ? p.dropout_scale : 1.f;

  if (!outside_bounds && rows.row_begin < p.seq_len_q) {
    // The query steps (next_query_step): every query block from the first that sees these keys, for
    // each query head of the GQA group in order.
    const int q_first = rows.row_begin / BQ * BQ;
    auto load_queries = [&](int head, int q_start, int stage) {
      load_tile<Major::K, BQ, D, kThreads>(
          HeadRows<T>::of(p.q, p.q_stride, batch, head, q_start, p.seq_len_q, p.head_dim), sQ_at(stage), 0, 0, tid);
      load_tile<Major::K, BQ, D, kThreads>(
          HeadRows<T>::of(bp.grad_out, bp.grad_out_stride, batch, head, q_start, p.seq_len_q, p.head_dim_v),
          sdO_at(stage), 0, 0, tid);
    };
    load_tile<Major::K, BK, D, kThreads>(k_rows, sK, key_start, 0, tid);
    if constexpr (kKey) load_tile<Major::K, BK, D, kThreads>(v_rows, sV, key_start, 0, tid);  // for dP^T
    const int end_head = (kv_head + 1) * group;
    QueryStep step{kv_head * group, q_first};
    int stage = 0;
    load_queries(step.head, step.q_start, stage);
    cp_async_fence();
    while (step.head < end_head) {
      const QueryStep next = next_query_step(step, BQ, p.seq_len_q, q_first);
      // The next step's stage was last read by the step before this one, which every thread has
      // finished (the barrier at the end of the loop).
      if (next.head < end_head) {
        load_queries(next.head, next.q_start, stage ^ 1);
        cp_async_fence();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // this step's Q and dO (and K, V) have landed
      const int head = step.head, q_start = step.q_start;
      const int head_batch = batch * p.heads_q + head;
      const ScoreMasks<T> masks = bounds.for_head(p, batch, head);
      const int64_t row_base = int64_t(head_batch) * p.seq_len_q;
      clear(acc_s);
      clear(acc_dp);
      gemm_smem(mma, acc_s, rK, sK, a_copy, rQ, sQ_at(stage), b_copy, tid);
      if constexpr (kKey) gemm_smem(mma, acc_dp, rV, sV, a_copy, rdO, sdO_at(stage), b_copy, tid);

      // Per column (query): its lse and delta; rows past Lq have lse = +inf, hence P = 0.
      float lse_log2[kCols], delta[kCols];
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int query = q_start + get<1>(c_rc(0, c));
        lse_log2[c] = query < p.seq_len_q ? p.lse[row_base + query] * kLog2e : INFINITY;
        if constexpr (kKey) delta[c] = query < p.seq_len_q ? bp.delta[row_base + query] : 0.f;
      }
      const bool needs_mask = !keys_inside || (bounds.causal && q_start < rows.row_full) || masks.per_element();
      scale_and_mask(s_rc, qk_scale, needs_mask, masks, [&](int r, int c) {
        return make_int2(q_start + get<1>(c_rc(r, c)), key_start + get<0>(c_rc(r, c)));
      });
      Tensor probs = make_tensor<T>(acc_s.layout());  // dropped-out P^T, the A operand of dV
      Tensor probs_rc = make_tensor(probs.data(), rowcol(probs.layout()));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int key = key_start + get<0>(c_rc(r, 0));
        uint32_t kept = ~0u;
        if (p.dropout_seed != nullptr) {
          kept = dropout_keep_bits(dropout, p.dropout_threshold, head_batch, kCols,
                                   [&](int c) { return make_int2(q_start + get<1>(c_rc(r, c)), key); });
        }
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const int query = q_start + get<1>(c_rc(r, c));
          const float prob = fast_exp2(s_rc(r, c) - lse_log2[c]);
          const bool keep = kept >> c & 1;
          if constexpr (kValue) probs_rc(r, c) = T(keep ? prob * dropout_scale : 0.f);
          if constexpr (kKey) {
            const float dp = keep ? dp_rc(r, c) * dropout_scale : 0.f;
            const float ds = prob * (dp - delta[c]);
            s_rc(r, c) = ds;
            if (bp.grad_scores != nullptr && query < p.seq_len_q && key < p.seq_len_k) {
              bp.grad_scores[(row_base + query) * p.seq_len_k + key] = ds;
            }
          }
        }
      }
      if constexpr (kValue) {
        Tensor probs_a = make_tensor(probs.data(), as_a_operand(probs.layout()));
        gemm_registers_smem(mma, acc_dv, probs_a, rdOt, Traits::transposed(sdO_at(stage)), bt_copy, tid);
      }
      if constexpr (kKey) {
        Tensor ds = make_tensor<T>(acc_s.layout());
        round_into(ds, acc_s);
        Tensor ds_a = make_tensor(ds.data(), as_a_operand(ds.layout()));
        gemm_registers_smem(mma, acc_dk, ds_a, rQt, Traits::transposed(sQ_at(stage)), bt_copy, tid);
      }
      __syncthreads();  // every thread is done with this step's stage: the step after next loads into it
      step = next_query_step(step, BQ, p.seq_len_q, q_first);  // recomputed: not kept live across the step
      stage ^= 1;
    }
  }
  if constexpr (kKey) {
    store_rows<T, BK, D>(acc_dk, thr_mma,
                         static_cast<T*>(bp.dk) + batch * bp.dk_stride.b + kv_head * bp.dk_stride.h, bp.dk_stride.l,
                         key_start, p.seq_len_k, p.head_dim, p.scale);
  }
  if constexpr (kValue) {
    store_rows<T, BK, D>(acc_dv, thr_mma,
                         static_cast<T*>(bp.dv) + batch * bp.dv_stride.b + kv_head * bp.dv_stride.h, bp.dv_stride.l,
                         key_start, p.seq_len_k, p.head_dim_v, 1.f);
  }
}

// The dO . O pre-pass: delta[row] = the sum over its Ev columns of grad_out * out, in float32, for
// every (batch, query head, query) row.  One grid row per (batch, query head), its queries split
// over warps as RowDotSplit says: each element is read once, 16 bytes a load, and each query's
// lanes add up their sums by shuffles.  Every thread reaches the shuffles, those past the last
// query with a sum of 0.
constexpr int kRowDotThreads = 256;

template <class T>
__global__ void __launch_bounds__(kRowDotThreads) row_dot_kernel(const __grid_constant__ BackwardProblem bp) {
  const ForwardProblem& p = bp.fwd;
  const RowDotSplit split = RowDotSplit::of(p.head_dim_v, kVector);
  const int64_t thread = int64_t(blockIdx.x) * kRowDotThreads + threadIdx.x;
  const int64_t query = split.row(thread);
  const int head_batch = blockIdx.y;
  const int batch = head_batch / p.heads_q, head = head_batch - batch * p.heads_q;
  float sum = 0.f;
  if (query < p.seq_len_q) {
    const T* d_out = static_cast<const T*>(bp.grad_out) + batch * bp.grad_out_stride.b +
                     head * bp.grad_out_stride.h + query * bp.grad_out_stride.l;
    const T* out = static_cast<const T*>(p.out) + batch * p.out_stride.b + head * p.out_stride.h +
                   query * p.out_stride.l;
    for (int col = split.first_col(thread); col < p.head_dim_v; col += split.col_step()) {
      float d_out_values[kVector], out_values[kVector];
      load8(d_out + col, d_out_values);
      load8(out + col, out_values);
      CUTE_UNROLL
      for (int i = 0; i < kVector; ++i) sum += d_out_values[i] * out_values[i];
    }
  }
  for (int offset = split.lanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (query < p.seq_len_q && split.first_col(thread) == 0) bp.delta[int64_t(head_batch) * p.seq_len_q + query] = sum;
}

template <class Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, int threads, int smem_bytes, const BackwardProblem& p,
                   cudaStream_t stream) {
  if (smem_bytes > 48 * 1024) {
    cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (error != cudaSuccess) return error;
  }
  kernel<<<grid, threads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

// dQ's shared memory: its Q and dO (block M rows), a key block's V and two key blocks' K (block N
// rows each).
template <class Traits>
constexpr int grad_query_smem_bytes() {
  return (2 * Traits::kSmemElementsQ + 3 * Traits::kSmemElementsKV) * int(sizeof(typename Traits::Element));
}

// dK/dV's: its K and V (block M rows) and two query steps' Q and dO (block N rows each).
template <class Traits>
constexpr int grad_key_value_smem_bytes() {
  return (2 * Traits::kSmemElementsQ + 4 * Traits::kSmemElementsKV) * int(sizeof(typename Traits::Element));
}

// (head dim, dQ's query block x key block, dK/dV's key block x query block, whether dK and dV take a
// pass each: past head dim 128 their two accumulators do not fit in registers together).
template <class T, int D, int kQueryBlock, int kKeyBlock, int kKvKeys, int kKvQueries, bool kKvPassEach = false>
cudaError_t run(const BackwardProblem& p, cudaStream_t stream) {
  using QueryTraits = FlashTraits<T, D, kQueryBlock, kKeyBlock>;
  using KvTraits = FlashTraits<T, D, kKvKeys, kKvQueries>;
  static_assert(grad_query_smem_bytes<QueryTraits>() <= kMaxSmemBytes, "fits an sm_80 block's shared memory");
  static_assert(grad_key_value_smem_bytes<KvTraits>() <= kMaxSmemBytes, "fits an sm_80 block's shared memory");
  const ForwardProblem& f = p.fwd;
  const RowDotSplit row_dot = RowDotSplit::of(f.head_dim_v, kVector);
  const int queries_per_block = kRowDotThreads / 32 * row_dot.rows_per_warp();
  cudaError_t error = cudaSuccess;
  if (f.seq_len_q > 0 && f.batch * f.heads_q > 0) {
    const dim3 row_dot_grid(ceil_div(f.seq_len_q, queries_per_block), f.batch * f.heads_q);
    error = launch(row_dot_kernel<T>, row_dot_grid, kRowDotThreads, 0, p, stream);
    if (error != cudaSuccess) return error;
  }
  error = launch(grad_query_kernel<QueryTraits>, dim3(ceil_div(f.seq_len_q, kQueryBlock), f.batch * f.heads_q),
                 QueryTraits::kThreads, grad_query_smem_bytes<QueryTraits>(), p, stream);
  if (error != cudaSuccess) return error;
  const dim3 kv_grid(ceil_div(f.seq_len_k, kKvKeys), f.batch * f.heads_k);
  constexpr int kKvSmem = grad_key_value_smem_bytes<KvTraits>();
  if constexpr (kKvPassEach) {
    error = launch(grad_key_value_kernel<KvTraits, KvGrads::kKey>, kv_grid, KvTraits::kThreads, kKvSmem, p, stream);
    if (error != cudaSuccess) return error;
    return launch(grad_key_value_kernel<KvTraits, KvGrads::kValue>, kv_grid, KvTraits::kThreads, kKvSmem, p, stream);
  } else {
    return launch(grad_key_value_kernel<KvTraits, KvGrads::kBoth>, kv_grid, KvTraits::kThreads, kKvSmem, p, stream);
  }
}

template <class T>
cudaError_t backward_typed(const BackwardProblem& p, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
#ifndef TK_COMPILE_CHECK_ONE_DTYPE
    case 32: return run<T, 32, 64, 64, 64, 32>(p, stream);
    case 64: return run<T, 64, 64, 64, 64, 32>(p, stream);
    case 96: return run<T, 96, 64, 64, 64, 32>(p, stream);
#endif
    case 128: return run<T, 128, 64, 64, 64, 16>(p, stream);
    // Head dim 192 too: its own dK pass spilled on sm_80.
    case 192:
    case 256: return run<T, 256, 64, 16, 64, 16, true>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace tk::attention
