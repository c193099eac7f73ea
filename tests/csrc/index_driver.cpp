// Host driver for tests/test_cuda_host.py: evaluates csrc/common/index.h's functions on queries read
// from stdin, one per line ("<function> <int args...>"), printing one result line per query.
#include <iostream>
#include <string>

#include "common/index.h"

int main() {
  std::string function;
  while (std::cin >> function) {
    if (function == "grouped_tile") {
      int linear, tiles_m, tiles_n, group_m;
      std::cin >> linear >> tiles_m >> tiles_n >> group_m;
      tk::TileCoord tile = tk::grouped_tile(linear, tiles_m, tiles_n, group_m);
      std::cout << tile.m << ' ' << tile.n << '\n';
    } else if (function == "head_split_index") {
      int seq_len, embed_dim, head_dim, token, feature;
      int64_t stride_b, stride_h, stride_l;
      std::cin >> seq_len >> embed_dim >> head_dim >> stride_b >> stride_h >> stride_l >> token >> feature;
      tk::HeadSplitShape shape{seq_len, embed_dim, head_dim, stride_b, stride_h, stride_l};
      tk::HeadSplitIndex index = tk::head_split_index(shape, token, feature);
      std::cout << index.proj << ' ' << index.offset << '\n';
    } else if (function == "fast_divisor") {
      int divisor, numerator;
      std::cin >> divisor >> numerator;
      std::cout << tk::FastDivisor(divisor).quotient(numerator) << '\n';
    } else if (function == "tap_position") {
      int s, tap, pad_left, length_in;
      std::cin >> s >> tap >> pad_left >> length_in;
      int position = tk::tap_position(s, tap, pad_left);
      std::cout << position << ' ' << tk::in_sequence(position, length_in) << '\n';
    } else if (function == "conv_output_length") {
      int length_in, kernel_size, pad_left, pad_right;
      std::cin >> length_in >> kernel_size >> pad_left >> pad_right;
      std::cout << tk::conv_output_length(length_in, kernel_size, pad_left, pad_right) << '\n';
    } else if (function == "step_window") {
      int tap, kernel_size;
      std::cin >> tap >> kernel_size;
      std::cout << tk::window_from_state(tap, kernel_size) << ' ' << tk::new_state_source(tap) << '\n';
    } else if (function == "row_dot_split") {
      int cols, chunk;
      int64_t thread;
      std::cin >> cols >> chunk >> thread;
      tk::RowDotSplit split = tk::RowDotSplit::of(cols, chunk);
      std::cout << split.lanes << ' ' << split.row(thread) << ' ' << split.first_col(thread) << ' '
                << split.col_step() << '\n';
    } else {
      std::cerr << "unknown function " << function << '\n';
      return 1;
    }
  }
  return 0;
}
