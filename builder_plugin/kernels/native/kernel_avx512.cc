// The int8 path on AVX-512 VNNI, reading B in its stored MatMulNBits layout (no prepacked form).
//
// A's rows are quantized per block of K to int8. B is read 64 bytes (a "chunk") of one column at a time: for 4 bits
// the low nibbles of a chunk hold 64 even-numbered rows of K and the high nibbles the odd ones, so A is kept split into
// its even and odd elements and each nibble plane meets its half with one vpdpbusd (unsigned codes x signed
// activations). Each 32-bit lane of a chunk lies inside one block, so a lane's integer sum is exact and gets its
// block's scales when it is converted to float. The zero point's share (sum (code - zp) a = sum code a - zp sum a):
// the default one starts each lane's sum (-zp x the lane's activation sum); stored ones are taken off per column after
// its chunks (sum over blocks of zp x both scales x the block's activation sum). Columns are split over onnxruntime's
// intra-op threads.
#include "matmul_nbits.h"
#include "quantize.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>

#define BP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2,bmi2")))

namespace bp {
namespace {

constexpr int kChunk = 64;    // bytes of a column read at once
constexpr int kLanes = 16;    // 32-bit lanes of a chunk
constexpr int kRowGroup = 8;  // rows sharing each chunk of B in the inner loop
// Bytes of a column prefetched ahead of its loads: 512 where a tile reads several columns (measured on a Xeon), 2 KB
// where it reads one (an AMD CPU's few rows, one stream per thread; 16 full-size 4-bit layers with zero points on a
// Zen 4, against 512: one row 2 % faster, four rows 11 %; 1 KB and 4 KB within 1 % of 2 KB).
template <int NR>
constexpr int kPrefetchAhead = NR == 1 ? 2048 : 512;

// How the chunks of one column map to blocks.
struct Layout {
  int bits = 4, block = 32, block_bytes = 16;
  int64_t blocks = 0, column_bytes = 0, chunks = 0, zero_point_columns = 0;
  int blocks_per_chunk = 0;  // 0: every chunk lies inside one block
  int block_shift = 0;       // log2(block_bytes)
  uint64_t tail = ~0ull;     // byte mask of the last chunk
  alignas(64) int32_t lane_block[kLanes] = {};  // lane -> block within its chunk

  explicit Layout(const Weights& w) {
    bits = static_cast<int>(w.bits);
    block = static_cast<int>(w.block);
    block_bytes = block * bits / 8;
    blocks = w.blocks();
    column_bytes = w.column_bytes();
    chunks = (column_bytes + kChunk - 1) / kChunk;
    zero_point_columns = w.zero_point_columns();
    const int64_t rest = column_bytes % kChunk;
    tail = rest ? (1ull << rest) - 1 : ~0ull;
    blocks_per_chunk = block_bytes < kChunk ? kChunk / block_bytes : 0;
    while ((1 << block_shift) < block_bytes) ++block_shift;
    for (int lane = 0; lane < kLanes; ++lane) {
      lane_block[lane] = blocks_per_chunk ? lane * 4 / block_bytes : 0;
    }
  }
  // elements of K one chunk covers
  int64_t chunk_elements() const { return kChunk * 8 / bits; }
};

// A's rows quantized: per row and chunk, the int8 operands of the chunk's vpdpbusd (4 bits: even then odd elements),
// the lanes' activation scales, and without zero points in B the lanes' activation sums times minus the default zero
// point (the lanes' sums then start from it). With zero points, their share is taken off per column after the chunks:
// sum over blocks of zp x weight scale x (activation scale x the block's sum of codes), the last factor per row here.
struct Activations {
  int64_t rows = 0, chunks = 0, planes = 1, blocks = 0;
  Buffer q, scale, offset;
  Buffer terms;  // B with zero points: per row and block, the activation scale x the block's sum of codes
  const float* row_terms(int64_t row) const { return static_cast<const float*>(terms.get()) + row * blocks; }
  const int8_t* operand(int64_t row, int64_t chunk, int plane) const {
    return static_cast<const int8_t*>(q.get()) + ((row * chunks + chunk) * planes + plane) * kChunk;
  }
  const float* lane_scale(int64_t row, int64_t chunk) const {
    return static_cast<const float*>(scale.get()) + (row * chunks + chunk) * kLanes;
  }
  const int32_t* lane_offset(int64_t row, int64_t chunk) const {
    return static_cast<const int32_t*>(offset.get()) + (row * chunks + chunk) * kLanes;
  }
};

}  // namespace

BP_AVX512 bool quantize_rows(const float* a, int64_t k, int64_t block, int64_t padded, int64_t rows,
                             QuantizedRows& out) {
  out.rows = rows;
  out.padded = padded;
  out.blocks = (k + block - 1) / block;
  out.codes = aligned_buffer(static_cast<size_t>(rows * padded));
  out.scales = aligned_buffer(static_cast<size_t>(rows * out.blocks * 4 + 64));
  auto* codes = static_cast<int8_t*>(out.codes.get());
  auto* scales = static_cast<float*>(out.scales.get());
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t row = 0; row < rows; ++row) {
    const float* x = a + row * k;
    int8_t* q = codes + row * padded;
    std::memset(q, 0, static_cast<size_t>(padded));
    for (int64_t b = 0; b < out.blocks; ++b) {
      const int64_t start = b * block, end = std::min<int64_t>(k, start + block);
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = start; i < end; i += 16) {
        const __mmask16 m = end - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (end - i)) - 1);
        amax = _mm512_max_ps(amax, _mm512_and_ps(_mm512_maskz_loadu_ps(m, x + i), abs_mask));
      }
      const float top = _mm512_reduce_max_ps(amax);
      scales[row * out.blocks + b] = top / 127.0f;
      const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      for (int64_t i = start; i < end; i += 16) {
        const __mmask16 m = end - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (end - i)) - 1);
        const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv), lo), hi);
        _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));  // nearest, ties to even
      }
    }
  }
  return true;
}

