// The paths for CPUs with AVX2 and FMA but no AVX-512: few rows (decode steps) reading B in place (column_rows below;
// blocks of 32 and more); many rows (a prompt) on a packed-panel int8 GEMM on vpmaddubsw (4 and 8 bits, blocks of 16
// and more).
//
// A's rows are quantized per block of K as on the other int8 paths (the same codes and scales). Each task unpacks a
// panel of B (16 columns x all of K) once into a buffer that stays in L2: per "quad" (4 rows of K), each 8 columns' 4
// codes side by side in one 32-byte vector. A's codes come in the panel's order of K (per 8 rows of K: 0 2 4 6 1 3 5
// 7, the low nibbles of a 32-bit word of B first). The codes stay unsigned (0..15) against A's signed codes, so
// vpmaddubsw's pair sums are at most 2 x 15 x 127 and 32 rows of K sum in 16 bits (8 quads: 30,480 < 32,767);
// vpmaddwd then gives each column's 32-bit block sum, less the zero point x the block's sum of A's codes: exact
// integers, converted to float with both scales.
#include "matmul_nbits.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "quantize.h"

#define BP_AVX2 __attribute__((target("avx2,fma")))

namespace bp {
namespace {

constexpr int kLanes = 8;                              // columns per vector
constexpr int kPanelVectors = 2;                       // vectors per panel
constexpr int kPanelColumns = kLanes * kPanelVectors;  // 16
template <int kBits>
constexpr int kQuadBytes = kPanelVectors * 32 * (kBits / 4);  // one quad of the panel: 8 bits in two nibble planes
constexpr int kColumnTileRows = 3;                     // rows of A per column pass of the few-rows path
constexpr int64_t kParallelQuantizeRows = 16;          // rows of A from which their quantization is spread
constexpr int kMaxQuadsPerSpan = 8;                    // 32 rows of K: their 16-bit sums cannot overflow
// bytes of a column the few-rows path prefetches ahead of its loads (measured on a Zen 4 seen as an AVX2 CPU, 16
// full-size layers, one row: 2-4 % faster at 4 bits, 6-10 % at 8 bits than the hardware prefetchers alone; 512 and
// 1024 gained less)
constexpr int64_t kPrefetchAhead = 2048;

struct Plan {
  const Weights* w;
  float* y;
  int64_t m, blocks, quads_per_block, quads, units;  // units: 32 rows of K each, the few-rows path's steps
  QuantizedRows rows;  // codes in the panel's order of K
  Buffer sums;         // int32 [m][blocks]: each block's sum of A's codes (the zero-point terms)
  const int32_t* row_sums(int64_t r) const { return static_cast<const int32_t*>(sums.get()) + r * blocks; }
};

// Where row i of K goes in A's codes: in each `group` rows the even ones first, then the odd ones.
inline int64_t position(int64_t i, int64_t group) { return (i & -group) + (i & (group - 1)) / 2 + group / 2 * (i & 1); }

// Lanes [0, count) set.
BP_AVX2 inline __m256i lanes_below(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

BP_AVX2 inline float horizontal_sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// 8 values from `at`, zeros past the first `count`.
BP_AVX2 inline __m256 load_below(const float* at, int64_t count) {
  return count >= kLanes ? _mm256_loadu_ps(at) : _mm256_maskload_ps(at, lanes_below(count));
}

// One row of A quantized per block (quantize.h's arithmetic: scale = max|a| / 127, codes rounded to nearest even:
// vcvtps2dq under the default rounding) and each block's code sum; in each `group` rows of K the even ones first,
// then the odd ones (the order of B's low nibbles, then its high ones: 8 for the panels' 32-bit words, 64 for two
// units' 32 bytes read in place; 1 keeps K's order, as 8-bit B is read). `codes`: `padded` bytes, zero past K.
BP_AVX2 void quantize_row(const Plan& p, const float* x, int64_t group, int8_t* codes, float* scales, int32_t* sums) {
  const Weights& w = *p.w;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), top = _mm256_set1_epi32(127);
  const __m256i bottom = _mm256_set1_epi32(-127);
  std::memset(codes, 0, static_cast<size_t>(p.rows.padded));
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int64_t start = b * w.block, count = std::min<int64_t>(w.k - start, w.block);
    const float* at = x + start;
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < count; i += kLanes)
      largest = _mm256_max_ps(largest, _mm256_and_ps(load_below(at + i, count - i), magnitude));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    const float most = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    scales[b] = most / 127.0f;
    const __m256 inverse = _mm256_set1_ps(most > 0.0f ? 127.0f / most : 0.0f);
    __m256i block_sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < count; i += kLanes) {
      const __m256i values = _mm256_cvtps_epi32(_mm256_mul_ps(load_below(at + i, count - i), inverse));
      const __m256i clamped = _mm256_max_epi32(_mm256_min_epi32(values, top), bottom);
      block_sum = _mm256_add_epi32(block_sum, clamped);
      const __m256i ordered = group == 1 ? clamped : _mm256_permutevar8x32_epi32(clamped, evens_first);
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ordered), _mm256_extracti128_si256(ordered, 1));
      const __m128i bytes = _mm_packs_epi16(words, words);
      const int64_t k = start + i;
      if (group == 1) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + k), bytes);
      } else {  // the 4 even rows' codes, then the 4 odd ones'
        const int32_t evens = _mm_cvtsi128_si32(bytes), odds = _mm_extract_epi32(bytes, 1);
        std::memcpy(codes + position(k, group), &evens, 4);
        std::memcpy(codes + position(k + 1, group), &odds, 4);
      }
    }
    const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(block_sum), _mm256_extracti128_si256(block_sum, 1));
    const __m128i two = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
    sums[b] = _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 0xB1)));
  }
}

