// Launchers of the fused QKV projection kernels (qkv.cu).  Raw pointers, sizes and strides only;
// bindings.cpp checks the tensors.  Shapes: x [B, L, E] (unit stride along E), weight [n*E, E]
// (unit stride along its rows), each of the n head-split tensors [B, H, L, Dh] with strides shared
// by all n and unit stride along Dh.  Requirements the launchers rely on: E % 8 == 0 and
// Dh % 8 == 0 (16-byte chunks never straddle a head or a row end), 16-byte aligned pointers and
// row strides that are multiples of 8 elements.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"
#include "../common/index.h"

namespace tk::qkv {

struct Problem {
  DType dtype;
  int num_proj;   // n
  int batch;      // B
  HeadSplitShape heads;  // L, E, Dh and the head-split tensors' strides
  int64_t x_stride_b, x_stride_l;
  int64_t weight_stride;  // between weight rows
};

// outputs[i] = x @ weight[i*E:(i+1)*E]^T + bias[i*E:(i+1)*E], head-split (bias may be null).
cudaError_t forward(const Problem& p, const void* x, const void* weight, const void* bias, void* const outputs[3],
                    cudaStream_t stream);

// grad_x (contiguous [B, L, E]) = sum_i grads[i] @ weight[i*E:(i+1)*E].
cudaError_t grad_input(const Problem& p, const void* const grads[3], const void* weight, void* grad_x,
                       cudaStream_t stream);

// grad_weight (contiguous [n*E, E]) = grad^T @ x and grad_bias [n*E] = the column sums of grad
// (skipped when grad_bias is null), in one pass over the gradients.
cudaError_t grad_weight(const Problem& p, const void* const grads[3], const void* x, void* grad_weight,
                        void* grad_bias, cudaStream_t stream);

}  // namespace tk::qkv
