// Where the library's MatMulNBits reads a node's stored weights (B, its scales and zero points), as
// BUILDER_PLUGIN_OPS_WEIGHTS says when a session makes its kernels:
// - "in-place" (the default): where onnxruntime keeps them, for a package the pages of its mapped data file;
// - "copy": copied once, at the node's first run, into anonymous memory of the library's own, and the file's pages
//   it copied unmapped from the process (MADV_DONTNEED: they stay in the page cache, so the next start finds them),
//   so resident memory holds the weights once, as in place;
// - "huge-pages": the copy on transparent huge pages.
// On the 2-core Zen 4 VM of #33 a read of mapped file pages ran at 0.89x the speed of the same read from anonymous
// memory, and a full-size decode step took 3-6 % less time on the copy (paired; 7-8 % on huge pages), but the first
// question of a process waited 2-8 s more for the copies (the decoder alone on huge pages: 6.8 s, the kernel
// compacting memory for them): worth it for a long-running server, not for one question (docs/runtime.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "matmul_nbits.h"

namespace bp {

// Where the kernels made now read their weights (BUILDER_PLUGIN_OPS_WEIGHTS; an unknown value leaves the default and
// says so on stderr, once).
enum class WeightsHome { kInPlace, kCopy, kHugePages };
WeightsHome weights_home();

// One node's weights where `home` says.
class ResidentWeights {
 public:
  explicit ResidentWeights(WeightsHome home) : home_(home) {}
  ResidentWeights(const ResidentWeights&) = delete;
  ResidentWeights& operator=(const ResidentWeights&) = delete;
  ~ResidentWeights();

  // `w` reading B, its scales and zero points from the copy, which the first call makes on `run`'s threads; `w` as
  // it is in place, where the copy could not be made, or where `w.packed` is not the B that was copied.
  Weights apply(const Weights& w, ParallelFor run, void* context);

 private:
  const WeightsHome home_;
  std::once_flag made_;
  const uint8_t* source_ = nullptr;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  const uint8_t* packed_ = nullptr;
  const float* scales_ = nullptr;
  const uint8_t* zero_points_ = nullptr;
};

}  // namespace bp
