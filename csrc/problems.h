// The checks of the CUDA extension's raw ops (bindings.cpp) and the launchers' problems built from
// their tensors: what each launcher relies on (device, dtype, shapes, unit stride along the last dim,
// 16-byte aligned chunks).  Free of the CUDA runtime and of torch's CUDA headers, so that
// tests/test_cuda_host.py runs them on CPU tensors (tests/csrc/problems_driver.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "attention/attention.h"
#include "glu_conv/glu_conv.h"
#include "qkv/qkv.h"

namespace tk::bindings {

inline tk::DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  if (t.scalar_type() == at::kHalf) return tk::DType::kHalf;
  if (t.scalar_type() == at::kBFloat16) return tk::DType::kBFloat16;
  TORCH_CHECK(false, op, ": ", name, " must be float16 or bfloat16, got ", t.scalar_type());
}

// The ops check their first tensor with check_cuda, and the others against it with check_like.
inline void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
}

inline void check_like(const at::Tensor& t, const at::Tensor& reference, const char* op, const char* name) {
  TORCH_CHECK(t.device() == reference.device(), op, ": ", name, " must be on ", reference.device(), ", got device ",
              t.device());
  TORCH_CHECK(t.scalar_type() == reference.scalar_type(), op, ": ", name, " must have dtype ",
              reference.scalar_type(), ", got ", t.scalar_type());
}

// The 16-byte chunks the kernels load: unit stride along the last dim, the other strides multiples of
// 8 elements, a 16-byte aligned start.
inline void check_chunks(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, op, ": ", name,
              " must have unit stride along its last dim, got strides ", t.strides());
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0 || t.size(d) == 1, op, ": ", name,
                " must have strides that are multiples of 8 elements (16 bytes), got strides ", t.strides());
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

// A tensor a kernel writes: no two of its elements at one address (an expand()-ed, stride-0 output
// would have every program that shares the address write it, and the last write win).
inline void check_output(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
              " must not have elements that share memory (an expanded output), got strides ", t.strides());
}

inline const void* optional_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// An optional bias: contiguous, `length` elements (`shape` names them), like `reference`.
inline void check_bias(const std::optional<at::Tensor>& bias, const at::Tensor& reference, int64_t length,
                       const char* shape, const char* op, const char* name) {
  if (!bias.has_value()) return;
  check_like(*bias, reference, op, name);
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == length && bias->is_contiguous(), op, ": ", name,
              " must be a contiguous ", shape, " tensor, got shape ", bias->sizes());
}

// ------------------------------------------------------------------------------------------------ qkv

// grads: the n head-split tensors [B, H, L, Dh], sharing strides.
inline tk::qkv::Problem qkv_problem(const at::Tensor& x, const at::Tensor& weight,
                                    const std::vector<at::Tensor>& heads, const char* op) {
  check_like(weight, x, op, "weight");
  TORCH_CHECK(x.dim() == 3 && x.size(2) > 0, op, ": x must be [B, L, E] with E > 0, got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(2) && weight.size(0) % x.size(2) == 0, op,
              ": weight must be [n*E, E] with E = x.size(2) = ", x.size(2), ", got shape ", weight.sizes());
  const int64_t embed = x.size(2), num_proj = weight.size(0) / embed;
  TORCH_CHECK(num_proj >= 1 && num_proj <= 3 && int64_t(heads.size()) == num_proj, op, ": expected ", num_proj,
              " head-split tensors, got ", heads.size());
  TORCH_CHECK(embed % 8 == 0, op, ": E must be a multiple of 8, got ", embed);
  const at::Tensor& h0 = heads[0];
  TORCH_CHECK(h0.dim() == 4 && h0.size(0) == x.size(0) && h0.size(2) == x.size(1) && h0.size(1) * h0.size(3) == embed,
              op, ": head-split tensors must be [B, H, L, Dh] with H * Dh = E, got shape ", h0.sizes());
  TORCH_CHECK(h0.size(3) % 8 == 0, op, ": the head dim must be a multiple of 8, got ", h0.size(3));
  TORCH_CHECK(x.numel() < (int64_t(1) << 31) && weight.numel() < (int64_t(1) << 31), op,
              ": tensors must have fewer than 2**31 elements");
  check_chunks(x, op, "x");
  check_chunks(weight, op, "weight");
  for (const at::Tensor& h : heads) {
    check_like(h, x, op, "head-split tensor");
    TORCH_CHECK(h.sizes() == h0.sizes() && h.strides() == h0.strides(), op,
                ": the head-split tensors must share shape and strides");
    check_chunks(h, op, "head-split tensor");
  }
  tk::qkv::Problem p;
  p.dtype = dtype_of(x, op, "x");
  p.num_proj = int(num_proj);
  p.batch = int(x.size(0));
  p.heads = tk::HeadSplitShape{int(x.size(1)), int(embed), int(h0.size(3)), h0.stride(0), h0.stride(1), h0.stride(2)};
  p.x_stride_b = x.stride(0);
  p.x_stride_l = x.stride(1);
  p.weight_stride = weight.stride(0);
  return p;
}

