// Host driver for tests/test_cuda_problems.py: builds the raw ops' launcher problems (csrc/problems.h)
// from CPU tensors described on stdin, one call per line, and prints "ok <problem fields>" or
// "error <message>" per line.
//   qkv <x> <weight> <head> <count>      (count head-split tensors like <head>)
//   step <window> <weight> <bias> <residual>
//   conv <xpad> <packed_weight> <length_in> <pad_left>
//   attention <q> <k> <v> <key_padding_mask> <key_bounds> <attn_mask> <causal> <dropout_seed> <threshold>
//   key_bounds <key_padding_mask>
//   output <tensor>                      (a tensor a kernel writes: check_chunks and check_output)
// A tensor is "dtype:sizes:strides[:offset]" (sizes and strides comma-separated, the offset in
// elements into a larger buffer), or "-" for none.
#include <algorithm>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "problems.h"

namespace {

std::vector<int64_t> numbers(const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) values.push_back(std::stoll(item));
  return values;
}

std::optional<at::Tensor> tensor(const std::string& spec) {
  if (spec == "-") return std::nullopt;
  static const std::map<std::string, at::ScalarType> dtypes = {
      {"f16", at::kHalf}, {"bf16", at::kBFloat16}, {"f32", at::kFloat},
      {"bool", at::kBool}, {"i32", at::kInt},      {"i64", at::kLong}};
  std::vector<std::string> fields;
  std::stringstream stream(spec);
  for (std::string field; std::getline(stream, field, ':');) fields.push_back(field);
  const std::vector<int64_t> sizes = numbers(fields.at(1)), strides = numbers(fields.at(2));
  const int64_t offset = fields.size() > 3 ? std::stoll(fields[3]) : 0;
  int64_t extent = 1;
  for (size_t d = 0; d < sizes.size(); ++d) extent += (sizes[d] - 1) * strides[d];
  at::Tensor buffer = at::zeros({offset + extent}, at::TensorOptions().dtype(dtypes.at(fields.at(0))));
  return buffer.as_strided(sizes, strides, offset);
}

std::string call(std::istream& in) {
  std::string builder;
  in >> builder;
  auto next = [&in] {
    std::string spec;
    in >> spec;
    return tensor(spec);
  };
  std::ostringstream out;
  if (builder == "qkv") {
    const at::Tensor x = *next(), weight = *next(), head = *next();
    int count;
    in >> count;
    const std::vector<at::Tensor> heads(count, head);
    const tk::qkv::Problem p = tk::bindings::qkv_problem(x, weight, heads, "qkv");
    out << p.num_proj << ' ' << p.batch << ' ' << p.heads.seq_len.divisor << ' ' << p.heads.embed_dim.divisor << ' '
        << p.heads.head_dim.divisor;
  } else if (builder == "step") {
    const at::Tensor window = *next(), weight = *next();
    const std::optional<at::Tensor> bias = next(), residual = next();
    const tk::glu_conv::StepProblem p = tk::bindings::step_problem(window, weight, bias, residual, 1.0, "step");
    out << p.batch << ' ' << p.channels_in << ' ' << p.channels_out << ' ' << p.kernel_size;
  } else if (builder == "conv") {
    const at::Tensor xpad = *next(), packed_weight = *next();
    int64_t length_in, pad_left;
    in >> length_in >> pad_left;
    const tk::glu_conv::ConvProblem p = tk::bindings::conv_problem(xpad, packed_weight, length_in, pad_left, 1.0, "conv");
    out << p.channels_in << ' ' << p.channels_out << ' ' << p.kernel_size << ' ' << p.length_out;
  } else if (builder == "attention") {
    const at::Tensor q = *next(), k = *next(), v = *next();
    const std::optional<at::Tensor> key_padding_mask = next(), key_bounds = next(), attn_mask = next();
    int64_t causal, threshold;
    in >> causal;
    const std::optional<at::Tensor> dropout_seed = next();
    in >> threshold;
    const tk::attention::ForwardProblem p = tk::bindings::attention_problem(
        q, k, v, key_padding_mask, key_bounds, attn_mask, causal, 1.0, dropout_seed, threshold, 1.0, "attention");
    out << p.batch << ' ' << p.heads_q << ' ' << p.heads_k << ' ' << p.seq_len_q << ' ' << p.seq_len_k << ' '
        << p.head_dim << ' ' << p.head_dim_v << " padding " << (p.key_padding != nullptr) << " bounds "
        << (p.key_bounds != nullptr);
  } else if (builder == "key_bounds") {
    const auto [batch, seq_len_k] = tk::bindings::key_bounds_problem(*next(), "key_bounds");
    out << batch << ' ' << seq_len_k;
  } else if (builder == "output") {
    const at::Tensor t = *next();
    tk::bindings::check_chunks(t, "output", "out");
    tk::bindings::check_output(t, "output", "out");
  } else {
    throw std::invalid_argument("unknown builder " + builder);
  }
  return out.str();
}

}  // namespace

int main() {
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    try {
      const std::string fields = call(in);
      std::cout << "ok " << fields << std::endl;  // flushed: a crash leaves the answers before it
    } catch (const c10::Error& error) {
      std::string message = error.what_without_backtrace();
      std::replace(message.begin(), message.end(), '\n', ' ');
      std::cout << "error " << message << std::endl;
    }
  }
  return 0;
}
