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
//
// glu_conv1d_update (kRing, ring non-null): the window is read from a ring, window == ring
// [B, C_in, k] contiguous, holding input position p in slot p % k, and new_input [B, C_in]
// (contiguous rows), the input at the row's position p (position[b * position_stride]): tap t < k - 1
// of the window is ring[b, ci, (p + 1 + t) % k], tap k - 1 is new_input[b, ci].  No pre-activation
// (inference).  store_new_input then writes new_input into slot p % k, which holds position p - k:
// no output of the step reads it, so it can be written while other CTAs still read the ring.
template <class T>
struct StepArgs {
  const T* window;
  const T* weight;
  const T* bias;      // [2C] or null
  const T* residual;  // [B, C] (strides below) or null
  T* out;             // [B, C] (strides below)
  T* preactivation;   // z [B, 2C] contiguous, for backward; null for a ring
  int batch, channels_in, channels_out, kernel_size;
  int64_t residual_stride_b, residual_stride_c, out_stride_b, out_stride_c;
  float residual_scale;
  T* ring = nullptr;
  const T* new_input = nullptr;
  const int64_t* position = nullptr;
  int64_t position_stride = 0;

  TK_HOST_DEVICE int width() const { return channels_in * kernel_size; }

  // Row b's position modulo k (floor: in [0, k) whatever the sign).
  TK_HOST_DEVICE int position_slot(int b) const {
    const int k = kernel_size;
    return int((position[b * position_stride] % k + k) % k);
  }

  // The 8 window elements of row b from column j0 (a multiple of 8) through the ring, whose tap 0
  // is slot `rotation` = (p + 1) % k.
  TK_HOST_DEVICE void load8_from_ring(int b, int rotation, int j0, float (&x)[kVector]) const {
    const T* ring_row = window + int64_t(b) * width();
    const T* new_row = new_input + int64_t(b) * channels_in;
    int channel = j0 / kernel_size, tap = j0 - channel * kernel_size;
    for (int i = 0; i < kVector; ++i) {
      if (tap == kernel_size - 1) {
        x[i] = float(new_row[channel]);
      } else {
        const int slot = tap + rotation < kernel_size ? tap + rotation : tap + rotation - kernel_size;
        x[i] = float(ring_row[channel * kernel_size + slot]);
      }
      if (++tap == kernel_size) {
        tap = 0;
        ++channel;
      }
    }
  }

  // Lane `lane` of `lanes` adds its share of channel c's two dot products (value row c, gate row
  // C + c) for batch rows b0 .. b0 + kRows - 1 (rows past the batch are skipped): the 8-element
  // slices starting at (lane + i * lanes) * 8.  Each weight slice is loaded once for all rows.
  template <int kRows, bool kRing = false>
  TK_HOST_DEVICE void partial_sums(int c, int b0, int lane, int lanes, float (&value)[kRows],
                                   float (&gate)[kRows]) const {
    const T* value_row = weight + int64_t(c) * width();
    const T* gate_row = weight + int64_t(c + channels_out) * width();
    int rotation[kRows] = {};
    if constexpr (kRing) {
      for (int r = 0; r < kRows; ++r) {
        if (b0 + r < batch) rotation[r] = (position_slot(b0 + r) + 1) % kernel_size;
      }
    }
    for (int k = lane * kVector; k < width(); k += lanes * kVector) {
      float w_value[kVector], w_gate[kVector];
      load8(value_row + k, w_value);
      load8(gate_row + k, w_gate);
      for (int r = 0; r < kRows; ++r) {
        if (b0 + r < batch) {
          float x[kVector];
          if constexpr (kRing) {
            load8_from_ring(b0 + r, rotation[r], k, x);
          } else {
            load8(window + int64_t(b0 + r) * width() + k, x);
          }
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
    if (preactivation != nullptr) {
      preactivation[int64_t(b) * 2 * channels_out + c] = T(value);
      preactivation[int64_t(b) * 2 * channels_out + channels_out + c] = T(gate);
    }
    const float r = residual != nullptr ? float(residual[b * residual_stride_b + c * residual_stride_c]) : 0.f;
    out[b * out_stride_b + c * out_stride_c] = T(glu_residual(value, gate, r, residual_scale));
  }

  // The ring's update: row b's input channel ci into its slot.
  TK_HOST_DEVICE void store_new_input(int b, int ci) const {
    ring[int64_t(b) * width() + ci * kernel_size + position_slot(b)] = new_input[int64_t(b) * channels_in + ci];
  }
};

}  // namespace tk::glu_conv