// ------------------------------------------------------------------------------------------------ glu_conv

// The decoding step's problem but for its output strides: window [B, C_in, k] and weight [2C, C_in, k]
// contiguous, bias [2C], residual [B, C, 1] with any strides.
// window_name: what the op calls the window (glu_conv1d_update's is its ring, conv_state).
inline tk::glu_conv::StepProblem step_problem(const at::Tensor& window, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& bias,
                                              const std::optional<at::Tensor>& residual, double residual_scale,
                                              const char* op, const char* window_name = "window") {
  check_like(weight, window, op, "weight");
  TORCH_CHECK(window.dim() == 3 && window.is_contiguous(), op, ": ", window_name,
              " must be a contiguous [B, C_in, k] tensor, got shape ", window.sizes(), " and strides ",
              window.strides());
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.size(1) == window.size(1) &&
                  weight.size(2) == window.size(2) && weight.size(0) % 2 == 0,
              op, ": weight must be a contiguous [2*C, C_in, k] tensor matching window ", window.sizes(),
              ", got shape ", weight.sizes());
  TORCH_CHECK(window.size(1) * window.size(2) % 8 == 0, op, ": C_in * k must be a multiple of 8, got ",
              window.size(1) * window.size(2));
  TORCH_CHECK(weight.numel() < (int64_t(1) << 31) && window.numel() < (int64_t(1) << 31), op,
              ": tensors must have fewer than 2**31 elements");
  // The kernel reads rows of K = C_in * k elements (both are contiguous): the chunks run along K.
  check_chunks(window.view({window.size(0), window.size(1) * window.size(2)}), op, window_name);
  check_chunks(weight.view({weight.size(0), weight.size(1) * weight.size(2)}), op, "weight");
  const int64_t batch = window.size(0), channels = weight.size(0) / 2;
  tk::glu_conv::StepProblem p{};  // the output strides stay 0 until the caller sets them
  p.dtype = dtype_of(window, op, window_name);
  p.batch = int(batch);
  p.channels_in = int(window.size(1));
  p.channels_out = int(channels);
  p.kernel_size = int(window.size(2));
  p.residual_scale = float(residual_scale);
  check_bias(bias, window, weight.size(0), "[2*C]", op, "bias");
  p.residual_stride_b = p.residual_stride_c = 0;
  if (residual.has_value()) {
    check_like(*residual, window, op, "residual");
    TORCH_CHECK(residual->dim() == 3 && residual->size(0) == batch && residual->size(1) == channels &&
                    residual->size(2) == 1,
                op, ": residual must be [B, C, 1] = [", batch, ", ", channels, ", 1], got shape ", residual->sizes());
    p.residual_stride_b = residual->stride(0);
    p.residual_stride_c = residual->stride(1);
  }
  return p;
}

