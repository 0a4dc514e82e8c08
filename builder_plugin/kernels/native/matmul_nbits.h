// One MatMulNBits product, as onnxruntime's contrib op defines it: Y[M, N] = A[M, K] x dequant(B)^T (+ bias), where
// B holds N columns of ceil(K / block) blocks of `bits`-bit unsigned codes (low bits first), each block with one float
// scale and a zero point (default 2^(bits - 1)).
#pragma once

#include <cstddef>
#include <cstdint>

namespace bp {

struct Weights {
  int64_t n = 0, k = 0, bits = 4, block = 32;
  const uint8_t* packed = nullptr;  // [n, blocks, block * bits / 8]
  const float* scales = nullptr;    // [n, blocks]
  const uint8_t* zero_points = nullptr;  // [n, ceil(blocks * bits / 8)], codes packed like the weights; or null
  const int32_t* g_idx = nullptr;   // [k] block of each row of B, or null (row / block)
  const float* bias = nullptr;      // [n] or null

  int64_t blocks() const { return (k + block - 1) / block; }
  int64_t block_bytes() const { return block * bits / 8; }
  int64_t column_bytes() const { return blocks() * block_bytes(); }
  int64_t zero_point_columns() const { return (blocks() * bits + 7) / 8; }
  // the code of column n at row r and its zero point (what the reference path and the tests read)
  int code(int64_t n, int64_t r) const;
  // column col's zero points (zero_point_columns() bytes), or null where B has none
  const uint8_t* zero_point_row(int64_t col) const {
    return zero_points == nullptr ? nullptr : zero_points + col * zero_point_columns();
  }
  // inline: the int8 panels read one per column and block at every call
  int zero_point(int64_t col, int64_t blk) const {
    if (zero_points == nullptr) return 1 << (bits - 1);
    const int64_t bit = blk * bits;
    const uint8_t* base = zero_point_row(col);
    uint32_t word = base[bit / 8];
    if (bit % 8 + bits > 8) word |= static_cast<uint32_t>(base[bit / 8 + 1]) << 8;
    return static_cast<int>((word >> (bit % 8)) & ((1u << bits) - 1));
  }
};

// Runs fn(data, i) for i in [0, total) on the session's intra-op threads (the caller's among them).
using ParallelFor = void (*)(void* context, void (*fn)(void*, size_t), size_t total, void* data);

// The float path any CPU runs: B dequantized, products and sums in float (double for the sum of one block). Any
// bits from 2 to 8, g_idx.
void matmul_reference(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context);

// The int8 path (accuracy_level 4): A quantized per row and block to int8 (scale = max|a| / 127, round to nearest
// even), block products in exact integers, scaled in float. bits 4 or 8, block >= 16, no g_idx. False when the CPU
// lacks AVX-512 VNNI (nothing is written then).
bool matmul_int8_avx512(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context);

// The same numbers as matmul_int8_avx512 (the same activation quantization and exact block sums), the block products
// on AMX tiles (TDPBUSD: 16 columns x up to 16 rows per instruction). False without AMX (nothing is written then).
bool matmul_int8_amx(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context);

// Many rows (a prompt): B unpacked once per call, panel by panel, to bf16 tiles (dequantized values), A converted to
// bf16, float sums over the whole of K on AMX (TDPBF16PS). bits 4 or 8, block >= 16, no g_idx. False without AMX
// bf16 (nothing is written then).
bool matmul_bf16_amx(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context);

// Many rows (a prompt) without AMX: the same numbers as matmul_int8_avx512, B unpacked once per call, panel by panel,
// to unsigned int8 codes in vpdpbusd's operand layout, products on register tiles of 4 rows x 48 columns. bits 4 or 8,
// block >= 16, no g_idx. False without AVX-512 VNNI (nothing is written then).
bool matmul_int8_panels(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context);

// Few rows on a CPU with AVX2 and FMA (no AVX-512 needed): the numbers of matmul_int8_avx512 (the same activation
// quantization, exact integer sums of the codes' products; the zero points' share subtracted in float), B read where
// it lies, one column at a time. bits 4 or 8, blocks of 32 to 256, no g_idx. False otherwise (nothing is written
// then).
bool matmul_int8_avx2(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context);

// Many rows on a CPU with AVX2 and FMA: the same numbers again (the zero points' share in exact integers here), B
// unpacked once per call, panel by panel, to unsigned 4-bit codes (8 bits: their low and high nibbles), products on
// vpmaddubsw. bits 4 or 8, block >= 16, no g_idx. False otherwise (nothing is written then).
bool matmul_int8_panels_avx2(const Weights& w, const float* a, int64_t m, float* y, ParallelFor run, void* context);

struct Cpu {
  bool avx2 = false;         // AVX2 and FMA, with the OS saving their registers
  bool avx512_vnni = false;  // AVX-512 F/BW/VL/DQ and VNNI, with the OS saving their registers
  bool amx_int8 = false;     // AMX tiles and int8, the OS saving them and granting this process their use
  bool amx_bf16 = false;     // AMX tiles and bf16 (and AVX-512 BF16 conversions), likewise
  bool avx512_bf16 = false;  // AVX-512 VNNI and BF16 (conversions and dot products): the attention without AMX
  bool one_stream = false;   // an AMD CPU: the few-rows path reads B one column at a time (kernel_avx512.cc)
};
const Cpu& cpu();

}  // namespace bp
