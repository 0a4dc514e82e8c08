// The many-rows path (a prompt): a packed-panel GEMM on AMX bf16 tiles (TDPBF16PS, float sums over the whole of K).
//
// Each task unpacks a panel of B (up to 128 columns x up to 4096 rows of K) once into a buffer that stays in L2:
// every weight dequantized, (code - zero point) x scale in float (one rounding, as numpy's), then rounded to bf16
// (nearest even), in the layout TDPBF16PS reads its second operand in (per 16 columns and 32 rows of K one 1 KB tile:
// tile row j holds rows 2j and 2j + 1 of K of the 16 columns). A's rows are converted to bf16 once per call, 16 rows x
// 32 of K per tile. All rows of the task then meet the panel, 32 rows x 32 columns (four sum tiles) at a time over the
// panel's K, and the float sums go straight from the tiles into Y (the bias, or Y's earlier sums, loaded into them
// first). No activation quantization and no per-block epilogue: bf16 keeps each value's own exponent, so a few
// channels hundreds of times larger than the rest cost nothing, and the block scales are inside the panel's values.
//
// With 4-bit weights a tile row's 32 values of K are a step's even rows, then its odd ones (the order of the codes'
// low and high nibbles); A's rows are permuted alike (a sum over a row cares only that both operands share it).
#include "matmul_nbits.h"
#include "quantize.h"
#include "bf16_util.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace bp {
namespace {

constexpr int kGroup = 16;                        // rows of A per activation tile; columns of B per weight tile
constexpr int kStep = 32;                         // rows of K per tile
constexpr int kTileElements = kGroup * kStep;     // bf16 values in one tile (1 KB)
constexpr int kPairElements = 2 * kTileElements;  // a step's tiles of two groups, side by side
constexpr int kPanelGroups = 8;                   // column groups per panel (128 columns)
constexpr int64_t kDepthSteps = 128;              // steps of K per panel (4096 rows: a 1 MB panel)
constexpr int kPrefetchAhead = 512;               // bytes of a column prefetched ahead of its loads
constexpr int64_t kTasks = 16;                    // tasks wanted per call, for the threads to share evenly

// The tiles (square_tiles()): 0-3 float sums [16 rows of A][16 columns], 4-5 activations [16 rows][32 of K], 6-7
// weights [16 pairs of K][16 columns x 2].

struct Plan {
  const Weights* w;
  const float* a;
  float* y;
  const float* bias;  // padded to whole column groups, or null
  int64_t m, groups, steps, column_bytes, zero_point_columns, block_shift;
  uint16_t* acts;  // [pairs of row groups][steps][2][16 rows][32 of K] bf16
  int64_t panel_groups, panels, depth_steps, splits, groups_per_split;
};

// Rows [16 h, 16 h + 16) of A as bf16 tiles, every step of K (rows past M and K past its end as zeros).
BP_BF16 void arrange_group(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t h = static_cast<int64_t>(index), k = p.w->k;
  uint16_t* out = p.acts + (h / 2 * p.steps * 2 + h % 2) * kTileElements;
  const int64_t valid = std::min<int64_t>(kGroup, p.m - h * kGroup);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t s = 0; s < p.steps; ++s, out += kPairElements) {
    const int64_t at = s * kStep;
    const __mmask16 low = first_lanes(k - at), high = first_lanes(k - at - 16);
    for (int r = 0; r < valid; ++r) {
      const float* x = p.a + (h * kGroup + r) * k + at;
      __m512 first = _mm512_maskz_loadu_ps(low, x), second = _mm512_maskz_loadu_ps(high, x + 16);
      if (p.w->bits == 4) {
        const __m512 evens = _mm512_permutex2var_ps(first, even, second);
        second = _mm512_permutex2var_ps(first, odd, second);
        first = evens;
      }
      _mm512_store_si512(out + r * kStep, (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
    for (int r = static_cast<int>(valid); r < kGroup; ++r) _mm512_store_si512(out + r * kStep, _mm512_setzero_si512());
  }
}

BP_BF16 inline int zero_point(const Weights& w, int64_t zero_point_columns, int64_t col, int64_t b) {
  if (w.zero_points == nullptr) return 1 << (w.bits - 1);
  const uint8_t* zp = w.zero_points + col * zero_point_columns;
  return w.bits == 4 ? (zp[b >> 1] >> (4 * (b & 1))) & 0x0F : zp[b];
}

// Per column of a group, for the blocks of one depth block: the scale and the zero point.
struct GroupScales {
  int64_t first = 0, count = 0;
  float* scale = nullptr;  // [16][count]
  float* zero = nullptr;   // [16][count]
};

BP_BF16 void group_scales(const Plan& p, int64_t col0, int64_t s0, int64_t s1, GroupScales& out) {
  const Weights& w = *p.w;
  out.first = (s0 * kStep) >> p.block_shift;
  out.count = std::min(w.blocks(), (((s1 * kStep) - 1) >> p.block_shift) + 1) - out.first;
  const __m512 fixed = _mm512_set1_ps(static_cast<float>(1 << (w.bits - 1)));
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i halves = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  for (int r = 0; r < kGroup; ++r) {
    const int64_t col = std::min(col0 + r, w.n - 1);  // columns past N are never stored
    const float* scales = w.scales + col * w.blocks() + out.first;
    const uint8_t* zps = w.zero_points ? w.zero_points + col * p.zero_point_columns : nullptr;
    for (int64_t i = 0; i < out.count; i += 16) {
      const __mmask16 mask = first_lanes(out.count - i);
      __m512 zp = fixed;
      const int64_t b = out.first + i;
      if (zps != nullptr && w.bits == 8) {
        zp = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, zps + b)));
      } else if (zps != nullptr && b % 2 == 0) {  // 4 bits, two blocks a byte, low nibble first
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(first_lanes((out.count - i + 1) / 2),
                                                                         zps + b / 2));
        zp = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(pairs, bytes), halves),
                                                 _mm512_set1_epi32(0x0F)));
      } else if (zps != nullptr) {
        alignas(64) float z[16] = {};
        for (int j = 0; j < 16 && i + j < out.count; ++j)
          z[j] = static_cast<float>(zero_point(w, p.zero_point_columns, col, b + j));
        zp = _mm512_load_ps(z);
      }
      _mm512_mask_storeu_ps(out.scale + r * out.count + i, mask, _mm512_maskz_loadu_ps(mask, scales + i));
      _mm512_mask_storeu_ps(out.zero + r * out.count + i, mask, zp);
    }
  }
}

