// Fused QKV projection on the sm_80 tensor-core GEMM (common/gemm_sm80.cuh).  Tokens t = b*L + l,
// features f in [0, n*E) (projection f / E, head (f % E) / Dh, d = f % Dh):
//
//   forward      C[t, f]    = sum_e  x[t, e] W[f, e]          A = x (K-major), B = W (K-major);
//                the epilogue adds bias[f] and stores C[t, f] at its head-split place.
//   grad_input   C[t, e]    = sum_f  G[t, f] W[f, e]          A = G read head-split (K-major),
//                                                             B = W (MN-major)
//   grad_weight  C[f, e]    = sum_t  G[t, f] x[t, e]          A = G (MN-major), B = x (MN-major);
//                CTAs of the first column of tiles also sum grad_bias[f] = sum_t G[t, f] from the
//                G tiles already in shared memory.
#include "qkv.h"

#include "../common/dispatch.cuh"
#include "../common/gemm_sm80.cuh"

namespace tk::qkv {
namespace {

constexpr int kGroupM = 8;  // tile rows per group of the L2-friendly tile order

// x [B, L, E] as the token matrix: chunk (t, e) holds x[t, e..e+7].
template <class T>
struct TokenRows {
  const T* ptr;
  int seq_len, tokens, cols;
  int64_t stride_b, stride_l;

  __device__ const T* at(int t, int c) const {
    int b = t / seq_len;
    return ptr + b * stride_b + (t - b * seq_len) * stride_l + c;
  }
};

template <class T>
struct XByToken : TokenRows<T> {  // K-major: (mn, k) = (t, e)
  __device__ const T* chunk(int t, int e, bool& valid) const {
    valid = t < this->tokens && e < this->cols;
    return valid ? this->at(t, e) : this->ptr;
  }
};

template <class T>
struct XByFeature : TokenRows<T> {  // MN-major: (mn, k) = (e, t)
  __device__ const T* chunk(int e, int t, bool& valid) const {
    valid = t < this->tokens && e < this->cols;
    return valid ? this->at(t, e) : this->ptr;
  }
};

// W [n*E, E] row-major (row stride `stride`).
template <class T>
struct WeightRows {  // K-major: (mn, k) = (f, e)
  const T* ptr;
  int rows, cols;
  int64_t stride;
  __device__ const T* chunk(int f, int e, bool& valid) const {
    valid = f < rows && e < cols;
    return valid ? ptr + f * stride + e : ptr;
  }
};

template <class T>
struct WeightCols {  // MN-major: (mn, k) = (e, f)
  const T* ptr;
  int rows, cols;
  int64_t stride;
  __device__ const T* chunk(int e, int f, bool& valid) const {
    valid = f < rows && e < cols;
    return valid ? ptr + f * stride + e : ptr;
  }
};

// The n head-split gradients as one [T, n*E] matrix, read in place.
template <class T>
struct HeadSplitTensors {
  const T* ptr[3];
  HeadSplitShape shape;
  int tokens, features;