struct QuantizeJob {
  Plan& plan;
  const float* a;
  int64_t group;
};

void quantize_task(void* data, size_t index) {
  const auto& job = *static_cast<const QuantizeJob*>(data);
  Plan& p = job.plan;
  const auto r = static_cast<int64_t>(index);
  quantize_row(p, job.a + r * p.w->k, job.group, static_cast<int8_t*>(p.rows.codes.get()) + r * p.rows.padded,
               static_cast<float*>(p.rows.scales.get()) + r * p.blocks,
               static_cast<int32_t*>(p.sums.get()) + r * p.blocks);
}

// One call's plan: A's `m` rows quantized in `group` order, a task per row.
Plan plan(const Weights& w, const float* a, int64_t m, float* y, int64_t group, ParallelFor run, void* context) {
  Plan p{};
  p.w = &w;
  p.y = y;
  p.m = m;
  p.blocks = w.blocks();
  p.quads_per_block = w.block / 4;
  p.quads = p.blocks * p.quads_per_block;
  p.units = (p.quads * 4 + 255) / 256 * 8;  // whole steps of the few-rows path (8 units), whole groups
  QuantizedRows& rows = p.rows;
  rows.rows = m;
  rows.padded = p.units * 32;
  rows.blocks = p.blocks;
  rows.codes = aligned_buffer(static_cast<size_t>(m * rows.padded + 64));
  rows.scales = aligned_buffer(static_cast<size_t>(m * p.blocks * 4 + 64));
  p.sums = aligned_buffer(static_cast<size_t>(m * p.blocks * 4 + 64));
  QuantizeJob job{p, a, group};
  if (m < kParallelQuantizeRows) {  // a decode step's row costs less than a dispatch to the threads
    for (int64_t r = 0; r < m; ++r) quantize_task(&job, static_cast<size_t>(r));
  } else {
    run(context, quantize_task, static_cast<size_t>(m), &job);
  }
  return p;
}

// The few-rows path's per-unit terms of A, per step of 8 units (zeros past K): the scales (its block's) in the order
// column_rows() sums the step's units (Bits<>::kOrder), and in K's order the zero points' share: the block's scale x
// sum of codes at its first unit, zero at the others.
class FewRows {
 public:
  FewRows(const Plan& p, const int (&order)[kLanes])
      : units_(p.units), scales_(aligned_buffer(static_cast<size_t>(p.m * units_ * 4))),
        zero_terms_(aligned_buffer(static_cast<size_t>(p.m * units_ * 4))) {
    const int64_t per_block = p.w->block / 32;
    for (int64_t r = 0; r < p.m; ++r) {
      const float* block_scales = p.rows.row_scales(r);
      const int32_t* sums = p.row_sums(r);
      float* ordered = static_cast<float*>(scales_.get()) + r * units_;
      float* zeros = static_cast<float*>(zero_terms_.get()) + r * units_;
      for (int64_t u = 0; u < units_; ++u) {
        const int64_t b = u / per_block, ordered_b = (u & -kLanes) / per_block + order[u % kLanes] / per_block;
        zeros[u] = b < p.blocks && u % per_block == 0 ? block_scales[b] * static_cast<float>(sums[b]) : 0.0f;
        ordered[u] = ordered_b < p.blocks ? block_scales[ordered_b] : 0.0f;
      }
    }
  }
  const float* scales(int64_t r) const { return static_cast<const float*>(scales_.get()) + r * units_; }
  const float* zero_terms(int64_t r) const { return static_cast<const float*>(zero_terms_.get()) + r * units_; }

