// Flash-attention forward on sm_80 tensor cores (flash_sm80.cuh): one CTA per (query block,
// batch * query head), looping over the key blocks its rows can see (common/attention_masks.h),
// from the last to the first.  K and V tiles stream through shared memory with cp.async, each
// load overlapping the other operand's MMAs (V(n) lands during S = Q K(n)^T and the softmax, K(n-1)
// during O += P V(n)).  Scores are in base-2 units (the scale folded with log2(e)), the softmax is
// online in registers, and only blocks that are not interior (the causal diagonal, the key-bound
// edges, any block with key padding holes or a dense mask) pay for per-element masks.
#pragma once

#include <cmath>

#include "attention.h"
#include "flash_sm80.cuh"

#include "../common/attention_masks.h"

namespace tk::attention {
namespace {

constexpr float kLn2 = 0.6931471805599453f;

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) forward_kernel(const __grid_constant__ ForwardProblem p) {
  using T = typename Traits::Element;
  constexpr int BM = Traits::kBlockM, BN = Traits::kBlockN, D = Traits::kHeadDim, kThreads = Traits::kThreads;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* smem = reinterpret_cast<T*>(smem_bytes);
  const int tid = threadIdx.x;

  const auto& [head_batch, batch, head, kv_head, row_start, masks, blocks] = QueryBlock<T, BM, BN>(p);

  const auto q_rows = HeadRows<T>::of(p.q, p.q_stride, batch, head, row_start, p.seq_len_q, p.head_dim);
  const auto k_rows = HeadRows<T>::of(p.k, p.k_stride, batch, kv_head, 0, p.seq_len_k, p.head_dim);
  const auto v_rows = HeadRows<T>::of(p.v, p.v_stride, batch, kv_head, 0, p.seq_len_k, p.head_dim_v);

  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem + Traits::kSmemElementsQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem + Traits::kSmemElementsQ + Traits::kSmemElementsKV),
                          typename Traits::SmemLayoutKV{});
  Tensor sVt = Traits::transposed(sV);

  auto [mma, thr_mma, s2r_q_copy, s2r_k_copy, s2r_v_copy] = mma_and_copies<Traits>(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);

  Tensor acc_o = partition_fragment_C(mma, Shape<Int<BM>, Int<D>>{});
  Tensor acc_s = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});
  clear(acc_o);
  // Each thread's rows and columns of a score tile (tile coordinates).
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  Tensor s_rc = make_tensor(acc_s.data(), rowcol(acc_s.layout()));
  Tensor c_rc = make_tensor(coords.data(), rowcol(coords.layout()));
  Tensor o_rc = make_tensor(acc_o.data(), rowcol(acc_o.layout()));
  constexpr int kRows = size<0>(decltype(s_rc.layout()){});
  float row_max[kRows], row_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
  }

  const float qk_scale = p.scale * kLog2e;
  DropoutKey dropout{};
  if (p.dropout_seed != nullptr) dropout = dropout_key(p.dropout_seed[0], p.dropout_seed[1]);

  if (blocks.begin < blocks.end) {
    load_tile<Major::K, BM, D, kThreads>(q_rows, sQ, 0, 0, tid);
    load_tile<Major::K, BN, D, kThreads>(k_rows, sK, (blocks.end - 1) * BN, 0, tid);
    cp_async_fence();
  }
  for (int n_block = blocks.end - 1; n_block >= blocks.begin; --n_block) {
    const int key_start = n_block * BN;
    cp_async_wait<0>();
    __syncthreads();  // K(n) has landed; every thread is done with V(n + 1)
    load_tile<Major::K, BN, D, kThreads>(v_rows, sV, key_start, 0, tid);
    cp_async_fence();

    clear(acc_s);
    gemm_smem(mma, acc_s, tSrQ, sQ, s2r_q_copy, tSrK, sK, s2r_k_copy, tid);

    // Scores in base-2 units; excluded keys -inf.
    const bool needs_mask = !blocks.interior(n_block) || masks.per_element();
    scale_and_mask(s_rc, qk_scale, needs_mask, masks, [&](int r, int c) {
      return make_int2(row_start + get<0>(c_rc(r, c)), key_start + get<1>(c_rc(r, c)));
    });

    // Online softmax.  A row with no visible key so far keeps max -inf; shifting by 0 then gives
    // p = exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float block_max = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) block_max = fmaxf(block_max, s_rc(r, c));
      block_max = quad_max(block_max);
      const float shift_by = block_max == -INFINITY ? 0.f : block_max;
      const float alpha = fast_exp2(row_max[r] - shift_by);
      row_max[r] = block_max;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const float prob = fast_exp2(s_rc(r, c) - shift_by);
        sum += prob;
        s_rc(r, c) = prob;
      }
      row_sum[r] = row_sum[r] * alpha + sum;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= alpha;
    }

    // Dropout after the normalizer has summed the kept and dropped weights alike (as the Triton
    // backend does): one Philox per row and 8 keys, a thread's column pairs sharing one.  The keep
    // bits are gathered by a rolled loop first: sixteen unrolled Philox rounds beside the
    // accumulators would spill.
    if (p.dropout_seed != nullptr) {
      static_assert(size<1>(decltype(s_rc.layout()){}) <= 32, "one keep bit per column in a word");
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = row_start + get<0>(c_rc(r, 0));
        uint32_t kept = 0;
#pragma unroll 1
        for (int c = 0; c < size<1>(s_rc); c += 2) {
          const int key = key_start + get<1>(c_rc(r, c));
          const Philox4 group = dropout_group(dropout, head_batch, row, key >> 3);
          kept |= uint32_t(dropout_bits(group, key) >= p.dropout_threshold) << c;
          kept |= uint32_t(dropout_bits(group, key + 1) >= p.dropout_threshold) << (c + 1);
        }
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) s_rc(r, c) = (kept >> c & 1) ? s_rc(r, c) * p.dropout_scale : 0.f;
      }
    }

    Tensor probs = make_tensor<T>(acc_s.layout());
    round_into(probs, acc_s);
    Tensor tOrP = make_tensor(probs.data(), as_a_operand(probs.layout()));

    cp_async_wait<0>();
    __syncthreads();  // V(n) has landed; every thread is done with K(n)
    if (n_block > blocks.begin) {
      load_tile<Major::K, BN, D, kThreads>(k_rows, sK, key_start - BN, 0, tid);
      cp_async_fence();
    }
    gemm_registers_smem(mma, acc_o, tOrP, tOrVt, sVt, s2r_v_copy, tid);
  }

  // out = acc / l (0 on rows without a key), lse = (m + log2 l) ln 2 (+inf there).
  Tensor o_coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
  Tensor oc_rc = make_tensor(o_coords.data(), rowcol(o_coords.layout()));
  T* out = static_cast<T*>(p.out) + batch * p.out_stride.b + head * p.out_stride.h;
  float* lse = p.lse + (int64_t(batch) * p.heads_q + head) * p.seq_len_q;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = row_start + get<0>(oc_rc(r, 0));
    const float sum = quad_sum(row_sum[r]);
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    if (row >= p.seq_len_q) continue;
    if ((tid & 3) == 0) lse[row] = sum == 0.f ? INFINITY : (row_max[r] + log2f(sum)) * kLn2;
    T* out_row = out + row * p.out_stride.l;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); c += 2) {
      const int col = get<1>(oc_rc(r, c));
      if (col < p.head_dim_v) {
        const uint32_t pair = uint32_t(T(o_rc(r, c) * inv).raw()) | uint32_t(T(o_rc(r, c + 1) * inv).raw()) << 16;
        *reinterpret_cast<uint32_t*>(out_row + col) = pair;
      }
    }
  }
}

