// The GLU decoding step: a batched GEMV, z = window (B x K) . weight^T (K x 2C), K = C_in * k.
// At decoding batch sizes it is bound by reading the weight, so each warp owns one output channel c
// and streams its two weight rows (value c and gate C + c) once for kRows batch rows, 16 bytes per
// lane per load; the window rows come from L1/L2, shared by the CTA's eight warps.  The GLU and the
// residual happen in the warp that summed both halves: the gate never goes to memory (z is written
// only as the saved pre-activation).  What it reads and writes is in glu_step_tiles.h.
#include <algorithm>

#include "glu_conv.h"
#include "glu_step_tiles.h"

#include "../common/dispatch.cuh"

namespace tk::glu_conv {
namespace {

constexpr int kWarps = 8;  // output channels per CTA
constexpr int kRows = 8;   // batch rows per CTA
constexpr int kMaxGridY = 65535;

__device__ __forceinline__ float warp_sum(float v) {
  #pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// kRing: glu_conv1d_update, the window read through the ring (glu_step_tiles.h); the CTAs of the
// first channel block then store their rows' new inputs into the ring, in slots no CTA reads.
template <class T, bool kRing>
__global__ void __launch_bounds__(kWarps * 32) glu_step_kernel(const __grid_constant__ StepArgs<T> a) {
  const int lane = threadIdx.x % 32;
  const int c = blockIdx.x * kWarps + threadIdx.x / 32;

  // Batches past CUDA's 65535 cap on gridDim.y take several row groups per CTA.
  for (int b0 = blockIdx.y * kRows; b0 < a.batch; b0 += gridDim.y * kRows) {
    if (c < a.channels_out) {  // the whole warp: no barrier in this loop
      float value[kRows] = {}, gate[kRows] = {};
      a.template partial_sums<kRows, kRing>(c, b0, lane, 32, value, gate);
      #pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float value_sum = warp_sum(value[r]), gate_sum = warp_sum(gate[r]);  // in every lane
        if (lane == r && b0 + r < a.batch) a.store(b0 + r, c, value_sum, gate_sum);
      }
    }
    if constexpr (kRing) {
      if (blockIdx.x == 0) {
        const int rows = min(kRows, a.batch - b0);
        for (int i = threadIdx.x; i < rows * a.channels_in; i += blockDim.x) {
          a.store_new_input(b0 + i / a.channels_in, i % a.channels_in);
        }
      }
    }
  }
}

dim3 step_grid(const StepProblem& p) {
  return dim3(ceil_div(p.channels_out, kWarps), std::min(ceil_div(p.batch, kRows), kMaxGridY));
}

template <class T>
StepArgs<T> step_args(const StepProblem& p, const void* window, const void* weight, const void* bias,
                      const void* residual, void* out, void* preactivation) {
  return StepArgs<T>{static_cast<const T*>(window), static_cast<const T*>(weight), static_cast<const T*>(bias),
                     static_cast<const T*>(residual), static_cast<T*>(out), static_cast<T*>(preactivation),
                     p.batch, p.channels_in, p.channels_out, p.kernel_size,
                     p.residual_stride_b, p.residual_stride_c, p.out_stride_b, p.out_stride_c, p.residual_scale};
}

}  // namespace

cudaError_t step(const StepProblem& p, const void* window, const void* weight, const void* bias,
                 const void* residual, void* out, void* preactivation, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) -> cudaError_t {
    using T = decltype(element);
    if (p.batch == 0) return cudaSuccess;
    const StepArgs<T> args = step_args<T>(p, window, weight, bias, residual, out, preactivation);
    glu_step_kernel<T, false><<<step_grid(p), kWarps * 32, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

cudaError_t update(const StepProblem& p, void* ring, const void* new_input, const int64_t* position,
                   int64_t position_stride, const void* weight, const void* bias, const void* residual, void* out,
                   cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) -> cudaError_t {
    using T = decltype(element);
    if (p.batch == 0) return cudaSuccess;
    StepArgs<T> args = step_args<T>(p, ring, weight, bias, residual, out, nullptr);
    args.ring = static_cast<T*>(ring);
    args.new_input = static_cast<const T*>(new_input);
    args.position = position;
    args.position_stride = position_stride;
    glu_step_kernel<T, true><<<step_grid(p), kWarps * 32, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace tk::glu_conv
