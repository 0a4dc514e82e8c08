// The int8 path on AMX tiles: the numbers of kernel_avx512.cc (the same quantized activations and exact block sums),
// with each block's products for 16 columns x up to 16 rows in one TDPBUSD.
//
// Tiles take bytes, so 16 columns of B are first unpacked to one code per byte (4 bits: within each 64-byte chunk,
// each block's low nibbles then its high nibbles, i.e. its even then its odd rows of K; A's rows are permuted the same
// way). A tile of codes (unsigned) meets a tile of activations (signed, 4 bytes of K per row per activation row) and
// sums into a tile of int32 per column and row; a TDPBUSD never spans two blocks, so after each block the sums are
// converted to float, the zero point's share (zp x the block's activation sum) is taken off and the two scales
// applied. The tile configuration lives in static memory: gcc 12 drops the stores of a configuration on the stack
// before ldtilecfg (it does not see the instruction read them).
#include "matmul_nbits.h"
#include "quantize.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#define BP_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8,fma,avx2,bmi2")))

namespace bp {
namespace {

constexpr int kGroup = 16;      // columns per tile (tile rows), and activation rows per tile (tile columns)
constexpr int kChunk = 64;      // stored bytes unpacked at once

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "AMX tile configuration is 64 bytes");

// [depth 16 / 32 / 64][activation rows - 1]: tiles 0-3 sums (16 x rows int32), 4-5 codes (16 x depth bytes), 6-7
// activations (depth / 4 x rows * 4 bytes).
alignas(64) TileConfig configs[3][kGroup];
std::once_flag configs_made;

void make_configs() {
  for (int d = 0; d < 3; ++d) {
    const int depth = 16 << d;
    for (int rows = 1; rows <= kGroup; ++rows) {
      TileConfig& c = configs[d][rows - 1];
      std::memset(&c, 0, sizeof c);
      c.palette = 1;
      for (int t = 0; t < 4; ++t) {
        c.rows[t] = kGroup;
        c.colsb[t] = static_cast<uint16_t>(rows * 4);
      }
      for (int t = 4; t < 6; ++t) {
        c.rows[t] = kGroup;
        c.colsb[t] = static_cast<uint16_t>(depth);
      }
      for (int t = 6; t < 8; ++t) {
        c.rows[t] = static_cast<uint8_t>(depth / 4);
        c.colsb[t] = static_cast<uint16_t>(rows * 4);
      }
    }
  }
}

struct Plan {
  const Weights* w;
  int bits, block, depth, depth_index, steps_per_block;
  int64_t blocks, padded, column_bytes, chunks, zero_point_columns;
  alignas(64) int64_t interleave[2][8];  // qword sources of a chunk's two unpacked halves (low: 0-7, high: 8-15)
};

BP_AMX void make_interleave(Plan& p) {
  // 4 bits: each block's share of a chunk (`segment` bytes) unpacks to its low nibbles then its high ones
  const int segment = std::min(p.block * p.bits / 8, kChunk);
  int64_t order[16];
  int at = 0;
  for (int s = 0; s < kChunk / segment; ++s) {
    for (int q = 0; q < segment / 8; ++q) order[at++] = s * segment / 8 + q;
    for (int q = 0; q < segment / 8; ++q) order[at++] = 8 + s * segment / 8 + q;
  }
  for (int i = 0; i < 8; ++i) {
    p.interleave[0][i] = order[i];
    p.interleave[1][i] = order[8 + i];
  }
}

// Chunk c (64 stored bytes) of columns [col, col + 16) of B as one code per byte, into out[16][padded] (columns past
// N read as zeros).
BP_AMX void unpack_chunk(const Plan& p, int64_t col, int64_t c, uint8_t* out) {
  const Weights& w = *p.w;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i first = _mm512_load_si512(p.interleave[0]), second = _mm512_load_si512(p.interleave[1]);
  const int64_t rest = p.column_bytes % kChunk;
  const __mmask64 mask = c + 1 == p.chunks && rest ? (1ull << rest) - 1 : ~0ull;
  const int64_t at = c * kChunk * 8 / p.bits;
  for (int r = 0; r < kGroup; ++r) {
    uint8_t* dst = out + r * p.padded + at;
    const __m512i v = col + r < w.n ? _mm512_maskz_loadu_epi8(mask, w.packed + (col + r) * p.column_bytes + c * kChunk)
                                    : _mm512_setzero_si512();
    if (p.bits == 4) {
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      _mm512_store_si512(dst, _mm512_permutex2var_epi64(lo, first, hi));
      _mm512_store_si512(dst + 64, _mm512_permutex2var_epi64(lo, second, hi));
    } else {
      _mm512_store_si512(dst, v);
    }
  }
}

// A's rows for the tiles: per group of 16 rows, per TDPBUSD step, [depth / 4][rows] groups of 4 bytes; and per group,
// per block, the rows' scales and activation sums (lanes = rows).
struct TileActivations {
  int64_t rows = 0, groups = 0, steps = 0;
  Buffer operands, scales, sums;
  const int8_t* operand(int64_t group, int64_t step, int depth) const {
    const int64_t rows_in = std::min<int64_t>(kGroup, rows - group * kGroup);
    return static_cast<const int8_t*>(operands.get()) + group * kGroup * steps * depth + step * depth * rows_in;
  }
};

BP_AMX void arrange(const Plan& p, const QuantizedRows& plain, TileActivations& act) {
  const int64_t m = plain.rows;
  act.rows = m;
  act.groups = (m + kGroup - 1) / kGroup;
  act.steps = p.blocks * p.steps_per_block;
  act.operands = aligned_buffer(static_cast<size_t>(act.groups * kGroup * act.steps * p.depth));
  act.scales = aligned_buffer(static_cast<size_t>(act.groups * p.blocks * kGroup * 4));
  act.sums = aligned_buffer(static_cast<size_t>(act.groups * p.blocks * kGroup * 4));
  auto* scales = static_cast<float*>(act.scales.get());
  auto* sums = static_cast<float*>(act.sums.get());
  std::memset(scales, 0, static_cast<size_t>(act.groups * p.blocks * kGroup * 4));
  std::memset(sums, 0, static_cast<size_t>(act.groups * p.blocks * kGroup * 4));
  const __m512i first = _mm512_load_si512(p.interleave[0]), second = _mm512_load_si512(p.interleave[1]);
  std::vector<int8_t> permuted(static_cast<size_t>(p.padded));
  for (int64_t row = 0; row < m; ++row) {
    const int8_t* q = plain.row(row);
    const int8_t* ordered = q;
    if (p.bits == 4) {  // the weights' order: per chunk of 128 rows of K, each block's even rows then its odd ones
      for (int64_t c = 0; c < p.padded / 128; ++c) {
        const __m512i x0 = _mm512_loadu_si512(q + c * 128), x1 = _mm512_loadu_si512(q + c * 128 + 64);
        const __m512i even = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(x0)),
                                                _mm512_cvtepi16_epi8(x1), 1);
        const __m512i odd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(x0, 8))),
                                               _mm512_cvtepi16_epi8(_mm512_srai_epi16(x1, 8)), 1);
        _mm512_storeu_si512(permuted.data() + c * 128, _mm512_permutex2var_epi64(even, first, odd));
        _mm512_storeu_si512(permuted.data() + c * 128 + 64, _mm512_permutex2var_epi64(even, second, odd));
      }
      ordered = permuted.data();
    }
    const int64_t group = row / kGroup, lane = row % kGroup;
    const int64_t rows_in = std::min<int64_t>(kGroup, m - group * kGroup);
    auto* dst = reinterpret_cast<int32_t*>(static_cast<int8_t*>(act.operands.get()) +
                                           group * kGroup * act.steps * p.depth);
    const auto* src = reinterpret_cast<const int32_t*>(ordered);
    const int64_t words = act.steps * p.depth / 4;  // the step's [depth / 4][rows_in] words, step after step
    for (int64_t word = 0; word < words; ++word) dst[word * rows_in + lane] = src[word];
    const float* row_scales = plain.row_scales(row);
    for (int64_t b = 0; b < p.blocks; ++b) {
      scales[(group * p.blocks + b) * kGroup + lane] = row_scales[b];
      int32_t total = 0;
      for (int64_t i = b * p.block; i < (b + 1) * p.block; ++i) total += q[i];
      sums[(group * p.blocks + b) * kGroup + lane] = static_cast<float>(total);
    }
  }
}

