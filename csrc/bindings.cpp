// The raw ops of the CUDA extension, registered with the dispatcher as torch.ops.transformer_kernels_C.*
// (CUDA kernels only: the autograd, fakes and the public ops live in Python, ops/*.py, which call
// these through backends/cuda/).  Each op checks what its launcher relies on (device, dtype,
// shapes, unit stride along the last dim, 16-byte alignment), makes the tensors' device current
// and launches on torch's current stream.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/attention.h"
#include "glu_conv/glu_conv.h"
#include "qkv/qkv.h"

namespace {

tk::DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  if (t.scalar_type() == at::kHalf) return tk::DType::kHalf;
  if (t.scalar_type() == at::kBFloat16) return tk::DType::kBFloat16;
  TORCH_CHECK(false, op, ": ", name, " must be float16 or bfloat16, got ", t.scalar_type());
}

void check_like(const at::Tensor& t, const at::Tensor& reference, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == reference.device(), op, ": ", name, " must be on ", reference.device(), ", got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == reference.scalar_type(), op, ": ", name, " must have dtype ",
              reference.scalar_type(), ", got ", t.scalar_type());
}

// The 16-byte chunks the kernels load: unit stride along the last dim, the other strides multiples of
// 8 elements, a 16-byte aligned start.
void check_chunks(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, op, ": ", name,
              " must have unit stride along its last dim, got strides ", t.strides());
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0 || t.size(d) == 1, op, ": ", name,
                " must have strides that are multiples of 8 elements (16 bytes), got strides ", t.strides());
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

void check_launch(cudaError_t error, const char* op) {
  TORCH_CHECK(error == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(error));
}

// ------------------------------------------------------------------------------------------------ qkv

// grads: the n head-split tensors [B, H, L, Dh], sharing strides.
tk::qkv::Problem qkv_problem(const at::Tensor& x, const at::Tensor& weight, const std::vector<at::Tensor>& heads,
                             const char* op) {
  check_like(x, x, op, "x");
  check_like(weight, x, op, "weight");
  TORCH_CHECK(x.dim() == 3, op, ": x must be [B, L, E], got shape ", x.sizes());
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

std::vector<at::Tensor> qkv_forward(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, int64_t num_heads) {
  constexpr const char* op = "qkv_forward";
  check_like(x, x, op, "x");
  check_like(weight, x, op, "weight");
  TORCH_CHECK(x.dim() == 3 && num_heads > 0 && x.size(2) % num_heads == 0, op,
              ": x must be [B, L, E] with E divisible by num_heads = ", num_heads, ", got shape ", x.sizes());
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t num_proj = weight.dim() == 2 && x.size(2) > 0 ? weight.size(0) / x.size(2) : 0;
  std::vector<at::Tensor> outputs;
  for (int64_t i = 0; i < num_proj; ++i) {
    outputs.push_back(at::empty({x.size(0), num_heads, x.size(1), x.size(2) / num_heads}, x.options()));
  }
  tk::qkv::Problem p = qkv_problem(x, weight, outputs, op);
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_like(*bias, x, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(), op,
                ": bias must be a contiguous [n*E] tensor, got shape ", bias->sizes());
    bias_ptr = bias->data_ptr();
  }
  void* out_ptrs[3] = {outputs[0].data_ptr(), outputs[0].data_ptr(), outputs[0].data_ptr()};
  for (int64_t i = 0; i < num_proj; ++i) out_ptrs[i] = outputs[i].data_ptr();
  check_launch(tk::qkv::forward(p, x.data_ptr(), weight.data_ptr(), bias_ptr, out_ptrs,
                                c10::cuda::getCurrentCUDAStream()),
               op);
  return outputs;
}

void head_pointers(const std::vector<at::Tensor>& grads, const void* (&ptrs)[3]) {
  for (int i = 0; i < 3; ++i) ptrs[i] = grads[i < int(grads.size()) ? i : 0].data_ptr();
}

