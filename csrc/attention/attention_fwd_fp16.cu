// The flash-attention forward's float16 kernels (attention_fwd.cuh).
#include "attention_fwd.cuh"

namespace tk::attention {

template <>
cudaError_t forward_for<cutlass::half_t>(const ForwardProblem& p, int padded_head_dim, cudaStream_t stream) {
  return forward_typed<cutlass::half_t>(p, padded_head_dim, stream);
}

}  // namespace tk::attention
