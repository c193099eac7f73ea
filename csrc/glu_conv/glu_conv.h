// Launchers of the GLU convolution kernels.  Raw pointers, sizes and strides only; bindings.cpp
// checks the tensors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"
#include "../common/index.h"

namespace tk::glu_conv {

// One decoding step: the window [B, C_in, k] (state then the new input, contiguous) convolved with
// weight [2C, C_in, k] (contiguous) gives the pre-activation z [B, 2C] (written: backward needs
// it) and out[b, c] = (z[b, c] * sigmoid(z[b, C + c]) + residual[b, c]) * residual_scale.
// Requires C_in * k % 8 == 0 and 16-byte aligned window and weight.
struct StepProblem {
  DType dtype;
  int batch, channels_in, channels_out, kernel_size;
  int64_t residual_stride_b, residual_stride_c;
  int64_t out_stride_b, out_stride_c;
  float residual_scale;
};

cudaError_t step(const StepProblem& p, const void* window, const void* weight, const void* bias,
                 const void* residual, void* out, void* preactivation, cudaStream_t stream);

// The same step in place (glu_conv1d_update): the window's first k - 1 inputs from the ring
// [B, C_in, k] (contiguous; input position p in slot p % k), its last from new_input [B, C_in]
// (contiguous), the rows' positions position[b * position_stride] (stride 0: one for every row);
// new_input is then stored into slot p % k.  No pre-activation.  Requires what step requires, of
// the ring in place of the window.
cudaError_t update(const StepProblem& p, void* ring, const void* new_input, const int64_t* position,
                   int64_t position_stride, const void* weight, const void* bias, const void* residual, void* out,
                   cudaStream_t stream);

// Whole-sequence convolution (glu_conv.cu), implicit GEMMs over (k x C_in) on the sm_80 tensor-core GEMM.
// Tensors in the kernels' layouts (the Python backend converts):
//   xpad          [B, Lp, C_in] contiguous: x padded with pad_value, channel-last, Lp = L_out + k - 1
//   packed weight [2C, k * C_in] contiguous, rows interleaved: row 2c is value channel c, row 2c + 1
//                 its gate channel C + c; column tap * C_in + ci holds weight[., ci, tap]
//   packed bias   [2C] interleaved the same way (or null)
//   grad_z        [B * L_out, 2C] contiguous, columns interleaved the same way
// [B, C, L]-shaped tensors (out, residual, grad_out, grad_x) are addressed through their strides.
// Requires C_in % 8 == 0, C % 4 == 0 and 16-byte aligned contiguous buffers.
struct ConvProblem {
  DType dtype;
  int batch, channels_in, channels_out, kernel_size;
  int length_in, length_out, pad_left;
  float residual_scale;
};

// out = (glu(z) + residual) * residual_scale.
cudaError_t forward(const ConvProblem& p, const void* xpad, const void* packed_weight, const void* packed_bias,
                    const void* residual, Strides3 residual_strides, void* out, Strides3 out_strides,
                    cudaStream_t stream);

// Backward's first step: recomputes z from xpad and writes grad_z from grad_out.
cudaError_t grad_preactivation(const ConvProblem& p, const void* xpad, const void* packed_weight,
                               const void* packed_bias, const void* grad_out, Strides3 grad_out_strides,
                               void* grad_z, cudaStream_t stream);

// grad_x [B, C_in, L] (any strides): the transposed convolution of grad_z.
cudaError_t grad_input(const ConvProblem& p, const void* grad_z, const void* packed_weight, void* grad_x,
                       Strides3 grad_x_strides, cudaStream_t stream);

// The packed weight's gradient [2C, k * C_in] and the packed bias's [2C] (skipped when null).
cudaError_t grad_weight(const ConvProblem& p, const void* grad_z, const void* xpad, void* grad_packed_weight,
                        void* grad_packed_bias, cudaStream_t stream);

}  // namespace tk::glu_conv
