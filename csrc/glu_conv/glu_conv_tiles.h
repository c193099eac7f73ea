// What the GLU convolution GEMMs read and write, apart from the GEMM itself (see common/index.h for
// the operands' interface).  Host-compilable: tests/test_cuda_host.py runs these with T = float in a
// host emulation of the GEMM and compares with the eager backend.
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
  int batch, channels_in;
  FastDivisor channels_z;
  int kernel_size;
  FastDivisor length_in, length_out;
  int pad_left;
  TK_HOST_DEVICE int tokens() const { return batch * length_out.divisor; }
  TK_HOST_DEVICE int padded_length() const { return length_out.divisor + kernel_size - 1; }
  TK_HOST_DEVICE int window() const { return kernel_size * channels_in; }
};

// xpad [B, Lp, C_in] by token: (mn, k) = (t, j).  Window element j = tap * C_in + ci of token (b, s)
// is xpad[b, s + tap, ci], at (b * Lp + s) * C_in + j: each token's window is one contiguous run.
template <class T>
struct XpadByToken {
  static constexpr Major kMajor = Major::K;
  using Line = ContiguousLine<T>;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE int row_count() const { return shape.tokens(); }
  TK_HOST_DEVICE int64_t row_offset(int t) const {  // where token t's window starts
    int b = shape.length_out.quotient(t), s = t - b * shape.length_out.divisor;
    return (int64_t(b) * shape.padded_length() + s) * shape.channels_in;
  }
  TK_HOST_DEVICE Line line(int t) const {
    const bool in_range = t < shape.tokens();
    return Line{in_range ? ptr + row_offset(t) : ptr, shape.window(), in_range};
  }
};

// xpad by reduction index: (mn, k) = (j, t).
template <class T>
struct XpadByWindow {
  static constexpr Major kMajor = Major::MN;
  using Line = RowOffsetLine<T, XpadByToken<T>>;  // window element j; the token's window is the K-dependent part
  XpadByToken<T> rows;
  TK_HOST_DEVICE Line line(int j) const {
    const bool in_range = j < rows.shape.window();
    return Line{&rows, in_range ? rows.ptr + j : rows.ptr, in_range};
  }
};

// Wp [2C, k * C_in]: (mn, k) = (n, j).
template <class T>
struct PackedWeightRows {
  static constexpr Major kMajor = Major::K;
  using Line = ContiguousLine<T>;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE Line line(int n) const {
    const bool in_range = n < shape.channels_z.divisor;
    return Line{in_range ? ptr + int64_t(n) * shape.window() : ptr, shape.window(), in_range};
  }
};

// Wp for the transposed convolution: (mn, k) = (ci, tap * 2C + n).
template <class T>
struct PackedWeightByInput {
  static constexpr Major kMajor = Major::MN;
  struct Line {  // input channel ci; the tap and the output channel are the K-dependent part
    const ConvShape* shape;
    const T* column;
    bool in_range;
    TK_HOST_DEVICE const T* chunk(int k, bool& valid) const {
      valid = in_range && k < shape->kernel_size * shape->channels_z.divisor;
      if (!valid) return column;
      int tap = shape->channels_z.quotient(k), n = k - tap * shape->channels_z.divisor;
      return column + int64_t(n) * shape->window() + tap * shape->channels_in;
    }
  };
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE Line line(int ci) const {
    const bool in_range = ci < shape.channels_in;
    return Line{&shape, in_range ? ptr + ci : ptr, in_range};
  }
};

// grad_z [B * L_out, 2C] for the transposed convolution: (mn, k) = ((b, p), tap * 2C + n), reading
// the output position s that read input p through this tap; none outside [0, L_out) (padding takes
// no gradient).
template <class T>
struct GradZByInput {
  static constexpr Major kMajor = Major::K;
  struct Line {  // input position (b, p); the tap, hence s, and the channel are the K-dependent part
    const GradZByInput* grad_z;
    int b, p;
    bool in_range;
    TK_HOST_DEVICE const T* chunk(int k, bool& valid) const {
      const ConvShape& shape = grad_z->shape;
      const int channels_z = shape.channels_z.divisor, length_out = shape.length_out.divisor;
      int tap = shape.channels_z.quotient(k), n = k - tap * channels_z;
      int s = p + shape.pad_left - tap;  // tap_position(s, tap, pad_left) == p
      valid = in_range && k < shape.kernel_size * channels_z && in_sequence(s, length_out);
      return valid ? grad_z->ptr + (int64_t(b) * length_out + s) * channels_z + n : grad_z->ptr;
    }
  };
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE Line line(int m) const {
    const int length_in = shape.length_in.divisor, b = shape.length_in.quotient(m);
    return Line{this, b, m - b * length_in, m < shape.batch * length_in};
  }
};

// grad_z by channel: (mn, k) = (n, t).
template <class T>
struct GradZByChannel {
  static constexpr Major kMajor = Major::MN;
  using Line = StridedLine<T>;
  const T* ptr;
  ConvShape shape;
  TK_HOST_DEVICE Line line(int n) const {
    const bool in_range = n < shape.channels_z.divisor;
    return Line{in_range ? ptr + n : ptr, shape.tokens(), in_range, shape.channels_z.divisor};
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
  TK_HOST_DEVICE int cols() const { return x.shape.channels_z.divisor; }
  TK_HOST_DEVICE int depth() const { return x.shape.window(); }

  TK_HOST_DEVICE void store(int t, int n, float value, float gate) const {
    if (t >= rows() || n >= cols()) return;
    if (bias != nullptr) {
      value += float(bias[n]);
      gate += float(bias[n + 1]);
    }
    const int b = x.shape.length_out.quotient(t), s = t - b * x.shape.length_out.divisor, c = n / 2;
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
  TK_HOST_DEVICE int rows() const { return grad_z.shape.batch * grad_z.shape.length_in.divisor; }
  TK_HOST_DEVICE int cols() const { return grad_z.shape.channels_in; }
  TK_HOST_DEVICE int depth() const { return grad_z.shape.kernel_size * grad_z.shape.channels_z.divisor; }

  TK_HOST_DEVICE void store(int m, int ci, float v0, float v1) const {
    if (m >= rows() || ci >= cols()) return;
    const int b = grad_z.shape.length_in.quotient(m), p = m - b * grad_z.shape.length_in.divisor;
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
  TK_HOST_DEVICE int rows() const { return grad_z.shape.channels_z.divisor; }
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
