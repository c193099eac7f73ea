// Host driver for tests/test_cuda_host.py: evaluates csrc/common/attention_masks.h's functions on
// queries read from stdin, one per line ("<function> <args...>"), printing one result line per query.
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include "common/attention_masks.h"

namespace at = tk::attention;

int main() {
  std::cout << std::setprecision(9);
  std::string function;
  while (std::cin >> function) {
    if (function == "key_blocks") {
      int row_start, block_m, block_n, seq_len_q, causal, shift, first_key, end_key;
      std::cin >> row_start >> block_m >> block_n >> seq_len_q >> causal >> shift >> first_key >> end_key;
      at::KeyBlocks b = at::key_blocks(row_start, block_m, block_n, seq_len_q, causal != 0, shift, first_key, end_key);
      std::cout << b.begin << ' ' << b.end << ' ' << b.full_begin << ' ' << b.full_end << '\n';
    } else if (function == "row_keys") {
      int has_bounds, has_padding, seq_len_k;
      int32_t bounds[3];
      std::cin >> has_bounds >> bounds[0] >> bounds[1] >> bounds[2] >> has_padding >> seq_len_k;
      at::RowKeys keys = at::row_keys(has_bounds != 0 ? bounds : nullptr, has_padding != 0, seq_len_k);
      std::cout << keys.first_key << ' ' << keys.end_key << ' ' << keys.holes << '\n';
    } else if (function == "key_bounds") {
      // "<threads> <seq_len_k> <padding bits>": the bounds kernel's partition of one row's keys
      // (thread t adds keys t, t + threads, ...), its partial bounds merged in butterfly order.
      int threads, seq_len_k;
      std::string bits;
      std::cin >> threads >> seq_len_k >> bits;
      std::vector<at::KeyBounds> partial(threads, at::KeyBounds::none(seq_len_k));
      for (int key = 0; key < seq_len_k; ++key) partial[key % threads].add_key(key, bits[key] == '1');
      for (int offset = threads / 2; offset > 0; offset /= 2) {
        for (int t = 0; t < offset; ++t) partial[t].merge(partial[t + offset]);
      }
      int32_t bounds[3];
      partial[0].store(bounds);
      std::cout << bounds[0] << ' ' << bounds[1] << ' ' << bounds[2] << '\n';
    } else if (function == "query_rows") {
      int key_start, block_n, seq_len_q, causal, shift;
      std::cin >> key_start >> block_n >> seq_len_q >> causal >> shift;
      at::QueryRows r = at::query_rows(key_start, block_n, seq_len_q, causal != 0, shift);
      std::cout << r.row_begin << ' ' << r.row_full << '\n';
    } else if (function == "query_steps") {
      int head_begin, head_end, q_first, block_q, seq_len_q;
      std::cin >> head_begin >> head_end >> q_first >> block_q >> seq_len_q;
      for (at::QueryStep step{head_begin, q_first}; step.head < head_end;
           step = at::next_query_step(step, block_q, seq_len_q, q_first)) {
        std::cout << step.head << ' ' << step.q_start << ' ';
      }
      std::cout << '\n';
    } else if (function == "causal_shift") {
      int causal, seq_len_q, seq_len_k;
      std::cin >> causal >> seq_len_q >> seq_len_k;
      std::cout << at::causal_shift(static_cast<at::Causal>(causal), seq_len_q, seq_len_k) << '\n';
    } else if (function == "mask_bias_log2") {
      std::string text;
      std::cin >> text;
      std::cout << at::mask_bias_log2(std::stof(text)) << '\n';
    } else if (function == "philox") {
      uint32_t c0, c1, c2, c3;
      uint64_t seed;
      std::cin >> seed >> c0 >> c1 >> c2 >> c3;
      at::Philox4 r = at::philox4x32_10(c0, c1, c2, c3, seed);
      std::cout << r.r[0] << ' ' << r.r[1] << ' ' << r.r[2] << ' ' << r.r[3] << '\n';
    } else if (function == "rand") {
      int32_t seed;
      uint32_t offset;
      std::cin >> seed >> offset;
      std::cout << at::triton_rand(seed, offset) << '\n';
    } else if (function == "dropout_keep") {
      int64_t seed, offset;
      int head_batch, query, key;
      uint32_t threshold;
      std::cin >> seed >> offset >> head_batch >> query >> key >> threshold;
      std::cout << at::dropout_keep(at::dropout_key(seed, offset), head_batch, query, key, threshold) << '\n';
    } else {
      std::cerr << "unknown function " << function << '\n';
      return 1;
    }
  }
  return 0;
}
