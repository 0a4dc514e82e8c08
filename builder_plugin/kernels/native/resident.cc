// ResidentWeights (resident.h): the copy, and the release of the file pages it was made from.
#include "resident.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace bp {

WeightsHome weights_home() {
  const char* value = std::getenv("BUILDER_PLUGIN_OPS_WEIGHTS");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "in-place") == 0) return WeightsHome::kInPlace;
  if (std::strcmp(value, "copy") == 0) return WeightsHome::kCopy;
  if (std::strcmp(value, "huge-pages") == 0) return WeightsHome::kHugePages;
  static std::once_flag told;
  std::call_once(told, [value] {
    std::fprintf(stderr, "builder_plugin ops: BUILDER_PLUGIN_OPS_WEIGHTS=%s is not in-place, copy or huge-pages; "
                 "reading in place\n", value);
  });
  return WeightsHome::kInPlace;
}

#if defined(__linux__)
namespace {

constexpr size_t kPiece = size_t{4} << 20;  // bytes copied per task
constexpr int kPopulateWrite = 23;          // MADV_POPULATE_WRITE (Linux 5.14), which older headers lack

struct Part {
  const void* from;
  void* to;
  size_t bytes;
};

constexpr size_t kParts = 3;  // B, scales, zero points

struct CopyJob {
  const Part* parts;
  size_t count;  // <= kParts
};

size_t pieces(size_t bytes) { return (bytes + kPiece - 1) / kPiece; }

// Piece `index` of the job: the parts' pieces in order.
void copy_piece(void* data, size_t index) {
  const auto& job = *static_cast<const CopyJob*>(data);
  for (size_t i = 0; i < job.count; ++i) {
    const Part& part = job.parts[i];
    if (index >= pieces(part.bytes)) {
      index -= pieces(part.bytes);
      continue;
    }
    const size_t offset = index * kPiece, bytes = std::min(kPiece, part.bytes - offset);
    std::memcpy(static_cast<uint8_t*>(part.to) + offset, static_cast<const uint8_t*>(part.from) + offset, bytes);
    return;
  }
}

size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

// The whole pages of each part's source, unmapped from this process where they lie in a mapping of a file (an inode
// in /proc/self/maps, read once): MADV_DONTNEED there only drops pages the file still holds (they stay in the page
// cache; onnxruntime never writes to an initializer), where on anonymous private memory it would zero them.
void release_file_pages(const Part* parts, size_t count) {
  FILE* maps = std::fopen("/proc/self/maps", "re");
  if (maps == nullptr) return;
  bool done[kParts] = {};
  size_t left = count;
  char line[512];
  while (left > 0 && std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long start = 0, end = 0, inode = 0;
    if (std::sscanf(line, "%lx-%lx %*s %*s %*s %lu", &start, &end, &inode) != 3) continue;
    for (size_t i = 0; i < count; ++i) {
      const auto first = reinterpret_cast<uintptr_t>(parts[i].from), last = first + parts[i].bytes;
      if (done[i] || first < start || last > end) continue;
      done[i] = true;
      --left;
      const uintptr_t page = 4096, from = round_up(first, page), to = last & ~(page - 1);
      if (inode != 0 && to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
    }
  }
  std::fclose(maps);
}

}  // namespace

ResidentWeights::~ResidentWeights() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

Weights ResidentWeights::apply(const Weights& w, ParallelFor run, void* context) {
  if (home_ == WeightsHome::kInPlace) return w;
  std::call_once(made_, [&] {
    if (w.packed == nullptr || w.scales == nullptr) return;
    const size_t packed = static_cast<size_t>(w.n * w.column_bytes());
    const size_t scales = static_cast<size_t>(w.n * w.blocks()) * sizeof(float);
    const size_t zero_points = w.zero_points ? static_cast<size_t>(w.n * w.zero_point_columns()) : 0;
    const size_t scales_at = round_up(packed, 64), zero_points_at = round_up(scales_at + scales, 64);
    const size_t total = zero_points_at + zero_points;
    void* mapping = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) return;
    auto* base = static_cast<uint8_t*>(mapping);
    if (home_ == WeightsHome::kHugePages) madvise(base, total, MADV_HUGEPAGE);
    // faulted in by one call rather than page by page during the copy (a kernel older than Linux 5.14 refuses it,
    // and the copy faults them in)
    madvise(base, total, kPopulateWrite);
    const Part parts[kParts] = {{w.packed, base, packed},
                                {w.scales, base + scales_at, scales},
                                {w.zero_points, base + zero_points_at, zero_points}};
    CopyJob job{parts, zero_points ? 3u : 2u};
    run(context, copy_piece, pieces(packed) + pieces(scales) + pieces(zero_points), &job);
    mapping_ = mapping;
    mapping_bytes_ = total;
    packed_ = base;
    scales_ = reinterpret_cast<const float*>(base + scales_at);
    zero_points_ = zero_points ? base + zero_points_at : nullptr;
    source_ = w.packed;
    release_file_pages(parts, job.count);
  });
  if (source_ == nullptr || source_ != w.packed) return w;
  Weights copied = w;
  copied.packed = packed_;
  copied.scales = scales_;
  copied.zero_points = zero_points_;
  return copied;
}

#else

ResidentWeights::~ResidentWeights() = default;
Weights ResidentWeights::apply(const Weights& w, ParallelFor, void*) { return w; }

#endif

}  // namespace bp
