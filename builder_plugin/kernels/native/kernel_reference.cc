// The float path: what the library computes where its int8 path does not apply (bits other than 4 and 8, g_idx,
// accuracy_level below 4). Plain C++, every CPU.
#include <cmath>
#include <vector>

#include "matmul_nbits.h"

namespace bp {

int Weights::code(int64_t col, int64_t r) const {
  // codes are packed from the lowest bit up, each block starting on a byte
  const int64_t blk = r / block, in_block = r % block;
  const int64_t bit = in_block * bits;
  const uint8_t* base = packed + col * column_bytes() + blk * block_bytes();
  uint32_t word = base[bit / 8];
  if (bit % 8 + bits > 8) word |= static_cast<uint32_t>(base[bit / 8 + 1]) << 8;
  return static_cast<int>((word >> (bit % 8)) & ((1u << bits) - 1));
}

namespace {

struct ReferenceJob {
  const Weights* w;
  const float* a;
  int64_t m;
  float* y;
  int64_t tile;
};

void reference_tile(void* data, size_t index) {
  const auto& job = *static_cast<const ReferenceJob*>(data);
  const Weights& w = *job.w;
  std::vector<float> column(static_cast<size_t>(w.k));
  const int64_t end = std::min<int64_t>(w.n, (static_cast<int64_t>(index) + 1) * job.tile);
  for (int64_t col = static_cast<int64_t>(index) * job.tile; col < end; ++col) {
    for (int64_t r = 0; r < w.k; ++r) {
      const int64_t blk = w.g_idx ? w.g_idx[r] : r / w.block;
      column[r] = static_cast<float>(w.code(col, r) - w.zero_point(col, blk)) * w.scales[col * w.blocks() + blk];
    }
    for (int64_t row = 0; row < job.m; ++row) {
      const float* a = job.a + row * w.k;
      double sum = 0.0;
      for (int64_t r = 0; r < w.k; ++r) sum += static_cast<double>(a[r]) * column[r];
      job.y[row * w.n + col] = static_cast<float>(sum) + (w.bias ? w.bias[col] : 0.0f);
    }
  }
}

}  // namespace

void matmul_reference(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  ReferenceJob job{&w, a, m, y, 16};
  run(context, reference_tile, static_cast<size_t>((w.n + job.tile - 1) / job.tile), &job);
}

}  // namespace bp