struct Job {
  const Plan* plan;
  const TileActivations* act;
  float* y;
  int64_t column_groups, row_groups_per_task;
};

BP_AMX inline int zero_point(const Weights& w, const Plan& p, int64_t col, int64_t b) {
  if (w.zero_points == nullptr) return 1 << (p.bits - 1);
  const uint8_t* zp = w.zero_points + col * p.zero_point_columns;
  return p.bits == 4 ? (zp[b >> 1] >> (4 * (b & 1))) & 0x0F : zp[b];
}

// The sums of block b in tile SUM, through the code and activation tiles CODES and ACTS (tiles are named by literal
// numbers: gcc's intrinsics paste them into the instruction).
#define BP_BLOCK_PRODUCTS(OP, SUM, CODES, ACTS, b)                              \
  do {                                                                          \
    _tile_zero(SUM);                                                            \
    for (int s = 0; s < p.steps_per_block; ++s) {                               \
      const int64_t step = (b) * p.steps_per_block + s;                         \
      _tile_loadd(CODES, codes + step * p.depth, p.padded);                     \
      _tile_loadd(ACTS, operands + step * p.depth * rows, rows * 4);            \
      OP(SUM, CODES, ACTS);                                                     \
    }                                                                           \
  } while (0)

// Per column group (16 columns), what the block epilogues read with one lane per column: the weights' scales and
// zero points, [blocks][16].
struct ColumnScales {
  std::vector<float> scales, zero_points;
};