at::Tensor qkv_grad_input(const std::vector<at::Tensor>& grads, const at::Tensor& x, const at::Tensor& weight) {
  constexpr const char* op = "qkv_grad_input";
  tk::qkv::Problem p = qkv_problem(x, weight, grads, op);  // checks devices before the guard needs one
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  const void* grad_ptrs[3];
  head_pointers(grads, grad_ptrs);
  check_launch(tk::qkv::grad_input(p, grad_ptrs, weight.data_ptr(), grad_x.data_ptr(),
                                   c10::cuda::getCurrentCUDAStream()),
               op);
  return grad_x;
}

std::tuple<at::Tensor, at::Tensor> qkv_grad_weight(const std::vector<at::Tensor>& grads, const at::Tensor& x,
                                                   const at::Tensor& weight, bool with_bias) {
  constexpr const char* op = "qkv_grad_weight";
  tk::qkv::Problem p = qkv_problem(x, weight, grads, op);  // checks devices before the guard needs one
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor grad_weight = at::empty(weight.sizes(), weight.options());
  at::Tensor grad_bias = with_bias ? at::empty({weight.size(0)}, weight.options()) : at::empty({0}, weight.options());
  const void* grad_ptrs[3];
  head_pointers(grads, grad_ptrs);
  if (p.batch * p.heads.seq_len == 0) {  // no tokens: the sums are empty
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_weight, grad_bias};
  }
  check_launch(tk::qkv::grad_weight(p, grad_ptrs, x.data_ptr(), grad_weight.data_ptr(),
                                    with_bias ? grad_bias.data_ptr() : nullptr, c10::cuda::getCurrentCUDAStream()),
               op);
  return {grad_weight, grad_bias};
}

// ------------------------------------------------------------------------------------------------ glu_conv

