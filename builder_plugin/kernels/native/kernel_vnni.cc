// The many-rows path (a prompt) on CPUs with AVX-512 VNNI but no AMX: a packed-panel int8 GEMM on vpdpbusd.
//
// A's rows are quantized per block of K as on the other int8 paths (quantize_rows). Each task unpacks a panel of B (48
// columns x all of K) once into a buffer that stays in L2: per "quad" (4 rows of K), the 16 columns' 4 codes side by
// side in one 64-byte vector, which vpdpbusd multiplies with 4 activation codes broadcast. Every row of A then meets
// the panel, 4 rows x 48 columns at a time. Per block of K the integer sums are exact; converted to float they take
// both scales.
//
// 4 bits: a 32-bit word of a column holds 8 rows of K (low nibbles the even ones); its quads are the low nibbles, then
// the high ones, and A's codes are put in that order (per 8 rows of K: 0 2 4 6 1 3 5 7). The panel holds the weights
// less their zero point (signed, |w - zp| <= 15) and A's codes are offset by 128 (unsigned), so vpdpbusd sums
// (a + 128)(w - zp); each block's sums start at -128 x the block's column sum of (w - zp), which leaves the exact
// sum of a (w - zp): the zero point costs nothing per block.
// 8 bits: w - zp does not fit a signed byte, so the panel holds the codes as they are (unsigned) against A's signed
// codes, and per block the zero point's share (zp x weight scale x activation scale x the block's sum of activation
// codes) is taken off in float.
#include "matmul_nbits.h"
#include "quantize.h"
#include "simd_util.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>

#define BP_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,bmi2")))

namespace bp {
namespace {

constexpr int kVector = 16;                            // columns per vector
constexpr int kPanelVectors = 3;                       // vectors per panel
constexpr int kPanelColumns = kVector * kPanelVectors;  // 48
constexpr int kQuadBytes = kPanelVectors * 64;          // one quad of the panel
constexpr int kTileRows = 4;                            // rows of A per register tile

struct Plan {
  const Weights* w;
  float* y;
  int64_t m, blocks, quads_per_block, quads, column_bytes;
  QuantizedRows rows;  // codes in the panel's order of K (4 bits: offset by 128)
  Buffer terms;        // 8 bits: float [m][blocks], activation scale x the block's sum of codes
  const float* row_terms(int64_t r) const { return static_cast<const float*>(terms.get()) + r * blocks; }
};

// Per row, 4 bits: the codes in the panel's order, offset by 128. 8 bits: each block's activation scale x sum of
// codes.
BP_VNNI void arrange_rows(Plan& p) {
  const int64_t block = p.w->block, padded = p.rows.padded;
  if (p.w->bits == 4) {
    const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t r = 0; r < p.m; ++r) {
      int8_t* codes = static_cast<int8_t*>(p.rows.codes.get()) + r * padded;
      for (int64_t at = 0; at < padded; at += 64) {
        const __m512i v = _mm512_shuffle_epi8(_mm512_load_si512(codes + at), order);
        _mm512_store_si512(codes + at, _mm512_xor_si512(v, offset));
      }
    }
    return;
  }
  const __m512i ones = _mm512_set1_epi8(1);
  p.terms = aligned_buffer(static_cast<size_t>(p.m * p.blocks * 4 + 64));
  auto* terms = static_cast<float*>(p.terms.get());
  alignas(64) int32_t sums[kVector];
  for (int64_t r = 0; r < p.m; ++r) {
    const int8_t* codes = p.rows.row(r);
    float* row_terms = terms + r * p.blocks;
    std::fill(row_terms, row_terms + p.blocks, 0.0f);
    for (int64_t at = 0; at < padded; at += 64) {
      _mm512_store_si512(sums, _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(codes + at)));
      for (int lane = 0; lane < kVector; ++lane) {
        const int64_t b = (at + 4 * lane) / block;
        if (b < p.blocks) row_terms[b] += static_cast<float>(sums[lane]);
      }
    }
    const float* scales = p.rows.row_scales(r);
    for (int64_t b = 0; b < p.blocks; ++b) row_terms[b] *= scales[b];
  }
}

// A panel of B: codes [quads][3 vectors][64 bytes], then per block the 48 columns' weight scales and their zero point
// term: 4 bits, int32 sums' start (-128 x the column sum of w - zp); 8 bits, float zp x scale.
struct Panel {
  uint8_t* codes;
  float* scales;
  void* zero_terms;
  const int32_t* starts() const { return static_cast<const int32_t*>(zero_terms); }
  const float* zero_scales() const { return static_cast<const float*>(zero_terms); }
};

