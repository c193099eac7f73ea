// The GLU convolution as implicit GEMMs on the sm_80 tensor-core GEMM (common/gemm_sm80.cuh), over
// tokens t = b * L_out + s, interleaved channels n in [0, 2C) (n = 2c: value c, n = 2c + 1: gate c)
// and the reduction index j = tap * C_in + ci:
//
//   forward / grad_preactivation
//                C[t, n]   = sum_j xpad[b, s + tap, ci] Wp[n, j]          A K-major, B K-major
//                the epilogue sees each column pair (2c, 2c + 1), value and gate of one channel, in
//                one thread: out = (value * sigmoid(gate) + residual) * scale, or grad_z.
//   grad_input   C[(b, p), ci] = sum_(tap, n) grad_z[b, p + pad_left - tap, n] Wp[n, tap * C_in + ci]
//                                                                        A K-major, B MN-major
//   grad_weight  C[n, j]   = sum_t grad_z[t, n] xpad[b, s + tap, ci]      A MN-major, B MN-major;
//                the first column of tiles also sums the bias gradient.
// The padded channel-last xpad makes every tap's tile a 16-byte aligned K-major load with no
// padding predicate; its cost is one pass over x (the Python backend builds it).
#include "glu_conv.h"

#include "../common/dispatch.cuh"
#include "../common/epilogue.h"
#include "../common/gemm_sm80.cuh"

