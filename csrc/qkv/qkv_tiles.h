// What the QKV GEMMs read and write, apart from the GEMM itself: each operand's addressing (its
// lines, whose chunks are the 8 contiguous elements at (mn, k), see common/index.h) and each
// epilogue's store.  Host-compilable (no CUDA or CUTLASS header): tests/test_cuda_host.py runs these
// with T = float in a host emulation of the GEMM and compares with the eager backend.
//
// Tokens t = b*L + l, features f in [0, n*E) (projection f / E, head (f % E) / Dh, d = f % Dh):
//   forward      C[t, f] = sum_e x[t, e] W[f, e]      A = XByToken (K-major), B = WeightRows (K-major)
//   grad_input   C[t, e] = sum_f G[t, f] W[f, e]      A = GradByToken (K-major), B = WeightCols (MN-major)
//   grad_weight  C[f, e] = sum_t G[t, f] x[t, e]      A = GradByFeature (MN-major), B = XByFeature (MN-major)
#pragma once

#include <cstdint>

#include "../common/epilogue.h"
#include "../common/index.h"

namespace tk::qkv {

// x [B, L, E] as the token matrix (unit stride along E).
template <class T>
struct TokenRows {
  const T* ptr;
  FastDivisor seq_len;
  int tokens, cols;
  int64_t stride_b, stride_l;

  TK_HOST_DEVICE int row_count() const { return tokens; }
  TK_HOST_DEVICE int64_t row_offset(int t) const {
    int b = seq_len.quotient(t);
    return b * stride_b + (t - b * seq_len.divisor) * stride_l;
  }
};

template <class T>
struct XByToken : TokenRows<T> {  // K-major: (mn, k) = (t, e)
  static constexpr Major kMajor = Major::K;
  using Line = ContiguousLine<T>;
  TK_HOST_DEVICE Line line(int t) const {
    const bool in_range = t < this->tokens;
    return Line{in_range ? this->ptr + this->row_offset(t) : this->ptr, this->cols, in_range};
  }
};

template <class T>
struct XByFeature : TokenRows<T> {  // MN-major: (mn, k) = (e, t)
  static constexpr Major kMajor = Major::MN;
  using Line = RowOffsetLine<T, TokenRows<T>>;  // column e; the token's row offset is the K-dependent part
  TK_HOST_DEVICE Line line(int e) const {
    const bool in_range = e < this->cols;
    return Line{this, in_range ? this->ptr + e : this->ptr, in_range};
  }
};

// W [n*E, E] row-major (row stride `stride`).
template <class T>
struct WeightRows {  // K-major: (mn, k) = (f, e)
  static constexpr Major kMajor = Major::K;
  using Line = ContiguousLine<T>;
  const T* ptr;
  int rows, cols;
  int64_t stride;
  TK_HOST_DEVICE Line line(int f) const {
    const bool in_range = f < rows;
    return Line{in_range ? ptr + f * stride : ptr, cols, in_range};
  }
};

template <class T>
struct WeightCols {  // MN-major: (mn, k) = (e, f)
  static constexpr Major kMajor = Major::MN;
  using Line = StridedLine<T>;
  const T* ptr;
  int rows, cols;
  int64_t stride;
  TK_HOST_DEVICE Line line(int e) const {
    const bool in_range = e < cols;
    return Line{in_range ? ptr + e : ptr, rows, in_range, stride};
  }
};

// The n head-split tensors as one [T, n*E] matrix, read in place.
template <class T>
struct HeadSplitTensors {
  const T* ptr[3];
  HeadSplitShape shape;
  int tokens, features;