// Sixteen 32-bit values of each of `valid` rows (row i at base + i x stride bytes; `count` of them, the rest zeros),
// transposed: out[i], lane j = row j's value i. Rows from `valid` on are zeros. Loads and a transpose: a 16-lane
// gather per value was most of the unpacking's time on Zen 4.
BP_VNNI void load_transposed(const uint8_t* base, int64_t stride, int64_t valid, int64_t count,
                             __m512i out[kVector]) {
  const __mmask16 mask = first_lanes(count);
  for (int i = 0; i < kVector; ++i)
    out[i] = i < valid ? _mm512_maskz_loadu_epi32(mask, base + i * stride) : _mm512_setzero_si512();
  transpose16(out);
}

// Column `col`'s zero points of blocks [b0, b0 + count) (count <= 16, b0 even), one per 32-bit lane, the rest zeros;
// the codes as Weights::zero_point reads them (4 bits: block 2i the low nibble of byte i).
BP_VNNI __m512i zero_point_lanes(const Weights& w, int64_t col, int64_t b0, int64_t count) {
  if (w.zero_points == nullptr) return _mm512_maskz_set1_epi32(first_lanes(count), 1 << (w.bits - 1));
  const uint8_t* row = w.zero_points + col * w.zero_point_columns();
  __m128i bytes;
  if (w.bits == 4) {
    const __m128i packed = _mm_maskz_loadu_epi8(first_lanes((count + 1) / 2), row + b0 / 2);
    const __m128i low = _mm_set1_epi8(0x0F);
    bytes = _mm_unpacklo_epi8(_mm_and_si128(packed, low), _mm_and_si128(_mm_srli_epi16(packed, 4), low));
  } else {
    bytes = _mm_maskz_loadu_epi8(first_lanes(count), row + b0);
  }
  return _mm512_maskz_mov_epi32(first_lanes(count), _mm512_cvtepu8_epi32(bytes));
}

// Columns [col0, col0 + 48) unpacked (columns past N as zeros), 16 at a time and 16 blocks at a time: codes (4
// bits less the zero point, with each block's start; 8 bits as they are), weight scales, 8 bits' zp x scale.
template <int BITS>
BP_VNNI void unpack(const Plan& p, int64_t col0, const Panel& panel) {
  const Weights& w = *p.w;
  const int64_t words_per_block = w.block * BITS / 32, words = p.column_bytes / 4;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i replicate = _mm512_set1_epi32(0x01010101);
  __m512i chunk[kVector], scales[kVector], zero_points[kVector];
  for (int v = 0; v < kPanelVectors; ++v) {
    const int64_t first = col0 + v * kVector;
    const int64_t valid = std::clamp<int64_t>(w.n - first, 0, kVector);
    const uint8_t* column = w.packed + std::min(first, w.n - 1) * p.column_bytes;  // the first of the 16
    uint8_t* out = panel.codes + v * 64;
    int64_t word = 0;
    for (int64_t b0 = 0; b0 < p.blocks; b0 += kVector) {
      const int64_t count = std::min<int64_t>(p.blocks - b0, kVector);
      load_transposed(reinterpret_cast<const uint8_t*>(w.scales + std::min(first, w.n - 1) * p.blocks + b0),
                      p.blocks * 4, valid, count, scales);
      for (int i = 0; i < kVector; ++i)
        zero_points[i] = i < valid ? zero_point_lanes(w, first + i, b0, count) : _mm512_setzero_si512();
      transpose16(zero_points);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t b = b0 + i;
        _mm512_store_si512(panel.scales + b * kPanelColumns + v * kVector, scales[i]);
        if (BITS == 4) {
          const __m512i zp = _mm512_mullo_epi32(zero_points[i], replicate);
          __m512i sum = _mm512_setzero_si512();
          for (int64_t end = word + words_per_block; word < end; ++word) {
            if (word % kVector == 0) load_transposed(column + word * 4, p.column_bytes, valid, words - word, chunk);
            const __m512i codes = chunk[word % kVector];
            const __m512i even = _mm512_sub_epi8(_mm512_and_si512(codes, low), zp);
            const __m512i odd = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(codes, 4), low), zp);
            _mm512_store_si512(out + (2 * word) * kQuadBytes, even);
            _mm512_store_si512(out + (2 * word + 1) * kQuadBytes, odd);
            sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, ones, even), ones, odd);
          }
          _mm512_store_si512(static_cast<int32_t*>(panel.zero_terms) + b * kPanelColumns + v * kVector,
                             _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
        } else {
          _mm512_store_ps(static_cast<float*>(panel.zero_terms) + b * kPanelColumns + v * kVector,
                          _mm512_mul_ps(_mm512_castsi512_ps(scales[i]), _mm512_cvtepi32_ps(zero_points[i])));
          for (int64_t end = word + words_per_block; word < end; ++word) {
            if (word % kVector == 0) load_transposed(column + word * 4, p.column_bytes, valid, words - word, chunk);
            _mm512_store_si512(out + word * kQuadBytes, chunk[word % kVector]);
          }
        }
      }
    }
  }
}

