// The GLU convolution as implicit GEMMs on the sm_80 tensor-core GEMM (common/gemm_sm80.cuh); the
// operands and epilogues are in glu_conv_tiles.h.  The padded channel-last xpad makes every tap's
// tile a 16-byte aligned K-major load with no padding predicate; its cost is one pass over x (the
// Python backend builds it).
#include "glu_conv.h"
#include "glu_conv_tiles.h"

#include "../common/dispatch.cuh"
#include "../common/gemm_sm80.cuh"

namespace tk::glu_conv {
namespace {

ConvShape shape_of(const ConvProblem& p) {
  return ConvShape{p.batch, p.channels_in, 2 * p.channels_out, p.kernel_size, p.length_in, p.length_out, p.pad_left};
}

template <bool kGrad>
cudaError_t preactivation(const ConvProblem& p, const void* xpad, const void* packed_weight, const void* packed_bias,
                          const void* other, Strides3 other_strides, void* out, Strides3 out_strides,
                          cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const ConvShape shape = shape_of(p);
    PreactivationArgs<T, kGrad> args{{static_cast<const T*>(xpad), shape},
                                     {static_cast<const T*>(packed_weight), shape},
                                     static_cast<const T*>(packed_bias),
                                     static_cast<const T*>(other),
                                     other_strides,
                                     static_cast<T*>(out),
                                     out_strides,
                                     p.residual_scale};
    return launch_gemm<T>(args, stream);
  });
}

}  // namespace

cudaError_t forward(const ConvProblem& p, const void* xpad, const void* packed_weight, const void* packed_bias,
                    const void* residual, Strides3 residual_strides, void* out, Strides3 out_strides,
                    cudaStream_t stream) {
  return preactivation<false>(p, xpad, packed_weight, packed_bias, residual, residual_strides, out, out_strides,
                              stream);
}

cudaError_t grad_preactivation(const ConvProblem& p, const void* xpad, const void* packed_weight,
                               const void* packed_bias, const void* grad_out, Strides3 grad_out_strides,
                               void* grad_z, cudaStream_t stream) {
  return preactivation<true>(p, xpad, packed_weight, packed_bias, grad_out, grad_out_strides, grad_z,
                             Strides3{0, 0, 0}, stream);
}

cudaError_t grad_input(const ConvProblem& p, const void* grad_z, const void* packed_weight, void* grad_x,
                       Strides3 grad_x_strides, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const ConvShape shape = shape_of(p);
    GradInputArgs<T> args{{static_cast<const T*>(grad_z), shape},
                          {static_cast<const T*>(packed_weight), shape},
                          static_cast<T*>(grad_x),
                          grad_x_strides};
    return launch_gemm<T>(args, stream);
  });
}

cudaError_t grad_weight(const ConvProblem& p, const void* grad_z, const void* xpad, void* grad_packed_weight,
                        void* grad_packed_bias, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto element) {
    using T = decltype(element);
    const ConvShape shape = shape_of(p);
    GradWeightArgs<T> args{{static_cast<const T*>(grad_z), shape},
                           {{static_cast<const T*>(xpad), shape}},
                           static_cast<T*>(grad_packed_weight),
                           static_cast<T*>(grad_packed_bias)};
    return launch_gemm<T>(args, stream);
  });
}

}  // namespace tk::glu_conv