namespace {

// The chunk operands of the VNNI tiles from the quantized rows.
BP_AVX512 void arrange_rows(const Layout& lay, const QuantizedRows& plain, bool zero_points, Activations& act) {
  const int64_t rows = plain.rows;
  act.rows = rows;
  act.chunks = lay.chunks;
  act.planes = lay.bits == 4 ? 2 : 1;
  act.q = aligned_buffer(static_cast<size_t>(rows * lay.chunks * act.planes * kChunk));
  act.scale = aligned_buffer(static_cast<size_t>(rows * lay.chunks * kLanes * 4));
  act.offset = aligned_buffer(static_cast<size_t>(rows * lay.chunks * kLanes * 4));
  auto* q_all = static_cast<int8_t*>(act.q.get());
  auto* scale_all = static_cast<float*>(act.scale.get());
  auto* offset_all = static_cast<int32_t*>(act.offset.get());
  const int default_zp = 1 << (lay.bits - 1);
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i factor = _mm512_set1_epi32(zero_points ? 0 : -default_zp);
  act.blocks = lay.blocks;
  if (zero_points) {
    act.terms = aligned_buffer(static_cast<size_t>(rows * lay.blocks * 4 + 64));
    auto* terms = static_cast<float*>(act.terms.get());
    const int64_t block = lay.block;
    for (int64_t row = 0; row < rows; ++row) {
      const int8_t* q = plain.row(row);
      for (int64_t b = 0; b < lay.blocks; ++b) {
        int32_t total = 0;
        for (int64_t i = b * block; i < (b + 1) * block; ++i) total += q[i];
        terms[row * lay.blocks + b] = plain.row_scales(row)[b] * static_cast<float>(total);
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int8_t* plain_row = plain.row(row);
    const float* block_scales = plain.row_scales(row);
    for (int64_t c = 0; c < lay.chunks; ++c) {
      int8_t* dst = q_all + (row * lay.chunks + c) * act.planes * kChunk;
      __m512i sums;
      if (lay.bits == 4) {  // 128 elements: the low bytes of their 16-bit pairs are the even ones
        const __m512i first = _mm512_loadu_si512(plain_row + c * 128);
        const __m512i second = _mm512_loadu_si512(plain_row + c * 128 + 64);
        const __m512i even = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(first)),
                                                _mm512_cvtepi16_epi8(second), 1);
        const __m512i odd = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(first, 8))),
            _mm512_cvtepi16_epi8(_mm512_srai_epi16(second, 8)), 1);
        _mm512_store_si512(dst, even);
        _mm512_store_si512(dst + kChunk, odd);
        sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, even), ones, odd);
      } else {
        const __m512i v = _mm512_loadu_si512(plain_row + c * 64);
        _mm512_store_si512(dst, v);
        sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, v);
      }
      _mm512_store_si512(offset_all + (row * lay.chunks + c) * kLanes, _mm512_mullo_epi32(sums, factor));
      float* lane_scale = scale_all + (row * lay.chunks + c) * kLanes;
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t b = (c * kChunk + lane * 4) >> lay.block_shift;
        lane_scale[lane] = b < lay.blocks ? block_scales[b] : 0.0f;
      }
    }
  }
}

