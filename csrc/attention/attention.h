// Launchers of the flash-attention kernels (attention.cu; the kernels in attention_fwd.cuh and
// attention_bwd.cuh).  Raw pointers, sizes and strides only;
// bindings.cpp checks the tensors.  Semantics: transformer_kernels/ops/attention.py (AttentionArgs)
// and the Triton backend.  Shapes: q [B, Hq, Lq, E], k [B, Hk, Lk, E], v [B, Hk, Lk, Ev] (Hk divides
// Hq: query head h reads kv head h / (Hq / Hk)), out [B, Hq, Lq, Ev], each with unit stride along its
// last dim, the other strides multiples of 8 elements and 16-byte aligned starts; E % 8 == 0 and
// Ev % 8 == 0, max(E, Ev) <= 256 (the kernels pad it up to 32, 64, 96, 128, 192 or 256).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"

namespace tk::attention {

// Strides of a [B, H, L, X] tensor along B, H and L (unit stride along X).
struct HeadStrides {
  int64_t b, h, l;
};

struct ForwardProblem {
  DType dtype;
  int batch, heads_q, heads_k, seq_len_q, seq_len_k, head_dim, head_dim_v;
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // contiguous [B, Hq, Lq]: natural-log row log-sum-exps, +inf on rows that see no key
  HeadStrides q_stride, k_stride, v_stride, out_stride;
  int causal;  // transformer_kernels.ops.attention.Causal
  float scale;
  // Key padding: bool [B, Lk] contiguous (true = padding) and its bounds int32 [B, 3] contiguous
  // (first kept key, last kept key + 1, count of kept keys: short of their difference where padding
  // sits between them); both null without key padding.  Bounds may be null with padding: every key's
  // padding is then tested (row_keys in common/attention_masks.h).
  const uint8_t* key_padding;
  const int32_t* key_bounds;
  // Dense mask [B, Hq, Lq, Lk] with any strides (0 where broadcast): bool (true = attend) or the
  // inputs' dtype (added to the scaled scores); null without one.
  const void* attn_mask;
  bool mask_is_bool;
  int64_t mask_stride[4];
  // Dropout: int64 [2] (seed, offset) on the device, null without dropout; weights whose 16 Philox
  // bits are below `dropout_threshold` are dropped, the others scaled by `dropout_scale`.
  const int64_t* dropout_seed;
  uint32_t dropout_threshold;
  float dropout_scale;
};

// The head dims the forward and backward kernels are instantiated for (max(E, Ev) rounded up to
// one of them), 0 past them.
int padded_head_dim(int head_dim);

cudaError_t forward(const ForwardProblem& p, cudaStream_t stream);

// The backward pass: the forward's problem (its out and lse are read) and the gradients.
struct BackwardProblem {
  ForwardProblem fwd;
  const void* grad_out;  // [B, Hq, Lq, Ev]
  HeadStrides grad_out_stride;
  float* delta;  // contiguous [B, Hq, Lq]: the dO . O row sums, written by the pre-pass
  void* dq;            // like q, k and v
  void* dk;
  void* dv;
  HeadStrides dq_stride, dk_stride, dv_stride;
  float* grad_scores;  // contiguous [B, Hq, Lq, Lk]: the float mask's gradient, or null
};

cudaError_t backward(const BackwardProblem& p, cudaStream_t stream);

// The key bounds of key_padding (bool [batch, seq_len_k] contiguous, true = padding) into key_bounds
// (int32 [batch, 3] contiguous), as ForwardProblem::key_bounds holds them (key_bounds.cu).
cudaError_t key_padding_bounds(const uint8_t* key_padding, int batch, int seq_len_k, int32_t* key_bounds,
                               cudaStream_t stream);

// forward and backward for one element type (cutlass::half_t or cutlass::bfloat16_t) and a padded
// head dim: specialized in a source file per direction and type (attention_{fwd,bwd}_{fp16,bf16}.cu),
// so that the build compiles the four in parallel.
template <class T>
cudaError_t forward_for(const ForwardProblem& p, int padded_head_dim, cudaStream_t stream);
template <class T>
cudaError_t backward_for(const BackwardProblem& p, int padded_head_dim, cudaStream_t stream);

}  // namespace tk::attention