// Rows [row0, row0 + R) x the panel's columns over all of K, into Y (with the bias).
template <int BITS, int R>
BP_VNNI void tile(const Plan& p, const Panel& panel, int64_t col0, int64_t row0) {
  __m512 f[R][kPanelVectors];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kPanelVectors; ++c) f[r][c] = _mm512_setzero_ps();
  const int32_t* a[R];
  const float* sa[R];
  const float* t[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    a[r] = reinterpret_cast<const int32_t*>(p.rows.row(row0 + r));
    sa[r] = p.rows.row_scales(row0 + r);
    t[r] = BITS == 8 ? p.row_terms(row0 + r) : nullptr;
  }
  const uint8_t* wq = panel.codes;
  int64_t quad = 0;
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512i acc[R][kPanelVectors];
#pragma GCC unroll 4
    for (int c = 0; c < kPanelVectors; ++c) {
      const __m512i start =
          BITS == 4 ? _mm512_load_si512(panel.starts() + b * kPanelColumns + c * kVector) : _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = start;
    }
#pragma GCC unroll 2
    for (int64_t q = 0; q < p.quads_per_block; ++q, ++quad, wq += kQuadBytes) {
      const __m512i w0 = _mm512_load_si512(wq), w1 = _mm512_load_si512(wq + 64), w2 = _mm512_load_si512(wq + 128);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(a[r][quad]);
        if (BITS == 4) {  // unsigned activations (offset by 128) x signed weights (less the zero point)
          acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], x, w0);
          acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], x, w1);
          acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], x, w2);
        } else {  // unsigned weights x signed activations
          acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, x);
          acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, x);
          acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], w2, x);
        }
      }
    }
    const float* sw = panel.scales + b * kPanelColumns;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(sa[r][b]);
#pragma GCC unroll 4
      for (int c = 0; c < kPanelVectors; ++c) {
        const __m512 scale = _mm512_mul_ps(s, _mm512_load_ps(sw + c * kVector));
        f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), scale, f[r][c]);
        if (BITS == 8)
          f[r][c] = _mm512_fnmadd_ps(_mm512_set1_ps(t[r][b]),
                                     _mm512_load_ps(panel.zero_scales() + b * kPanelColumns + c * kVector), f[r][c]);
      }
    }
  }
  const Weights& w = *p.w;
#pragma GCC unroll 4
  for (int c = 0; c < kPanelVectors; ++c) {
    const int64_t col = col0 + c * kVector;
    const int64_t valid = std::clamp<int64_t>(w.n - col, 0, kVector);
    if (valid == 0) break;
    const __mmask16 mask = first_lanes(valid);
    const __m512 bias = w.bias ? _mm512_maskz_loadu_ps(mask, w.bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(p.y + (row0 + r) * w.n + col, mask, _mm512_add_ps(f[r][c], bias));
  }
}

using TileFn = void (*)(const Plan&, const Panel&, int64_t, int64_t);
template <int BITS>
constexpr TileFn kTiles[kTileRows] = {tile<BITS, 1>, tile<BITS, 2>, tile<BITS, 3>, tile<BITS, 4>};

// One task: a panel, unpacked once, against every row of A.
BP_VNNI void run_task(void* data, size_t index) {
  const Plan& p = *static_cast<const Plan*>(data);
  const int64_t col0 = static_cast<int64_t>(index) * kPanelColumns;
  const size_t code_bytes = static_cast<size_t>(p.quads * kQuadBytes);
  auto* bytes =
      static_cast<uint8_t*>(thread_scratch(code_bytes + static_cast<size_t>(2 * p.blocks * kPanelColumns * 4)));
  const Panel panel{bytes, reinterpret_cast<float*>(bytes + code_bytes),
                    reinterpret_cast<float*>(bytes + code_bytes) + p.blocks * kPanelColumns};
  const TileFn* tiles = p.w->bits == 4 ? kTiles<4> : kTiles<8>;
  if (p.w->bits == 4) unpack<4>(p, col0, panel);
  else unpack<8>(p, col0, panel);
  for (int64_t row = 0; row < p.m; row += kTileRows)
    tiles[std::min<int64_t>(kTileRows, p.m - row) - 1](p, panel, col0, row);
}

}  // namespace

bool matmul_int8_panels(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().avx512_vnni || (w.bits != 4 && w.bits != 8) || w.block < 16 || w.g_idx != nullptr) return false;
  Plan p{};
  p.w = &w;
  p.y = y;
  p.m = m;
  p.blocks = w.blocks();
  p.column_bytes = w.column_bytes();
  p.quads_per_block = w.block / 4;
  p.quads = p.blocks * p.quads_per_block;
  // whole blocks of A's codes (zeros past K), a multiple of 64 for arrange_rows
  quantize_rows(a, w.k, w.block, (p.quads * 4 + 63) / 64 * 64, m, p.rows);
  arrange_rows(p);
  run(context, run_task, static_cast<size_t>((w.n + kPanelColumns - 1) / kPanelColumns), &p);
  return true;
}

}  // namespace bp

#else

namespace bp {
bool matmul_int8_panels(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
}  // namespace bp

#endif
