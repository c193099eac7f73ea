// What the GLU convolution GEMMs read and write, apart from the GEMM itself (see qkv_tiles.h for the
// interface).  Host-compilable: tests/test_cuda_host.py runs these with T = float in a host emulation
// of the GEMM and compares with the eager backend.
//
// Tokens t = b * L_out + s, interleaved channels n in [0, 2C) (n = 2c: value c, n = 2c + 1: gate c),
// reduction index j = tap * C_in + ci (layouts in glu_conv.h):
//   forward / grad_preactivation
//                C[t, n] = sum_j xpad[b, s + tap, ci] Wp[n, j]           A XpadByToken, B PackedWeightRows
//                the column pair (2c, 2c + 1) is value and gate of channel c, in one thread.
//   grad_input   C[(b, p), ci] = sum_(tap, n) grad_z[b, p + pad_left - tap, n] Wp[n, tap * C_in + ci]
//                                                                       A GradZByInput, B PackedWeightByInput
//   grad_weight  C[n, j] = sum_t grad_z[t, n] xpad[b, s + tap, ci]       A GradZByChannel, B XpadByWindow
#pragma once

#include <cstdint>

#include "../common/epilogue.h"
#include "../common/index.h"

namespace tk::glu_conv {

struct ConvShape {
  int batch, channels_in, channels_z, kernel_size, length_in, length_out, pad_left;
  TK_HOST_DEVICE int tokens() const { return batch * length_out; }
  TK_HOST_DEVICE int padded_length() const { return length_out + kernel_size - 1; }
  TK_HOST_DEVICE int window() const { return kernel_size * channels_in; }
};

// xpad [B, Lp, C_in] by token: (mn, k) = (t, j).
template <class T>
struct XpadByToken {
  static constexpr Major kMajor = Major::K;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE const T* chunk(int t, int j, bool& valid) const {
    valid = t < shape.tokens() && j < shape.window();
    if (!valid) return ptr;
    int b = t / shape.length_out, s = t - b * shape.length_out;
    int tap = j / shape.channels_in, ci = j - tap * shape.channels_in;
    return ptr + (int64_t(b) * shape.padded_length() + s + tap) * shape.channels_in + ci;
  }
};

// xpad by reduction index: (mn, k) = (j, t).
template <class T>
struct XpadByWindow {
  static constexpr Major kMajor = Major::MN;
  XpadByToken<T> rows;
  TK_HOST_DEVICE const T* chunk(int j, int t, bool& valid) const { return rows.chunk(t, j, valid); }
};

// Wp [2C, k * C_in]: (mn, k) = (n, j).
template <class T>
struct PackedWeightRows {
  static constexpr Major kMajor = Major::K;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE const T* chunk(int n, int j, bool& valid) const {
    valid = n < shape.channels_z && j < shape.window();
    return valid ? ptr + int64_t(n) * shape.window() + j : ptr;
  }
};

// Wp for the transposed convolution: (mn, k) = (ci, tap * 2C + n).
template <class T>
struct PackedWeightByInput {
  static constexpr Major kMajor = Major::MN;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE const T* chunk(int ci, int k, bool& valid) const {
    valid = ci < shape.channels_in && k < shape.kernel_size * shape.channels_z;
    if (!valid) return ptr;
    int tap = k / shape.channels_z, n = k - tap * shape.channels_z;
    return ptr + int64_t(n) * shape.window() + tap * shape.channels_in + ci;
  }
};

// grad_z [B * L_out, 2C] for the transposed convolution: (mn, k) = ((b, p), tap * 2C + n), reading
// the output position s that read input p through this tap; none outside [0, L_out) (padding takes
// no gradient).
template <class T>
struct GradZByInput {
  static constexpr Major kMajor = Major::K;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE const T* chunk(int m, int k, bool& valid) const {
    int b = m / shape.length_in, p = m - b * shape.length_in;
    int tap = k / shape.channels_z, n = k - tap * shape.channels_z;
    int s = p + shape.pad_left - tap;  // tap_position(s, tap, pad_left) == p
    valid = m < shape.batch * shape.length_in && k < shape.kernel_size * shape.channels_z &&
            in_sequence(s, shape.length_out);
    return valid ? ptr + (int64_t(b) * shape.length_out + s) * shape.channels_z + n : ptr;
  }
};

// grad_z by channel: (mn, k) = (n, t).
template <class T>
struct GradZByChannel {
  static constexpr Major kMajor = Major::MN;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE const T* chunk(int n, int t, bool& valid) const {
    valid = n < shape.channels_z && t < shape.tokens();
    return valid ? ptr + int64_t(t) * shape.channels_z + n : ptr;
  }
};

TK_HOST_DEVICE int64_t offset(const Strides3& strides, int b, int c, int l) {
  return b * strides.b + c * strides.c + l * strides.l;
}

// The forward (kGrad false: out = (glu(z) + residual) * scale) and backward's first step (kGrad
// true: grad_z from grad_out, the pre-activation recomputed) share operands.
template <class T, bool kGrad>
struct PreactivationArgs {
  using A = XpadByToken<T>;
  using B = PackedWeightRows<T>;
  static constexpr bool kSumsRowsOfA = false;
  A x;
  B weight;
  const T* bias;        // packed, or null
  const T* other;       // forward: residual (or null); kGrad: grad_out
  Strides3 other_strides;
  T* out;               // forward: out [B, C, L_out] (out_strides); kGrad: grad_z [B * L_out, 2C]
  Strides3 out_strides;
  float residual_scale;

