// Multi-head attention without a cache (the encoders' com.microsoft MultiHeadAttention): out = softmax(scale x Q K^T
// + bias + mask) V per batch row and head, Q, K, V and out as [batch, sequence, heads x head_dim].
#pragma once

#include <cstdint>

#include "matmul_nbits.h"

namespace bp {

struct Attention {
  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, head_dim = 0;
  const float* q = nullptr;  // [batch, q_len, heads * head_dim]
  const float* k = nullptr;  // [batch, kv_len, heads * head_dim]
  const float* v = nullptr;
  const int32_t* key_padding = nullptr;  // [batch, kv_len]: 0 masks the key out (mask_value added), or null
  const float* bias = nullptr;           // [batch or 1, heads or 1, q_len, kv_len] added to the scores, or null
  int64_t bias_batch_stride = 0, bias_head_stride = 0;  // 0 where the bias broadcasts
  float scale = 1.0f, mask_value = -10000.0f;
  float* out = nullptr;  // [batch, q_len, heads * head_dim]
};

// On AMX bf16 tiles: Q (scaled), K, V and the probabilities rounded to bf16, scores, softmax and sums in float.
// head_dim up to 256. False without AMX bf16 (nothing is written then).
bool attention_bf16_amx(const Attention& a, ParallelFor run, void* context);

}  // namespace bp
