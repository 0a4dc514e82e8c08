// The paths for CPUs with AVX2 and FMA but no AVX-512, 4-bit weights: many rows (a prompt) on a packed-panel int8
// GEMM on vpmaddubsw, few rows (decode steps) reading B in place (column_rows below).
//
// A's rows are quantized per block of K as on the other int8 paths (the same codes and scales). Each task unpacks a
// panel of B (16 columns x all of K) once into a buffer that stays in L2: per "quad" (4 rows of K), each 8 columns' 4
// codes side by side in one 32-byte vector. A's codes come in the panel's order of K (per 8 rows of K: 0 2 4 6 1 3 5
// 7, the low nibbles of a 32-bit word of B first). The codes stay unsigned (0..15) against A's signed codes, so
// vpmaddubsw's pair sums are at most 2 x 15 x 127 and a whole block of 32 sums in 16 bits (8 quads: 30,480 < 32,767);
// vpmaddwd then gives each column's 32-bit block sum, less the zero point x the block's sum of A's codes: exact
// integers, converted to float with both scales.
#include "matmul_nbits.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quantize.h"

#define BP_AVX2 __attribute__((target("avx2,fma")))

namespace bp {
namespace {

constexpr int kLanes = 8;                              // columns per vector
constexpr int kPanelVectors = 2;                       // vectors per panel
constexpr int kPanelColumns = kLanes * kPanelVectors;  // 16
constexpr int kQuadBytes = kPanelVectors * 32;         // one quad of the panel
constexpr int kTileRows = 3;                           // rows of A per tile
constexpr int kMaxQuadsPerBlock = 8;                   // blocks of up to 32: their 16-bit sums cannot overflow

struct Plan {
  const Weights* w;
  float* y;
  int64_t m, blocks, quads_per_block, quads;
  QuantizedRows rows;  // codes in the panel's order of K
  Buffer sums;         // int32 [m][blocks]: each block's sum of A's codes (the panels' zero-point terms)
  const int32_t* row_sums(int64_t r) const { return static_cast<const int32_t*>(sums.get()) + r * blocks; }
};

// A quantized per row and block (quantize.h's arithmetic: scale = max|a| / 127, codes rounded to nearest even), each
// block's code sum; in each `group` rows of K the even ones first, then the odd ones (the order of B's low nibbles,
// then its high ones: 8 for the panels' 32-bit words, 32 for a block's 16 bytes read in place).
BP_AVX2 void quantize(const float* a, int64_t group, Plan& p) {
  const Weights& w = *p.w;
  const int64_t block = w.block, padded = p.quads * 4;
  QuantizedRows& out = p.rows;
  out.rows = p.m;
  out.padded = padded;
  out.blocks = p.blocks;
  out.codes = aligned_buffer(static_cast<size_t>(p.m * padded + 64));
  out.scales = aligned_buffer(static_cast<size_t>(p.m * p.blocks * 4 + 64));
  p.sums = aligned_buffer(static_cast<size_t>(p.m * p.blocks * 4 + 64));
  for (int64_t r = 0; r < p.m; ++r) {
    const float* x = a + r * w.k;
    auto* codes = static_cast<int8_t*>(out.codes.get()) + r * padded;
    auto* scales = static_cast<float*>(out.scales.get()) + r * p.blocks;
    auto* sums = static_cast<int32_t*>(p.sums.get()) + r * p.blocks;
    std::memset(codes, 0, static_cast<size_t>(padded));
    for (int64_t b = 0; b < p.blocks; ++b) {
      const int64_t start = b * block, end = std::min<int64_t>(w.k, start + block);
      float top = 0.0f;
      for (int64_t i = start; i < end; ++i) top = std::max(top, std::fabs(x[i]));
      scales[b] = top / 127.0f;
      const float inv = top > 0.0f ? 127.0f / top : 0.0f;
      int32_t sum = 0;
      for (int64_t i = start; i < end; ++i) {
        const auto code = static_cast<int8_t>(std::nearbyint(std::min(std::max(x[i] * inv, -127.0f), 127.0f)));
        codes[(i & -group) + (i & (group - 1)) / 2 + group / 2 * (i & 1)] = code;
        sum += code;
      }
      sums[b] = sum;
    }
  }
}

// One call's plan: A's `m` rows quantized, in `group` order.
Plan plan(const Weights& w, const float* a, int64_t m, float* y, int64_t group) {
  Plan p{};
  p.w = &w;
  p.y = y;
  p.m = m;
  p.blocks = w.blocks();
  p.quads_per_block = w.block / 4;
  p.quads = p.blocks * p.quads_per_block;
  quantize(a, group, p);
  return p;
}

// A panel of B: codes [quads][2 vectors][32 bytes], then per block the 16 columns' weight scales and zero points.
struct Panel {
  uint8_t* codes;
  float* scales;
  int32_t* zero_points;
};

// 8 x 8 32-bit values: rows become columns.
BP_AVX2 inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3: u[4h + c], lane L of each half: column c (+ 4) of the 4 rows
    u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}

// Column `col`'s 4-bit zero points of blocks [b0, b0 + count) (count <= 8, b0 even), one per 32-bit lane, the lanes
// past count undefined; the codes as Weights::zero_point reads them (block 2i the low nibble of byte i).
BP_AVX2 __m256i zero_point_lanes(const Weights& w, int64_t col, int64_t b0, int64_t count) {
  if (w.zero_points == nullptr) return _mm256_set1_epi32(1 << (w.bits - 1));
  uint32_t packed = 0;
  std::memcpy(&packed, w.zero_points + col * w.zero_point_columns() + b0 / 2, static_cast<size_t>((count + 1) / 2));
  const __m128i bytes = _mm_cvtsi32_si128(static_cast<int>(packed)), low = _mm_set1_epi8(0x0F);
  return _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
}

// Columns [col0, col0 + 16) unpacked (columns past N as zeros), 8 columns x 8 words (64 rows of K) at a time: per
// 32-bit word of a column (8 rows of K), its low nibbles as one quad and its high nibbles as the next; then each
// block's weight scales and zero points.
BP_AVX2 void unpack(const Plan& p, int64_t col0, const Panel& panel) {
  const Weights& w = *p.w;
  const int64_t words = p.quads / 2, column_bytes = w.column_bytes();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int v = 0; v < kPanelVectors; ++v) {
    const int64_t first = col0 + v * kLanes;
    const int64_t valid = std::clamp<int64_t>(w.n - first, 0, kLanes);
    uint8_t* out = panel.codes + v * 32;
    for (int64_t i0 = 0; i0 < words; i0 += kLanes) {
      const int64_t count = std::min<int64_t>(words - i0, kLanes);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i chunk[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        const auto* at = reinterpret_cast<const int*>(w.packed + (first + j) * column_bytes + 4 * i0);
        chunk[j] = j >= valid           ? _mm256_setzero_si256()
                   : count == kLanes    ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                        : _mm256_maskload_epi32(at, mask);
      }
      transpose8(chunk);
      for (int64_t i = 0; i < count; ++i) {
        const __m256i codes = chunk[i];
        uint8_t* quad = out + 2 * (i0 + i) * kQuadBytes;
        _mm256_store_si256(reinterpret_cast<__m256i*>(quad), _mm256_and_si256(codes, low));
        _mm256_store_si256(reinterpret_cast<__m256i*>(quad + kQuadBytes),
                           _mm256_and_si256(_mm256_srli_epi16(codes, 4), low));
      }
    }
    for (int64_t b0 = 0; b0 < p.blocks; b0 += kLanes) {  // 8 columns x 8 blocks of scales and zero points
      const int64_t count = std::min<int64_t>(p.blocks - b0, kLanes);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i scales[kLanes], zero_points[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        if (j >= valid) {
          scales[j] = zero_points[j] = _mm256_setzero_si256();
          continue;
        }
        const auto* at = reinterpret_cast<const int*>(w.scales + (first + j) * p.blocks + b0);
        scales[j] = count == kLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                    : _mm256_maskload_epi32(at, mask);
        zero_points[j] = zero_point_lanes(w, first + j, b0, count);
      }
      transpose8(scales);
      transpose8(zero_points);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t at = (b0 + i) * kPanelColumns + v * kLanes;
        _mm256_store_si256(reinterpret_cast<__m256i*>(panel.scales + at), scales[i]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(panel.zero_points + at), zero_points[i]);
      }
    }
  }
}