// 16 codes of a step as floats: 4 bits, the low (HIGH false) or high nibbles of 16 bytes (rows 2j or 2j + 1 of the
// step); 8 bits, 16 bytes as they are (rows j or 16 + j).
template <int BITS, bool HIGH>
BP_BF16 inline __m512 codes(__m512i bytes) {
  if (BITS == 8) return _mm512_cvtepi32_ps(bytes);
  return _mm512_cvtepi32_ps(HIGH ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
}

// Steps [s0, s1) of columns [col0, col0 + 16) dequantized to bf16 tiles at `dst` (a step's tile kPairElements after
// the last one). Columns past N and rows of K past its end are zeros. SPLIT: blocks of 16 rows (a step spans two).
template <int BITS, bool SPLIT>
BP_BF16 void unpack_group(const Plan& p, int64_t col0, int64_t s0, int64_t s1, const GroupScales& gs, uint16_t* dst) {
  const Weights& w = *p.w;
  const int columns = static_cast<int>(std::clamp<int64_t>(w.n - col0, 0, kGroup));  // 0: a padding group
  const int64_t tail = w.k % kStep ? (w.k / kStep) : INT64_MAX;  // the step K ends in, if inside one
  for (int64_t s = s0; s < s1; ++s, dst += kPairElements) {
    const int64_t at = s * kStep, bytes_at = at * BITS / 8;
    const int64_t b0 = (at >> p.block_shift) - gs.first, b1 = SPLIT ? b0 + 1 : b0;
    // 4 bits, blocks of 16: lanes 0-7 of each half are rows of the first block; 8 bits: the second half the second
    const __mmask16 first_block = BITS == 4 ? 0x00FF : 0xFFFF;
    __mmask16 keep0 = 0xFFFF, keep1 = 0xFFFF;
    if (s == tail) {
      const int64_t left = w.k - at;
      keep0 = BITS == 4 ? first_lanes((left + 1) / 2) : first_lanes(left);
      keep1 = BITS == 4 ? first_lanes(left / 2) : first_lanes(left - 16);
    }
    const bool whole = bytes_at + kStep * BITS / 8 <= p.column_bytes;
    const int64_t stored = p.column_bytes - bytes_at;  // bytes of the column from the step on
    __m512i rows[kGroup];
    for (int r = 0; r < columns; ++r) {
      const uint8_t* src = w.packed + (col0 + r) * p.column_bytes + bytes_at;
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchAhead), _MM_HINT_T0);  // past the end: harmless
      const float* scale = gs.scale + r * gs.count;
      const float* zero = gs.zero + r * gs.count;
      __m512 sc0 = _mm512_set1_ps(scale[b0]), zp0 = _mm512_set1_ps(zero[b0]), sc1 = sc0, zp1 = zp0;
      if (SPLIT && b1 < gs.count) {
        const __m512 sc_next = _mm512_set1_ps(scale[b1]), zp_next = _mm512_set1_ps(zero[b1]);
        if (BITS == 4) {
          sc0 = sc1 = _mm512_mask_blend_ps(first_block, sc_next, sc0);
          zp0 = zp1 = _mm512_mask_blend_ps(first_block, zp_next, zp0);
        } else {
          sc1 = sc_next;
          zp1 = zp_next;
        }
      }
      __m512i lo, hi;
      if (BITS == 4) {
        lo = hi = _mm512_cvtepu8_epi32(whole ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src))
                                             : _mm_maskz_loadu_epi8(first_lanes(stored), src));
      } else {
        const __m256i v = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                : _mm256_maskz_loadu_epi8(stored >= 32 ? ~0u : (1u << stored) - 1, src);
        lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(v));
        hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1));
      }
      __m512 v0 = _mm512_mul_ps(_mm512_sub_ps(codes<BITS, false>(lo), zp0), sc0);
      __m512 v1 = _mm512_mul_ps(_mm512_sub_ps(codes<BITS, true>(hi), zp1), sc1);
      if (s == tail) {
        v0 = _mm512_maskz_mov_ps(keep0, v0);
        v1 = _mm512_maskz_mov_ps(keep1, v1);
      }
      rows[r] = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);  // 32-bit lane j: values 2j and 2j + 1 of the column's row
    }
    for (int r = columns; r < kGroup; ++r) rows[r] = _mm512_setzero_si512();
    transpose16(rows);  // tile row j: lane j of the 16 columns
    for (int r = 0; r < kGroup; ++r) _mm512_store_si512(dst + r * kStep, rows[r]);
  }
}

