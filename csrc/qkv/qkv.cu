// Fused QKV projection on the sm_80 tensor-core GEMM (common/gemm_sm80.cuh): the operands and
// epilogues are in qkv_tiles.h.  The weight-gradient kernel's first column of tiles also sums
// grad_bias from the gradient tiles already in shared memory, so the gradients are read once.
#include "qkv.h"
#include "qkv_tiles.h"

#include "../common/dispatch.cuh"
#include "../common/gemm_sm80.cuh"

namespace tk::qkv {
namespace {

template <class T>
TokenRows<T> token_rows(const Problem& p, const void* x) {
  return TokenRows<T>{static_cast<const T*>(x), p.heads.seq_len, p.batch * p.heads.seq_len.divisor,
                      p.heads.embed_dim.divisor, p.x_stride_b, p.x_stride_l};
}

template <class T>
HeadSplitTensors<T> head_split(const Problem& p, const void* const tensors[3]) {
  HeadSplitTensors<T> h;
  for (int i = 0; i < 3; ++i) h.ptr[i] = static_cast<const T*>(tensors[i < p.num_proj ? i : 0]);
  h.shape = p.heads;
  h.tokens = p.batch * p.heads.seq_len.divisor;
  h.features = p.num_proj * p.heads.embed_dim.divisor;
  return h;
}

}  // namespace

cudaError_t forward(const Problem& p, const void* x, const void* weight, const void* bias, void* const outputs[3],
                    cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const int features = p.num_proj * p.heads.embed_dim.divisor;
    ForwardArgs<T> args;
    args.x = XByToken<T>{token_rows<T>(p, x)};
    args.weight = WeightRows<T>{static_cast<const T*>(weight), features, p.heads.embed_dim.divisor, p.weight_stride};
    args.bias = static_cast<const T*>(bias);
    for (int i = 0; i < 3; ++i) args.out[i] = static_cast<T*>(outputs[i < p.num_proj ? i : 0]);
    args.out_shape = p.heads;
    return launch_gemm<T>(args, stream);
  });
}

cudaError_t grad_input(const Problem& p, const void* const grads[3], const void* weight, void* grad_x,
                       cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    GradInputArgs<T> args;
    args.grad = GradByToken<T>{head_split<T>(p, grads)};
    args.weight = WeightCols<T>{static_cast<const T*>(weight), args.grad.features, p.heads.embed_dim.divisor,
                                p.weight_stride};
    args.grad_x = static_cast<T*>(grad_x);
    return launch_gemm<T>(args, stream);
  });
}

cudaError_t grad_weight(const Problem& p, const void* const grads[3], const void* x, void* grad_weight,
                        void* grad_bias, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    GradWeightArgs<T> args;
    args.grad = GradByFeature<T>{head_split<T>(p, grads)};
    args.x = XByFeature<T>{token_rows<T>(p, x)};
    args.grad_weight = static_cast<T*>(grad_weight);
    args.grad_bias = static_cast<T*>(grad_bias);
    return launch_gemm<T>(args, stream);
  });
}

}  // namespace tk::qkv
