// What the AVX-512 paths share: a 16 x 16 transpose of 32-bit values and lane masks, under the AVX-512 base target
// (so they inline into every path's functions, whose targets add to it).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define BP_AVX512_BASE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace bp {

// 16 x 16 32-bit values: rows become columns.
BP_AVX512_BASE inline void transpose16(__m512i r[16]) {
  __m512i a[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], lane L: column 4L + c of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), y = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i x2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i y2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    a[c] = _mm512_shuffle_i32x4(x, x2, 0x88);
    a[8 + c] = _mm512_shuffle_i32x4(x, x2, 0xdd);
    a[4 + c] = _mm512_shuffle_i32x4(y, y2, 0x88);
    a[12 + c] = _mm512_shuffle_i32x4(y, y2, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = a[i];
}

// The first `count` of 16 lanes (none for count <= 0).
BP_AVX512_BASE inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(count, 0)) - 1);
}

// exp(x) for x <= 0 (scores less their row's maximum), on every path: x floored at kExpFloor (0 below it, as float's
// exp, nearly), n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts: |r| <= ln2 / 2), then 2^n x the degree-6
// polynomial of r with kExpTerms by Horner's rule, highest degree first (relative error below 2e-7).
constexpr float kExpFloor = -87.0f, kLog2e = 1.44269504f, kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;
constexpr float kExpTerms[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

BP_AVX512_BASE inline __m512 exp_negative(__m512 x) {
  const __m512 floor = _mm512_set1_ps(kExpFloor);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_setzero_ps();
  for (float term : kExpTerms) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(term));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

}  // namespace bp

#endif
