// The GLU decoding step: a batched GEMV, z = window (B x K) . weight^T (K x 2C), K = C_in * k.
// At decoding batch sizes it is bound by reading the weight, so each warp owns one output channel c
// and streams its two weight rows (value c and gate C + c) once for kRows batch rows, 16 bytes per
// lane per load; the window rows come from L1/L2, shared by the CTA's eight warps.  The GLU and the
// residual happen in the warp that summed both halves: the gate never goes to memory (z is written
// only as the saved pre-activation).
#include "glu_conv.h"

#include "../common/dispatch.cuh"
#include "../common/epilogue.h"
#include "../common/index.h"

namespace tk::glu_conv {
namespace {

constexpr int kWarps = 8;     // output channels per CTA
constexpr int kRows = 8;      // batch rows per CTA
constexpr int kVector = 8;    // elements per 16-byte load

template <class T>
struct StepArgs {
  const T* window;
  const T* weight;
  const T* bias;
  const T* residual;
  T* out;
  T* preactivation;
  StepProblem p;
};

template <class T>
__device__ __forceinline__ void load_vector(const T* src, float (&dst)[kVector]) {
  uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* values = reinterpret_cast<const T*>(&raw);
  #pragma unroll
  for (int i = 0; i < kVector; ++i) dst[i] = float(values[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
  #pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <class T>
__global__ void __launch_bounds__(kWarps * 32) glu_step_kernel(const __grid_constant__ StepArgs<T> a) {
  const StepProblem& p = a.p;
  const int lane = threadIdx.x % 32;
  const int c = blockIdx.x * kWarps + threadIdx.x / 32;
  const int b0 = blockIdx.y * kRows;
  if (c >= p.channels_out) return;
  const int width = p.channels_in * p.kernel_size;
  const T* value_row = a.weight + int64_t(c) * width;
  const T* gate_row = a.weight + int64_t(c + p.channels_out) * width;
  const int rows = p.batch - b0 < kRows ? p.batch - b0 : kRows;

  float acc_value[kRows] = {}, acc_gate[kRows] = {};
  for (int k = lane * kVector; k < width; k += 32 * kVector) {
    float w_value[kVector], w_gate[kVector];
    load_vector(value_row + k, w_value);
    load_vector(gate_row + k, w_gate);
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < rows) {
        float x[kVector];
        load_vector(a.window + int64_t(b0 + r) * width + k, x);
        #pragma unroll
        for (int i = 0; i < kVector; ++i) {
          acc_value[r] = fmaf(x[i], w_value[i], acc_value[r]);
          acc_gate[r] = fmaf(x[i], w_gate[i], acc_gate[r]);
        }
      }
    }
  }

  const float bias_value = a.bias != nullptr ? float(a.bias[c]) : 0.f;
  const float bias_gate = a.bias != nullptr ? float(a.bias[c + p.channels_out]) : 0.f;
  #pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float value = warp_sum(acc_value[r]) + bias_value;  // every lane holds the sums
    float gate = warp_sum(acc_gate[r]) + bias_gate;
    if (lane == r && r < rows) {
      const int64_t b = b0 + r;
      a.preactivation[b * 2 * p.channels_out + c] = T(value);
      a.preactivation[b * 2 * p.channels_out + p.channels_out + c] = T(gate);
      const float residual =
          a.residual != nullptr ? float(a.residual[b * p.residual_stride_b + c * p.residual_stride_c]) : 0.f;
      a.out[b * p.out_stride_b + c * p.out_stride_c] = T(glu_residual(value, gate, residual, p.residual_scale));
    }
  }
}

}  // namespace

cudaError_t step(const StepProblem& p, const void* window, const void* weight, const void* bias,
                 const void* residual, void* out, void* preactivation, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) -> cudaError_t {
    using T = decltype(element);
    if (p.batch == 0) return cudaSuccess;
    StepArgs<T> args{static_cast<const T*>(window), static_cast<const T*>(weight), static_cast<const T*>(bias),
                     static_cast<const T*>(residual), static_cast<T*>(out), static_cast<T*>(preactivation), p};
    dim3 grid(ceil_div(p.channels_out, kWarps), ceil_div(p.batch, kRows));
    glu_step_kernel<T><<<grid, kWarps * 32, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace tk::glu_conv
