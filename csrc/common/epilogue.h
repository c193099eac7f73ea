// Epilogue arithmetic in fp32, shared by the kernels and unit-tested on the host
// (tests/test_cuda_host.py) against torch's own functions.
#pragma once

#include <cmath>

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

}  // namespace tk
