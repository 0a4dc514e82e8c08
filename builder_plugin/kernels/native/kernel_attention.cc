// Attention on bf16 operands (attention.h): on AMX tiles, or without AMX on AVX-512 BF16 dot products (vdpbf16ps,
// the same sums in another order). One task per batch row and K/V head, its query heads one after the other.
//
// Per task, K and V are converted once into the layout TDPBF16PS reads its second operand in (K: per 16 keys and 32
// of head_dim a tile whose row j holds dims 2j, 2j + 1 of the 16 keys; V: per 16 dims and 32 keys a tile whose row j
// holds keys 2j, 2j + 1 of the 16 dims) and Q (times the scale) into rows of 32 dims. Then per 32 query rows: the
// scores Q K^T (float sums), the bias and the key mask added in float, a float softmax over the keys, the
// probabilities rounded to bf16, and P V (float sums) into the output. Causal: a block of query rows meets only the
// keys its last row sees, and each row's softmax runs over its own.
#include "attention.h"

#include "bf16_util.h"
#include "quantize.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace bp {
namespace {

constexpr int kGroup = 16;
constexpr int kStep = 32;
constexpr int kTileElements = kGroup * kStep;
constexpr int kPairElements = 2 * kTileElements;

struct Shape {
  int64_t dim_steps;   // steps of 32 over head_dim (the scores' depth)
  int64_t dim_pairs;   // pairs of 16 dims (the output's column pairs)
  int64_t key_pairs;   // pairs of 16 keys (the scores' column pairs) = steps of 32 over the keys (P V's depth)
  int64_t row_pairs;   // pairs of 16 query rows
  int64_t padded_keys;
};

struct Buffers {
  Buffer storage;
  size_t capacity = 0;
  uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *p = nullptr;
  float* scores = nullptr;
  void reserve(const Shape& s) {
    const size_t q = s.row_pairs * s.dim_steps * kPairElements, k = s.key_pairs * s.dim_steps * kPairElements;
    const size_t v = s.dim_pairs * s.key_pairs * kPairElements, p = s.key_pairs * kPairElements;
    const size_t bytes = (q + k + v + p) * 2 + 2 * kGroup * s.padded_keys * 4 + 64 * 5;
    if (capacity < bytes) {
      storage = aligned_buffer(bytes);
      capacity = bytes;
    }
    auto* at = static_cast<char*>(storage.get());
    auto take = [&at](size_t size) {
      char* here = at;
      at += (size + 63) / 64 * 64;
      return here;
    };
    this->q = reinterpret_cast<uint16_t*>(take(q * 2));
    this->k = reinterpret_cast<uint16_t*>(take(k * 2));
    this->v = reinterpret_cast<uint16_t*>(take(v * 2));
    this->p = reinterpret_cast<uint16_t*>(take(p * 2));
    scores = reinterpret_cast<float*>(take(2 * kGroup * s.padded_keys * 4));
  }
};

struct Job {
  const Attention* a;
  Shape shape;
  bool tiles;  // AMX, else AVX-512 BF16
};

// 32 values of a row from `at` (`count` of them valid, the rest zeros), times `factor`, as bf16 pairs in 32-bit lanes.
BP_BF16 inline __m512i bf16_row(const float* at, int64_t count, __m512 factor) {
  const __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(count), at), factor);
  const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(count - 16), at + 16), factor);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// Rows [16 g, 16 g + 16) of X (`rows` of them, stride `stride`) over 32-dim steps, as first-operand tiles (row r: 32
// dims) or, `transposed`, second-operand tiles (row j: dims 2j, 2j + 1 of the 16 rows); pair layout.
BP_BF16 void row_tiles(const float* x, int64_t rows, int64_t stride, int64_t dim, int64_t steps, float factor,
                       bool transposed, uint16_t* out) {
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  for (int64_t g = 0; g < groups + groups % 2; ++g) {
    uint16_t* tile = out + (g / 2 * steps * 2 + g % 2) * kTileElements;
    for (int64_t s = 0; s < steps; ++s, tile += kPairElements) {
      __m512i lanes[kGroup];
      for (int r = 0; r < kGroup; ++r) {
        const int64_t row = g * kGroup + r;
        lanes[r] = row < rows ? bf16_row(x + row * stride + s * kStep, dim - s * kStep, _mm512_set1_ps(factor))
                              : _mm512_setzero_si512();
      }
      if (transposed) transpose16(lanes);
      for (int r = 0; r < kGroup; ++r) _mm512_store_si512(tile + r * kStep, lanes[r]);
    }
  }
}

