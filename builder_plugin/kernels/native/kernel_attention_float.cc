// Attention in float for a few query rows (a decoder's step, a few speculative tokens): on AVX-512, or on AVX2 and
// FMA. One task per batch row and K/V head; per query row, the scores of the group's query heads read each key row
// once, a float softmax per head, then P V reads each value row once for the group. Float throughout: a step answers
// as onnxruntime's float kernel does, up to the order of the sums.
#include "attention.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd_util.h"

#define BP_AVX512_FLOAT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")))
#define BP_AVX2_FLOAT __attribute__((target("avx2,fma")))

namespace bp {
namespace {

// Keys ahead of the loads that the key and value rows are prefetched (the cache is cold after a step's weights).
constexpr int64_t kAhead = 8;

// Every cache line of the row kAhead rows past `row` (rows `stride` floats apart, `d` floats each).
inline void prefetch_ahead(const float* row, int64_t stride, int64_t d) {
  for (int64_t at = 0; at < d; at += 16)
    _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * stride + at), _MM_HINT_T0);
}

// One task's share: batch row b's K/V head g and its group of query heads, [first_head, first_head + group).
struct Task {
  const Attention& a;
  int64_t b, g, group, first_head;
  const float* k;
  const float* v;  // the head's key and value rows

  Task(const Attention& attention, size_t index)
      : a(attention), b(static_cast<int64_t>(index) / a.kv_heads), g(static_cast<int64_t>(index) % a.kv_heads),
        group(a.heads / a.kv_heads), first_head(g * group),
        k(a.k + b * a.kv_batch_stride + g * a.kv_head_stride), v(a.v + b * a.kv_batch_stride + g * a.kv_head_stride) {}
  // query row r's causal reach: the keys it sees
  int64_t visible(int64_t r) const {
    return a.causal_past >= 0 ? std::min(a.kv_len, a.causal_past + r + 1) : a.kv_len;
  }
  const float* query(int64_t r, int64_t head) const {
    return a.q + (b * a.q_len + r) * a.q_row_stride + head * a.head_dim;
  }
  float* out(int64_t r, int64_t head) const { return a.out + ((b * a.q_len + r) * a.heads + head) * a.head_dim; }
};

// This thread's room for the scores of `heads` query heads ([heads][keys_stride]: kv_len rounded up to `lanes`) and
// their sums of P V ([heads][head_dim rounded up to `lanes`]), kept from task to task.
struct Scratch {
  int64_t keys_stride;
  float* scores;
  float* sums;
};

Scratch scratch_for(const Attention& a, int64_t heads, int64_t lanes) {
  thread_local std::vector<float> memory;
  const int64_t keys_stride = (a.kv_len + lanes - 1) / lanes * lanes;
  const int64_t width = (a.head_dim + lanes - 1) / lanes * lanes;
  memory.resize(static_cast<size_t>(heads * (keys_stride + width)));
  return {keys_stride, memory.data(), memory.data() + heads * keys_stride};
}

// ---- AVX-512: 16 lanes, the head's last vector masked ----

BP_AVX512_FLOAT void run_kv_head_avx512(void* data, size_t index) {
  const Task task(*static_cast<const Attention*>(data), index);
  const Attention& a = task.a;
  const int64_t group = task.group, d = a.head_dim, vectors = (d + 15) / 16;
  const __mmask16 tail = first_lanes(d - (vectors - 1) * 16);
  const Scratch scratch = scratch_for(a, group, 16);
  const int64_t keys_stride = scratch.keys_stride;
  float *scores = scratch.scores, *sums = scratch.sums;
  const float *k = task.k, *v = task.v;
  for (int64_t r = 0; r < a.q_len; ++r) {
    const int64_t visible = task.visible(r);
    const float* q = task.query(r, task.first_head);  // the group's heads, side by side
    for (int64_t t = 0; t < visible; ++t) {
      const float* key = k + t * a.kv_row_stride;
      if (t + kAhead < visible) prefetch_ahead(key, a.kv_row_stride, d);
      for (int64_t h = 0; h < group; ++h) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < vectors; ++j) {
          const __mmask16 m = j + 1 < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
          acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + h * d + 16 * j), _mm512_maskz_loadu_ps(m, key + 16 * j),
                                acc);
        }
        scores[h * keys_stride + t] = _mm512_reduce_add_ps(acc) * a.scale;
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      float* row = scores + h * keys_stride;
      __m512 peak = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < visible; t += 16)
        peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(peak, first_lanes(visible - t), row + t));
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
      __m512 total = _mm512_setzero_ps();
      for (int64_t t = 0; t < visible; t += 16) {
        const __mmask16 m = first_lanes(visible - t);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_negative(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), top)));
        _mm512_mask_storeu_ps(row + t, m, e);
        total = _mm512_add_ps(total, e);
      }
      const float inverse = 1.0f / _mm512_reduce_add_ps(total);
      for (int64_t t = 0; t < visible; t += 16) {
        const __mmask16 m = first_lanes(visible - t);
        _mm512_mask_storeu_ps(row + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t), _mm512_set1_ps(inverse)));
      }
    }
    std::fill(sums, sums + group * vectors * 16, 0.0f);
    for (int64_t t = 0; t < visible; ++t) {
      const float* value = v + t * a.kv_row_stride;
      if (t + kAhead < visible) prefetch_ahead(value, a.kv_row_stride, d);
      for (int64_t j = 0; j < vectors; ++j) {
        const __mmask16 m = j + 1 < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
        const __m512 x = _mm512_maskz_loadu_ps(m, value + 16 * j);
        for (int64_t h = 0; h < group; ++h) {
          float* at = sums + (h * vectors + j) * 16;
          _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_set1_ps(scores[h * keys_stride + t]), x, _mm512_loadu_ps(at)));
        }
      }
    }
    float* out = task.out(r, task.first_head);
    for (int64_t h = 0; h < group; ++h)
      for (int64_t j = 0; j < vectors; ++j) {
        const __mmask16 m = j + 1 < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
        _mm512_mask_storeu_ps(out + h * d + 16 * j, m, _mm512_loadu_ps(sums + (h * vectors + j) * 16));
      }
  }
}