// Rows [row0, row0 + R) x the panel's columns over all of K, into Y (with the bias).
template <int R>
BP_AVX2 void tile(const Plan& p, const Panel& panel, int64_t col0, int64_t row0) {
  __m256 f[R][kPanelVectors];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) f[r][c] = _mm256_setzero_ps();
  const int32_t* a[R];
  const float* sa[R];
  const int32_t* sums[R];
  for (int r = 0; r < R; ++r) {
    a[r] = reinterpret_cast<const int32_t*>(p.rows.row(row0 + r));
    sa[r] = p.rows.row_scales(row0 + r);
    sums[r] = p.row_sums(row0 + r);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* wq = panel.codes;
  int64_t quad = 0;
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256i acc[R][kPanelVectors];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kPanelVectors; ++c) acc[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t q = 0; q < p.quads_per_block; ++q, ++quad, wq += kQuadBytes) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq));
      const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + 32));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(a[r][quad]);
        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, x));
        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, x));
      }
    }
    const float* sw = panel.scales + b * kPanelColumns;
    const int32_t* zp = panel.zero_points + b * kPanelColumns;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(sa[r][b]);
      const __m256i sum = _mm256_set1_epi32(sums[r][b]);
#pragma GCC unroll 2
      for (int c = 0; c < kPanelVectors; ++c) {
        const __m256i zero_share =
            _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(zp + c * kLanes)), sum);
        const __m256i exact = _mm256_sub_epi32(_mm256_madd_epi16(acc[r][c], ones), zero_share);
        const __m256 scale = _mm256_mul_ps(s, _mm256_load_ps(sw + c * kLanes));
        f[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, f[r][c]);
      }
    }
  }
  const Weights& w = *p.w;
  alignas(32) float out[R][kPanelColumns];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVectors; ++c) _mm256_store_ps(out[r] + c * kLanes, f[r][c]);
  for (int c = 0; c < kPanelColumns; ++c) {
    const int64_t col = col0 + c;
    if (col >= w.n) break;
    const float bias = w.bias ? w.bias[col] : 0.0f;
    for (int r = 0; r < R; ++r) p.y[(row0 + r) * w.n + col] = out[r][c] + bias;
  }
}