// V [keys][dims] as second-operand tiles for P V: per pair of 16-dim groups and 32-key step, row j of a tile holds
// keys 2j and 2j + 1 of its 16 dims, interleaved.
BP_BF16 void value_tiles(const float* v, int64_t keys, int64_t stride, int64_t dim, const Shape& s, uint16_t* out) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t g = 0; g < 2 * s.dim_pairs; ++g) {
    const __mmask16 valid = first_lanes(dim - g * kGroup);
    uint16_t* tile = out + (g / 2 * s.key_pairs * 2 + g % 2) * kTileElements;
    for (int64_t step = 0; step < s.key_pairs; ++step, tile += kPairElements) {
      for (int j = 0; j < kGroup; ++j) {
        const int64_t key = step * kStep + 2 * j;
        const __m512 first = key < keys ? _mm512_maskz_loadu_ps(valid, v + key * stride + g * kGroup)
                                        : _mm512_setzero_ps();
        const __m512 second = key + 1 < keys ? _mm512_maskz_loadu_ps(valid, v + (key + 1) * stride + g * kGroup)
                                             : _mm512_setzero_ps();
        _mm512_store_si512(tile + j * kStep,
                           _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(second, first)));
      }
    }
  }
}

// Float sums of first-operand tiles `a` (rows h, h + 1) and second-operand tiles `b` (columns g, g + 1) over
// `steps`, stored to `out` (row stride `stride` floats) at [16 h][16 g]. The four tiles: 0-3 sums, 4-5 a, 6-7 b.
BP_BF16 inline void tile_products(const uint16_t* a, const uint16_t* b, int64_t steps, float* out, int64_t stride) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s, a += kPairElements, b += kPairElements) {
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + kTileElements, 64);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, stride * 4);
  _tile_stored(2, out + kGroup, stride * 4);
  _tile_stored(1, out + kGroup * stride, stride * 4);
  _tile_stored(3, out + kGroup * stride + kGroup, stride * 4);
}

// The same sums on AVX-512 BF16: per 8 rows of `a`, a row's 32-bit pair j broadcast against row j of each `b` tile
// (16 columns x a pair of K), 8 rows x 32 columns (kBoth; else the first 16) of float sums in registers. The last
// step's pairs from `last_pairs` on are padding (zeros in one operand) and skipped: SigLIP's 72-dim heads pad to 96.
template <bool kBoth>
BP_BF16 void vector_products(const uint16_t* a, const uint16_t* b, int64_t steps, int last_pairs, float* out,
                             int64_t stride) {
  constexpr int kRows = 8;
  for (int r0 = 0; r0 < 2 * kGroup; r0 += kRows) {
    const uint16_t* rows = a + (r0 / kGroup) * kTileElements + (r0 % kGroup) * kStep;
    __m512 sums[kRows][2];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_ps();
    const uint16_t* x = rows;
    const uint16_t* w = b;
    for (int64_t s = 0; s < steps; ++s, x += kPairElements, w += kPairElements) {
      const int pairs = s + 1 < steps ? kGroup : last_pairs;
      for (int j = 0; j < pairs; ++j) {
        const __m512bh w0 = (__m512bh)_mm512_load_si512(w + j * kStep);
        const __m512bh w1 = kBoth ? (__m512bh)_mm512_load_si512(w + kTileElements + j * kStep) : w0;
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const __m512bh v = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(x + r * kStep)[j]);
          sums[r][0] = _mm512_dpbf16_ps(sums[r][0], v, w0);
          if (kBoth) sums[r][1] = _mm512_dpbf16_ps(sums[r][1], v, w1);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(out + (r0 + r) * stride, sums[r][0]);
      _mm512_storeu_ps(out + (r0 + r) * stride + kGroup, sums[r][1]);
    }
  }
}