 private:
  int64_t units_;
  Buffer scales_, zero_terms_;
};

// A panel of B: codes [quads][planes (8 bits: the low nibbles, the high ones)][2 vectors][32 bytes], then per block
// the 16 columns' weight scales and zero points.
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

// The zero points of blocks [b0, b0 + count) (count <= 8) of a column (Weights::zero_point_row()), one per 32-bit lane,
// the lanes past count undefined; the codes as Weights::zero_point reads them (4 bits: block 2i the low nibble of
// byte i). Inlined, with a fixed-size load for a whole step: the few-rows path calls it at every step of every column.
BP_AVX2 inline __attribute__((always_inline)) __m256i zero_point_lanes(int64_t bits, const uint8_t* column,
                                                                         int64_t b0, int64_t count) {
  if (column == nullptr) return _mm256_set1_epi32(1 << (bits - 1));
  if (bits == 8) {
    uint64_t packed = 0;
    if (count == kLanes) std::memcpy(&packed, column + b0, kLanes);
    else std::memcpy(&packed, column + b0, static_cast<size_t>(count));
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(packed)));
  }
  if (b0 % 2) return _mm256_set1_epi32(column[b0 / 2] >> 4);  // one block per step: blocks of 256 read in place
  uint32_t packed = 0;
  if (count == kLanes) std::memcpy(&packed, column + b0 / 2, kLanes / 2);
  else std::memcpy(&packed, column + b0 / 2, static_cast<size_t>((count + 1) / 2));
  const __m128i bytes = _mm_cvtsi32_si128(static_cast<int>(packed)), low = _mm_set1_epi8(0x0F);
  return _mm256_cvtepu8_epi32(
      _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
}

