// The flash-attention backward's float16 kernels (attention_bwd.cuh).
#include "attention_bwd.cuh"

namespace tk::attention {

template <>
cudaError_t backward_for<cutlass::half_t>(const BackwardProblem& p, int padded_head_dim, cudaStream_t stream) {
  return backward_typed<cutlass::half_t>(p, padded_head_dim, stream);
}

}  // namespace tk::attention
