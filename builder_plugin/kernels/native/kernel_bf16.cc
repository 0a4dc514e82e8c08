// The many-rows path (a prompt): a packed-panel GEMM on AMX bf16 tiles (TDPBF16PS, float sums over the whole of K).
//
// Each task unpacks a panel of B (up to 128 columns x up to 4096 rows of K) once into a buffer that stays in L2:
// every weight dequantized, (code - zero point) x scale, and rounded to bf16, in the layout of the tiles (per 16
// columns, per 32 rows of K, one 16 x 64-byte tile: a column's 32 values per tile row, so the stored columns need no
// transposing). A's rows are converted to bf16 once per call (round to nearest even), 16 rows x 32 of K per tile,
// pairs of K per 4 bytes (the layout TDPBF16PS reads its second operand in). All rows of the task then meet the panel,
// 32 columns x 32 rows (four sum tiles) at a time over the panel's K; the float sums are transposed into Y. No
// activation quantization and no per-block epilogue: bf16 keeps each value's own exponent, so a few channels hundreds
// of times larger than the rest cost nothing, and the block scales are inside the panel's values.
#include "matmul_nbits.h"
#include "quantize.h"
#include "tiles.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#define BP_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,fma,avx2,bmi2")))

namespace bp {
namespace {

constexpr int kGroup = 16;        // columns per weight tile; activation rows per activation tile
constexpr int kStep = 32;         // rows of K per tile (bf16)
constexpr int kTileElements = kGroup * kStep;  // bf16 values in one tile (1 KB)
constexpr int kPanelGroups = 8;   // column groups per panel (128 columns)
constexpr int64_t kDepthSteps = 128;  // steps of K per panel (4096 rows: a 1 MB panel)
constexpr int kPrefetchAhead = 512;   // bytes of a column prefetched ahead of its loads

// Every tile 16 rows x 64 bytes: 0-3 float sums [16 columns][16 rows], 4-5 weights [16 columns][32 K], 6-7
// activations [16 pairs of K][16 rows x 2].
alignas(64) TileConfig config;
std::once_flag config_made;

void make_config() {
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kGroup;
    config.colsb[t] = 64;
  }
}

// 16 x 16 32-bit values: rows become columns.
BP_BF16 inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c], lane L: column 4L + c of rows 4i..4i+3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), y = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xdd);
    const __m512i x2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i y2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(x, x2, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(x, x2, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(y, y2, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(y, y2, 0xdd);
  }
}

BP_BF16 inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(count, 0)) - 1);
}

struct Plan {
  const Weights* w;
  const float* a;
  float* y;
  int64_t m, groups, steps, column_bytes, zero_point_columns, block_shift;
  uint16_t* acts;  // [groups][steps][16 pairs of K][16 rows][2] bf16
  int64_t panel_groups, panels, depth_steps, splits, groups_per_split;
};

// Rows [16 h, 16 h + 16) of A as bf16 tiles, every step of K (rows past M and K past its end as zeros). With 4-bit
// weights a tile row holds a step's even rows of K, then its odd ones: the order the weights' low and high nibbles
// give (the sum over a row does not care about the order, only that both operands share it).
BP_BF16 void arrange_group(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t h = static_cast<int64_t>(index), k = p.w->k;
  uint16_t* out = p.acts + h * p.steps * kTileElements;
  const int64_t valid = std::min<int64_t>(kGroup, p.m - h * kGroup);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t s = 0; s < p.steps; ++s) {
    const int64_t at = s * kStep;
    const __mmask16 low = first_lanes(k - at), high = first_lanes(k - at - 16);
    __m512i rows[kGroup];
    for (int r = 0; r < kGroup; ++r) {
      if (r < valid) {
        const float* x = p.a + (h * kGroup + r) * k + at;
        __m512 first = _mm512_maskz_loadu_ps(low, x), second = _mm512_maskz_loadu_ps(high, x + 16);
        if (p.w->bits == 4) {
          const __m512 evens = _mm512_permutex2var_ps(first, even, second);
          second = _mm512_permutex2var_ps(first, odd, second);
          first = evens;
        }
        rows[r] = (__m512i)_mm512_cvtne2ps_pbh(second, first);  // 32-bit lane j: values 2j and 2j + 1 of the row
      } else {
        rows[r] = _mm512_setzero_si512();
      }
    }
    transpose16(rows);  // tile row j: the 16 rows' lane j
    for (int r = 0; r < kGroup; ++r) _mm512_store_si512(out + s * kTileElements + r * 32, rows[r]);
  }
}

BP_BF16 inline int zero_point(const Weights& w, int64_t zero_point_columns, int64_t col, int64_t b) {
  if (w.zero_points == nullptr) return 1 << (w.bits - 1);
  const uint8_t* zp = w.zero_points + col * zero_point_columns;
  return w.bits == 4 ? (zp[b >> 1] >> (4 * (b & 1))) & 0x0F : zp[b];
}