// Columns [col0, col0 + 16) unpacked (columns past N as zeros), 8 columns x 8 32-bit words at a time. 4 bits: a word
// holds 8 rows of K, its low nibbles one quad and its high nibbles the next; 8 bits: a word is a quad, its low nibbles
// one plane and its high nibbles the other. Then each block's weight scales and zero points.
template <int kBits>
BP_AVX2 void unpack(const Plan& p, int64_t col0, const Panel& panel) {
  const Weights& w = *p.w;
  const int64_t words = p.quads * kBits / 8, column_bytes = w.column_bytes();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int v = 0; v < kPanelVectors; ++v) {
    const int64_t first = col0 + v * kLanes;
    const int64_t valid = std::clamp<int64_t>(w.n - first, 0, kLanes);
    uint8_t* out = panel.codes + v * 32;
    for (int64_t i0 = 0; i0 < words; i0 += kLanes) {
      const int64_t count = std::min<int64_t>(words - i0, kLanes);
      const __m256i mask = lanes_below(count);
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
        // 4 bits: the word's two quads; 8 bits: its quad's two planes
        uint8_t* first_half = out + (kBits == 4 ? 2 * (i0 + i) * kQuadBytes<4> : (i0 + i) * kQuadBytes<8>);
        uint8_t* second_half = first_half + (kBits == 4 ? kQuadBytes<4> : kQuadBytes<8> / 2);
        _mm256_store_si256(reinterpret_cast<__m256i*>(first_half), _mm256_and_si256(codes, low));
        _mm256_store_si256(reinterpret_cast<__m256i*>(second_half), _mm256_and_si256(_mm256_srli_epi16(codes, 4), low));
      }
    }
    for (int64_t b0 = 0; b0 < p.blocks; b0 += kLanes) {  // 8 columns x 8 blocks of scales and zero points
      const int64_t count = std::min<int64_t>(p.blocks - b0, kLanes);
      const __m256i mask = lanes_below(count);
      __m256i scales[kLanes], zero_points[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        if (j >= valid) {
          scales[j] = zero_points[j] = _mm256_setzero_si256();
          continue;
        }
        const auto* at = reinterpret_cast<const int*>(w.scales + (first + j) * p.blocks + b0);
        scales[j] = count == kLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                    : _mm256_maskload_epi32(at, mask);
        zero_points[j] = zero_point_lanes(w.bits, w.zero_point_row(first + j), b0, count);
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

// Rows [row0, row0 + R) x the panel's columns over all of K, into Y (with the bias). kLongBlocks: blocks past 32
// rows of K, summed 32 rows at a time. 8 bits: each plane's 16-bit sums apart, the high one's x 16 in 32 bits.
template <int kBits, int R, bool kLongBlocks>
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
  const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  const uint8_t* wq = panel.codes;
  int64_t quad = 0;
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256i exact[R][kPanelVectors];  // the block's sums, 8 quads (32 rows of K) at a time in 16 bits
    for (int64_t span = 0; span < p.quads_per_block; span += kMaxQuadsPerSpan) {
      constexpr int kPlanes = kBits / 4;
      __m256i acc[R][kPlanes * kPanelVectors];  // per plane (8 bits: low, high), per vector
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kPlanes * kPanelVectors; ++c) acc[r][c] = _mm256_setzero_si256();
      const int64_t span_quads = kLongBlocks ? std::min<int64_t>(kMaxQuadsPerSpan, p.quads_per_block - span)
                                             : p.quads_per_block;
#pragma GCC unroll 8
      for (int64_t q = 0; q < span_quads; ++q, ++quad, wq += kQuadBytes<kBits>) {
        __m256i wv[kPlanes * kPanelVectors];
#pragma GCC unroll 4
        for (int c = 0; c < kPlanes * kPanelVectors; ++c)
          wv[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + 32 * c));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(a[r][quad]);
#pragma GCC unroll 4
          for (int c = 0; c < kPlanes * kPanelVectors; ++c)
            acc[r][c] = _mm256_add_epi16(acc[r][c], _mm256_maddubs_epi16(wv[c], x));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kPanelVectors; ++c) {
          __m256i sums = _mm256_madd_epi16(acc[r][c], ones);
          if (kBits == 8) sums = _mm256_add_epi32(sums, _mm256_madd_epi16(acc[r][kPanelVectors + c], sixteens));
          exact[r][c] = kLongBlocks && span > 0 ? _mm256_add_epi32(exact[r][c], sums) : sums;
        }
      if (!kLongBlocks) break;
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
        const __m256 scale = _mm256_mul_ps(s, _mm256_load_ps(sw + c * kLanes));
        f[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(exact[r][c], zero_share)), scale, f[r][c]);
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
// Rows per tile: 8 bits 2 at most (their 8 accumulators and the quad's 4 vectors fill the registers).
template <int kBits>
constexpr int kTileRows = kBits == 4 ? 3 : 2;

// [long blocks][rows - 1]
template <int kBits, size_t... kRows>
constexpr std::array<std::array<TileFn, sizeof...(kRows)>, 2> tile_table(std::index_sequence<kRows...>) {
  return {{{tile<kBits, kRows + 1, false>...}, {tile<kBits, kRows + 1, true>...}}};
}
template <int kBits>
constexpr auto kTiles = tile_table<kBits>(std::make_index_sequence<kTileRows<kBits>>());

// One task: a panel, unpacked once, against every row of A.
template <int kBits>
void run_task(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t col0 = static_cast<int64_t>(index) * kPanelColumns;
  const size_t code_bytes = static_cast<size_t>(p.quads * kQuadBytes<kBits>);
  auto* bytes =
      static_cast<uint8_t*>(thread_scratch(code_bytes + static_cast<size_t>(2 * p.blocks * kPanelColumns * 4)));
  auto* scales = reinterpret_cast<float*>(bytes + code_bytes);
  const Panel panel{bytes, scales, reinterpret_cast<int32_t*>(scales + p.blocks * kPanelColumns)};
  unpack<kBits>(p, col0, panel);
  const auto& tiles = kTiles<kBits>[p.quads_per_block > kMaxQuadsPerSpan];
  for (int64_t row = 0; row < p.m; row += kTileRows<kBits>)
    tiles[std::min<int64_t>(kTileRows<kBits>, p.m - row) - 1](p, panel, col0, row);
}