// `depth`: the valid length of K (the rest of the last step is padding); `columns`: the output columns wanted (of 32).
BP_BF16 inline void pair_products(bool tiles, const uint16_t* a, const uint16_t* b, int64_t steps, int64_t depth,
                                  int64_t columns, float* out, int64_t stride) {
  if (tiles) return tile_products(a, b, steps, out, stride);
  const int last_pairs = static_cast<int>((depth - (steps - 1) * kStep + 1) / 2);
  if (columns > kGroup) vector_products<true>(a, b, steps, last_pairs, out, stride);
  else vector_products<false>(a, b, steps, last_pairs, out, stride);
}

// The softmax of one score row over its first `keys` keys, its bias and key mask added, into bf16 probabilities
// (later keys of the block's `key_pairs` steps: 0) in the first-operand tiles of P (row `r` of the 32-row block).
BP_BF16 void softmax_row(const Attention& a, int64_t b, int64_t h, int64_t row, int64_t keys, int64_t key_pairs,
                         float* scores, int r, uint16_t* p) {
  const float* bias = a.bias ? a.bias + b * a.bias_batch_stride + h * a.bias_head_stride + row * a.kv_len : nullptr;
  const int32_t* mask = a.key_padding ? a.key_padding + b * a.kv_len : nullptr;
  const __m512 masked = _mm512_set1_ps(a.mask_value);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < keys; t += 16) {
    const __mmask16 valid = first_lanes(keys - t);
    __m512 x = _mm512_maskz_loadu_ps(valid, scores + t);
    if (bias) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(valid, bias + t));
    if (mask) {
      const __mmask16 off = _mm512_mask_cmpeq_epi32_mask(valid, _mm512_maskz_loadu_epi32(valid, mask + t),
                                                         _mm512_setzero_si512());
      x = _mm512_mask_add_ps(x, off, x, masked);
    }
    _mm512_mask_storeu_ps(scores + t, valid, x);
    top = _mm512_mask_max_ps(top, valid, top, x);
  }
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < keys; t += 16) {
    const __mmask16 valid = first_lanes(keys - t);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp_negative(_mm512_sub_ps(_mm512_loadu_ps(scores + t), peak)));
    _mm512_storeu_ps(scores + t, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  uint16_t* tile = p + (r / kGroup) * kTileElements + (r % kGroup) * kStep;
  for (int64_t step = 0; step < key_pairs; ++step, tile += kPairElements) {
    const int64_t t = step * kStep;
    const __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(keys - t), scores + t), inverse);
    const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(keys - t - 16), scores + t + 16), inverse);
    _mm512_store_si512(tile, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// One query head of batch row b over the K/V tiles already in `buffers`.
BP_BF16 void run_head(const Attention& a, const Shape& s, bool tiles, Buffers& buffers, int64_t b, int64_t h) {
  const int64_t dim = a.head_dim, width = a.heads * dim;
  const float* q = a.q + b * a.q_len * a.q_row_stride + h * dim;
  row_tiles(q, a.q_len, a.q_row_stride, dim, s.dim_steps, a.scale, false, buffers.q);
  alignas(64) float sums[2 * kGroup * 2 * kGroup];
  for (int64_t pair = 0; pair < s.row_pairs; ++pair) {
    const int rows = static_cast<int>(std::min<int64_t>(2 * kGroup, a.q_len - pair * 2 * kGroup));
    // the keys the block's last row sees (causal), as whole steps of 32
    const int64_t block_keys = a.causal_past < 0 ? a.kv_len
                                                 : std::min(a.kv_len, a.causal_past + pair * 2 * kGroup + rows);
    const int64_t key_pairs = (block_keys + kStep - 1) / kStep;
    const uint16_t* q_tiles = buffers.q + pair * s.dim_steps * kPairElements;
    for (int64_t keys = 0; keys < key_pairs; ++keys)
      pair_products(tiles, q_tiles, buffers.k + keys * s.dim_steps * kPairElements, s.dim_steps, dim, 2 * kGroup,
                    buffers.scores + keys * 2 * kGroup, s.padded_keys);
    for (int r = 0; r < 2 * kGroup; ++r) {
      const int64_t row = pair * 2 * kGroup + r;
      if (r < rows) {
        const int64_t keys = a.causal_past < 0 ? a.kv_len : std::min(a.kv_len, a.causal_past + row + 1);
        softmax_row(a, b, h, row, keys, key_pairs, buffers.scores + r * s.padded_keys, r, buffers.p);
      } else {  // rows past the queries: zero probabilities
        uint16_t* tile = buffers.p + (r / kGroup) * kTileElements + (r % kGroup) * kStep;
        for (int64_t step = 0; step < key_pairs; ++step) _mm512_store_si512(tile + step * kPairElements,
                                                                            _mm512_setzero_si512());
      }
    }
    for (int64_t dims = 0; dims < s.dim_pairs; ++dims) {
      pair_products(tiles, buffers.p, buffers.v + dims * s.key_pairs * kPairElements, key_pairs, block_keys,
                    dim - dims * 2 * kGroup, sums, 2 * kGroup);
      const __mmask16 first = first_lanes(dim - dims * 2 * kGroup), second = first_lanes(dim - dims * 2 * kGroup - 16);
      for (int r = 0; r < rows; ++r) {
        float* out = a.out + (b * a.q_len + pair * 2 * kGroup + r) * width + h * dim + dims * 2 * kGroup;
        _mm512_mask_storeu_ps(out, first, _mm512_load_ps(sums + r * 2 * kGroup));
        _mm512_mask_storeu_ps(out + kGroup, second, _mm512_load_ps(sums + r * 2 * kGroup + kGroup));
      }
    }
  }
}

// One task: K/V head g of batch row b converted once, then each query head that reads it.
BP_BF16 void run_kv_head(void* data, size_t index) {
  const Job& job = *static_cast<const Job*>(data);
  const Attention& a = *job.a;
  const Shape& s = job.shape;
  const int64_t b = static_cast<int64_t>(index) / a.kv_heads, g = static_cast<int64_t>(index) % a.kv_heads;
  const int64_t group = a.heads / a.kv_heads;
  thread_local Buffers buffers;
  buffers.reserve(s);
  const int64_t kv_at = b * a.kv_batch_stride + g * a.kv_head_stride;
  row_tiles(a.k + kv_at, a.kv_len, a.kv_row_stride, a.head_dim, s.dim_steps, 1.0f, true, buffers.k);
  value_tiles(a.v + kv_at, a.kv_len, a.kv_row_stride, a.head_dim, s, buffers.v);
  if (job.tiles) _tile_loadconfig(&square_tiles());
  for (int64_t h = g * group; h < (g + 1) * group; ++h) run_head(a, s, job.tiles, buffers, b, h);
  if (job.tiles) _tile_release();
}

}  // namespace