using UnpackFn = void (*)(const Plan&, int64_t, int64_t, int64_t, const GroupScales&, uint16_t*);

UnpackFn unpacker(int bits, bool split) {
  if (bits == 4) return split ? unpack_group<4, true> : unpack_group<4, false>;
  return split ? unpack_group<8, true> : unpack_group<8, false>;
}

// A sum tile of rows [row, row + 16) x columns [col, col + 16): where its earlier sums are loaded from (Y itself when
// the tile lies inside it, else a 16 x 16 copy of what lies inside).
struct SumTile {
  int64_t row, col;
  int rows, columns;
  bool inside;
};

BP_BF16 inline SumTile sum_tile(const Plan& p, int64_t row, int64_t col) {
  const int rows = static_cast<int>(std::min<int64_t>(kGroup, p.m - row));
  const int columns = static_cast<int>(std::min<int64_t>(kGroup, p.w->n - col));
  return {row, col, rows, columns, rows == kGroup && columns == kGroup};
}

// Where a later depth block's products start from: Y's sums.
BP_BF16 const float* sums_so_far(const Plan& p, const SumTile& t, float* copy, int64_t& stride) {
  if (t.inside) {
    stride = p.w->n * 4;
    return p.y + t.row * p.w->n + t.col;
  }
  const __mmask16 valid = first_lanes(t.columns);
  for (int r = 0; r < kGroup; ++r)
    _mm512_store_ps(copy + r * kGroup,
                    r < t.rows ? _mm512_maskz_loadu_ps(valid, p.y + (t.row + r) * p.w->n + t.col) : _mm512_setzero_ps());
  stride = kGroup * 4;
  return copy;
}

