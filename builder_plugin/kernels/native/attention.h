// Multi-head attention over K and V already in memory: out = softmax(scale x Q K^T + bias + mask) V per batch row and
// query head, the form of the encoders' com.microsoft MultiHeadAttention (no cache) and of the decoder's
// GroupQueryAttention on a prompt (causal, several query heads per K/V head, K and V in the cache).
#pragma once

#include <cstdint>

#include "matmul_nbits.h"

namespace bp {

struct Attention {
  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, head_dim = 0;
  int64_t kv_heads = 0;  // heads of K and V: query head h reads K/V head h / (heads / kv_heads)
  // Q [batch, q_len, rows of q_row_stride floats, head h at h x head_dim]; K and V: key t of K/V head g of batch row
  // b at b x kv_batch_stride + g x kv_head_stride + t x kv_row_stride (in floats)
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t q_row_stride = 0, kv_row_stride = 0, kv_head_stride = 0, kv_batch_stride = 0;
  // >= 0: causal, query row r sees keys [0, causal_past + r] (the keys before the prompt and its own up to r)
  int64_t causal_past = -1;
  const int32_t* key_padding = nullptr;  // [batch, kv_len]: 0 masks the key out (mask_value added), or null
  const float* bias = nullptr;           // [batch or 1, heads or 1, q_len, kv_len] added to the scores, or null
  int64_t bias_batch_stride = 0, bias_head_stride = 0;  // 0 where the bias broadcasts
  float scale = 1.0f, mask_value = -10000.0f;
  float* out = nullptr;  // [batch, q_len, heads * head_dim]
};

// The layout of K and V as [batch, kv_len, heads x head_dim] (the encoders'): sets kv_heads and the strides.
void packed_rows(Attention& a);

constexpr int64_t kMaxAttentionHeadDim = 256;

// Q (scaled), K, V and the probabilities rounded to bf16, scores, softmax and sums in float: on AMX bf16 tiles
// (`tiles`), or on AVX-512 BF16 dot products. head_dim up to kMaxAttentionHeadDim. False where the CPU lacks the one
// asked for (nothing is written then).
bool attention_bf16(const Attention& a, bool tiles, ParallelFor run, void* context);

// The same in float for a few query rows (a decode step reads each key and value row once per K/V head), on AVX-512
// (`avx512`) or on AVX2 and FMA. No key padding or bias. False where the CPU lacks the one asked for (nothing is
// written then).
bool attention_float(const Attention& a, bool avx512, ParallelFor run, void* context);

}  // namespace bp
