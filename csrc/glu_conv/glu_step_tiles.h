// What the decoding-step kernel (glu_step.cu) reads and writes, apart from its warp reductions.
// Host-compilable: tests/test_cuda_host.py runs it with T = float, summing the lanes' partial sums on
// the host, and compares with the eager backend.
#pragma once

#include <cstdint>

#include "../common/epilogue.h"
#include "../common/index.h"

namespace tk::glu_conv {

// window [B, C_in, k] and weight [2C, C_in, k] contiguous (row width C_in * k, a multiple of 8);
// z = window . weight^T, out = (z[:, c] * sigmoid(z[:, C + c]) + residual) * scale.
template <class T>
struct StepArgs {
  const T* window;
  const T* weight;
  const T* bias;      // [2C] or null
  const T* residual;  // [B, C] (strides below) or null
  T* out;             // [B, C] (strides below)
  T* preactivation;   // z [B, 2C] contiguous, for backward
  int batch, channels_in, channels_out, kernel_size;
  int64_t residual_stride_b, residual_stride_c, out_stride_b, out_stride_c;
  float residual_scale;

  TK_HOST_DEVICE int width() const { return channels_in * kernel_size; }

  // Lane `lane` of `lanes` adds its share of channel c's two dot products (value row c, gate row
  // C + c) for batch rows b0 .. b0 + kRows - 1 (rows past the batch are skipped): the 8-element
  // slices starting at (lane + i * lanes) * 8.  Each weight slice is loaded once for all rows.
  template <int kRows>
  TK_HOST_DEVICE void partial_sums(int c, int b0, int lane, int lanes, float (&value)[kRows],
                                   float (&gate)[kRows]) const {
    const T* value_row = weight + int64_t(c) * width();
    const T* gate_row = weight + int64_t(c + channels_out) * width();
    for (int k = lane * kVector; k < width(); k += lanes * kVector) {
      float w_value[kVector], w_gate[kVector];
      load8(value_row + k, w_value);
      load8(gate_row + k, w_gate);
      for (int r = 0; r < kRows; ++r) {
        if (b0 + r < batch) {
          float x[kVector];
          load8(window + int64_t(b0 + r) * width() + k, x);
          for (int i = 0; i < kVector; ++i) {
            value[r] += x[i] * w_value[i];
            gate[r] += x[i] * w_gate[i];
          }
        }
      }
    }
  }

  // Batch row b, channel c, given the two complete dot products.
  TK_HOST_DEVICE void store(int b, int c, float value, float gate) const {
    if (bias != nullptr) {
      value += float(bias[c]);
      gate += float(bias[c + channels_out]);
    }
    preactivation[int64_t(b) * 2 * channels_out + c] = T(value);
    preactivation[int64_t(b) * 2 * channels_out + channels_out + c] = T(gate);
    const float r = residual != nullptr ? float(residual[b * residual_stride_b + c * residual_stride_c]) : 0.f;
    out[b * out_stride_b + c * out_stride_c] = T(glu_residual(value, gate, r, residual_scale));
  }
};

}  // namespace tk::glu_conv