  __device__ const T* element(int t, int f) const {
    HeadSplitIndex index = head_split_index(shape, t, f);
    const T* base = index.proj == 0 ? ptr[0] : index.proj == 1 ? ptr[1] : ptr[2];
    return base + index.offset;
  }
};

template <class T>
struct GradByToken : HeadSplitTensors<T> {  // K-major: (mn, k) = (t, f)
  __device__ const T* chunk(int t, int f, bool& valid) const {
    valid = t < this->tokens && f < this->features;
    return valid ? this->element(t, f) : this->ptr[0];
  }
};

template <class T>
struct GradByFeature : HeadSplitTensors<T> {  // MN-major: (mn, k) = (f, t)
  __device__ const T* chunk(int f, int t, bool& valid) const {
    valid = t < this->tokens && f < this->features;
    return valid ? this->element(t, f) : this->ptr[0];
  }
};

template <class Traits>
__device__ TileCoord tile_of_block(int rows, int cols) {
  return grouped_tile(blockIdx.x, ceil_div(rows, Traits::kBlockM), ceil_div(cols, Traits::kBlockN), kGroupM);
}

template <class Traits>
int tiles_for(int rows, int cols) {
  return ceil_div(rows, Traits::kBlockM) * ceil_div(cols, Traits::kBlockN);
}

// ------------------------------------------------------------------------------------------------ forward

template <class T>
struct ForwardArgs {
  XByToken<T> x;
  WeightRows<T> weight;
  const T* bias;
  T* out[3];
  HeadSplitShape out_shape;
};

template <class T>
using ForwardTraits = GemmTraits<T, Major::K, Major::K>;

template <class T>
__global__ void __launch_bounds__(256, 1) qkv_forward_kernel(const __grid_constant__ ForwardArgs<T> args) {
  using Traits = ForwardTraits<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tokens = args.x.tokens, features = args.weight.rows;
  TileCoord tile = tile_of_block<Traits>(tokens, features);
  const int m0 = tile.m * Traits::kBlockM, n0 = tile.n * Traits::kBlockN;

  auto acc = make_accumulator<Traits>();
  gemm_mainloop<Traits>(args.x, args.weight, m0, n0, args.x.cols, reinterpret_cast<T*>(smem), acc, NoStageHook{});

  for_each_column_pair<Traits>(acc, m0, n0, [&](int t, int f, float v0, float v1) {
    if (t >= tokens || f >= features) return;  // features % 8 == 0: f + 1 is in range too
    if (args.bias != nullptr) {
      v0 += float(args.bias[f]);
      v1 += float(args.bias[f + 1]);
    }
    HeadSplitIndex index = head_split_index(args.out_shape, t, f);  // Dh even: f + 1 is the next d
    T* base = index.proj == 0 ? args.out[0] : index.proj == 1 ? args.out[1] : args.out[2];
    *reinterpret_cast<uint32_t*>(base + index.offset) = pack2<T>(v0, v1);
  });
}

// ------------------------------------------------------------------------------------------------ grad_input

template <class T>
struct GradInputArgs {
  GradByToken<T> grad;
  WeightCols<T> weight;
  T* grad_x;  // contiguous [T, E]
};

template <class T>
using GradInputTraits = GemmTraits<T, Major::K, Major::MN>;

template <class T>
__global__ void __launch_bounds__(256, 1) qkv_grad_input_kernel(const __grid_constant__ GradInputArgs<T> args) {
  using Traits = GradInputTraits<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tokens = args.grad.tokens, embed = args.weight.cols;
  TileCoord tile = tile_of_block<Traits>(tokens, embed);
  const int m0 = tile.m * Traits::kBlockM, n0 = tile.n * Traits::kBlockN;

  auto acc = make_accumulator<Traits>();
  gemm_mainloop<Traits>(args.grad, args.weight, m0, n0, args.grad.features, reinterpret_cast<T*>(smem), acc,
                        NoStageHook{});

  for_each_column_pair<Traits>(acc, m0, n0, [&](int t, int e, float v0, float v1) {
    if (t >= tokens || e >= embed) return;
    *reinterpret_cast<uint32_t*>(args.grad_x + int64_t(t) * embed + e) = pack2<T>(v0, v1);
  });
}

// ------------------------------------------------------------------------------------------------ grad_weight

template <class T>
struct GradWeightArgs {
  GradByFeature<T> grad;
  XByFeature<T> x;
  T* grad_weight;  // contiguous [n*E, E]
  T* grad_bias;    // [n*E] or null
};

template <class T>
using GradWeightTraits = GemmTraits<T, Major::MN, Major::MN>;

template <class T>
__global__ void __launch_bounds__(256, 1) qkv_grad_weight_kernel(const __grid_constant__ GradWeightArgs<T> args) {
  using Traits = GradWeightTraits<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int features = args.grad.features, embed = args.x.cols;
  TileCoord tile = tile_of_block<Traits>(features, embed);
  const int m0 = tile.m * Traits::kBlockM, n0 = tile.n * Traits::kBlockN;

  // The first column of tiles sums grad_bias: thread f < BM adds row f of every G tile (zero-filled
  // past the last token), so the gradients are read once for both results.
  const bool sums_bias = args.grad_bias != nullptr && tile.n == 0;
  float bias_sum = 0.f;
  auto sum_bias = [&](const auto& g_tile, int) {
    if (sums_bias && threadIdx.x < Traits::kBlockM) {
      CUTE_UNROLL
      for (int k = 0; k < Traits::kBlockK; ++k) bias_sum += float(g_tile(threadIdx.x, k));
    }
  };

  auto acc = make_accumulator<Traits>();
  gemm_mainloop<Traits>(args.grad, args.x, m0, n0, args.grad.tokens, reinterpret_cast<T*>(smem), acc, sum_bias);

  for_each_column_pair<Traits>(acc, m0, n0, [&](int f, int e, float v0, float v1) {
    if (f >= features || e >= embed) return;
    *reinterpret_cast<uint32_t*>(args.grad_weight + int64_t(f) * embed + e) = pack2<T>(v0, v1);
  });
  const int f = m0 + threadIdx.x;
  if (sums_bias && threadIdx.x < Traits::kBlockM && f < features) args.grad_bias[f] = T(bias_sum);
}

// ------------------------------------------------------------------------------------------------ launch

template <class T>
TokenRows<T> token_rows(const Problem& p, const void* x) {
  return TokenRows<T>{static_cast<const T*>(x), p.heads.seq_len, p.batch * p.heads.seq_len, p.heads.embed_dim,
                      p.x_stride_b, p.x_stride_l};
}

template <class T>
HeadSplitTensors<T> head_split(const Problem& p, const void* const tensors[3]) {
  HeadSplitTensors<T> h;
  for (int i = 0; i < 3; ++i) h.ptr[i] = static_cast<const T*>(tensors[i < p.num_proj ? i : 0]);
  h.shape = p.heads;
  h.tokens = p.batch * p.heads.seq_len;
  h.features = p.num_proj * p.heads.embed_dim;
  return h;
}

template <class Traits, class Args>
cudaError_t launch(void (*kernel)(Args), const Args& args, int tiles, cudaStream_t stream) {
  static_assert(Traits::kSmemBytes <= 48 * 1024, "within the default dynamic shared memory limit");
  if (tiles == 0) return cudaSuccess;
  kernel<<<tiles, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t forward(const Problem& p, const void* x, const void* weight, const void* bias, void* const outputs[3],
                    cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const int features = p.num_proj * p.heads.embed_dim;
    ForwardArgs<T> args;
    args.x = XByToken<T>{token_rows<T>(p, x)};
    args.weight = WeightRows<T>{static_cast<const T*>(weight), features, p.heads.embed_dim, p.weight_stride};
    args.bias = static_cast<const T*>(bias);
    for (int i = 0; i < 3; ++i) args.out[i] = static_cast<T*>(outputs[i < p.num_proj ? i : 0]);
    args.out_shape = p.heads;
    return launch<ForwardTraits<T>>(qkv_forward_kernel<T>, args,
                                    tiles_for<ForwardTraits<T>>(args.x.tokens, features), stream);
  });
}

cudaError_t grad_input(const Problem& p, const void* const grads[3], const void* weight, void* grad_x,
                       cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    GradInputArgs<T> args;
    args.grad = GradByToken<T>{head_split<T>(p, grads)};
    args.weight = WeightCols<T>{static_cast<const T*>(weight), args.grad.features, p.heads.embed_dim,
                                p.weight_stride};
    args.grad_x = static_cast<T*>(grad_x);
    return launch<GradInputTraits<T>>(qkv_grad_input_kernel<T>, args,
                                      tiles_for<GradInputTraits<T>>(args.grad.tokens, p.heads.embed_dim), stream);
  });
}

cudaError_t grad_weight(const Problem& p, const void* const grads[3], const void* x, void* grad_weight,
                        void* grad_bias, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    GradWeightArgs<T> args;
    args.grad = GradByFeature<T>{head_split<T>(p, grads)};
    args.x = XByFeature<T>{token_rows<T>(p, x)};
    args.grad_weight = static_cast<T*>(grad_weight);
    args.grad_bias = static_cast<T*>(grad_bias);
    return launch<GradWeightTraits<T>>(qkv_grad_weight_kernel<T>, args,
                                       tiles_for<GradWeightTraits<T>>(args.grad.features, p.heads.embed_dim),
                                       stream);
  });
}

}  // namespace tk::qkv
