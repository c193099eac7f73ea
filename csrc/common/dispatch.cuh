// Dtype dispatch for the launchers.  Defining TK_COMPILE_CHECK_ONE_DTYPE instantiates float16 only:
// tests/test_cuda_compile.py builds that representative instantiation of every kernel in CI, where
// compile time is scarce; the extension build and benchmarks/gpu_check.sh instantiate both.
#pragma once

#include <cutlass/numeric_types.h>

#include "dtype.h"

namespace tk {

template <class Fn>
cudaError_t dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kHalf:
      return fn(cutlass::half_t{});
#ifndef TK_COMPILE_CHECK_ONE_DTYPE
    case DType::kBFloat16:
      return fn(cutlass::bfloat16_t{});
#endif
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace tk