std::tuple<at::Tensor, at::Tensor> glu_conv1d_step(const at::Tensor& window, const at::Tensor& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   const std::optional<at::Tensor>& residual, double residual_scale) {
  constexpr const char* op = "glu_conv1d_step";
  check_like(window, window, op, "window");
  check_like(weight, window, op, "weight");
  TORCH_CHECK(window.dim() == 3 && window.is_contiguous(), op,
              ": window must be a contiguous [B, C_in, k] tensor, got shape ", window.sizes(), " and strides ",
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
  check_chunks(window.view({window.size(0), window.size(1) * window.size(2)}), op, "window");
  check_chunks(weight.view({weight.size(0), weight.size(1) * weight.size(2)}), op, "weight");
  const c10::cuda::OptionalCUDAGuard guard(window.device());
  const int64_t batch = window.size(0), channels = weight.size(0) / 2;

  tk::glu_conv::StepProblem p;
  p.dtype = dtype_of(window, op, "window");
  p.batch = int(batch);
  p.channels_in = int(window.size(1));
  p.channels_out = int(channels);
  p.kernel_size = int(window.size(2));
  p.residual_scale = float(residual_scale);
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_like(*bias, window, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(), op,
                ": bias must be a contiguous [2*C] tensor, got shape ", bias->sizes());
    bias_ptr = bias->data_ptr();
  }
  const void* residual_ptr = nullptr;
  p.residual_stride_b = p.residual_stride_c = 0;
  if (residual.has_value()) {
    check_like(*residual, window, op, "residual");
    TORCH_CHECK(residual->dim() == 3 && residual->size(0) == batch && residual->size(1) == channels &&
                    residual->size(2) == 1,
                op, ": residual must be [B, C, 1] = [", batch, ", ", channels, ", 1], got shape ", residual->sizes());
    residual_ptr = residual->data_ptr();
    p.residual_stride_b = residual->stride(0);
    p.residual_stride_c = residual->stride(1);
  }
  at::Tensor out = at::empty({batch, channels, 1}, window.options());
  at::Tensor preactivation = at::empty({batch, 1, 2 * channels}, window.options());
  p.out_stride_b = out.stride(0);
  p.out_stride_c = out.stride(1);
  check_launch(tk::glu_conv::step(p, window.data_ptr(), weight.data_ptr(), bias_ptr, residual_ptr, out.data_ptr(),
                                  preactivation.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               op);
  return {out, preactivation};
}

tk::Strides3 strides3(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The whole-sequence kernels' problem from xpad [B, Lp, C_in] and the packed weight [2C, k * C_in].
tk::glu_conv::ConvProblem conv_problem(const at::Tensor& xpad, const at::Tensor& packed_weight, int64_t length_in,
                                       int64_t pad_left, double residual_scale, const char* op) {
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
  TORCH_CHECK(xpad.numel() < (int64_t(1) << 31) && packed_weight.numel() < (int64_t(1) << 31) &&
                  xpad.size(0) * length_out * packed_weight.size(0) < (int64_t(1) << 31),
              op, ": tensors must have fewer than 2**31 elements");
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

const void* packed_bias_ptr(const std::optional<at::Tensor>& packed_bias, const at::Tensor& packed_weight,
                            const char* op) {
  if (!packed_bias.has_value()) return nullptr;
  check_like(*packed_bias, packed_weight, op, "packed_bias");
  TORCH_CHECK(packed_bias->dim() == 1 && packed_bias->size(0) == packed_weight.size(0) &&
                  packed_bias->is_contiguous(),
              op, ": packed_bias must be a contiguous [2*C] tensor, got shape ", packed_bias->sizes());
  return packed_bias->data_ptr();
}

void check_bcl(const at::Tensor& t, const at::Tensor& reference, int64_t channels, int64_t length, const char* op,
               const char* name) {
  check_like(t, reference, op, name);
  TORCH_CHECK(t.dim() == 3 && t.size(0) == reference.size(0) && t.size(1) == channels && t.size(2) == length, op, ": ",
              name, " must be [B, C, L] = [", reference.size(0), ", ", channels, ", ", length, "], got shape ",
              t.sizes());
}

void glu_conv1d_forward(const at::Tensor& xpad, const at::Tensor& packed_weight,
                        const std::optional<at::Tensor>& packed_bias, const std::optional<at::Tensor>& residual,
                        at::Tensor& out, int64_t length_in, int64_t pad_left, double residual_scale) {
  constexpr const char* op = "glu_conv1d_forward";
  check_like(xpad, xpad, op, "xpad");
  const c10::cuda::OptionalCUDAGuard guard(xpad.device());
  tk::glu_conv::ConvProblem p = conv_problem(xpad, packed_weight, length_in, pad_left, residual_scale, op);
  check_bcl(out, xpad, p.channels_out, p.length_out, op, "out");
  const void* residual_ptr = nullptr;
  tk::Strides3 residual_strides{0, 0, 0};
  if (residual.has_value()) {
    check_bcl(*residual, xpad, p.channels_out, p.length_out, op, "residual");
    residual_ptr = residual->data_ptr();
    residual_strides = strides3(*residual);
  }
  check_launch(tk::glu_conv::forward(p, xpad.data_ptr(), packed_weight.data_ptr(),
                                     packed_bias_ptr(packed_bias, packed_weight, op), residual_ptr, residual_strides,
                                     out.data_ptr(), strides3(out), c10::cuda::getCurrentCUDAStream()),
               op);
}

at::Tensor glu_conv1d_grad_preactivation(const at::Tensor& xpad, const at::Tensor& packed_weight,
                                         const std::optional<at::Tensor>& packed_bias, const at::Tensor& grad_out,
                                         int64_t length_in, int64_t pad_left, double residual_scale) {
  constexpr const char* op = "glu_conv1d_grad_preactivation";
  check_like(xpad, xpad, op, "xpad");
  const c10::cuda::OptionalCUDAGuard guard(xpad.device());
  tk::glu_conv::ConvProblem p = conv_problem(xpad, packed_weight, length_in, pad_left, residual_scale, op);
  check_bcl(grad_out, xpad, p.channels_out, p.length_out, op, "grad_out");
  at::Tensor grad_z = at::empty({int64_t(p.batch) * p.length_out, packed_weight.size(0)}, xpad.options());
  check_launch(tk::glu_conv::grad_preactivation(p, xpad.data_ptr(), packed_weight.data_ptr(),
                                                packed_bias_ptr(packed_bias, packed_weight, op), grad_out.data_ptr(),
                                                strides3(grad_out), grad_z.data_ptr(),
                                                c10::cuda::getCurrentCUDAStream()),
               op);
  return grad_z;
}

void glu_conv1d_grad_input(const at::Tensor& grad_z, const at::Tensor& xpad, const at::Tensor& packed_weight,
                           at::Tensor& grad_x, int64_t pad_left) {
  constexpr const char* op = "glu_conv1d_grad_input";
  check_like(xpad, xpad, op, "xpad");
  check_like(grad_z, xpad, op, "grad_z");
  const c10::cuda::OptionalCUDAGuard guard(xpad.device());
  TORCH_CHECK(grad_x.dim() == 3, op, ": grad_x must be [B, C_in, L], got shape ", grad_x.sizes());
  tk::glu_conv::ConvProblem p = conv_problem(xpad, packed_weight, grad_x.size(2), pad_left, 1.0, op);
  check_bcl(grad_x, xpad, p.channels_in, p.length_in, op, "grad_x");
  TORCH_CHECK(grad_z.dim() == 2 && grad_z.is_contiguous() && grad_z.size(0) == int64_t(p.batch) * p.length_out &&
                  grad_z.size(1) == packed_weight.size(0),
              op, ": grad_z must be a contiguous [B * L_out, 2*C] tensor, got shape ", grad_z.sizes());
  check_chunks(grad_z, op, "grad_z");
  check_launch(tk::glu_conv::grad_input(p, grad_z.data_ptr(), packed_weight.data_ptr(), grad_x.data_ptr(),
                                        strides3(grad_x), c10::cuda::getCurrentCUDAStream()),
               op);
}

std::tuple<at::Tensor, at::Tensor> glu_conv1d_grad_weight(const at::Tensor& grad_z, const at::Tensor& xpad,
                                                          const at::Tensor& packed_weight, int64_t length_in,
                                                          int64_t pad_left, bool with_bias) {
  constexpr const char* op = "glu_conv1d_grad_weight";
  check_like(xpad, xpad, op, "xpad");
  check_like(grad_z, xpad, op, "grad_z");
  const c10::cuda::OptionalCUDAGuard guard(xpad.device());
  tk::glu_conv::ConvProblem p = conv_problem(xpad, packed_weight, length_in, pad_left, 1.0, op);
  TORCH_CHECK(grad_z.dim() == 2 && grad_z.is_contiguous() && grad_z.size(0) == int64_t(p.batch) * p.length_out &&
                  grad_z.size(1) == packed_weight.size(0),
              op, ": grad_z must be a contiguous [B * L_out, 2*C] tensor, got shape ", grad_z.sizes());
  check_chunks(grad_z, op, "grad_z");
  at::Tensor grad_weight = at::empty(packed_weight.sizes(), packed_weight.options());
  at::Tensor grad_bias = at::empty({with_bias ? packed_weight.size(0) : 0}, packed_weight.options());
  if (p.batch == 0) {  // no positions: the sums are empty
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_weight, grad_bias};
  }
  check_launch(tk::glu_conv::grad_weight(p, grad_z.data_ptr(), xpad.data_ptr(), grad_weight.data_ptr(),
                                         with_bias ? grad_bias.data_ptr() : nullptr,
                                         c10::cuda::getCurrentCUDAStream()),
               op);
  return {grad_weight, grad_bias};
}

// ------------------------------------------------------------------------------------------ attention

tk::attention::HeadStrides head_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The attention problem of q [B, Hq, Lq, E], k [B, Hk, Lk, E], v [B, Hk, Lk, Ev] and its masks:
// key_padding_mask bool [B, Lk] with key_bounds int32 [B, 2] (both contiguous), attn_mask
// [B, Hq, Lq, Lk] bool or q's dtype (any strides), dropout_seed int64 [2]: each optional.
tk::attention::ForwardProblem attention_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const std::optional<at::Tensor>& key_padding_mask,
                                                const std::optional<at::Tensor>& key_bounds,
                                                const std::optional<at::Tensor>& attn_mask, int64_t causal, double scale,
                                                const std::optional<at::Tensor>& dropout_seed, int64_t dropout_threshold,
                                                double dropout_scale, const char* op) {
  check_like(q, q, op, "query");
  check_like(k, q, op, "key");
  check_like(v, q, op, "value");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": query, key and value must be 4-D [B, H, L, X]");
  const int64_t batch = q.size(0), heads_q = q.size(1), lq = q.size(2), heads_k = k.size(1), lk = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == heads_k && v.size(2) == lk && k.size(3) == q.size(3),
              op, ": key [B, Hk, Lk, E] and value [B, Hk, Lk, Ev] must match query [B, Hq, Lq, E], got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(heads_k > 0 && heads_q % heads_k == 0, op, ": Hk must divide Hq, got Hq = ", heads_q, ", Hk = ", heads_k);
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
  TORCH_CHECK(key_padding_mask.has_value() == key_bounds.has_value(), op,
              ": key_padding_mask and key_bounds come together");
  if (key_padding_mask.has_value()) {
    const at::Tensor& pad = *key_padding_mask;
    const at::Tensor& bounds = *key_bounds;
    TORCH_CHECK(pad.device() == q.device() && pad.scalar_type() == at::kBool && pad.is_contiguous() &&
                    pad.sizes() == at::IntArrayRef({batch, lk}),
                op, ": key_padding_mask must be a contiguous bool [B, Lk] tensor on query's device, got ", pad.sizes());
    TORCH_CHECK(bounds.device() == q.device() && bounds.scalar_type() == at::kInt && bounds.is_contiguous() &&
                    bounds.sizes() == at::IntArrayRef({batch, 2}),
                op, ": key_bounds must be a contiguous int32 [B, 2] tensor on query's device");
    p.key_padding = reinterpret_cast<const uint8_t*>(pad.data_ptr<bool>());
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

void check_rows(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.sizes() == q.sizes().slice(0, 3),
              op, ": ", name, " must be a contiguous float32 [B, Hq, Lq] tensor on query's device");
}

// Writes out [B, Hq, Lq, Ev] and lse [B, Hq, Lq] (float32, contiguous).
void attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& key_bounds,
                       const std::optional<at::Tensor>& attn_mask, int64_t causal, double scale,
                       const std::optional<at::Tensor>& dropout_seed, int64_t dropout_threshold, double dropout_scale,
                       at::Tensor& out, at::Tensor& lse) {
  constexpr const char* op = "attention_forward";
  tk::attention::ForwardProblem p = attention_problem(q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale,
                                                      dropout_seed, dropout_threshold, dropout_scale, op);
  check_like(out, q, op, "out");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2), v.size(3)}), op,
              ": out must be [B, Hq, Lq, Ev], got ", out.sizes());
  check_chunks(out, op, "out");
  check_rows(lse, q, op, "lse");
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  p.out = out.data_ptr();
  p.out_stride = head_strides(out);
  p.lse = lse.data_ptr<float>();
  check_launch(tk::attention::forward(p, c10::cuda::getCurrentCUDAStream()), op);
}

