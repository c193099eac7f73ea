// Epilogue arithmetic in fp32, shared by the kernels and unit-tested on the host
// (tests/test_cuda_host.py) against torch's own functions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "index.h"

namespace tk {

TK_HOST_DEVICE float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  return 1.f / (1.f + __expf(-x));
#else
  return 1.f / (1.f + std::exp(-x));
#endif
}

// out = (value * sigmoid(gate) + residual) * scale: F.glu of the two halves, then the residual.
TK_HOST_DEVICE float glu_residual(float value, float gate, float residual, float scale) {
  return (value * sigmoid(gate) + residual) * scale;
}

// The gradients of glu_residual with respect to value and gate, given the output's gradient.
struct GluGrad {
  float value;
  float gate;
};

TK_HOST_DEVICE GluGrad glu_residual_grad(float value, float gate, float grad_out, float scale) {
  float s = sigmoid(gate);
  float g = grad_out * scale * s;
  return GluGrad{g, g * value * (1.f - s)};
}

// Stores two adjacent outputs; 16-bit types in one 32-bit store (the address is 4-byte aligned: the
// column pair starts at an even column of a row whose length is a multiple of 8).
template <class T>
TK_HOST_DEVICE void store_pair(T* at, float v0, float v1) {
  if constexpr (sizeof(T) == 2) {
    T pair[2] = {T(v0), T(v1)};
    uint32_t bits;
    memcpy(&bits, pair, sizeof(bits));
    *reinterpret_cast<uint32_t*>(at) = bits;
  } else {
    at[0] = T(v0);
    at[1] = T(v1);
  }
}

}  // namespace tk