BP_AMX void column_scales(const Plan& p, int64_t col, ColumnScales& out) {
  const Weights& w = *p.w;
  out.scales.resize(static_cast<size_t>(p.blocks * kGroup));
  out.zero_points.resize(static_cast<size_t>(p.blocks * kGroup));
  for (int r = 0; r < kGroup; ++r) {
    const int64_t c = std::min(col + r, w.n - 1);  // columns past N (the last group) repeat the last one
    const float* scales = w.scales + c * p.blocks;
    for (int64_t b = 0; b < p.blocks; ++b) out.scales[b * kGroup + r] = scales[b];
    for (int64_t b = 0; b < p.blocks; ++b) out.zero_points[b * kGroup + r] = static_cast<float>(zero_point(w, p, c, b));
  }
}

// The sums of `count` blocks from b, [16 columns][16 lanes: rows] int32 each, into the columns' accumulators (lane =
// activation row): sum code x a - zp x sum a (exact), times the row's and the column's scales.
BP_AMX inline void scale_blocks(const int32_t (*sums)[kGroup * kGroup], int count, int64_t b, const ColumnScales& cs,
                                const float* group_scales, const float* group_sums, __m512* acc) {
  for (int i = 0; i < count; ++i) {
    const __m512 sa = _mm512_load_ps(group_scales + (b + i) * kGroup);
    const __m512 xs = _mm512_load_ps(group_sums + (b + i) * kGroup);
    const float* sw = cs.scales.data() + (b + i) * kGroup;
    const float* zp = cs.zero_points.data() + (b + i) * kGroup;
#pragma GCC unroll 16
    for (int r = 0; r < kGroup; ++r) {
      const __m512 total = _mm512_fnmadd_ps(_mm512_set1_ps(zp[r]), xs,
                                            _mm512_cvtepi32_ps(_mm512_load_si512(sums[i] + r * kGroup)));
      acc[r] = _mm512_fmadd_ps(total, _mm512_mul_ps(sa, _mm512_set1_ps(sw[r])), acc[r]);
    }
  }
}

// One group of `rows` activation rows x the task's 16 columns over all of K. Blocks go in pairs on sum tiles 0-1 and
// 2-3 in turn, so that one pair's epilogue runs while the tiles compute the next pair.
BP_AMX void group_products(const Plan& p, uint8_t* codes, int64_t& unpacked, const int8_t* operands, int rows,
                           const ColumnScales& cs, const float* group_scales, const float* group_sums, float* y,
                           int64_t col, int valid) {
  const Weights& w = *p.w;
  const int64_t chunk_elements = kChunk * 8 / p.bits;
  alignas(64) int32_t sums[2][2][kGroup * kGroup];
  __m512 acc[kGroup];
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) acc[r] = _mm512_setzero_ps();
  int64_t pending = -1;  // the first block of the pair whose sums wait in sums[its pair's parity]
  for (int64_t b = 0; b < p.blocks; b += 2) {
    const int count = b + 1 < p.blocks ? 2 : 1;
    const int parity = static_cast<int>((b / 2) % 2);
    // the first group of rows unpacks the codes as its blocks come (still in L1 when the tiles load them)
    for (const int64_t needed = (b + count) * p.block; unpacked < needed; unpacked += chunk_elements)
      unpack_chunk(p, col, unpacked / chunk_elements, codes);
    if (parity == 0) {
      BP_BLOCK_PRODUCTS(_tile_dpbusd, 0, 4, 6, b);
      if (count > 1) BP_BLOCK_PRODUCTS(_tile_dpbusd, 1, 5, 7, b + 1);
    } else {
      BP_BLOCK_PRODUCTS(_tile_dpbusd, 2, 4, 6, b);
      if (count > 1) BP_BLOCK_PRODUCTS(_tile_dpbusd, 3, 5, 7, b + 1);
    }
    if (pending >= 0) scale_blocks(sums[1 - parity], 2, pending, cs, group_scales, group_sums, acc);
    if (parity == 0) {
      _tile_stored(0, sums[0][0], kGroup * 4);
      if (count > 1) _tile_stored(1, sums[0][1], kGroup * 4);
    } else {
      _tile_stored(2, sums[1][0], kGroup * 4);
      if (count > 1) _tile_stored(3, sums[1][1], kGroup * 4);
    }
    pending = b;
  }
  scale_blocks(sums[(pending / 2) % 2], static_cast<int>(std::min<int64_t>(2, p.blocks - pending)), pending, cs,
               group_scales, group_sums, acc);
  alignas(64) float out[kGroup][kGroup];
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) _mm512_store_ps(out[r], acc[r]);
  for (int m = 0; m < rows; ++m)
    for (int r = 0; r < valid; ++r) y[m * w.n + col + r] = out[r][m] + (w.bias ? w.bias[col + r] : 0.0f);
}