namespace tk::glu_conv {
namespace {

constexpr int kGroupM = 8;

struct Shape {
  int batch, channels_in, channels_z, kernel_size, length_in, length_out, pad_left;
  __device__ int tokens() const { return batch * length_out; }
  __device__ int padded_length() const { return length_out + kernel_size - 1; }
  __device__ int window() const { return kernel_size * channels_in; }
};

// xpad [B, Lp, C_in] by token: K-major (mn, k) = (t, j).
template <class T>
struct XpadByToken {
  const T* ptr;
  Shape shape;
  __device__ const T* chunk(int t, int j, bool& valid) const {
    valid = t < shape.tokens() && j < shape.window();
    if (!valid) return ptr;
    int b = t / shape.length_out, s = t - b * shape.length_out;
    int tap = j / shape.channels_in, ci = j - tap * shape.channels_in;
    return ptr + (int64_t(b) * shape.padded_length() + s + tap) * shape.channels_in + ci;
  }
};

// xpad by reduction index: MN-major (mn, k) = (j, t).
template <class T>
struct XpadByWindow {
  XpadByToken<T> rows;
  __device__ const T* chunk(int j, int t, bool& valid) const { return rows.chunk(t, j, valid); }
};

// Wp [2C, k * C_in]: K-major (mn, k) = (n, j).
template <class T>
struct PackedWeightRows {
  const T* ptr;
  Shape shape;
  __device__ const T* chunk(int n, int j, bool& valid) const {
    valid = n < shape.channels_z && j < shape.window();
    return valid ? ptr + int64_t(n) * shape.window() + j : ptr;
  }
};

// Wp for the transposed convolution: MN-major (mn, k) = (ci, tap * 2C + n).
template <class T>
struct PackedWeightByInput {
  const T* ptr;
  Shape shape;
  __device__ const T* chunk(int ci, int k, bool& valid) const {
    valid = ci < shape.channels_in && k < shape.kernel_size * shape.channels_z;
    if (!valid) return ptr;
    int tap = k / shape.channels_z, n = k - tap * shape.channels_z;
    return ptr + int64_t(n) * shape.window() + tap * shape.channels_in + ci;
  }
};

// grad_z [B * L_out, 2C] for the transposed convolution: K-major (mn, k) = ((b, p), tap * 2C + n),
// reading output position s = p + pad_left - tap (zero outside [0, L_out): padding takes no gradient).
template <class T>
struct GradZByInput {
  const T* ptr;
  Shape shape;
  __device__ const T* chunk(int m, int k, bool& valid) const {
    int b = m / shape.length_in, p = m - b * shape.length_in;
    int tap = k / shape.channels_z, n = k - tap * shape.channels_z;
    int s = p + shape.pad_left - tap;  // the output position that read p through this tap
    valid = m < shape.batch * shape.length_in && k < shape.kernel_size * shape.channels_z &&
            in_sequence(s, shape.length_out);
    return valid ? ptr + (int64_t(b) * shape.length_out + s) * shape.channels_z + n : ptr;
  }
};

// grad_z by channel: MN-major (mn, k) = (n, t).
template <class T>
struct GradZByChannel {
  const T* ptr;
  Shape shape;
  __device__ const T* chunk(int n, int t, bool& valid) const {
    valid = n < shape.channels_z && t < shape.tokens();
    return valid ? ptr + int64_t(t) * shape.channels_z + n : ptr;
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
struct PreactivationArgs {
  XpadByToken<T> x;
  PackedWeightRows<T> weight;
  const T* bias;       // packed, or null
  const T* other;      // forward: residual (or null); grad: grad_out
  Strides3 other_strides;
  T* out;              // forward: out [B, C, L_out] (out_strides); grad: grad_z
  Strides3 out_strides;
  float residual_scale;
};

template <class T>
using PreactivationTraits = GemmTraits<T, Major::K, Major::K>;

// kGrad false: the forward epilogue; true: grad_z, recomputing the pre-activation.
template <class T, bool kGrad>
__global__ void __launch_bounds__(256, 1) glu_preactivation_kernel(const __grid_constant__ PreactivationArgs<T> a) {
  using Traits = PreactivationTraits<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const Shape& shape = a.x.shape;
  const int tokens = shape.tokens(), channels_z = shape.channels_z;
  TileCoord tile = tile_of_block<Traits>(tokens, channels_z);
  const int m0 = tile.m * Traits::kBlockM, n0 = tile.n * Traits::kBlockN;

  auto acc = make_accumulator<Traits>();
  gemm_mainloop<Traits>(a.x, a.weight, m0, n0, shape.window(), reinterpret_cast<T*>(smem), acc, NoStageHook{});

  for_each_column_pair<Traits>(acc, m0, n0, [&](int t, int n, float value, float gate) {
    if (t >= tokens || n >= channels_z) return;  // channels_z % 8 == 0: n + 1 is in range too
    if (a.bias != nullptr) {
      value += float(a.bias[n]);
      gate += float(a.bias[n + 1]);
    }
    const int b = t / shape.length_out, s = t - b * shape.length_out, c = n / 2;
    const int64_t at_other = b * a.other_strides.b + c * a.other_strides.c + s * a.other_strides.l;
    if constexpr (kGrad) {
      GluGrad g = glu_residual_grad(value, gate, float(a.other[at_other]), a.residual_scale);
      *reinterpret_cast<uint32_t*>(a.out + int64_t(t) * channels_z + n) = pack2<T>(g.value, g.gate);
    } else {
      const float residual = a.other != nullptr ? float(a.other[at_other]) : 0.f;
      a.out[b * a.out_strides.b + c * a.out_strides.c + s * a.out_strides.l] =
          T(glu_residual(value, gate, residual, a.residual_scale));
    }
  });
}

// ------------------------------------------------------------------------------------------------ grad_input

template <class T>
struct GradInputArgs {
  GradZByInput<T> grad_z;
  PackedWeightByInput<T> weight;
  T* grad_x;
  Strides3 grad_x_strides;
};

template <class T>
using GradInputTraits = GemmTraits<T, Major::K, Major::MN>;

template <class T>
__global__ void __launch_bounds__(256, 1) glu_grad_input_kernel(const __grid_constant__ GradInputArgs<T> a) {
  using Traits = GradInputTraits<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const Shape& shape = a.grad_z.shape;
  const int rows = shape.batch * shape.length_in;
  TileCoord tile = tile_of_block<Traits>(rows, shape.channels_in);
  const int m0 = tile.m * Traits::kBlockM, n0 = tile.n * Traits::kBlockN;

  auto acc = make_accumulator<Traits>();
  gemm_mainloop<Traits>(a.grad_z, a.weight, m0, n0, shape.kernel_size * shape.channels_z,
                        reinterpret_cast<T*>(smem), acc, NoStageHook{});

  for_each_column_pair<Traits>(acc, m0, n0, [&](int m, int ci, float v0, float v1) {
    if (m >= rows || ci >= shape.channels_in) return;  // channels_in % 8 == 0: ci + 1 too
    const int b = m / shape.length_in, p = m - b * shape.length_in;
    T* at = a.grad_x + b * a.grad_x_strides.b + ci * a.grad_x_strides.c + p * a.grad_x_strides.l;
    at[0] = T(v0);
    at[a.grad_x_strides.c] = T(v1);
  });
}

// ------------------------------------------------------------------------------------------------ grad_weight

template <class T>
struct GradWeightArgs {
  GradZByChannel<T> grad_z;
  XpadByWindow<T> x;
  T* grad_weight;  // [2C, k * C_in]
  T* grad_bias;    // [2C] or null
};

template <class T>
using GradWeightTraits = GemmTraits<T, Major::MN, Major::MN>;

template <class T>
__global__ void __launch_bounds__(256, 1) glu_grad_weight_kernel(const __grid_constant__ GradWeightArgs<T> a) {
  using Traits = GradWeightTraits<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  const Shape& shape = a.grad_z.shape;
  TileCoord tile = tile_of_block<Traits>(shape.channels_z, shape.window());
  const int m0 = tile.m * Traits::kBlockM, n0 = tile.n * Traits::kBlockN;

  const bool sums_bias = a.grad_bias != nullptr && tile.n == 0;
  float bias_sum = 0.f;
  auto sum_bias = [&](const auto& g_tile, int) {
    if (sums_bias && threadIdx.x < Traits::kBlockM) {
      CUTE_UNROLL
      for (int k = 0; k < Traits::kBlockK; ++k) bias_sum += float(g_tile(threadIdx.x, k));
    }
  };

  auto acc = make_accumulator<Traits>();
  gemm_mainloop<Traits>(a.grad_z, a.x, m0, n0, shape.tokens(), reinterpret_cast<T*>(smem), acc, sum_bias);

  for_each_column_pair<Traits>(acc, m0, n0, [&](int n, int j, float v0, float v1) {
    if (n >= shape.channels_z || j >= shape.window()) return;
    *reinterpret_cast<uint32_t*>(a.grad_weight + int64_t(n) * shape.window() + j) = pack2<T>(v0, v1);
  });
  const int n = m0 + threadIdx.x;
  if (sums_bias && threadIdx.x < Traits::kBlockM && n < shape.channels_z) a.grad_bias[n] = T(bias_sum);
}

// ------------------------------------------------------------------------------------------------ launch

Shape shape_of(const ConvProblem& p) {
  return Shape{p.batch, p.channels_in, 2 * p.channels_out, p.kernel_size, p.length_in, p.length_out, p.pad_left};
}

template <class Traits, class Args>
cudaError_t launch(void (*kernel)(Args), const Args& args, int tiles, cudaStream_t stream) {
  static_assert(Traits::kSmemBytes <= 48 * 1024, "within the default dynamic shared memory limit");
  if (tiles == 0) return cudaSuccess;
  kernel<<<tiles, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

template <bool kGrad>
cudaError_t preactivation(const ConvProblem& p, const void* xpad, const void* packed_weight, const void* packed_bias,
                          const void* other, Strides3 other_strides, void* out, Strides3 out_strides,
                          cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const Shape shape = shape_of(p);
    PreactivationArgs<T> args{XpadByToken<T>{static_cast<const T*>(xpad), shape},
                              PackedWeightRows<T>{static_cast<const T*>(packed_weight), shape},
                              static_cast<const T*>(packed_bias),
                              static_cast<const T*>(other),
                              other_strides,
                              static_cast<T*>(out),
                              out_strides,
                              p.residual_scale};
    return launch<PreactivationTraits<T>>(glu_preactivation_kernel<T, kGrad>, args,
                                          tiles_for<PreactivationTraits<T>>(p.batch * p.length_out, shape.channels_z),
                                          stream);
  });
}

}  // namespace

cudaError_t forward(const ConvProblem& p, const void* xpad, const void* packed_weight, const void* packed_bias,
                    const void* residual, Strides3 residual_strides, void* out, Strides3 out_strides,
                    cudaStream_t stream) {
  return preactivation<false>(p, xpad, packed_weight, packed_bias, residual, residual_strides, out, out_strides,
                              stream);
}

cudaError_t grad_preactivation(const ConvProblem& p, const void* xpad, const void* packed_weight,
                               const void* packed_bias, const void* grad_out, Strides3 grad_out_strides,
                               void* grad_z, cudaStream_t stream) {
  return preactivation<true>(p, xpad, packed_weight, packed_bias, grad_out, grad_out_strides, grad_z,
                             Strides3{0, 0, 0}, stream);
}

cudaError_t grad_input(const ConvProblem& p, const void* grad_z, const void* packed_weight, void* grad_x,
                       Strides3 grad_x_strides, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const Shape shape = shape_of(p);
    GradInputArgs<T> args{GradZByInput<T>{static_cast<const T*>(grad_z), shape},
                          PackedWeightByInput<T>{static_cast<const T*>(packed_weight), shape},
                          static_cast<T*>(grad_x), grad_x_strides};
    return launch<GradInputTraits<T>>(glu_grad_input_kernel<T>, args,
                                      tiles_for<GradInputTraits<T>>(p.batch * p.length_in, p.channels_in), stream);
  });
}

cudaError_t grad_weight(const ConvProblem& p, const void* grad_z, const void* xpad, void* grad_packed_weight,
                        void* grad_packed_bias, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const Shape shape = shape_of(p);
    GradWeightArgs<T> args{GradZByChannel<T>{static_cast<const T*>(grad_z), shape},
                           XpadByWindow<T>{XpadByToken<T>{static_cast<const T*>(xpad), shape}},
                           static_cast<T*>(grad_packed_weight), static_cast<T*>(grad_packed_bias)};
    return launch<GradWeightTraits<T>>(glu_grad_weight_kernel<T>, args,
                                       tiles_for<GradWeightTraits<T>>(shape.channels_z, p.kernel_size * p.channels_in),
                                       stream);
  });
}

}  // namespace tk::glu_conv