inline tk::Strides3 strides3(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The whole-sequence kernels' problem from xpad [B, Lp, C_in] and the packed weight [2C, k * C_in].
inline tk::glu_conv::ConvProblem conv_problem(const at::Tensor& xpad, const at::Tensor& packed_weight,
                                              int64_t length_in, int64_t pad_left, double residual_scale,
                                              const char* op) {
  check_like(packed_weight, xpad, op, "packed_weight");
  TORCH_CHECK(xpad.dim() == 3 && xpad.is_contiguous(), op,
              ": xpad must be a contiguous [B, Lp, C_in] tensor, got shape ", xpad.sizes(), " and strides ",
              xpad.strides());
  const int64_t channels_in = xpad.size(2);
  TORCH_CHECK(channels_in % 8 == 0 && channels_in > 0, op, ": C_in must be a positive multiple of 8, got ",
              channels_in);
  TORCH_CHECK(packed_weight.dim() == 2 && packed_weight.is_contiguous() && packed_weight.size(1) % channels_in == 0 &&
                  packed_weight.size(0) % 8 == 0 && packed_weight.size(0) > 0,
              op, ": packed_weight must be a contiguous [2*C, k * C_in] tensor with C a multiple of 4, got shape ",
              packed_weight.sizes());
  const int64_t kernel_size = packed_weight.size(1) / channels_in;
  const int64_t length_out = xpad.size(1) - kernel_size + 1;
  TORCH_CHECK(kernel_size >= 1 && length_out >= 1 && length_in >= 1 && pad_left >= 0 &&
                  pad_left + length_in <= xpad.size(1),
              op, ": xpad of length ", xpad.size(1), " does not hold ", length_in, " positions after ", pad_left,
              " of padding for kernel size ", kernel_size);
  TORCH_CHECK(xpad.numel() < (int64_t(1) << 31) && packed_weight.numel() < (int64_t(1) << 31), op,
              ": xpad and packed_weight must have fewer than 2**31 elements");
  TORCH_CHECK(xpad.size(0) * length_out * packed_weight.size(0) < (int64_t(1) << 31), op,
              ": B * L_out * 2C (the pre-activation's gradient) must be below 2**31, got ",
              xpad.size(0) * length_out * packed_weight.size(0));
  check_chunks(xpad, op, "xpad");
  check_chunks(packed_weight, op, "packed_weight");
  tk::glu_conv::ConvProblem p;
  p.dtype = dtype_of(xpad, op, "xpad");
  p.batch = int(xpad.size(0));
  p.channels_in = int(channels_in);
  p.channels_out = int(packed_weight.size(0) / 2);
  p.kernel_size = int(kernel_size);
  p.length_in = int(length_in);
  p.length_out = int(length_out);
  p.pad_left = int(pad_left);
  p.residual_scale = float(residual_scale);
  return p;
}

inline const void* packed_bias_ptr(const std::optional<at::Tensor>& packed_bias, const at::Tensor& packed_weight,
                                   const char* op) {
  check_bias(packed_bias, packed_weight, packed_weight.size(0), "[2*C]", op, "packed_bias");
  return optional_ptr(packed_bias);
}

inline void check_bcl(const at::Tensor& t, const at::Tensor& reference, int64_t channels, int64_t length,
                      const char* op, const char* name) {
  check_like(t, reference, op, name);
  TORCH_CHECK(t.dim() == 3 && t.size(0) == reference.size(0) && t.size(1) == channels && t.size(2) == length, op, ": ",
              name, " must be [B, C, L] = [", reference.size(0), ", ", channels, ", ", length, "], got shape ",
              t.sizes());
}

// ------------------------------------------------------------------------------------------ attention

inline tk::attention::HeadStrides head_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The attention problem of q [B, Hq, Lq, E], k [B, Hk, Lk, E], v [B, Hk, Lk, Ev] and its masks:
// key_padding_mask bool [B, Lk] with or without its key_bounds int32 [B, 3] (both contiguous; without
// bounds the kernels test every key's padding, see common/attention_masks.h's row_keys), attn_mask
// [B, Hq, Lq, Lk] bool or q's dtype (any strides), dropout_seed int64 [2]: each optional.
inline tk::attention::ForwardProblem attention_problem(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& key_bounds, const std::optional<at::Tensor>& attn_mask, int64_t causal,
    double scale, const std::optional<at::Tensor>& dropout_seed, int64_t dropout_threshold, double dropout_scale,
    const char* op) {
  check_like(k, q, op, "key");
  check_like(v, q, op, "value");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": query, key and value must be 4-D [B, H, L, X]");
  const int64_t batch = q.size(0), heads_q = q.size(1), lq = q.size(2), heads_k = k.size(1), lk = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == heads_k && v.size(2) == lk && k.size(3) == q.size(3),
              op, ": key [B, Hk, Lk, E] and value [B, Hk, Lk, Ev] must match query [B, Hq, Lq, E], got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(heads_k > 0 && heads_q % heads_k == 0, op, ": Hk must divide Hq, got Hq = ", heads_q, ", Hk = ", heads_k);
  // An empty grid is an invalid launch, and dk, dv of keys no query sees would be left unwritten: the
  // public op answers these calls without the raw ops.
  TORCH_CHECK(batch > 0 && heads_q > 0 && lq > 0, op, ": B, Hq and Lq must be positive, got query of shape ",
              q.sizes());
  const int64_t head_dim = q.size(3), head_dim_v = v.size(3);
  TORCH_CHECK(head_dim % 8 == 0 && head_dim_v % 8 == 0 && head_dim <= 256 && head_dim_v <= 256, op,
              ": the head dims must be multiples of 8 up to 256, got E = ", head_dim, ", Ev = ", head_dim_v);
  TORCH_CHECK(batch * heads_q <= 65535, op, ": B * Hq must be at most 65535, got ", batch * heads_q);
  TORCH_CHECK(lq < (int64_t(1) << 31) && lk < (int64_t(1) << 31), op, ": sequences must be shorter than 2**31");
  for (auto [t, name] : {std::pair{&q, "query"}, {&k, "key"}, {&v, "value"}}) check_chunks(*t, op, name);

  tk::attention::ForwardProblem p{};
  p.dtype = dtype_of(q, op, "query");
  p.batch = int(batch);
  p.heads_q = int(heads_q);
  p.heads_k = int(heads_k);
  p.seq_len_q = int(lq);
  p.seq_len_k = int(lk);
  p.head_dim = int(head_dim);
  p.head_dim_v = int(head_dim_v);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_stride = head_strides(q);
  p.k_stride = head_strides(k);
  p.v_stride = head_strides(v);
  TORCH_CHECK(causal >= 0 && causal <= 2, op, ": causal must be 0 (none), 1 (top-left) or 2 (bottom-right), got ", causal);
  p.causal = int(causal);
  p.scale = float(scale);
  TORCH_CHECK(key_padding_mask.has_value() || !key_bounds.has_value(), op,
              ": key_bounds come with a key_padding_mask");
  if (key_padding_mask.has_value()) {
    const at::Tensor& pad = *key_padding_mask;
    TORCH_CHECK(pad.device() == q.device() && pad.scalar_type() == at::kBool && pad.is_contiguous() &&
                    pad.sizes() == at::IntArrayRef({batch, lk}),
                op, ": key_padding_mask must be a contiguous bool [B, Lk] tensor on query's device, got ", pad.sizes());
    p.key_padding = reinterpret_cast<const uint8_t*>(pad.data_ptr<bool>());
  }
  if (key_bounds.has_value()) {
    const at::Tensor& bounds = *key_bounds;
    TORCH_CHECK(bounds.device() == q.device() && bounds.scalar_type() == at::kInt && bounds.is_contiguous() &&
                    bounds.sizes() == at::IntArrayRef({batch, 3}),
                op, ": key_bounds must be a contiguous int32 [B, 3] tensor on query's device");
    p.key_bounds = bounds.data_ptr<int32_t>();
  }
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    TORCH_CHECK(mask.device() == q.device() && (mask.scalar_type() == at::kBool || mask.scalar_type() == q.scalar_type()) &&
                    mask.sizes() == at::IntArrayRef({batch, heads_q, lq, lk}),
                op, ": attn_mask must be a bool or ", q.scalar_type(), " [B, Hq, Lq, Lk] tensor on query's device, got ",
                mask.scalar_type(), " ", mask.sizes());
    p.attn_mask = mask.data_ptr();
    p.mask_is_bool = mask.scalar_type() == at::kBool;
    for (int d = 0; d < 4; ++d) p.mask_stride[d] = mask.stride(d);
  }
  if (dropout_seed.has_value()) {
    const at::Tensor& seed = *dropout_seed;
    TORCH_CHECK(seed.device() == q.device() && seed.scalar_type() == at::kLong && seed.numel() == 2 && seed.is_contiguous(),
                op, ": dropout_seed must be a contiguous int64 [2] tensor (seed, offset) on query's device");
    TORCH_CHECK(dropout_threshold >= 0 && dropout_threshold < 65536, op,
                ": dropout_threshold must be in [0, 65536), got ", dropout_threshold);
    p.dropout_seed = seed.data_ptr<int64_t>();
    p.dropout_threshold = uint32_t(dropout_threshold);
    p.dropout_scale = float(dropout_scale);
  }
  return p;
}

// The key bounds' input (attention_key_bounds): a contiguous bool [B, Lk] key padding mask, B and Lk
// below 2**31.  Returns (B, Lk).
inline std::pair<int, int> key_bounds_problem(const at::Tensor& key_padding_mask, const char* op) {
  TORCH_CHECK(key_padding_mask.scalar_type() == at::kBool && key_padding_mask.dim() == 2 &&
                  key_padding_mask.is_contiguous(),
              op, ": key_padding_mask must be a contiguous bool [B, Lk] tensor, got ", key_padding_mask.scalar_type(),
              " of shape ", key_padding_mask.sizes(), " and strides ", key_padding_mask.strides());
  TORCH_CHECK(key_padding_mask.size(0) < (int64_t(1) << 31) && key_padding_mask.size(1) < (int64_t(1) << 31), op,
              ": key_padding_mask must have fewer than 2**31 rows and keys");
  return {int(key_padding_mask.size(0)), int(key_padding_mask.size(1))};
}

inline void check_rows(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  TORCH_CHECK(t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.sizes() == q.sizes().slice(0, 3),
              op, ": ", name, " must be a contiguous float32 [B, Hq, Lq] tensor on query's device");
}

}  // namespace tk::bindings
