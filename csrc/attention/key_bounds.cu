// The key bounds of a key padding mask, one CTA per batch row (common/attention_masks.h's
// KeyBounds): the one launch that replaces the dozen small torch ops of ops/attention.py's
// key_padding_bounds, whose host cost per op outweighed their work on short rows.
#include "attention.h"

#include "../common/attention_masks.h"

namespace tk::attention {
namespace {

constexpr int kBoundsThreads = 256;
constexpr int kWarps = kBoundsThreads / 32;

__device__ KeyBounds shuffle_xor(const KeyBounds& bounds, int offset) {
  return KeyBounds{__shfl_xor_sync(0xffffffffu, bounds.first, offset),
                   __shfl_xor_sync(0xffffffffu, bounds.end, offset),
                   __shfl_xor_sync(0xffffffffu, bounds.count, offset)};
}

// Thread t reads keys t, t + 256, ... (consecutive threads, consecutive bytes); the warps' bounds
// merge by shuffles, then the first warp's lanes merge the warps'.
__global__ void __launch_bounds__(kBoundsThreads) key_bounds_kernel(const uint8_t* key_padding, int seq_len_k,
                                                                    int32_t* key_bounds) {
  __shared__ KeyBounds warp_bounds[kWarps];
  const int row = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint8_t* padding = key_padding + int64_t(row) * seq_len_k;
  KeyBounds bounds = KeyBounds::none(seq_len_k);
  for (int key = threadIdx.x; key < seq_len_k; key += kBoundsThreads) bounds.add_key(key, padding[key] != 0);
  for (int offset = 16; offset > 0; offset /= 2) bounds.merge(shuffle_xor(bounds, offset));
  if (lane == 0) warp_bounds[warp] = bounds;
  __syncthreads();
  if (warp != 0) return;
  bounds = lane < kWarps ? warp_bounds[lane] : KeyBounds::none(seq_len_k);
  for (int offset = 16; offset > 0; offset /= 2) bounds.merge(shuffle_xor(bounds, offset));
  if (lane == 0) bounds.store(key_bounds + 3 * int64_t(row));
}

}  // namespace

cudaError_t key_padding_bounds(const uint8_t* key_padding, int batch, int seq_len_k, int32_t* key_bounds,
                               cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  key_bounds_kernel<<<batch, kBoundsThreads, 0, stream>>>(key_padding, seq_len_k, key_bounds);
  return cudaGetLastError();
}

}  // namespace tk::attention