// ---- AVX2: 8 lanes; query heads in bundles of up to 4, whose scores of two keys at a time stay in registers ----

constexpr int kBundle = 4;

BP_AVX2_FLOAT inline float sum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

BP_AVX2_FLOAT inline float max8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// The first `count` of 8 lanes, as maskload / maskstore read them.
BP_AVX2_FLOAT inline __m256i lanes8(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(count, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(x) for x <= 0, as exp_negative (simd_util.h): 2^n built in the exponent bits (n >= -126 above the floor).
BP_AVX2_FLOAT inline __m256 exp_negative8(__m256 x) {
  const __m256 floor = _mm256_set1_ps(kExpFloor);
  const __m256 tiny = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x));
  __m256 p = _mm256_setzero_ps();
  for (float term : kExpTerms) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(term));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(power)));
}

struct Head {
  int64_t d, vectors;  // head_dim, and its vectors of 8 (the last one `tail`)
  __m256i tail;
};

BP_AVX2_FLOAT inline __m256 load8(const Head& head, const float* at, int64_t j) {
  return j + 1 < head.vectors ? _mm256_loadu_ps(at + 8 * j) : _mm256_maskload_ps(at + 8 * j, head.tail);
}

// Scores of kHeads query heads (q: their rows side by side) against keys [0, visible), two keys at a time.
template <int kHeads>
BP_AVX2_FLOAT void bundle_scores(const Head& head, const float* q, const float* k, int64_t stride, int64_t visible,
                                 float scale, float* scores, int64_t keys_stride) {
  int64_t t = 0;
  for (; t + 2 <= visible; t += 2) {
    const float* first = k + t * stride;
    const float* second = first + stride;
    __m256 acc[2][kHeads];
    for (int h = 0; h < kHeads; ++h) acc[0][h] = acc[1][h] = _mm256_setzero_ps();
    if (t + kAhead + 1 < visible) {
      prefetch_ahead(first, stride, head.d);
      prefetch_ahead(second, stride, head.d);
    }
    for (int64_t j = 0; j < head.vectors; ++j) {
      const __m256 x = load8(head, first, j), y = load8(head, second, j);
      for (int h = 0; h < kHeads; ++h) {
        const __m256 query = load8(head, q + h * head.d, j);
        acc[0][h] = _mm256_fmadd_ps(query, x, acc[0][h]);
        acc[1][h] = _mm256_fmadd_ps(query, y, acc[1][h]);
      }
    }
    for (int h = 0; h < kHeads; ++h) {
      scores[h * keys_stride + t] = sum8(acc[0][h]) * scale;
      scores[h * keys_stride + t + 1] = sum8(acc[1][h]) * scale;
    }
  }
  for (; t < visible; ++t) {
    __m256 acc[kHeads];
    for (int h = 0; h < kHeads; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t j = 0; j < head.vectors; ++j) {
      const __m256 x = load8(head, k + t * stride, j);
      for (int h = 0; h < kHeads; ++h) acc[h] = _mm256_fmadd_ps(load8(head, q + h * head.d, j), x, acc[h]);
    }
    for (int h = 0; h < kHeads; ++h) scores[h * keys_stride + t] = sum8(acc[h]) * scale;
  }
}