  TK_HOST_DEVICE int row_count() const { return tokens; }
  TK_HOST_DEVICE int64_t row_offset(int t) const { return head_split_token_offset(shape, t); }
  TK_HOST_DEVICE const T* output(int proj) const {
    // A select, not ptr[proj]: a dynamic index into a kernel parameter array goes to local memory.
    return proj == 0 ? ptr[0] : proj == 1 ? ptr[1] : ptr[2];
  }
};

template <class T>
struct GradByToken : HeadSplitTensors<T> {  // K-major: (mn, k) = (t, f)
  static constexpr Major kMajor = Major::K;
  struct Line {  // token t; the feature's output, head and place are the K-dependent part
    const GradByToken* grad;
    int64_t token_offset;
    bool in_range;
    TK_HOST_DEVICE const T* chunk(int f, bool& valid) const {
      valid = in_range && f < grad->features;
      if (!valid) return grad->ptr[0];
      HeadSplitIndex index = head_split_feature_index(grad->shape, f);
      return grad->output(index.proj) + token_offset + index.offset;
    }
  };
  TK_HOST_DEVICE Line line(int t) const {
    const bool in_range = t < this->tokens;
    return Line{this, in_range ? this->row_offset(t) : 0, in_range};
  }
};

template <class T>
struct GradByFeature : HeadSplitTensors<T> {  // MN-major: (mn, k) = (f, t)
  static constexpr Major kMajor = Major::MN;
  using Line = RowOffsetLine<T, HeadSplitTensors<T>>;  // feature f; the token's offset is the K-dependent part
  TK_HOST_DEVICE Line line(int f) const {
    const bool in_range = f < this->features;
    if (!in_range) return Line{this, this->ptr[0], false};
    HeadSplitIndex index = head_split_feature_index(this->shape, f);
    return Line{this, this->output(index.proj) + index.offset, true};
  }
};

// Each kernel's arguments, in the interface of gemm_kernel (common/gemm_sm80.cuh): its operands,
// its size and its epilogue, store(m, n, v0, v1) for the column pair (n, n + 1) of row m (n even;
// the sizes being multiples of 8, n + 1 is in range with n).

template <class T>
struct ForwardArgs {
  using A = XByToken<T>;
  using B = WeightRows<T>;
  static constexpr bool kSumsRowsOfA = false;
  A x;
  B weight;
  const T* bias;  // or null
  T* out[3];
  HeadSplitShape out_shape;

  TK_HOST_DEVICE const A& a() const { return x; }
  TK_HOST_DEVICE const B& b() const { return weight; }
  TK_HOST_DEVICE int rows() const { return x.tokens; }
  TK_HOST_DEVICE int cols() const { return weight.rows; }
  TK_HOST_DEVICE int depth() const { return x.cols; }

  TK_HOST_DEVICE void store(int t, int f, float v0, float v1) const {
    if (t >= rows() || f >= cols()) return;
    if (bias != nullptr) {
      v0 += float(bias[f]);
      v1 += float(bias[f + 1]);
    }
    HeadSplitIndex index = head_split_index(out_shape, t, f);  // Dh even: f + 1 is the next d
    T* base = index.proj == 0 ? out[0] : index.proj == 1 ? out[1] : out[2];
    store_pair(base + index.offset, v0, v1);
  }
};

template <class T>
struct GradInputArgs {
  using A = GradByToken<T>;
  using B = WeightCols<T>;
  static constexpr bool kSumsRowsOfA = false;
  A grad;
  B weight;
  T* grad_x;  // contiguous [T, E]

  TK_HOST_DEVICE const A& a() const { return grad; }
  TK_HOST_DEVICE const B& b() const { return weight; }
  TK_HOST_DEVICE int rows() const { return grad.tokens; }
  TK_HOST_DEVICE int cols() const { return weight.cols; }
  TK_HOST_DEVICE int depth() const { return grad.features; }

  TK_HOST_DEVICE void store(int t, int e, float v0, float v1) const {
    if (t >= rows() || e >= cols()) return;
    store_pair(grad_x + int64_t(t) * cols() + e, v0, v1);
  }
};

template <class T>
struct GradWeightArgs {
  using A = GradByFeature<T>;
  using B = XByFeature<T>;
  static constexpr bool kSumsRowsOfA = true;  // grad_bias
  A grad;
  B x;
  T* grad_weight;  // contiguous [n*E, E]
  T* grad_bias;    // [n*E] or null

  TK_HOST_DEVICE const A& a() const { return grad; }
  TK_HOST_DEVICE const B& b() const { return x; }
  TK_HOST_DEVICE int rows() const { return grad.features; }
  TK_HOST_DEVICE int cols() const { return x.cols; }
  TK_HOST_DEVICE int depth() const { return grad.tokens; }

  TK_HOST_DEVICE void store(int f, int e, float v0, float v1) const {
    if (f >= rows() || e >= cols()) return;
    store_pair(grad_weight + int64_t(f) * cols() + e, v0, v1);
  }
  TK_HOST_DEVICE bool sums_rows_of_a() const { return grad_bias != nullptr; }
  TK_HOST_DEVICE void store_row_sum(int f, float sum) const {
    if (f < rows()) grad_bias[f] = T(sum);
  }
};

}  // namespace tk::qkv