template <class Traits>
cudaError_t launch(const ForwardProblem& p, cudaStream_t stream) {
  static_assert(Traits::kSmemBytes <= kMaxSmemBytes, "fits an sm_80 block's shared memory");
  auto kernel = forward_kernel<Traits>;
  if (Traits::kSmemBytes > 48 * 1024) {
    cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    if (error != cudaSuccess) return error;
  }
  dim3 grid(ceil_div(p.seq_len_q, Traits::kBlockM), p.batch * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Tile shapes per head dim (FlashAttention-2's sm_80 choices, narrowed where the output
// accumulator would not fit in registers beside the scores): (head dim, block M, block N).
template <class T, class Fn>
cudaError_t dispatch_head_dim(int head_dim, Fn&& fn) {
  switch (head_dim) {
#ifndef TK_COMPILE_CHECK_ONE_DTYPE
    case 32: return fn(FlashTraits<T, 32, 128, 64>{});
    case 64: return fn(FlashTraits<T, 64, 64, 64>{});
    case 96: return fn(FlashTraits<T, 96, 64, 64>{});
    case 192: return fn(FlashTraits<T, 192, 64, 32>{});
    case 256: return fn(FlashTraits<T, 256, 64, 16>{});
#endif
    case 128: return fn(FlashTraits<T, 128, 64, 64>{});
    default: return cudaErrorInvalidValue;
  }
}

template <class T>
cudaError_t forward_typed(const ForwardProblem& p, int head_dim, cudaStream_t stream) {
  return dispatch_head_dim<T>(head_dim, [&](auto traits) { return launch<decltype(traits)>(p, stream); });
}

}  // namespace
}  // namespace tk::attention