// The tile's sums (stored to `sums`, in L1) into Y: plain vector stores, which the store buffer drains while the
// tiles go on (a tile stored straight into Y stalls them until its lines arrive).
BP_BF16 inline void sums_out(const Plan& p, const SumTile& t, const float* sums) {
  const __mmask16 valid = first_lanes(t.columns);
  for (int r = 0; r < t.rows; ++r)
    _mm512_mask_storeu_ps(p.y + (t.row + r) * p.w->n + t.col, valid, _mm512_load_ps(sums + r * kGroup));
}

// Starts sum tile T: the bias (first depth block; a tile whose rows all read the same 64 bytes), or the sums so far.
#define BP_SUMS_IN(T, tile)                                                  \
  do {                                                                       \
    if (!first) {                                                            \
      int64_t stride = 0;                                                    \
      const float* from = sums_so_far(p, tile, sums[T], stride);             \
      _tile_loadd(T, from, stride);                                          \
    } else if (p.bias) {                                                     \
      _tile_loadd(T, p.bias + (tile).col, 0);                                \
    } else {                                                                 \
      _tile_zero(T);                                                         \
    }                                                                        \
  } while (0)

// Row groups h, h + 1 (TWO_M) x column groups g, g + 1 of the panel over `depth` steps of K from s0. Each operand
// pair's tiles of a step lie side by side: two streams, which the L2 prefetchers follow (four streams of one tile
// each ran at half the speed). `next`: the activations of the task's next row groups, prefetched meanwhile (`ahead`
// bytes per step), so that they come from L2 rather than L3 when their turn comes.
template <bool TWO_M>
BP_BF16 void block_products(const Plan& p, const uint16_t* panel, int64_t g, int64_t h, int64_t s0, int64_t depth,
                            int64_t col0, bool first, const char* next, int64_t ahead) {
  alignas(64) float sums[4][kGroup * kGroup];
  const int64_t row = h * kGroup, col = col0 + g * kGroup;
  const SumTile t0 = sum_tile(p, row, col), t2 = sum_tile(p, row, col + kGroup);
  SumTile t1 = t0, t3 = t2;
  if (TWO_M) {
    t1 = sum_tile(p, row + kGroup, col);
    t3 = sum_tile(p, row + kGroup, col + kGroup);
  }
  BP_SUMS_IN(0, t0);
  BP_SUMS_IN(2, t2);
  if (TWO_M) BP_SUMS_IN(1, t1);
  if (TWO_M) BP_SUMS_IN(3, t3);
  const uint16_t* a = p.acts + (h / 2 * p.steps + s0) * kPairElements;
  const uint16_t* w = panel + g / 2 * depth * kPairElements;
  for (int64_t s = 0; s < depth; ++s, w += kPairElements, a += kPairElements) {
    for (int64_t line = 0; line < ahead; line += 64) _mm_prefetch(next + s * ahead + line, _MM_HINT_T1);
    _tile_loadd(4, a, 64);
    if (TWO_M) _tile_loadd(5, a + kTileElements, 64);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if (TWO_M) _tile_dpbf16ps(1, 5, 6);
    if (TWO_M) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(2, sums[2], 64);
  if (TWO_M) _tile_stored(1, sums[1], 64);
  if (TWO_M) _tile_stored(3, sums[3], 64);
  sums_out(p, t0, sums[0]);
  sums_out(p, t2, sums[2]);
  if (TWO_M) sums_out(p, t1, sums[1]);
  if (TWO_M) sums_out(p, t3, sums[3]);
}

// One task: a panel of columns x a range of row groups, over all of K one depth block at a time.
BP_BF16 void run_task(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t panel = static_cast<int64_t>(index) / p.splits, split = static_cast<int64_t>(index) % p.splits;
  const int64_t col0 = panel * p.panel_groups * kGroup;
  int64_t groups = std::min<int64_t>(p.panel_groups, (p.w->n - col0 + kGroup - 1) / kGroup);
  groups += groups % 2;  // pairs (columns past N unpack to zeros)
  const int64_t h0 = split * p.groups_per_split, h1 = std::min(p.groups, h0 + p.groups_per_split);
  if (h0 >= h1) return;
  auto* buffer =
      static_cast<uint16_t*>(thread_scratch(static_cast<size_t>(p.panel_groups * p.depth_steps * kTileElements * 2)));
  thread_local std::vector<float> scale_storage;
  scale_storage.resize(static_cast<size_t>(2 * kGroup * (p.depth_steps * kStep / p.w->block + 2)));
  GroupScales gs;
  gs.scale = scale_storage.data();
  gs.zero = gs.scale + scale_storage.size() / 2;
  const UnpackFn unpack = unpacker(static_cast<int>(p.w->bits), p.w->block < kStep);
  _tile_loadconfig(&square_tiles());
  for (int64_t s0 = 0; s0 < p.steps; s0 += p.depth_steps) {
    const int64_t depth = std::min(p.depth_steps, p.steps - s0);
    for (int64_t g = 0; g < groups; ++g) {
      group_scales(p, col0 + g * kGroup, s0, s0 + depth, gs);
      unpack(p, col0 + g * kGroup, s0, s0 + depth, gs, buffer + (g / 2 * depth * 2 + g % 2) * kTileElements);
    }
    const bool first = s0 == 0;
    // the next row pair's activations for this depth block, spread over the steps of this pair's column pairs
    const int64_t steps_per_pair = groups / 2 * depth;
    const int64_t ahead = (depth * kPairElements * 2 / steps_per_pair + 63) / 64 * 64;
    for (int64_t h = h0; h < h1; h += 2) {
      const char* next = reinterpret_cast<const char*>(p.acts + ((h / 2 + 1) * p.steps + s0) * kPairElements);
      const int64_t prefetch = h + 2 < h1 ? ahead : 0;
      for (int64_t g = 0; g < groups; g += 2) {
        const char* from = next + g / 2 * depth * prefetch;
        if (h + 1 < h1) block_products<true>(p, buffer, g, h, s0, depth, col0, first, from, prefetch);
        else block_products<false>(p, buffer, g, h, s0, depth, col0, first, from, prefetch);
      }
    }
  }
  _tile_release();
}

}  // namespace

