// Host emulation of the extension's kernels for tests/test_cuda_host.py: the GEMM kernels' own
// operand addressing and epilogues (qkv_tiles.h, glu_conv_tiles.h, instantiated with T = float) driven
// by a plain loop in place of the tensor-core main loop, and the decoding step's (glu_step_tiles.h)
// with the lanes' partial sums added up in place of the warp reduction.  The loop covers whole 128 x 128 tiles, as
// the kernels do, so the epilogues' bounds checks are exercised (the tests build it with
// AddressSanitizer where available), and reads each operand element through its line's chunk(), 8 elements
// at a time along the operand's contiguous dimension, zero where a chunk is not valid (cp.async's
// zero fill).
//
// Protocol (stdin/stdout, whitespace separated): a kernel name, its integer and float parameters,
// then its input tensors, each as a length followed by that many values; it prints its output
// tensors the same way.
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "glu_conv/glu_conv_tiles.h"
#include "glu_conv/glu_step_tiles.h"
#include "qkv/qkv_tiles.h"

namespace {

constexpr int kTile = 128;  // the kernels' tile size in M and N

using Tensor = std::vector<float>;

Tensor read_tensor() {
  size_t size;
  std::cin >> size;
  Tensor t(size);
  for (float& v : t) std::cin >> v;
  return t;
}

void write_tensor(const Tensor& t) {
  std::cout << t.size();
  for (float v : t) std::cout << ' ' << v;
  std::cout << '\n';
}

int read_int() {
  int v;
  std::cin >> v;
  return v;
}

template <class Operand>
float element(const Operand& op, int mn, int k) {
  bool valid;
  if constexpr (Operand::kMajor == tk::Major::K) {
    const float* p = op.line(mn).chunk(k - k % 8, valid);
    return valid ? p[k % 8] : 0.f;
  } else {
    const float* p = op.line(mn - mn % 8).chunk(k, valid);
    return valid ? p[mn % 8] : 0.f;
  }
}

template <class Args>
void emulate(const Args& args) {
  const int rows = tk::ceil_div(args.rows(), kTile) * kTile, cols = tk::ceil_div(args.cols(), kTile) * kTile;
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < cols; n += 2) {
      double acc0 = 0, acc1 = 0;
      for (int k = 0; k < args.depth(); ++k) {
        const double a = element(args.a(), m, k);
        acc0 += a * element(args.b(), n, k);
        acc1 += a * element(args.b(), n + 1, k);
      }
      args.store(m, n, float(acc0), float(acc1));
    }
  }
  if constexpr (Args::kSumsRowsOfA) {
    if (args.sums_rows_of_a()) {
      for (int m = 0; m < kTile * tk::ceil_div(args.rows(), kTile); ++m) {
        double sum = 0;
        for (int k = 0; k < args.depth(); ++k) sum += element(args.a(), m, k);
        args.store_row_sum(m, float(sum));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ qkv

struct QkvShape {
  int num_proj, batch, seq_len, embed, heads;
  tk::HeadSplitShape head_split(int64_t sb, int64_t sh, int64_t sl) const {
    return tk::HeadSplitShape{seq_len, embed, embed / heads, sb, sh, sl};
  }
};

QkvShape read_qkv_shape() {
  QkvShape s;
  std::cin >> s.num_proj >> s.batch >> s.seq_len >> s.embed >> s.heads;
  return s;
}

tk::qkv::TokenRows<float> token_rows(const QkvShape& s, const Tensor& x, int64_t sb, int64_t sl) {
  return {x.data(), s.seq_len, s.batch * s.seq_len, s.embed, sb, sl};
}

tk::qkv::HeadSplitTensors<float> head_split(const QkvShape& s, const std::vector<Tensor>& grads, int64_t sb,
                                            int64_t sh, int64_t sl) {
  tk::qkv::HeadSplitTensors<float> h;
  for (int i = 0; i < 3; ++i) h.ptr[i] = grads[i < s.num_proj ? i : 0].data();
  h.shape = s.head_split(sb, sh, sl);
  h.tokens = s.batch * s.seq_len;
  h.features = s.num_proj * s.embed;
  return h;
}

void qkv_forward() {
  QkvShape s = read_qkv_shape();
  int64_t sb = read_int(), sl = read_int(), weight_stride = read_int();
  int has_bias = read_int();
  Tensor x = read_tensor(), weight = read_tensor(), bias = has_bias ? read_tensor() : Tensor();
  const int head_dim = s.embed / s.heads;
  std::vector<Tensor> outs(s.num_proj, Tensor(size_t(s.batch) * s.seq_len * s.embed, 0.f));
  tk::qkv::ForwardArgs<float> args;
  args.x = {token_rows(s, x, sb, sl)};
  args.weight = {weight.data(), s.num_proj * s.embed, s.embed, weight_stride};
  args.bias = has_bias ? bias.data() : nullptr;
  for (int i = 0; i < 3; ++i) args.out[i] = outs[i < s.num_proj ? i : 0].data();
  args.out_shape = s.head_split(int64_t(s.heads) * s.seq_len * head_dim, int64_t(s.seq_len) * head_dim, head_dim);
  emulate(args);
  for (const Tensor& out : outs) write_tensor(out);
}

void qkv_grad_input() {
  QkvShape s = read_qkv_shape();
  int64_t gb = read_int(), gh = read_int(), gl = read_int(), weight_stride = read_int();
  std::vector<Tensor> grads;
  for (int i = 0; i < s.num_proj; ++i) grads.push_back(read_tensor());
  Tensor weight = read_tensor();
  Tensor grad_x(size_t(s.batch) * s.seq_len * s.embed, 0.f);
  tk::qkv::GradInputArgs<float> args;
  args.grad = {head_split(s, grads, gb, gh, gl)};
  args.weight = {weight.data(), s.num_proj * s.embed, s.embed, weight_stride};
  args.grad_x = grad_x.data();
  emulate(args);
  write_tensor(grad_x);
}

void qkv_grad_weight() {
  QkvShape s = read_qkv_shape();
  int64_t gb = read_int(), gh = read_int(), gl = read_int(), sb = read_int(), sl = read_int();
  int has_bias = read_int();
  std::vector<Tensor> grads;
  for (int i = 0; i < s.num_proj; ++i) grads.push_back(read_tensor());
  Tensor x = read_tensor();
  Tensor grad_weight(size_t(s.num_proj) * s.embed * s.embed, 0.f), grad_bias(has_bias ? s.num_proj * s.embed : 0, 0.f);
  tk::qkv::GradWeightArgs<float> args;
  args.grad = {head_split(s, grads, gb, gh, gl)};
  args.x = {token_rows(s, x, sb, sl)};
  args.grad_weight = grad_weight.data();
  args.grad_bias = has_bias ? grad_bias.data() : nullptr;
  emulate(args);
  write_tensor(grad_weight);
  write_tensor(grad_bias);
}

// ------------------------------------------------------------------------------------------------ glu_conv

tk::glu_conv::ConvShape read_conv_shape() {
  int batch, channels_in, channels_z, kernel_size, length_in, length_out, pad_left;
  std::cin >> batch >> channels_in >> channels_z >> kernel_size >> length_in >> length_out >> pad_left;
  return tk::glu_conv::ConvShape{batch, channels_in, channels_z, kernel_size, length_in, length_out, pad_left};
}

tk::Strides3 read_strides() {
  tk::Strides3 s;
  std::cin >> s.b >> s.c >> s.l;
  return s;
}

template <bool kGrad>
void glu_preactivation() {
  tk::glu_conv::ConvShape s = read_conv_shape();
  float scale;
  std::cin >> scale;
  int has_bias = read_int(), has_other = read_int();
  tk::Strides3 other_strides = read_strides(), out_strides = read_strides();
  int out_size = read_int();
  Tensor xpad = read_tensor(), weight = read_tensor(), bias = has_bias ? read_tensor() : Tensor();
  Tensor other = has_other ? read_tensor() : Tensor();
  Tensor out(out_size, 0.f);
  tk::glu_conv::PreactivationArgs<float, kGrad> args{{xpad.data(), s}, {weight.data(), s},
                                                     has_bias ? bias.data() : nullptr,
                                                     has_other ? other.data() : nullptr, other_strides,
                                                     out.data(), out_strides, scale};
  emulate(args);
  write_tensor(out);
}

void glu_grad_input() {
  tk::glu_conv::ConvShape s = read_conv_shape();
  tk::Strides3 strides = read_strides();
  int size = read_int();
  Tensor grad_z = read_tensor(), weight = read_tensor();
  Tensor grad_x(size, 0.f);
  tk::glu_conv::GradInputArgs<float> args{{grad_z.data(), s}, {weight.data(), s}, grad_x.data(), strides};
  emulate(args);
  write_tensor(grad_x);
}

void glu_grad_weight() {
  tk::glu_conv::ConvShape s = read_conv_shape();
  int has_bias = read_int();
  Tensor grad_z = read_tensor(), xpad = read_tensor();
  const int channels_z = s.channels_z.divisor;
  Tensor grad_weight(size_t(channels_z) * s.window(), 0.f), grad_bias(has_bias ? channels_z : 0, 0.f);
  tk::glu_conv::GradWeightArgs<float> args{{grad_z.data(), s}, {{xpad.data(), s}}, grad_weight.data(),
                                           has_bias ? grad_bias.data() : nullptr};
  emulate(args);
  write_tensor(grad_weight);
  write_tensor(grad_bias);
}

// The step kernel's grid: CTAs of 8 channels x 8 batch rows, 32 lanes per channel.
void glu_step() {
  constexpr int kRows = 8, kLanes = 32;
  int batch = read_int(), channels_in = read_int(), channels = read_int(), kernel_size = read_int();
  float scale;
  std::cin >> scale;
  int has_bias = read_int(), has_residual = read_int();
  int64_t rb = read_int(), rc = read_int();
  Tensor window = read_tensor(), weight = read_tensor(), bias = has_bias ? read_tensor() : Tensor();
  Tensor residual = has_residual ? read_tensor() : Tensor();
  Tensor out(size_t(batch) * channels, 0.f), z(size_t(batch) * 2 * channels, 0.f);
  tk::glu_conv::StepArgs<float> args{window.data(), weight.data(), has_bias ? bias.data() : nullptr,
                                     has_residual ? residual.data() : nullptr, out.data(), z.data(),
                                     batch, channels_in, channels, kernel_size, rb, rc, channels, 1, scale};
  for (int c = 0; c < channels; ++c) {
    for (int b0 = 0; b0 < batch; b0 += kRows) {
      float value[kRows] = {}, gate[kRows] = {};
      for (int lane = 0; lane < kLanes; ++lane) args.partial_sums<kRows>(c, b0, lane, kLanes, value, gate);
      for (int r = 0; r < kRows && b0 + r < batch; ++r) args.store(b0 + r, c, value[r], gate[r]);
    }
  }
  write_tensor(out);
  write_tensor(z);
}

// glu_conv1d_update: the step through a ring of positions (int64, one per row), then each row's
// new input stored into its slot, as the CTAs of the first channel block store them.
void glu_update() {
  constexpr int kRows = 8, kLanes = 32;
  int batch = read_int(), channels_in = read_int(), channels = read_int(), kernel_size = read_int();
  float scale;
  std::cin >> scale;
  int has_bias = read_int();
  Tensor ring = read_tensor(), new_input = read_tensor(), positions = read_tensor(), weight = read_tensor();
  Tensor bias = has_bias ? read_tensor() : Tensor();
  std::vector<int64_t> position(positions.begin(), positions.end());
  Tensor out(size_t(batch) * channels, 0.f);
  tk::glu_conv::StepArgs<float> args{ring.data(), weight.data(), has_bias ? bias.data() : nullptr, nullptr,
                                     out.data(), nullptr, batch, channels_in, channels, kernel_size, 0, 0,
                                     channels, 1, scale};
  args.ring = ring.data();
  args.new_input = new_input.data();
  args.position = position.data();
  args.position_stride = 1;
  for (int c = 0; c < channels; ++c) {
    for (int b0 = 0; b0 < batch; b0 += kRows) {
      float value[kRows] = {}, gate[kRows] = {};
      for (int lane = 0; lane < kLanes; ++lane) args.partial_sums<kRows, true>(c, b0, lane, kLanes, value, gate);
      for (int r = 0; r < kRows && b0 + r < batch; ++r) args.store(b0 + r, c, value[r], gate[r]);
    }
  }
  for (int b = 0; b < batch; ++b) {
    for (int ci = 0; ci < channels_in; ++ci) args.store_new_input(b, ci);
  }
  write_tensor(out);
  write_tensor(ring);
}

}  // namespace

int main() {
  std::cout.precision(9);
  std::string kernel;
  std::cin >> kernel;
  if (kernel == "qkv_forward") qkv_forward();
  else if (kernel == "qkv_grad_input") qkv_grad_input();
  else if (kernel == "qkv_grad_weight") qkv_grad_weight();
  else if (kernel == "glu_forward") glu_preactivation<false>();
  else if (kernel == "glu_grad_preactivation") glu_preactivation<true>();
  else if (kernel == "glu_grad_input") glu_grad_input();
  else if (kernel == "glu_grad_weight") glu_grad_weight();
  else if (kernel == "glu_step") glu_step();
  else if (kernel == "glu_update") glu_update();
  else {
    std::cerr << "unknown kernel " << kernel << '\n';
    return 1;
  }
  return 0;
}
