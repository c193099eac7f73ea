// The raw ops of the CUDA extension, registered with the dispatcher as torch.ops.transformer_kernels_C.*
// (CUDA kernels only: the autograd, fakes and the public ops live in Python, ops/*.py, which call
// these through backends/cuda/).  Each op checks that its tensors are on a CUDA device and what its
// launcher relies on (problems.h), makes that device current and launches on torch's current stream.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "problems.h"

namespace {

using namespace tk::bindings;

void check_launch(cudaError_t error, const char* op) {
  TORCH_CHECK(error == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(error));
}

// ------------------------------------------------------------------------------------------------ qkv

std::vector<at::Tensor> qkv_forward(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, int64_t num_heads) {
  constexpr const char* op = "qkv_forward";
  check_cuda(x, op, "x");
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
  check_bias(bias, x, weight.size(0), "[n*E]", op, "bias");
  void* out_ptrs[3] = {outputs[0].data_ptr(), outputs[0].data_ptr(), outputs[0].data_ptr()};
  for (int64_t i = 0; i < num_proj; ++i) out_ptrs[i] = outputs[i].data_ptr();
  check_launch(tk::qkv::forward(p, x.data_ptr(), weight.data_ptr(), optional_ptr(bias), out_ptrs,
                                c10::cuda::getCurrentCUDAStream()),
               op);
  return outputs;
}

void head_pointers(const std::vector<at::Tensor>& grads, const void* (&ptrs)[3]) {
  for (int i = 0; i < 3; ++i) ptrs[i] = grads[i < int(grads.size()) ? i : 0].data_ptr();
}

at::Tensor qkv_grad_input(const std::vector<at::Tensor>& grads, const at::Tensor& x, const at::Tensor& weight) {
  constexpr const char* op = "qkv_grad_input";
  check_cuda(x, op, "x");
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
  check_cuda(x, op, "x");
  tk::qkv::Problem p = qkv_problem(x, weight, grads, op);  // checks devices before the guard needs one
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor grad_weight = at::empty(weight.sizes(), weight.options());
  at::Tensor grad_bias = with_bias ? at::empty({weight.size(0)}, weight.options()) : at::empty({0}, weight.options());
  const void* grad_ptrs[3];
  head_pointers(grads, grad_ptrs);
  if (p.batch * p.heads.seq_len.divisor == 0) {  // no tokens: the sums are empty
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
  check_cuda(window, op, "window");
  tk::glu_conv::StepProblem p = step_problem(window, weight, bias, residual, residual_scale, op);
  const c10::cuda::OptionalCUDAGuard guard(window.device());
  at::Tensor out = at::empty({p.batch, p.channels_out, 1}, window.options());
  at::Tensor preactivation = at::empty({p.batch, 1, 2 * int64_t(p.channels_out)}, window.options());
  p.out_stride_b = out.stride(0);
  p.out_stride_c = out.stride(1);
  check_launch(tk::glu_conv::step(p, window.data_ptr(), weight.data_ptr(), optional_ptr(bias), optional_ptr(residual),
                                  out.data_ptr(), preactivation.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               op);
  return {out, preactivation};
}

at::Tensor glu_conv1d_update(const at::Tensor& x_t, at::Tensor& conv_state, const at::Tensor& position,
                             const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, double residual_scale) {
  constexpr const char* op = "glu_conv1d_update";
  check_cuda(conv_state, op, "conv_state");
  tk::glu_conv::StepProblem p = step_problem(conv_state, weight, bias, residual, residual_scale, op, "conv_state");
  check_like(x_t, conv_state, op, "x_t");
  TORCH_CHECK(x_t.dim() == 2 && x_t.size(0) == p.batch && x_t.size(1) == p.channels_in && x_t.is_contiguous(), op,
              ": x_t must be a contiguous [B, C_in] = [", p.batch, ", ", p.channels_in, "] tensor, got shape ",
              x_t.sizes(), " and strides ", x_t.strides());
  // One position for every row: a 0-dim tensor, or [B] of one row (whatever its stride).
  const bool one_position = position.dim() == 0 || (position.dim() == 1 && position.size(0) == 1);
  TORCH_CHECK(position.device() == conv_state.device() && position.scalar_type() == at::kLong &&
                  (one_position || (position.dim() == 1 && position.size(0) == p.batch && position.stride(0) == 1)),
              op, ": position must be an int64 tensor of shape [] or [B] = [", p.batch, "] (unit stride) on ",
              conv_state.device(), ", got ", position.scalar_type(), " of shape ", position.sizes(), " on ",
              position.device());
  const c10::cuda::OptionalCUDAGuard guard(conv_state.device());
  at::Tensor out = at::empty({p.batch, p.channels_out}, conv_state.options());
  p.out_stride_b = out.stride(0);
  p.out_stride_c = out.stride(1);
  check_launch(tk::glu_conv::update(p, conv_state.data_ptr(), x_t.data_ptr(), position.data_ptr<int64_t>(),
                                    one_position ? 0 : 1, weight.data_ptr(), optional_ptr(bias),
                                    optional_ptr(residual), out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

void glu_conv1d_forward(const at::Tensor& xpad, const at::Tensor& packed_weight,
                        const std::optional<at::Tensor>& packed_bias, const std::optional<at::Tensor>& residual,
                        at::Tensor& out, int64_t length_in, int64_t pad_left, double residual_scale) {
  constexpr const char* op = "glu_conv1d_forward";
  check_cuda(xpad, op, "xpad");
  const c10::cuda::OptionalCUDAGuard guard(xpad.device());
  tk::glu_conv::ConvProblem p = conv_problem(xpad, packed_weight, length_in, pad_left, residual_scale, op);
  check_bcl(out, xpad, p.channels_out, p.length_out, op, "out");
  check_output(out, op, "out");
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
  check_cuda(xpad, op, "xpad");
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
  check_cuda(xpad, op, "xpad");
  check_like(grad_z, xpad, op, "grad_z");
  const c10::cuda::OptionalCUDAGuard guard(xpad.device());
  TORCH_CHECK(grad_x.dim() == 3, op, ": grad_x must be [B, C_in, L], got shape ", grad_x.sizes());
  tk::glu_conv::ConvProblem p = conv_problem(xpad, packed_weight, grad_x.size(2), pad_left, 1.0, op);
  check_bcl(grad_x, xpad, p.channels_in, p.length_in, op, "grad_x");
  check_output(grad_x, op, "grad_x");
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
  check_cuda(xpad, op, "xpad");
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

// Writes out [B, Hq, Lq, Ev] and lse [B, Hq, Lq] (float32, contiguous).
void attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& key_bounds,
                       const std::optional<at::Tensor>& attn_mask, int64_t causal, double scale,
                       const std::optional<at::Tensor>& dropout_seed, int64_t dropout_threshold, double dropout_scale,
                       at::Tensor& out, at::Tensor& lse) {
  constexpr const char* op = "attention_forward";
  check_cuda(q, op, "query");
  tk::attention::ForwardProblem p = attention_problem(q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale,
                                                      dropout_seed, dropout_threshold, dropout_scale, op);
  check_like(out, q, op, "out");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2), v.size(3)}), op,
              ": out must be [B, Hq, Lq, Ev], got ", out.sizes());
  check_chunks(out, op, "out");
  check_output(out, op, "out");
  check_rows(lse, q, op, "lse");
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  p.out = out.data_ptr();
  p.out_stride = head_strides(out);
  p.lse = lse.data_ptr<float>();
  check_launch(tk::attention::forward(p, c10::cuda::getCurrentCUDAStream()), op);
}

// Writes dq, dk, dv (shaped like q, k, v), delta (contiguous float32 [B, Hq, Lq]: the row sums of
// grad_out * out, the kernels' pre-pass) and, when given, grad_scores: the float mask's gradient,
// contiguous float32 [B, Hq, Lq, Lk] (zero-filled by the caller: only visited scores are written).
void attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse, at::Tensor& delta,
                        const std::optional<at::Tensor>& key_padding_mask,
                        const std::optional<at::Tensor>& key_bounds, const std::optional<at::Tensor>& attn_mask,
                        int64_t causal, double scale, const std::optional<at::Tensor>& dropout_seed,
                        int64_t dropout_threshold, double dropout_scale, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                        const std::optional<at::Tensor>& grad_scores) {
  constexpr const char* op = "attention_backward";
  check_cuda(q, op, "query");
  tk::attention::ForwardProblem f = attention_problem(q, k, v, key_padding_mask, key_bounds, attn_mask, causal, scale,
                                                      dropout_seed, dropout_threshold, dropout_scale, op);
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};  // [B, Hq, Lq, Ev]
  for (auto [t, shape, name] : {std::tuple{&grad_out, at::IntArrayRef(out_shape), "grad_out"},
                                {&out, at::IntArrayRef(out_shape), "out"}, {&dq, q.sizes(), "dq"},
                                {&dk, k.sizes(), "dk"}, {&dv, v.sizes(), "dv"}}) {
    check_like(*t, q, op, name);
    check_chunks(*t, op, name);
    TORCH_CHECK(t->sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t->sizes());
  }
  for (auto [t, name] : {std::pair{&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}) check_output(*t, op, name);
  check_rows(lse, q, op, "lse");
  check_rows(delta, q, op, "delta");
  tk::attention::BackwardProblem p{};
  p.fwd = f;
  p.fwd.lse = lse.data_ptr<float>();
  p.fwd.out = out.data_ptr();
  p.fwd.out_stride = head_strides(out);
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

// The key bounds of a key padding mask [B, Lk]: int32 [B, 3] (ForwardProblem::key_bounds).
at::Tensor attention_key_bounds(const at::Tensor& key_padding_mask) {
  constexpr const char* op = "attention_key_bounds";
  check_cuda(key_padding_mask, op, "key_padding_mask");
  const auto [batch, seq_len_k] = key_bounds_problem(key_padding_mask, op);
  const c10::cuda::OptionalCUDAGuard guard(key_padding_mask.device());
  at::Tensor key_bounds = at::empty({batch, 3}, key_padding_mask.options().dtype(at::kInt));
  check_launch(tk::attention::key_padding_bounds(reinterpret_cast<const uint8_t*>(key_padding_mask.data_ptr<bool>()),
                                                 batch, seq_len_k, key_bounds.data_ptr<int32_t>(),
                                                 c10::cuda::getCurrentCUDAStream()),
               op);
  return key_bounds;
}

}  // namespace

TORCH_LIBRARY(transformer_kernels_C, m) {
  m.def("attention_forward(Tensor query, Tensor key, Tensor value, Tensor? key_padding_mask, Tensor? key_bounds, "
        "Tensor? attn_mask, int causal, float scale, Tensor? dropout_seed, int dropout_threshold, float dropout_scale, "
        "Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
        "Tensor(a!) delta, Tensor? key_padding_mask, Tensor? key_bounds, Tensor? attn_mask, int causal, float scale, "
        "Tensor? dropout_seed, int dropout_threshold, float dropout_scale, Tensor(b!) dq, Tensor(c!) dk, "
        "Tensor(d!) dv, Tensor(e!)? grad_scores) -> ()");
  m.def("attention_key_bounds(Tensor key_padding_mask) -> Tensor");
  m.def("qkv_forward(Tensor x, Tensor weight, Tensor? bias, int num_heads) -> Tensor[]");
  m.def("qkv_grad_input(Tensor[] grads, Tensor x, Tensor weight) -> Tensor");
  m.def("qkv_grad_weight(Tensor[] grads, Tensor x, Tensor weight, bool with_bias) -> (Tensor, Tensor)");
  m.def("glu_conv1d_step(Tensor window, Tensor weight, Tensor? bias, Tensor? residual, float residual_scale) "
        "-> (Tensor, Tensor)");
  m.def("glu_conv1d_update(Tensor x_t, Tensor(a!) conv_state, Tensor position, Tensor weight, Tensor? bias, "
        "Tensor? residual, float residual_scale) -> Tensor");
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
  m.impl("attention_key_bounds", &attention_key_bounds);
  m.impl("qkv_forward", &qkv_forward);
  m.impl("qkv_grad_input", &qkv_grad_input);
  m.impl("qkv_grad_weight", &qkv_grad_weight);
  m.impl("glu_conv1d_step", &glu_conv1d_step);
  m.impl("glu_conv1d_update", &glu_conv1d_update);
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
