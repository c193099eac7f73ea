// Launchers of the GLU convolution kernels.  Raw pointers, sizes and strides only; bindings.cpp
// checks the tensors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"

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

}  // namespace tk::glu_conv
