// What the library's custom operators share: the trace switch, attributes and node names read at kernel creation,
// inputs and shapes read at compute, onnxruntime's thread pool as a ParallelFor, and the OrtCustomOp callbacks every
// op answers alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "matmul_nbits.h"
#include "ort_abi.h"

namespace bp::op {

constexpr const char* kLibrary = "builder_plugin ops";

// BUILDER_PLUGIN_OPS_TRACE=1: one line per kernel made (at session load) naming the path it takes.
bool trace();

// An attribute of the node: false where the node lacks it (`value` untouched), or the value / `fallback`.
bool has_attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, int64_t* value);
bool has_attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, float* value);
int64_t attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, int64_t fallback);
float attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, float fallback);
std::string node_name(const ort::Api& api, const OrtKernelInfo* info);

// An input's data (null where it is absent) and its dimensions (empty where it is absent).
const void* input_data(const ort::Api& api, OrtKernelContext* context, size_t index);
OrtStatus* input_dims(const ort::Api& api, OrtKernelContext* context, size_t index, std::vector<int64_t>& dims);

// The session's intra-op threads, through KernelContext_ParallelFor (`data`: a Context).
struct Context {
  const ort::Api* api;
  OrtKernelContext* context;
};
void parallel_for(void* data, void (*fn)(void*, size_t), size_t total, void* job);

// The OrtCustomOp of a CPU kernel with these callbacks (the rest answered alike for every op).
OrtCustomOp custom_op(const char* (*name)(const OrtCustomOp*), size_t (*inputs)(const OrtCustomOp*),
                      OrtElementType (*input_type)(const OrtCustomOp*, size_t),
                      OrtCustomOpCharacteristic (*input_characteristic)(const OrtCustomOp*, size_t),
                      size_t (*outputs)(const OrtCustomOp*),
                      OrtCustomOpCharacteristic (*output_characteristic)(const OrtCustomOp*, size_t),
                      OrtStatus* (*create)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**),
                      OrtStatus* (*compute)(void*, OrtKernelContext*), void (*destroy)(void*));

// Where the attention kernels below run (ops.cc decides, from the CPU and BUILDER_PLUGIN_OPS_PATH as it is when a
// session registers the library or makes a kernel): on AMX bf16 tiles, on AVX-512 BF16 dot products (a CPU without
// AMX), or nowhere (onnxruntime's own kernels: no bf16, or a forced int8 path). Its name for the trace: "bf16 AMX",
// "bf16 AVX-512" or "".
enum class AttentionPath { kNone, kAvx512Bf16, kAmx };
AttentionPath attention_path();
const char* attention_path_name(AttentionPath path);

// Where a decode step's attention (GroupQueryAttention with fewer than 16 new tokens) runs, in float: on AVX-512 (a
// CPU with AVX-512 VNNI, unless BUILDER_PLUGIN_OPS_PATH=avx2), else on AVX2 and FMA, which every CPU the library
// registers on has. Its name for the trace: "float AVX-512" or "float AVX2".
enum class StepPath { kAvx512, kAvx2 };
StepPath step_path();
const char* step_path_name(StepPath path);

// The com.microsoft MultiHeadAttention kernel of the encoders (op_attention.cc).
const OrtCustomOp& multi_head_attention();
// The com.microsoft GroupQueryAttention kernel of the decoders: their prompts and steps (op_group_query_attention.cc).
const OrtCustomOp& group_query_attention();

}  // namespace bp::op
