// The attention launchers' dispatch on element type and padded head dim (attention.h); the kernels
// live in one source file per direction and type.
#include <cutlass/numeric_types.h>

#include "attention.h"

#include "../common/dispatch.cuh"

namespace tk::attention {

int padded_head_dim(int head_dim) {
  for (int padded : {32, 64, 96, 128, 192, 256}) {
    if (head_dim <= padded) return padded;
  }
  return 0;
}

cudaError_t forward(const ForwardProblem& p, cudaStream_t stream) {
  const int head_dim = padded_head_dim(p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v);
  return dispatch_dtype(p.dtype, [&](auto element) { return forward_for<decltype(element)>(p, head_dim, stream); });
}

cudaError_t backward(const BackwardProblem& p, cudaStream_t stream) {
  const int head_dim = padded_head_dim(p.fwd.head_dim > p.fwd.head_dim_v ? p.fwd.head_dim : p.fwd.head_dim_v);
  return dispatch_dtype(p.fwd.dtype,
                        [&](auto element) { return backward_for<decltype(element)>(p, head_dim, stream); });
}

}  // namespace tk::attention