// Writes dq, dk, dv (shaped like q, k, v) and, when given, grad_scores: the float mask's gradient,
// contiguous float32 [B, Hq, Lq, Lk] (zero-filled by the caller: only visited scores are written).
// delta: contiguous float32 [B, Hq, Lq], the row sums of grad_out * out.
void attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& lse, const at::Tensor& delta, const std::optional<at::Tensor>& key_padding_mask,
                        const std::optional<at::Tensor>& key_bounds, const std::optional<at::Tensor>& attn_mask,
                        int64_t causal, double scale, const std::optional<at::Tensor>& dropout_seed,
                        int64_t dropout_threshold, double dropout_scale, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                        const std::optional<at::Tensor>& grad_scores) {
  constexpr const char* op = "attention_backward";
  tk::attention::ForwardProblem f = attention_problem(q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale,
                                                      dropout_seed, dropout_threshold, dropout_scale, op);
  for (auto [t, like, name] : {std::tuple{&grad_out, &q, "grad_out"}, {&dq, &q, "dq"}, {&dk, &k, "dk"}, {&dv, &v, "dv"}}) {
    check_like(*t, q, op, name);
    check_chunks(*t, op, name);
    if (t != &grad_out) TORCH_CHECK(t->sizes() == like->sizes(), op, ": ", name, " must have shape ", like->sizes());
  }
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2), v.size(3)}), op,
              ": grad_out must be [B, Hq, Lq, Ev], got ", grad_out.sizes());
  check_rows(lse, q, op, "lse");
  check_rows(delta, q, op, "delta");
  tk::attention::BackwardProblem p{};
  p.fwd = f;
  p.fwd.lse = lse.data_ptr<float>();
  p.grad_out = grad_out.data_ptr();
  p.grad_out_stride = head_strides(grad_out);
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_stride = head_strides(dq);
  p.dk_stride = head_strides(dk);
  p.dv_stride = head_strides(dv);
  if (grad_scores.has_value()) {
    const at::Tensor& g = *grad_scores;
    TORCH_CHECK(g.device() == q.device() && g.scalar_type() == at::kFloat && g.is_contiguous() &&
                    g.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2), k.size(2)}),
                op, ": grad_scores must be a contiguous float32 [B, Hq, Lq, Lk] tensor on query's device");
    p.grad_scores = g.data_ptr<float>();
  }
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  check_launch(tk::attention::backward(p, c10::cuda::getCurrentCUDAStream()), op);
}

}  // namespace