// Rows [row0, row0 + MR) x columns [col, col + NR) over all of K.
template <int BITS, int MR, int NR, bool ZP>
BP_AVX512 void tile(const Layout& lay, const Weights& w, const Activations& act, int64_t row0, int64_t col,
                    float* y, int64_t ldy) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i lane_block = _mm512_load_si512(lay.lane_block);
  const uint8_t* base[NR];
  const float* scales[NR];
  const uint8_t* zps[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    base[j] = w.packed + (col + j) * lay.column_bytes;
    scales[j] = w.scales + (col + j) * lay.blocks;
    zps[j] = ZP ? w.zero_points + (col + j) * lay.zero_point_columns : nullptr;
  }
  for (int64_t c = 0; c < lay.chunks; ++c) {
    const __mmask64 mask = c + 1 == lay.chunks ? lay.tail : ~0ull;
    __m512i plane0[NR], plane1[NR];
    __m512 sw[NR];
    const int64_t first = c * lay.blocks_per_chunk;
    const int64_t count = std::min<int64_t>(lay.blocks_per_chunk, lay.blocks - first);
    const __mmask16 bmask = static_cast<__mmask16>((1u << count) - 1);
    const int64_t whole = (c * kChunk) >> lay.block_shift;  // the block of a chunk inside one
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      // a few chunks ahead of the loads (measured: ~20 % on the decode shapes over the hardware prefetchers alone);
      // a prefetch past the column's end is harmless
      _mm_prefetch(reinterpret_cast<const char*>(base[j] + c * kChunk + kPrefetchAhead<NR>), _MM_HINT_T0);
      const __m512i v = _mm512_maskz_loadu_epi8(mask, base[j] + c * kChunk);
      if (BITS == 4) {
        plane0[j] = _mm512_and_si512(v, low);
        plane1[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      } else {
        plane0[j] = v;
      }
      if (lay.blocks_per_chunk) {
        sw[j] = _mm512_permutexvar_ps(lane_block, _mm512_maskz_loadu_ps(bmask, scales[j] + first));
      } else {
        sw[j] = _mm512_set1_ps(scales[j][whole]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const int64_t row = row0 + m;
      const __m512 sa = _mm512_load_ps(act.lane_scale(row, c));
      const __m512i offset = ZP ? _mm512_setzero_si512() : _mm512_load_si512(act.lane_offset(row, c));
      const __m512i x0 = _mm512_load_si512(act.operand(row, c, 0));
      const __m512i x1 = BITS == 4 ? _mm512_load_si512(act.operand(row, c, 1)) : x0;
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m512i sum = _mm512_dpbusd_epi32(offset, plane0[j], x0);
        if (BITS == 4) sum = _mm512_dpbusd_epi32(sum, plane1[j], x1);
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sw[j], sa), acc[m][j]);
      }
    }
  }
  float taken[MR][NR] = {};
  if (ZP) {  // sum over blocks of zp x weight scale x the row's term, 16 blocks at a time
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i halves = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i nibble = _mm512_set1_epi32(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      __m512 share[MR];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) share[m] = _mm512_setzero_ps();
      for (int64_t b = 0; b < lay.blocks; b += 16) {
        const int64_t n = std::min<int64_t>(16, lay.blocks - b);
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
        __m512i codes;
        if (BITS == 4) {
          const __mmask16 bytes = static_cast<__mmask16>((1u << ((n + 1) / 2)) - 1);
          codes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes, zps[j] + b / 2));
          codes = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(pairs, codes), halves), nibble);
        } else {
          codes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, zps[j] + b));
        }
        const __m512 weight = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, scales[j] + b), _mm512_cvtepi32_ps(codes));
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m)
          share[m] = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(mask, act.row_terms(row0 + m) + b), share[m]);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) taken[m][j] = _mm512_reduce_add_ps(share[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      y[(row0 + m) * ldy + col + j] =
          _mm512_reduce_add_ps(acc[m][j]) - taken[m][j] + (w.bias ? w.bias[col + j] : 0.0f);
}

using TileFn = void (*)(const Layout&, const Weights&, const Activations&, int64_t, int64_t, float*, int64_t);

// Few rows, on an AMD CPU: one column at a time, so that each thread reads B as one sequential stream (four columns at
// a time are four streams 1.5-4 KB apart, which a Zen 4's prefetchers follow badly: one row took 1.3-1.5x
// onnxruntime's time there, one column 0.8x). Elsewhere four columns (one load of a chunk's activations serves four;
// measured on a Xeon: 76 % of the read bound). More rows: two, so that the accumulators stay in registers.
int columns_for(int rows) {
  if (rows > 4) return 2;
  return cpu().one_stream ? 1 : 4;
}

template <int BITS, bool ZP, int NR>
TileFn pick_rows(int rows) {
  switch (rows) {
    case 1: return tile<BITS, 1, NR, ZP>;
    case 2: return tile<BITS, 2, NR, ZP>;
    case 3: return tile<BITS, 3, NR, ZP>;
    case 4: return tile<BITS, 4, NR, ZP>;
    case 5: return tile<BITS, 5, NR, ZP>;
    case 6: return tile<BITS, 6, NR, ZP>;
    case 7: return tile<BITS, 7, NR, ZP>;
    default: return tile<BITS, 8, NR, ZP>;
  }
}

template <int BITS, bool ZP>
TileFn pick_columns(int rows, int columns) {
  if (columns == 4) return pick_rows<BITS, ZP, 4>(rows);
  if (columns == 2) return pick_rows<BITS, ZP, 2>(rows);
  return pick_rows<BITS, ZP, 1>(rows);
}

TileFn pick(int bits, bool zp, int rows, int columns) {
  if (bits == 4) return zp ? pick_columns<4, true>(rows, columns) : pick_columns<4, false>(rows, columns);
  return zp ? pick_columns<8, true>(rows, columns) : pick_columns<8, false>(rows, columns);
}

struct Job {
  const Layout* lay;
  const Weights* w;
  const Activations* act;
  float* y;
  int64_t rows, row_block, column_tile, column_tiles;
};

// One task: a block of rows x a tile of columns; column pairs outermost so a pair's chunks stay in L1 while each
// group of rows meets them.
void run_task(void* data, size_t index) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t row_start = static_cast<int64_t>(index) / job.column_tiles * job.row_block;
  const int64_t col_start = static_cast<int64_t>(index) % job.column_tiles * job.column_tile;
  const int64_t row_end = std::min(job.rows, row_start + job.row_block);
  const int64_t col_end = std::min(job.w->n, col_start + job.column_tile);
  const bool zp = job.w->zero_points != nullptr;
  const int group = static_cast<int>(std::min<int64_t>(kRowGroup, row_end - row_start));
  const int step = columns_for(group);
  for (int64_t col = col_start; col < col_end;) {
    const int columns = col + step <= col_end ? step : 1;
    for (int64_t row = row_start; row < row_end; row += kRowGroup) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowGroup, row_end - row));
      pick(job.lay->bits, zp, rows, columns)(*job.lay, *job.w, *job.act, row, col, job.y, job.w->n);
    }
    col += columns;
  }
}

}  // namespace