const TileConfig& square_tiles() {
  alignas(64) static const TileConfig config = [] {
    TileConfig c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = kGroup;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return config;
}

bool matmul_bf16_amx(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().amx_bf16 || (w.bits != 4 && w.bits != 8) || w.block < 16 || w.g_idx != nullptr) return false;
  Plan p{};
  p.w = &w;
  p.a = a;
  p.y = y;
  p.m = m;
  p.groups = (m + kGroup - 1) / kGroup;
  p.steps = (w.k + kStep - 1) / kStep;
  p.column_bytes = w.column_bytes();
  p.zero_point_columns = w.zero_point_columns();
  while ((int64_t{1} << p.block_shift) < w.block) ++p.block_shift;
  const int64_t column_groups = (w.n + kGroup - 1) / kGroup;
  std::vector<float> bias;
  if (w.bias != nullptr) {  // whole groups of 16: a tile load reads 64 bytes from any column group's start
    bias.assign(static_cast<size_t>(column_groups * kGroup), 0.0f);
    std::copy(w.bias, w.bias + w.n, bias.begin());
    p.bias = bias.data();
  }
  Buffer acts = aligned_buffer(static_cast<size_t>((p.groups + p.groups % 2) * p.steps * kTileElements * 2));
  p.acts = static_cast<uint16_t*>(acts.get());
  run(context, arrange_group, static_cast<size_t>(p.groups), &p);
  // Panels of 128 columns (64 or 32 where N gives few), and where there are still few, the rows split in parts
  // (each part unpacks the panel again).
  p.panel_groups = kPanelGroups;
  while (p.panel_groups > 2 && (column_groups + p.panel_groups - 1) / p.panel_groups < kTasks) p.panel_groups /= 2;
  p.panels = (column_groups + p.panel_groups - 1) / p.panel_groups;
  p.splits = std::max<int64_t>(1, std::min<int64_t>(p.groups / 2, kTasks / p.panels));
  p.groups_per_split = (p.groups + p.splits - 1) / p.splits;
  p.groups_per_split += p.groups_per_split % 2;  // pairs of row groups
  p.splits = (p.groups + p.groups_per_split - 1) / p.groups_per_split;
  p.depth_steps = std::min(kDepthSteps, p.steps);
  run(context, run_task, static_cast<size_t>(p.panels * p.splits), &p);
  return true;
}

}  // namespace bp

#else

namespace bp {
bool matmul_bf16_amx(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
}  // namespace bp

#endif