// Few rows (decode steps): B read where it lies, one column at a time (one sequential stream per thread,
// which the prefetchers follow), in steps of 8 units of 32 rows of K, each unit's sum exact in 32 bits and taken to
// float with its block's two scales; the zero points' share (zero point - the codes' offset, x the weight scale x the
// block's activation sum and scale) is subtracted per block in float.
// 4 bits: two units per 32-byte load, their low nibbles (each unit's even rows of K) and high nibbles (odd rows)
// against A's codes in that order (quantize_row()'s groups of 64), unsigned against signed on vpmaddubsw, even and odd
// added, then two levels of vphaddw (at most 4 x 2 x 2 x 15 x 127 = 30,480 in 16 bits) and vpmaddwd: one sum per
// unit, in kOrder.
// 8 bits: a unit per load, less 128 (as int8), its magnitude on vpmaddubsw against A's codes with its sign (at most
// 2 x 128 x 127 = 32,512 per pair), vpmaddwd, then two levels of vphaddd and the two halves added: K's order.
template <int kBits>
struct Bits;

template <>
struct Bits<4> {
  static constexpr int kUnitBytes = 16, kOffset = 0, kGroup = 64;
  static constexpr int kOrder[kLanes] = {0, 2, 4, 6, 1, 3, 5, 7};
  // the step's 8 units' sums against R rows
  template <int R>
  BP_AVX2 static void step(const uint8_t* packed, const int8_t* const (&x)[R], __m256i (&sums)[R]) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i half[R][2];  // units 0-3 and 4-7 after the first vphaddw
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i pair[R][2];
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64 * h + 32 * j));
        const __m256i even = _mm256_and_si256(codes, low), odd = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const auto* a = reinterpret_cast<const __m256i*>(x[r] + 128 * h + 64 * j);
          pair[r][j] = _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_load_si256(a)),
                                        _mm256_maddubs_epi16(odd, _mm256_load_si256(a + 1)));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) half[r][h] = _mm256_hadd_epi16(pair[r][0], pair[r][1]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(_mm256_hadd_epi16(half[r][0], half[r][1]), ones);
  }
};

template <>
struct Bits<8> {
  static constexpr int kUnitBytes = 32, kOffset = 128, kGroup = 1;
  static constexpr int kOrder[kLanes] = {0, 1, 2, 3, 4, 5, 6, 7};
  template <int R>
  BP_AVX2 static void step(const uint8_t* packed, const int8_t* const (&x)[R], __m256i (&sums)[R]) {
    const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    __m256i quarter[R][2];  // units 0-3 and 4-7 after two vphaddd: each half of the vector a part of all four
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i pair[R][2];
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        __m256i unit[R][2];
#pragma GCC unroll 2
        for (int i = 0; i < 2; ++i) {
          const int u = 4 * h + 2 * j + i;
          const __m256i codes =
              _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * u)), offset);
          const __m256i magnitude = _mm256_abs_epi8(codes);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(x[r] + 32 * u));
            unit[r][i] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a, codes)), ones);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) pair[r][j] = _mm256_hadd_epi32(unit[r][0], unit[r][1]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) quarter[r][h] = _mm256_hadd_epi32(pair[r][0], pair[r][1]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      sums[r] = _mm256_add_epi32(_mm256_permute2x128_si256(quarter[r][0], quarter[r][1], 0x20),
                                 _mm256_permute2x128_si256(quarter[r][0], quarter[r][1], 0x31));
  }
};