bool matmul_int8_avx512(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context) {
  if (!cpu().avx512_vnni || (w.bits != 4 && w.bits != 8) || w.block < 16 || w.g_idx != nullptr) return false;
  const Layout lay(w);
  QuantizedRows plain;
  quantize_rows(a, w.k, w.block, lay.chunks * lay.chunk_elements(), m, plain);
  Activations act;
  arrange_rows(lay, plain, w.zero_points != nullptr, act);
  Job job{&lay, &w, &act, y, m, 0, 0, 0};
  // Few rows: tiles of columns only (each thread streams its own columns once). Many rows: blocks of rows whose
  // quantized activations stay in L2 while a tile of columns is read once per block.
  job.row_block = m <= kRowGroup ? m : 64;
  job.column_tile = 32;
  job.column_tiles = (w.n + job.column_tile - 1) / job.column_tile;
  const int64_t row_blocks = (m + job.row_block - 1) / job.row_block;
  run(context, run_task, static_cast<size_t>(row_blocks * job.column_tiles), &job);
  return true;
}

}  // namespace bp

#else

namespace bp {
bool quantize_rows(const float*, int64_t, int64_t, int64_t, int64_t, QuantizedRows&) { return false; }
bool matmul_int8_avx512(const Weights&, const float*, int64_t, float*, ParallelFor, void*) { return false; }
}  // namespace bp

#endif