TORCH_LIBRARY(transformer_kernels_C, m) {
  m.def("attention_forward(Tensor query, Tensor key, Tensor value, Tensor? key_padding_mask, Tensor? key_bounds, "
        "Tensor? attn_mask, int causal, float scale, Tensor? dropout_seed, int dropout_threshold, float dropout_scale, "
        "Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor lse, Tensor delta, "
        "Tensor? key_padding_mask, Tensor? key_bounds, Tensor? attn_mask, int causal, float scale, Tensor? dropout_seed, "
        "int dropout_threshold, float dropout_scale, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, "
        "Tensor(d!)? grad_scores) -> ()");
  m.def("qkv_forward(Tensor x, Tensor weight, Tensor? bias, int num_heads) -> Tensor[]");
  m.def("qkv_grad_input(Tensor[] grads, Tensor x, Tensor weight) -> Tensor");
  m.def("qkv_grad_weight(Tensor[] grads, Tensor x, Tensor weight, bool with_bias) -> (Tensor, Tensor)");
  m.def("glu_conv1d_step(Tensor window, Tensor weight, Tensor? bias, Tensor? residual, float residual_scale) "
        "-> (Tensor, Tensor)");
  m.def("glu_conv1d_forward(Tensor xpad, Tensor packed_weight, Tensor? packed_bias, Tensor? residual, "
        "Tensor(a!) out, int length_in, int pad_left, float residual_scale) -> ()");
  m.def("glu_conv1d_grad_preactivation(Tensor xpad, Tensor packed_weight, Tensor? packed_bias, Tensor grad_out, "
        "int length_in, int pad_left, float residual_scale) -> Tensor");
  m.def("glu_conv1d_grad_input(Tensor grad_z, Tensor xpad, Tensor packed_weight, Tensor(a!) grad_x, "
        "int pad_left) -> ()");
  m.def("glu_conv1d_grad_weight(Tensor grad_z, Tensor xpad, Tensor packed_weight, int length_in, int pad_left, "
        "bool with_bias) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(transformer_kernels_C, CUDA, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
  m.impl("qkv_forward", &qkv_forward);
  m.impl("qkv_grad_input", &qkv_grad_input);
  m.impl("qkv_grad_weight", &qkv_grad_weight);
  m.impl("glu_conv1d_step", &glu_conv1d_step);
  m.impl("glu_conv1d_forward", &glu_conv1d_forward);
  m.impl("glu_conv1d_grad_preactivation", &glu_conv1d_grad_preactivation);
  m.impl("glu_conv1d_grad_input", &glu_conv1d_grad_input);
  m.impl("glu_conv1d_grad_weight", &glu_conv1d_grad_weight);
}

// Importing transformer_kernels._C registers the ops above; the module itself holds nothing.
PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "transformer_kernels._C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