template <int kBits, int R>
BP_AVX2 void column_rows(const Plan& p, const FewRows& rows, int64_t col, int64_t row0) {
  using B = Bits<kBits>;
  const Weights& w = *p.w;
  const int64_t per_block = w.block / 32, block_step = kLanes / per_block;  // blocks per step (1-8)
  const uint8_t* column = w.packed + col * w.column_bytes();
  const float* sw = w.scales + col * p.blocks;
  const uint8_t* zero_column = w.zero_point_row(col);
  __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B::kOrder));
  __m256i natural = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  if (per_block > 1) {  // each unit's block within the step
    const __m128i shift = _mm_cvtsi64_si128(__builtin_ctzll(static_cast<unsigned long long>(per_block)));
    order = _mm256_srl_epi32(order, shift);
    natural = _mm256_srl_epi32(natural, shift);
  }
  const __m256i offset = _mm256_set1_epi32(B::kOffset);
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.rows.row(row0 + r);
  __m256 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
  alignas(32) uint8_t tail[kLanes * B::kUnitBytes];  // zeroed only where K ends inside a step
  const int64_t units = w.blocks() * per_block;
  for (int64_t u0 = 0, b0 = 0; u0 < units; u0 += kLanes, b0 += block_step) {
    const uint8_t* packed = column + B::kUnitBytes * u0;
    if (units - u0 < kLanes) {  // the last step: the units past K are zeros against zero codes of A
      const auto bytes = static_cast<size_t>(B::kUnitBytes * (units - u0));
      std::memcpy(tail, packed, bytes);
      std::memset(tail + bytes, 0, sizeof(tail) - bytes);
      packed = tail;
    }
#pragma GCC unroll 4
    for (int line = 0; line < B::kUnitBytes * kLanes; line += 64)  // past the column's end: harmless, never faults
      _mm_prefetch(reinterpret_cast<const char*>(column + B::kUnitBytes * u0 + kPrefetchAhead + line), _MM_HINT_T0);
    const int64_t count = std::min<int64_t>(p.blocks - b0, block_step);
    const __m256 scales = load_below(sw + b0, count);
    const __m256i zero_points = _mm256_sub_epi32(zero_point_lanes(w.bits, zero_column, b0, count), offset);
    const __m256 zero_scales =
        _mm256_permutevar8x32_ps(_mm256_mul_ps(scales, _mm256_cvtepi32_ps(zero_points)), natural);
    const __m256 ordered_scales = _mm256_permutevar8x32_ps(scales, order);
    __m256i sums[R];
    const int8_t* step_x[R];
    for (int r = 0; r < R; ++r) step_x[r] = x[r] + 32 * u0;
    B::template step<R>(packed, step_x, sums);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]),
                             _mm256_mul_ps(ordered_scales, _mm256_load_ps(rows.scales(row0 + r) + u0)), f[r]);
      f[r] = _mm256_fnmadd_ps(zero_scales, _mm256_load_ps(rows.zero_terms(row0 + r) + u0), f[r]);
    }
  }
  for (int r = 0; r < R; ++r) p.y[(row0 + r) * w.n + col] = horizontal_sum(f[r]) + (w.bias ? w.bias[col] : 0.0f);
}

using ColumnFn = void (*)(const Plan&, const FewRows&, int64_t, int64_t);
template <int kBits>
constexpr ColumnFn kColumnRows[kColumnTileRows] = {column_rows<kBits, 1>, column_rows<kBits, 2>, column_rows<kBits, 3>};
constexpr int64_t kColumnsPerTask = 64;

struct FewRowsTask {
  const Plan& plan;
  const FewRows& rows;
  const ColumnFn* tiles;
};

void few_rows_task(void* data, size_t index) {
  const auto& task = *static_cast<const FewRowsTask*>(data);
  const Plan& p = task.plan;
  const int64_t first = static_cast<int64_t>(index) * kColumnsPerTask;
  for (int64_t col = first; col < std::min(p.w->n, first + kColumnsPerTask); ++col)
    for (int64_t row = 0; row < p.m; row += kColumnTileRows)
      task.tiles[std::min<int64_t>(kColumnTileRows, p.m - row) - 1](p, task.rows, col, row);
}

template <int kBits>
void few_rows(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  const Plan p = plan(w, a, m, y, Bits<kBits>::kGroup, run, context);
  const FewRows rows(p, Bits<kBits>::kOrder);
  FewRowsTask task{p, rows, kColumnRows<kBits>};
  run(context, few_rows_task, static_cast<size_t>((w.n + kColumnsPerTask - 1) / kColumnsPerTask), &task);
}

}  // namespace

bool matmul_int8_avx2(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().avx2 || (w.bits != 4 && w.bits != 8) || w.block < 32 || w.block > 256 || w.g_idx != nullptr)
    return false;
  if (w.bits == 4) few_rows<4>(w, a, m, y, run, context);
  else few_rows<8>(w, a, m, y, run, context);
  return true;
}

bool matmul_int8_panels_avx2(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().avx2 || (w.bits != 4 && w.bits != 8) || w.block < 16 || w.g_idx != nullptr) return false;
  Plan p = plan(w, a, m, y, w.bits == 4 ? 8 : 1, run, context);
  run(context, w.bits == 4 ? run_task<4> : run_task<8>, static_cast<size_t>((w.n + kPanelColumns - 1) / kPanelColumns),
      &p);
  return true;
}

}  // namespace bp

#else

namespace bp {
bool matmul_int8_avx2(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
bool matmul_int8_panels_avx2(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
}  // namespace bp

#endif
