// A's rows quantized to int8 per block of K, shared by the AVX-512 and AMX paths: scale = max|a| / 127, code =
// round-half-even(a * 127 / max|a|), in K order, zero beyond K. kernel_avx2.cc's quantize_row() computes the same codes
// with AVX2 alone (in its own order of K): a change to this arithmetic changes both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

namespace bp {

struct AlignedFree {
  void operator()(void* p) const { ::operator delete(p, std::align_val_t(64)); }
};
using Buffer = std::unique_ptr<void, AlignedFree>;
inline Buffer aligned_buffer(size_t bytes) { return Buffer(::operator new(bytes, std::align_val_t(64))); }

// This thread's scratch memory of at least `bytes` (64-byte aligned), kept for its next task: where a task of the
// panel paths unpacks its panel. One per thread for every path (a thread runs one task at a time).
inline void* thread_scratch(size_t bytes) {
  thread_local Buffer storage;
  thread_local size_t capacity = 0;
  if (capacity < bytes) {
    storage = aligned_buffer(bytes);
    capacity = bytes;
  }
  return storage.get();
}

struct QuantizedRows {
  int64_t rows = 0, padded = 0, blocks = 0;
  Buffer codes;   // int8 [rows][padded]
  Buffer scales;  // float [rows][blocks]
  const int8_t* row(int64_t r) const { return static_cast<const int8_t*>(codes.get()) + r * padded; }
  const float* row_scales(int64_t r) const { return static_cast<const float*>(scales.get()) + r * blocks; }
};

// `padded` >= blocks * block, a multiple of 64. False without AVX-512 (nothing written).
bool quantize_rows(const float* a, int64_t k, int64_t block, int64_t padded, int64_t rows, QuantizedRows& out);

}  // namespace bp