// Per column of a group, for the blocks of one depth block: the scale and the zero point (w = (code - zero point) x
// scale, one rounding to float as the reference's).
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
      const __m512 scale = _mm512_maskz_loadu_ps(mask, scales + i);
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
      _mm512_mask_storeu_ps(out.scale + r * out.count + i, mask, scale);
      _mm512_mask_storeu_ps(out.zero + r * out.count + i, mask, zp);
    }
  }
}

// 16 codes of a step's tile row as floats: 4 bits, the low (HIGH false) or high nibbles of 16 bytes (rows 2j or
// 2j + 1 of the step); 8 bits, 16 bytes as they are (rows j or 16 + j).
template <int BITS, bool HIGH>
BP_BF16 inline __m512 codes(__m512i bytes) {
  if (BITS == 8) return _mm512_cvtepi32_ps(bytes);
  return _mm512_cvtepi32_ps(HIGH ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
}

// Steps [s0, s1) of columns [col0, col0 + 16) dequantized to bf16 tiles at `dst` (a step's tile after the other).
// Columns past N and rows of K past its end are zeros. SPLIT: blocks of 16 rows (a step spans two blocks).
template <int BITS, bool SPLIT>
BP_BF16 void unpack_group(const Plan& p, int64_t col0, int64_t s0, int64_t s1, const GroupScales& gs, uint16_t* dst) {
  const Weights& w = *p.w;
  const int columns = static_cast<int>(std::min<int64_t>(kGroup, w.n - col0));
  const int64_t tail = w.k % kStep ? (w.k / kStep) : INT64_MAX;  // the step K ends in, if inside one
  for (int64_t s = s0; s < s1; ++s, dst += kTileElements) {
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
    for (int r = 0; r < columns; ++r) {
      const uint8_t* src = w.packed + (col0 + r) * p.column_bytes + bytes_at;
      _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchAhead), _MM_HINT_T0);  // past the end: harmless
      const float* scale = gs.scale + r * gs.count;
      const float* zero = gs.zero + r * gs.count;
      __m512 sc0 = _mm512_set1_ps(scale[b0]), of0 = _mm512_set1_ps(zero[b0]), sc1 = sc0, of1 = of0;
      if (SPLIT && b1 < gs.count) {
        const __m512 sc_next = _mm512_set1_ps(scale[b1]), of_next = _mm512_set1_ps(zero[b1]);
        if (BITS == 4) {
          sc0 = sc1 = _mm512_mask_blend_ps(first_block, sc_next, sc0);
          of0 = of1 = _mm512_mask_blend_ps(first_block, of_next, of0);
        } else {
          sc1 = sc_next;
          of1 = of_next;
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
      __m512 v0 = _mm512_mul_ps(_mm512_sub_ps(codes<BITS, false>(lo), of0), sc0);
      __m512 v1 = _mm512_mul_ps(_mm512_sub_ps(codes<BITS, true>(hi), of1), sc1);
      if (s == tail) {
        v0 = _mm512_maskz_mov_ps(keep0, v0);
        v1 = _mm512_maskz_mov_ps(keep1, v1);
      }
      _mm512_store_si512(dst + r * kStep, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
    for (int r = columns; r < kGroup; ++r) _mm512_store_si512(dst + r * kStep, _mm512_setzero_si512());
  }
}

using UnpackFn = void (*)(const Plan&, int64_t, int64_t, int64_t, const GroupScales&, uint16_t*);

UnpackFn unpacker(int bits, bool split) {
  if (bits == 4) return split ? unpack_group<4, true> : unpack_group<4, false>;
  return split ? unpack_group<8, true> : unpack_group<8, false>;
}

// The float sums of tile T for column group `col` and row group `row` into Y (first depth block: written with the
// bias; later ones: added).
#define BP_SUMS_OUT(T, col, row)                        \
  do {                                                  \
    _tile_stored(T, sums, 64);                          \
    write_sums(p, sums, col, row, first);               \
  } while (0)

BP_BF16 void write_sums(const Plan& p, float* sums, int64_t col, int64_t row, bool first) {
  const Weights& w = *p.w;
  if (col >= w.n || row >= p.m) return;
  __m512i r[kGroup];
  for (int i = 0; i < kGroup; ++i) r[i] = _mm512_load_si512(sums + i * kGroup);
  transpose16(r);  // r[i]: row `row + i`, 16 columns
  const __mmask16 valid = first_lanes(w.n - col);
  const __m512 bias = w.bias ? _mm512_maskz_loadu_ps(valid, w.bias + col) : _mm512_setzero_ps();
  const int64_t rows = std::min<int64_t>(kGroup, p.m - row);
  for (int64_t i = 0; i < rows; ++i) {
    float* out = p.y + (row + i) * w.n + col;
    const __m512 v = _mm512_castsi512_ps(r[i]);
    _mm512_mask_storeu_ps(out, valid, first ? _mm512_add_ps(v, bias) : _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, out)));
  }
}

// Column groups g, g + 1 (TWO_N) of the panel x row groups h, h + 1 (TWO_M) over `depth` steps of K from s0.
template <bool TWO_N, bool TWO_M>
BP_BF16 void block_products(const Plan& p, const uint16_t* panel, int64_t g, int64_t h, int64_t s0, int64_t depth,
                            int64_t col0, bool first) {
  alignas(64) float sums[kGroup * kGroup];
  const uint16_t* w0 = panel + g * depth * kTileElements;
  const uint16_t* w1 = w0 + depth * kTileElements;
  const uint16_t* a0 = p.acts + (h * p.steps + s0) * kTileElements;
  const uint16_t* a1 = a0 + p.steps * kTileElements;
  _tile_zero(0);
  if (TWO_M) _tile_zero(1);
  if (TWO_N) _tile_zero(2);
  if (TWO_N && TWO_M) _tile_zero(3);
  for (int64_t s = 0; s < depth; ++s) {
    _tile_loadd(4, w0 + s * kTileElements, 64);
    if (TWO_N) _tile_loadd(5, w1 + s * kTileElements, 64);
    _tile_loadd(6, a0 + s * kTileElements, 64);
    if (TWO_M) _tile_loadd(7, a1 + s * kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO_M) _tile_dpbf16ps(1, 4, 7);
    if (TWO_N) _tile_dpbf16ps(2, 5, 6);
    if (TWO_N && TWO_M) _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t col = col0 + g * kGroup, row = h * kGroup;
  BP_SUMS_OUT(0, col, row);
  if (TWO_M) BP_SUMS_OUT(1, col, row + kGroup);
  if (TWO_N) BP_SUMS_OUT(2, col + kGroup, row);
  if (TWO_N && TWO_M) BP_SUMS_OUT(3, col + kGroup, row + kGroup);
}

// One task: a panel of columns x a range of row groups, over all of K one depth block at a time.
BP_BF16 void run_task(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t panel = static_cast<int64_t>(index) / p.splits, split = static_cast<int64_t>(index) % p.splits;
  const int64_t col0 = panel * p.panel_groups * kGroup;
  const int64_t groups = std::min<int64_t>(p.panel_groups, (p.w->n - col0 + kGroup - 1) / kGroup);
  const int64_t h0 = split * p.groups_per_split, h1 = std::min(p.groups, h0 + p.groups_per_split);
  if (h0 >= h1) return;
  thread_local Buffer storage;
  thread_local size_t capacity = 0;
  const size_t needed = static_cast<size_t>(p.panel_groups * p.depth_steps * kTileElements * 2);
  if (capacity < needed) {
    storage = aligned_buffer(needed);
    capacity = needed;
  }
  auto* buffer = static_cast<uint16_t*>(storage.get());
  thread_local std::vector<float> scale_storage;
  scale_storage.resize(static_cast<size_t>(2 * kGroup * (p.depth_steps * kStep / p.w->block + 2)));
  GroupScales gs;
  gs.scale = scale_storage.data();
  gs.zero = gs.scale + scale_storage.size() / 2;
  const UnpackFn unpack = unpacker(static_cast<int>(p.w->bits), p.w->block < kStep);
  _tile_loadconfig(&config);
  for (int64_t s0 = 0; s0 < p.steps; s0 += p.depth_steps) {
    const int64_t depth = std::min(p.depth_steps, p.steps - s0);
    for (int64_t g = 0; g < groups; ++g) {
      group_scales(p, col0 + g * kGroup, s0, s0 + depth, gs);
      unpack(p, col0 + g * kGroup, s0, s0 + depth, gs, buffer + g * depth * kTileElements);
    }
    const bool first = s0 == 0;
    for (int64_t h = h0; h < h1; h += 2) {
      const bool two_m = h + 1 < h1;
      for (int64_t g = 0; g < groups; g += 2) {
        const bool two_n = g + 1 < groups;
        if (two_n && two_m) block_products<true, true>(p, buffer, g, h, s0, depth, col0, first);
        else if (two_n) block_products<true, false>(p, buffer, g, h, s0, depth, col0, first);
        else if (two_m) block_products<false, true>(p, buffer, g, h, s0, depth, col0, first);
        else block_products<false, false>(p, buffer, g, h, s0, depth, col0, first);
      }
    }
  }
  _tile_release();
}

}  // namespace

bool matmul_bf16_amx(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().amx_bf16 || (w.bits != 4 && w.bits != 8) || w.block < 16 || w.g_idx != nullptr) return false;
  std::call_once(config_made, make_config);
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
  Buffer acts = aligned_buffer(static_cast<size_t>(p.groups * p.steps * kTileElements * 2));
  p.acts = static_cast<uint16_t*>(acts.get());
  run(context, arrange_group, static_cast<size_t>(p.groups), &p);
  // Panels of 128 columns (64 or 32 where N gives few), and where there are still few, the rows split in two or more
  // (each part unpacks the panel again): tasks enough for the threads to share evenly.
  constexpr int64_t kTasks = 16;
  const int64_t column_groups = (w.n + kGroup - 1) / kGroup;
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
