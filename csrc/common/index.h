// Index arithmetic shared by the kernels, written as plain __host__ __device__ functions so that
// tests/test_cuda_host.py compiles this header for the host and checks it against Python.
// Includes nothing: no CUDA or CUTLASS header is needed to use it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TK_HOST_DEVICE inline
#endif

namespace tk {

TK_HOST_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }

// A divisor fixed for a kernel launch, divided by as a multiply-high and a shift (the round-up method
// of Granlund and Montgomery, as CUTLASS's FastDivmod): a GPU has no integer divider, and `n / d`
// compiles to about 20 instructions.  Exact for n in [0, 2^31).  Made from an int on the host (the
// magic number costs a 64-bit division), so shapes that hold one are initialized as before.
struct FastDivisor {
  int divisor;
  uint32_t multiplier;  // ceil(2^(31 + l) / divisor), with 2^(l - 1) < divisor <= 2^l; unused below 2
  int shift;            // l - 1

  FastDivisor() = default;
  TK_HOST_DEVICE FastDivisor(int d) : divisor(d), multiplier(0), shift(0) {  // NOLINT: implicit, see above
    if (d < 2) return;  // 1 divides as itself; 0 (an empty shape) is never divided by
    int l = 0;
    while ((int64_t(1) << l) < d) ++l;
    multiplier = uint32_t(((uint64_t(1) << (31 + l)) + uint64_t(d) - 1) / uint64_t(d));
    shift = l - 1;
  }

  TK_HOST_DEVICE int quotient(int n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(uint32_t(n), multiplier);
#else
    const uint32_t high = uint32_t((uint64_t(uint32_t(n)) * multiplier) >> 32);
#endif
    return divisor == 1 ? n : int(high >> shift);
  }
};

// How a GEMM operand lies in global memory: 8 elements contiguous along K (K-major) or along its M or
// N dimension (MN-major).  Every operand type declares its kMajor and a line(mn) returning its Line at
// row (or column) mn, whose chunk(k, valid) is the address of the 8 contiguous elements starting at
// (mn, k).  The line holds what the address owes to mn alone, so a GEMM thread, whose chunks keep
// their mn through the K loop, computes that part once, outside the loop.
enum class Major { K, MN };

// The stride of a line whose elements lie one after another: k * UnitStride{} is k.
struct UnitStride {};
TK_HOST_DEVICE int operator*(int k, UnitStride) { return k; }

// A line whose elements lie `stride` apart from `start` (an MN-major operand with one stride along
// K), or one after another (ContiguousLine): chunk k at start + k * stride.  Out of range (mn or k
// past the operand), `valid` is false and the address is `start`, which is never read.
template <class T, class Stride = int64_t>
struct StridedLine {
  const T* start;  // the line's element 0; the operand's base address when mn is out of range
  int depth;       // K
  bool in_range;   // mn inside the operand
  Stride stride{};
  TK_HOST_DEVICE const T* chunk(int k, bool& valid) const {
    valid = in_range && k < depth;
    return valid ? start + k * stride : start;
  }
};

template <class T>
using ContiguousLine = StridedLine<T, UnitStride>;

// A line of an MN-major operand whose K index runs over rows that `Rows` addresses (its
// row_count() and row_offset(k)): chunk k at column + row_offset(k).  The column is the part the
// address owes to mn.
template <class T, class Rows>
struct RowOffsetLine {
  const Rows* rows;
  const T* column;
  bool in_range;
  TK_HOST_DEVICE const T* chunk(int k, bool& valid) const {
    valid = in_range && k < rows->row_count();
    return valid ? column + rows->row_offset(k) : column;
  }
};

// ------------------------------------------------------------------------------------------------
// Tile order: tiles are visited in groups of `group_m` tile rows, column by column inside a group,
// so the CTAs running at one time share A row blocks and B column blocks in L2 (grouped ordering).

struct TileCoord {
  int m;
  int n;
};

TK_HOST_DEVICE TileCoord grouped_tile(int linear, int tiles_m, int tiles_n, int group_m) {
  int tiles_per_group = group_m * tiles_n;
  int group = linear / tiles_per_group;
  int first_m = group * group_m;
  int rows_in_group = tiles_m - first_m < group_m ? tiles_m - first_m : group_m;
  int in_group = linear % tiles_per_group;
  return TileCoord{first_m + in_group % rows_in_group, in_group / rows_in_group};
}

// ------------------------------------------------------------------------------------------------
// Head split: the packed projection's column `feature` in [0, n*E) of token `token` in [0, B*L)
// is element [b, h, l, d] of output `proj` (each output [B, H, L, Dh], its own strides).

struct HeadSplitShape {
  FastDivisor seq_len;    // L
  FastDivisor embed_dim;  // E = H * Dh
  FastDivisor head_dim;   // Dh
  int64_t stride_b, stride_h, stride_l;  // shared by the n outputs; unit stride along Dh
};