// out (kHeads rows side by side) = P V over keys [0, visible): each value row read once, whole, for the bundle, into
// `sums` ([kHeads][vectors x 8], in L1). (Sums in registers, 16 dims at a time over blocks of keys, read the rows in
// slices and ran 10-30 % slower with the cache cold.)
template <int kHeads>
BP_AVX2_FLOAT void bundle_values(const Head& head, const float* p, int64_t keys_stride, const float* v, int64_t stride,
                                 int64_t visible, float* sums, float* out) {
  const int64_t width = head.vectors * 8;
  std::fill(sums, sums + kHeads * width, 0.0f);
  for (int64_t t = 0; t < visible; ++t) {
    const float* row = v + t * stride;
    __m256 weight[kHeads];
    for (int h = 0; h < kHeads; ++h) weight[h] = _mm256_broadcast_ss(p + h * keys_stride + t);
    for (int64_t j = 0; j < head.vectors; ++j) {
      const __m256 x = load8(head, row, j);
      for (int h = 0; h < kHeads; ++h) {
        float* at = sums + h * width + 8 * j;
        _mm256_storeu_ps(at, _mm256_fmadd_ps(weight[h], x, _mm256_loadu_ps(at)));
      }
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int64_t j = 0; j < head.vectors; ++j) {
      const __m256 x = _mm256_loadu_ps(sums + h * width + 8 * j);
      if (j + 1 < head.vectors) _mm256_storeu_ps(out + h * head.d + 8 * j, x);
      else _mm256_maskstore_ps(out + h * head.d + 8 * j, head.tail, x);
    }
}

// row[0, visible) = softmax of itself; row has room up to `visible` rounded up to 8.
BP_AVX2_FLOAT void softmax8(float* row, int64_t visible) {
  const int64_t padded = (visible + 7) / 8 * 8;
  std::fill(row + visible, row + padded, -INFINITY);  // exp gives them 0
  __m256 peak = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < padded; t += 8) peak = _mm256_max_ps(peak, _mm256_loadu_ps(row + t));
  const __m256 top = _mm256_set1_ps(max8(peak));
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 e = exp_negative8(_mm256_sub_ps(_mm256_loadu_ps(row + t), top));
    _mm256_storeu_ps(row + t, e);
    total = _mm256_add_ps(total, e);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / sum8(total));
  for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(row + t, _mm256_mul_ps(_mm256_loadu_ps(row + t), inverse));
}

template <int kHeads>
BP_AVX2_FLOAT void run_bundle(const Attention& a, const Head& head, const float* q, const float* k, const float* v,
                              int64_t visible, float* scores, int64_t keys_stride, float* sums, float* out) {
  bundle_scores<kHeads>(head, q, k, a.kv_row_stride, visible, a.scale, scores, keys_stride);
  for (int h = 0; h < kHeads; ++h) softmax8(scores + h * keys_stride, visible);
  bundle_values<kHeads>(head, scores, keys_stride, v, a.kv_row_stride, visible, sums, out);
}

BP_AVX2_FLOAT void run_kv_head_avx2(void* data, size_t index) {
  const Task task(*static_cast<const Attention*>(data), index);
  const Attention& a = task.a;
  const int64_t d = a.head_dim, vectors = (d + 7) / 8, last_head = task.first_head + task.group;
  const Head head{d, vectors, lanes8(d - (vectors - 1) * 8)};
  const Scratch s = scratch_for(a, kBundle, 8);
  for (int64_t r = 0; r < a.q_len; ++r) {
    const int64_t visible = task.visible(r);
    for (int64_t h = task.first_head; h < last_head; h += kBundle) {
      const float* q = task.query(r, h);
      float* out = task.out(r, h);
      const int64_t heads = std::min<int64_t>(kBundle, last_head - h);
      if (heads == 4) run_bundle<4>(a, head, q, task.k, task.v, visible, s.scores, s.keys_stride, s.sums, out);
      if (heads == 3) run_bundle<3>(a, head, q, task.k, task.v, visible, s.scores, s.keys_stride, s.sums, out);
      if (heads == 2) run_bundle<2>(a, head, q, task.k, task.v, visible, s.scores, s.keys_stride, s.sums, out);
      if (heads == 1) run_bundle<1>(a, head, q, task.k, task.v, visible, s.scores, s.keys_stride, s.sums, out);
    }
  }
}

}  // namespace

bool attention_float(const Attention& a, bool avx512, ParallelFor run, void* context) {
  const bool cpu_has = avx512 ? cpu().avx512_vnni : cpu().avx2;
  if (!cpu_has || a.head_dim < 1 || a.kv_heads < 1 || a.heads % a.kv_heads || a.key_padding || a.bias) return false;
  run(context, avx512 ? run_kv_head_avx512 : run_kv_head_avx2, static_cast<size_t>(a.batch * a.kv_heads),
      const_cast<Attention*>(&a));
  return true;
}

}  // namespace bp

#else

namespace bp {
bool attention_float(const Attention&, bool, ParallelFor, void*) { return false; }
}  // namespace bp

#endif