BP_AMX void run_task(void* data, size_t index) {
  const Job& job = *static_cast<const Job*>(data);
  const Plan& p = *job.plan;
  const Weights& w = *p.w;
  const TileActivations& act = *job.act;
  const int64_t col = static_cast<int64_t>(index) % job.column_groups * kGroup;
  const int64_t first_group = static_cast<int64_t>(index) / job.column_groups * job.row_groups_per_task;
  const int64_t last_group = std::min(act.groups, first_group + job.row_groups_per_task);
  thread_local std::vector<uint8_t> storage;
  thread_local ColumnScales cs;
  storage.resize(static_cast<size_t>(kGroup * p.padded + 64));
  auto* codes = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  int64_t unpacked = 0;  // elements of K unpacked so far
  column_scales(p, col, cs);
  const int valid = static_cast<int>(std::min<int64_t>(kGroup, w.n - col));
  int loaded = -1;
  for (int64_t group = first_group; group < last_group; ++group) {
    const int rows = static_cast<int>(std::min<int64_t>(kGroup, act.rows - group * kGroup));
    if (rows != loaded) {
      _tile_loadconfig(&configs[p.depth_index][rows - 1]);
      loaded = rows;
    }
    const int8_t* operands = act.operand(group, 0, p.depth);
    const float* scales = static_cast<const float*>(act.scales.get()) + group * p.blocks * kGroup;
    const float* sums = static_cast<const float*>(act.sums.get()) + group * p.blocks * kGroup;
    float* y = job.y + group * kGroup * w.n;
    group_products(p, codes, unpacked, operands, rows, cs, scales, sums, y, col, valid);
  }
  _tile_release();
}

}  // namespace

bool matmul_int8_amx(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().amx_int8 || (w.bits != 4 && w.bits != 8) || w.block < 16 || w.g_idx != nullptr) return false;
  std::call_once(configs_made, make_configs);
  Plan p{};
  p.w = &w;
  p.bits = static_cast<int>(w.bits);
  p.block = static_cast<int>(w.block);
  p.depth = std::min(p.block, 64);
  p.depth_index = p.depth == 16 ? 0 : (p.depth == 32 ? 1 : 2);
  p.steps_per_block = p.block / p.depth;
  p.blocks = w.blocks();
  p.column_bytes = w.column_bytes();
  p.chunks = (p.column_bytes + kChunk - 1) / kChunk;
  p.padded = p.chunks * kChunk * 8 / p.bits;
  p.zero_point_columns = w.zero_point_columns();
  make_interleave(p);
  QuantizedRows plain;
  quantize_rows(a, w.k, w.block, p.padded, m, plain);
  TileActivations act;
  arrange(p, plain, act);
  Job job{&p, &act, y, (w.n + kGroup - 1) / kGroup, 4};
  const int64_t row_tasks = (act.groups + job.row_groups_per_task - 1) / job.row_groups_per_task;
  run(context, run_task, static_cast<size_t>(row_tasks * job.column_groups), &job);
  return true;
}

}  // namespace bp

#else

namespace bp {
bool matmul_int8_amx(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
}  // namespace bp

#endif