  TK_HOST_DEVICE const A& a() const { return x; }
  TK_HOST_DEVICE const B& b() const { return weight; }
  TK_HOST_DEVICE int rows() const { return x.shape.tokens(); }
  TK_HOST_DEVICE int cols() const { return x.shape.channels_z; }
  TK_HOST_DEVICE int depth() const { return x.shape.window(); }

  TK_HOST_DEVICE void store(int t, int n, float value, float gate) const {
    if (t >= rows() || n >= cols()) return;
    if (bias != nullptr) {
      value += float(bias[n]);
      gate += float(bias[n + 1]);
    }
    const int b = t / x.shape.length_out, s = t - b * x.shape.length_out, c = n / 2;
    if constexpr (kGrad) {
      GluGrad g = glu_residual_grad(value, gate, float(other[offset(other_strides, b, c, s)]), residual_scale);
      store_pair(out + int64_t(t) * cols() + n, g.value, g.gate);
    } else {
      const float residual = other != nullptr ? float(other[offset(other_strides, b, c, s)]) : 0.f;
      out[offset(out_strides, b, c, s)] = T(glu_residual(value, gate, residual, residual_scale));
    }
  }
};

template <class T>
struct GradInputArgs {
  using A = GradZByInput<T>;
  using B = PackedWeightByInput<T>;
  static constexpr bool kSumsRowsOfA = false;
  A grad_z;
  B weight;
  T* grad_x;  // [B, C_in, L], any strides
  Strides3 grad_x_strides;

  TK_HOST_DEVICE const A& a() const { return grad_z; }
  TK_HOST_DEVICE const B& b() const { return weight; }
  TK_HOST_DEVICE int rows() const { return grad_z.shape.batch * grad_z.shape.length_in; }
  TK_HOST_DEVICE int cols() const { return grad_z.shape.channels_in; }
  TK_HOST_DEVICE int depth() const { return grad_z.shape.kernel_size * grad_z.shape.channels_z; }

  TK_HOST_DEVICE void store(int m, int ci, float v0, float v1) const {
    if (m >= rows() || ci >= cols()) return;
    const int b = m / grad_z.shape.length_in, p = m - b * grad_z.shape.length_in;
    T* at = grad_x + offset(grad_x_strides, b, ci, p);
    at[0] = T(v0);
    at[grad_x_strides.c] = T(v1);
  }
};

template <class T>
struct GradWeightArgs {
  using A = GradZByChannel<T>;
  using B = XpadByWindow<T>;
  static constexpr bool kSumsRowsOfA = true;  // the bias gradient
  A grad_z;
  B x;
  T* grad_weight;  // packed [2C, k * C_in]
  T* grad_bias;    // packed [2C] or null

  TK_HOST_DEVICE const A& a() const { return grad_z; }
  TK_HOST_DEVICE const B& b() const { return x; }
  TK_HOST_DEVICE int rows() const { return grad_z.shape.channels_z; }
  TK_HOST_DEVICE int cols() const { return grad_z.shape.window(); }
  TK_HOST_DEVICE int depth() const { return grad_z.shape.tokens(); }

  TK_HOST_DEVICE void store(int n, int j, float v0, float v1) const {
    if (n >= rows() || j >= cols()) return;
    store_pair(grad_weight + int64_t(n) * cols() + j, v0, v1);
  }
  TK_HOST_DEVICE bool sums_rows_of_a() const { return grad_bias != nullptr; }
  TK_HOST_DEVICE void store_row_sum(int n, float sum) const {
    if (n < rows()) grad_bias[n] = T(sum);
  }
};

}  // namespace tk::glu_conv
