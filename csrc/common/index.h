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

// How a GEMM operand lies in global memory: 8 elements contiguous along K (K-major) or along its M or
// N dimension (MN-major).  Every operand type declares its kMajor and a chunk(mn, k, valid) returning
// the address of the 8 contiguous elements starting at (mn, k).
enum class Major { K, MN };

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
  int seq_len;     // L
  int embed_dim;   // E = H * Dh
  int head_dim;    // Dh
  int64_t stride_b, stride_h, stride_l;  // shared by the n outputs; unit stride along Dh
};

struct HeadSplitIndex {
  int proj;        // which output (q, k or v)
  int64_t offset;  // element offset inside that output
};

TK_HOST_DEVICE HeadSplitIndex head_split_index(const HeadSplitShape& s, int token, int feature) {
  int proj = feature / s.embed_dim;
  int within = feature - proj * s.embed_dim;
  int head = within / s.head_dim;
  int d = within - head * s.head_dim;
  int b = token / s.seq_len;
  int l = token - b * s.seq_len;
  return HeadSplitIndex{proj, b * s.stride_b + head * s.stride_h + l * s.stride_l + d};
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
// Decoding-step window: the step convolves the k positions (state[0..k-2], x_t), oldest first.
// Window slot `tap` in [0, k) is state slot `tap` for tap < k - 1, else the new input; the new
// state keeps slots 1..k-1 of the window: new_state[j] = window[j + 1].

TK_HOST_DEVICE bool window_from_state(int tap, int kernel_size) { return tap < kernel_size - 1; }

TK_HOST_DEVICE int new_state_source(int slot) { return slot + 1; }

}  // namespace tk
