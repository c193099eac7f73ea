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

template <class T>
__global__ void __launch_bounds__(kWarps * 32) glu_step_kernel(const __grid_constant__ StepArgs<T> a) {
  const int lane = threadIdx.x % 32;
  const int c = blockIdx.x * kWarps + threadIdx.x / 32;
  if (c >= a.channels_out) return;  // the whole warp: no barrier follows

  // Batches past CUDA's 65535 cap on gridDim.y take several row groups per CTA.
  for (int b0 = blockIdx.y * kRows; b0 < a.batch; b0 += gridDim.y * kRows) {
    float value[kRows] = {}, gate[kRows] = {};
    a.template partial_sums<kRows>(c, b0, lane, 32, value, gate);
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float value_sum = warp_sum(value[r]), gate_sum = warp_sum(gate[r]);  // in every lane
      if (lane == r && b0 + r < a.batch) a.store(b0 + r, c, value_sum, gate_sum);
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
                     static_cast<const T*>(residual), static_cast<T*>(out), static_cast<T*>(preactivation),
                     p.batch, p.channels_in, p.channels_out, p.kernel_size,
                     p.residual_stride_b, p.residual_stride_c, p.out_stride_b, p.out_stride_c, p.residual_scale};
    dim3 grid(ceil_div(p.channels_out, kWarps), std::min(ceil_div(p.batch, kRows), kMaxGridY));
    glu_step_kernel<T><<<grid, kWarps * 32, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace tk::glu_conv