struct HeadSplitIndex {
  int proj;        // which output (q, k or v)
  int64_t offset;  // element offset inside that output
};

// The index splits into a token's part (its sequence and position) and a feature's (the output, the
// head and the place in the head), which add up: a GEMM operand computes the part that stays fixed
// along its K loop once.
TK_HOST_DEVICE int64_t head_split_token_offset(const HeadSplitShape& s, int token) {
  int b = s.seq_len.quotient(token);
  int l = token - b * s.seq_len.divisor;
  return b * s.stride_b + l * s.stride_l;
}

TK_HOST_DEVICE HeadSplitIndex head_split_feature_index(const HeadSplitShape& s, int feature) {
  int proj = s.embed_dim.quotient(feature);
  int within = feature - proj * s.embed_dim.divisor;
  int head = s.head_dim.quotient(within);
  int d = within - head * s.head_dim.divisor;
  return HeadSplitIndex{proj, head * s.stride_h + d};
}

TK_HOST_DEVICE HeadSplitIndex head_split_index(const HeadSplitShape& s, int token, int feature) {
  HeadSplitIndex index = head_split_feature_index(s, feature);
  index.offset += head_split_token_offset(s, token);
  return index;
}

// ------------------------------------------------------------------------------------------------
// The strides of a [B, C, L] tensor (contiguous, channel-last or any other).

struct Strides3 {
  int64_t b, c, l;
};

// ------------------------------------------------------------------------------------------------
// Convolution taps: output position `s` reads, through tap `tap`, input position
// s + tap - pad_left; outside [0, length_in) it reads the padding value.

TK_HOST_DEVICE int tap_position(int s, int tap, int pad_left) { return s + tap - pad_left; }

TK_HOST_DEVICE bool in_sequence(int position, int length_in) { return position >= 0 && position < length_in; }

TK_HOST_DEVICE int conv_output_length(int length_in, int kernel_size, int pad_left, int pad_right) {
  return pad_left + length_in + pad_right - kernel_size + 1;
}

// ------------------------------------------------------------------------------------------------
// Vector loads: the decoding step and the attention's dO . O pre-pass read their operands 16 bytes
// at a time, eight 16-bit elements.

constexpr int kVector = 8;  // elements per 16-byte load

// Eight elements from a 16-byte aligned address, as floats: one 16-byte load for 16-bit types.
template <class T>
TK_HOST_DEVICE void load8(const T* src, float (&dst)[kVector]) {
  if constexpr (sizeof(T) == 2) {
    struct alignas(16) Chunk {
      T values[kVector];
    };
    const Chunk chunk = *reinterpret_cast<const Chunk*>(src);
    for (int i = 0; i < kVector; ++i) dst[i] = float(chunk.values[i]);
  } else {
    for (int i = 0; i < kVector; ++i) dst[i] = float(src[i]);
  }
}

// ------------------------------------------------------------------------------------------------
// Row dot products (the attention backward's dO . O pre-pass): every row of `cols` elements is
// summed by `lanes` lanes of one warp, each lane reading 16-byte chunks of `chunk` elements,
// lanes = the row's chunks rounded up to a power of two, at most 32.  So 32 / lanes rows share a
// warp, a row's lanes are adjacent and aligned, and shuffles over lane offsets below `lanes` add
// up one row's sums without leaving it.

struct RowDotSplit {
  int lanes;
  int chunk;

  TK_HOST_DEVICE static RowDotSplit of(int cols, int chunk) {
    const int chunks = ceil_div(cols, chunk);
    int lanes = 1;
    while (lanes < chunks && lanes < 32) lanes *= 2;
    return RowDotSplit{lanes, chunk};
  }
  TK_HOST_DEVICE int rows_per_warp() const { return 32 / lanes; }
  // The row that global thread `thread` sums part of, its first column and the step between its columns.
  TK_HOST_DEVICE int64_t row(int64_t thread) const { return thread / 32 * rows_per_warp() + thread % 32 / lanes; }
  TK_HOST_DEVICE int first_col(int64_t thread) const { return int(thread % lanes) * chunk; }
  TK_HOST_DEVICE int col_step() const { return lanes * chunk; }
};

// ------------------------------------------------------------------------------------------------
// Decoding-step window: the step convolves the k positions (state[0..k-2], x_t), oldest first.
// Window slot `tap` in [0, k) is state slot `tap` for tap < k - 1, else the new input; the new
// state keeps slots 1..k-1 of the window: new_state[j] = window[j + 1].

TK_HOST_DEVICE bool window_from_state(int tap, int kernel_size) { return tap < kernel_size - 1; }

TK_HOST_DEVICE int new_state_source(int slot) { return slot + 1; }

}  // namespace tk