using TileFn = void (*)(const Plan&, const Panel&, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows] = {tile<1>, tile<2>, tile<3>};

// One task: a panel, unpacked once, against every row of A.
void run_task(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t col0 = static_cast<int64_t>(index) * kPanelColumns;
  const size_t code_bytes = static_cast<size_t>(p.quads * kQuadBytes);
  auto* bytes =
      static_cast<uint8_t*>(thread_scratch(code_bytes + static_cast<size_t>(2 * p.blocks * kPanelColumns * 4)));
  auto* scales = reinterpret_cast<float*>(bytes + code_bytes);
  const Panel panel{bytes, scales, reinterpret_cast<int32_t*>(scales + p.blocks * kPanelColumns)};
  unpack(p, col0, panel);
  for (int64_t row = 0; row < p.m; row += kTileRows)
    kTiles[std::min<int64_t>(kTileRows, p.m - row) - 1](p, panel, col0, row);
}

// Few rows (decode steps): B read where it lies, one column at a time (one sequential stream per thread, which the
// prefetchers follow), each block's 16 bytes widened to its 32 codes (low nibbles, then high ones) less the zero
// point, against R rows' codes in that order: vpmaddubsw multiplies their magnitudes by the codes carrying their
// signs, so a block's 32-bit lane sums are exact; taken to float with both scales per block, summed across the lanes
// at the column's end.
template <int R>
BP_AVX2 void column_rows(const Plan& p, int64_t col, int64_t row0) {
  const Weights& w = *p.w;
  const uint8_t* column = w.packed + col * w.column_bytes();
  const float* sw = w.scales + col * p.blocks;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const bool zero_points = w.zero_points != nullptr;
  const __m256i default_zp = _mm256_set1_epi8(static_cast<char>(1 << (w.bits - 1)));
  __m256 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + 16 * b));
    const __m256i zp = zero_points ? _mm256_set1_epi8(static_cast<char>(w.zero_point(col, b))) : default_zp;
    // w - zp in [-15, 15]: its magnitude (unsigned) against the activations with its sign, products exact
    const __m256i weights =
        _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low), zp);
    const __m256i magnitude = _mm256_abs_epi8(weights);
    const __m256 scale = _mm256_set1_ps(sw[b]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.rows.row(row0 + r) + 32 * b));
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, weights)), ones);
      f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                             _mm256_mul_ps(_mm256_set1_ps(p.rows.row_scales(row0 + r)[b]), scale), f[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(f[r]), _mm256_extractf128_ps(f[r], 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    const float sum = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
    p.y[(row0 + r) * w.n + col] = sum + (w.bias ? w.bias[col] : 0.0f);
  }
}

using ColumnFn = void (*)(const Plan&, int64_t, int64_t);
constexpr ColumnFn kColumnRows[kTileRows] = {column_rows<1>, column_rows<2>, column_rows<3>};
constexpr int64_t kColumnsPerTask = 64;

void few_rows_task(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t first = static_cast<int64_t>(index) * kColumnsPerTask;
  for (int64_t col = first; col < std::min(p.w->n, first + kColumnsPerTask); ++col)
    for (int64_t row = 0; row < p.m; row += kTileRows)
      kColumnRows[std::min<int64_t>(kTileRows, p.m - row) - 1](p, col, row);
}

}  // namespace

bool matmul_int8_avx2(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().avx2 || w.bits != 4 || w.block != 32 || w.g_idx != nullptr) return false;
  Plan p = plan(w, a, m, y, 32);
  run(context, few_rows_task, static_cast<size_t>((w.n + kColumnsPerTask - 1) / kColumnsPerTask), &p);
  return true;
}

bool matmul_int8_panels_avx2(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().avx2 || w.bits != 4 || w.block < 16 || w.block / 4 > kMaxQuadsPerBlock || w.g_idx != nullptr)
    return false;
  Plan p = plan(w, a, m, y, 8);
  run(context, run_task, static_cast<size_t>((w.n + kPanelColumns - 1) / kPanelColumns), &p);
  return true;
}

}  // namespace bp

#else

namespace bp {
bool matmul_int8_avx2(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
bool matmul_int8_panels_avx2(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
}  // namespace bp

#endif
