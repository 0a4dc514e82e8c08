// What the bf16 paths share: their target attribute and the tile configuration they use (every tile 16 rows x 64
// bytes), kept in static memory (see tiles.h); the transpose and lane masks of simd_util.h.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "simd_util.h"
#include "tiles.h"

#define BP_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,fma,avx2,bmi2")))

namespace bp {

// Every tile 16 rows x 64 bytes; made once, loaded by each task.
const TileConfig& square_tiles();

}  // namespace bp

#endif