bool attention_bf16(const Attention& a, bool tiles, ParallelFor run, void* context) {
  const bool cpu_has = tiles ? cpu().amx_bf16 : cpu().avx512_bf16;
  if (!cpu_has || a.head_dim > kMaxAttentionHeadDim || a.head_dim < 1 || a.kv_heads < 1 || a.heads % a.kv_heads)
    return false;
  Job job{&a, {}, tiles};
  job.shape.dim_steps = (a.head_dim + kStep - 1) / kStep;
  job.shape.dim_pairs = (a.head_dim + 2 * kGroup - 1) / (2 * kGroup);
  job.shape.key_pairs = (a.kv_len + kStep - 1) / kStep;
  job.shape.row_pairs = (a.q_len + 2 * kGroup - 1) / (2 * kGroup);
  job.shape.padded_keys = job.shape.key_pairs * kStep;
  run(context, run_kv_head, static_cast<size_t>(a.batch * a.kv_heads), &job);
  return true;
}

}  // namespace bp

#else

namespace bp {
bool attention_bf16(const Attention&, bool, ParallelFor, void*) { return false; }
}  // namespace bp

#endif

namespace bp {

void packed_rows(Attention& a) {
  a.kv_heads = a.heads;
  a.q_row_stride = a.kv_row_stride = a.heads * a.head_dim;
  a.kv_head_stride = a.head_dim;
  a.kv_batch_stride = a.kv_len * a.heads * a.head_dim;
}

}  // namespace bp
