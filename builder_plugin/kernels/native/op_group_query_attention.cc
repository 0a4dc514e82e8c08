// com.microsoft GroupQueryAttention: a prompt's attention (16 or more new tokens) on attention.h's bf16 paths where the
// CPU has AMX bf16 or AVX-512 BF16, a decode step (fewer new tokens) in float on AVX-512 or AVX2 on every CPU the
// library registers on, every other form (and prompts elsewhere) through onnxruntime's own kernel, run from here
// (CreateOp / InvokeOp), so that the routing's mode record and any form the library does not take answer exactly as
// without it. onnxruntime's kernel took 0.4 ms a layer for a decode step past a 512-token prompt at full size (2
// cores), about three times the time of reading the layer's cache.
//
// The library's paths take the form the builder's decoders and onnxruntime-genai give it: batch 1, Q, K and V packed in
// the query, rotary embedding from the cos/sin caches (not interleaved; over the first 2 x their width of each head,
// the rest as it is: Phi-4-mini turns 96 of 128), past and present sharing one buffer (genai_config's
// past_present_share_buffer), no padding (seqlens_k + 1 = total_sequence_length), no softcap, local window, smooth
// softmax, position ids, attention bias, head sink or qk output. It rotates Q and the new K at positions past .. past
// + S - 1 (past = total - S, onnxruntime's rule), writes K and V into the cache there, then runs causal attention of
// the S queries over the total keys.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "attention.h"
#include "op_common.h"
#include "quantize.h"

namespace bp::op {
namespace {

enum Input {
  kQuery = 0, kKey, kValue, kPastKey, kPastValue, kSeqlensK, kTotalSequenceLength, kCosCache, kSinCache,
  kPositionIds, kAttentionBias, kHeadSink, kInputs
};
constexpr OrtElementType kInputTypes[kInputs] = {ORT_FLOAT, ORT_FLOAT, ORT_FLOAT, ORT_FLOAT, ORT_FLOAT, ORT_INT32,
                                                  ORT_INT32, ORT_FLOAT, ORT_FLOAT, ORT_INT64, ORT_FLOAT, ORT_FLOAT};
enum Output { kOutput = 0, kPresentKey, kPresentValue, kOutputQk, kOutputs };  // output_qk: refused

// New tokens from which the bf16 paths run (fewer: a decode step or a few speculative tokens, the float path).
constexpr int64_t kFromTokens = 16;

// The attributes onnxruntime's GroupQueryAttention reads, passed on to it as the node has them.
constexpr const char* kIntAttributes[] = {"num_heads", "kv_num_heads", "local_window_size", "do_rotary",
                                          "rotary_interleaved", "smooth_softmax", "qk_output"};
constexpr const char* kFloatAttributes[] = {"scale", "softcap", "mask_filter_value"};

struct Kernel {
  ort::Api api;
  std::string name;
  int64_t heads = 0, kv_heads = 0, local_window = -1, do_rotary = 0, interleaved = 0, smooth_softmax = 0;
  float scale = 0.0f, softcap = 0.0f;
  size_t inputs = 0, outputs = 0;
  OrtOp* native = nullptr;  // onnxruntime's kernel for this node
  bool form = false;        // the node's attributes allow the library's paths
  // where prompts and steps run, as the session found it when it made the kernel (prompts: kNone, onnxruntime's)
  AttentionPath path = AttentionPath::kNone;
  StepPath step = StepPath::kAvx2;
  // BUILDER_PLUGIN_OPS_TRACE: a line at the first prompt on the tiles, and at the first one left to onnxruntime
  mutable std::atomic<bool> told_tiles{false}, told_native{false};
};

void tell(const Kernel& kernel, std::atomic<bool>& told, int64_t tokens, const char* path) {
  if (trace() && !told.exchange(true))
    std::fprintf(stderr, "%s: GroupQueryAttention %s: a prompt of %lld new tokens %s\n", kLibrary,
                 kernel.name.c_str(), static_cast<long long>(tokens), path);
}

// onnxruntime's GroupQueryAttention with the node's attributes.
OrtStatus* make_native(Kernel& kernel, const OrtKernelInfo* info) {
  const ort::Api& api = kernel.api;
  std::vector<OrtOpAttr*> attrs;
  OrtStatus* status = nullptr;
  for (const char* name : kIntAttributes) {
    int64_t value = 0;
    OrtOpAttr* attr = nullptr;
    if (!has_attribute(api, info, name, &value)) continue;
    // onnxruntime has read an int here, and reads an int64 now: little-endian, the int64 serves both
    if ((status = api.CreateOpAttr(name, &value, 1, ORT_OP_ATTR_INT, &attr))) break;
    attrs.push_back(attr);
  }
  for (const char* name : kFloatAttributes) {
    float value = 0.0f;
    OrtOpAttr* attr = nullptr;
    if (status || !has_attribute(api, info, name, &value)) continue;
    if ((status = api.CreateOpAttr(name, &value, 1, ORT_OP_ATTR_FLOAT, &attr))) break;
    attrs.push_back(attr);
  }
  if (status == nullptr) {
    const char* type_names[] = {"T", "M"};
    const OrtElementType type_values[] = {ORT_FLOAT, ORT_INT32};
    status = api.CreateOp(info, "GroupQueryAttention", "com.microsoft", 1, type_names, type_values, 2, attrs.data(),
                          static_cast<int>(attrs.size()), static_cast<int>(kernel.inputs),
                          static_cast<int>(kernel.outputs), &kernel.native);
  }
  for (OrtOpAttr* attr : attrs) api.ReleaseOpAttr(attr);
  return status;
}

OrtStatus* create(const OrtCustomOp*, const OrtApi* table, const OrtKernelInfo* info, void** out) {
  ort::Api api{table};
  auto* kernel = new (std::nothrow) Kernel{api};
  if (kernel == nullptr) return api.CreateStatus(ORT_FAIL, "GroupQueryAttention: out of memory");
  kernel->name = node_name(api, info);
  kernel->heads = attribute(api, info, "num_heads", int64_t{0});
  kernel->kv_heads = attribute(api, info, "kv_num_heads", int64_t{0});
  kernel->local_window = attribute(api, info, "local_window_size", int64_t{-1});
  kernel->do_rotary = attribute(api, info, "do_rotary", int64_t{0});
  kernel->interleaved = attribute(api, info, "rotary_interleaved", int64_t{0});
  kernel->smooth_softmax = attribute(api, info, "smooth_softmax", int64_t{0});
  kernel->scale = attribute(api, info, "scale", 0.0f);
  kernel->softcap = attribute(api, info, "softcap", 0.0f);
  OrtStatus* status = api.KernelInfo_GetInputCount(info, &kernel->inputs);
  if (status == nullptr) status = api.KernelInfo_GetOutputCount(info, &kernel->outputs);
  if (status == nullptr && kernel->outputs > kOutputQk) {
    const std::string message = "GroupQueryAttention " + kernel->name + ": the qk output is not supported by the "
                                "builder_plugin library's kernel (BUILDER_PLUGIN_KERNELS=0 runs onnxruntime's)";
    status = api.CreateStatus(ORT_INVALID_ARGUMENT, message.c_str());
  }
  if (status == nullptr) status = make_native(*kernel, info);
  if (status) {
    delete kernel;
    return status;
  }
  kernel->path = attention_path();
  kernel->step = step_path();
  kernel->form = kernel->heads > 0 && kernel->kv_heads > 0 && kernel->heads % kernel->kv_heads == 0 &&
                 kernel->do_rotary == 1 && kernel->interleaved == 0 && kernel->local_window < 0 &&
                 kernel->smooth_softmax == 0 && kernel->softcap == 0.0f;
  if (trace()) {
    const std::string prompts = kernel->path != AttentionPath::kNone
                                    ? std::string("the ") + attention_path_name(kernel->path) + " path"
                                    : std::string("onnxruntime's kernel");
    std::fprintf(stderr, "%s: GroupQueryAttention %s num_heads=%lld kv_num_heads=%lld: %s\n", kLibrary,
                 kernel->name.c_str(), static_cast<long long>(kernel->heads),
                 static_cast<long long>(kernel->kv_heads),
                 kernel->form ? (prompts + " for prompts, the " + step_path_name(kernel->step) +
                                 " path for fewer than 16 tokens").c_str()
                              : "onnxruntime's kernel");
  }
  *out = kernel;
  return nullptr;
}

// Rotary embedding of one head's row (not interleaved: dims j and j + half turn together, dims from 2 x half on stay),
// in place.
void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float first = x[j], second = x[j + half];
    x[j] = first * cos[j] - second * sin[j];
    x[j + half] = second * cos[j] + first * sin[j];
  }
}

struct Prompt {
  const float* query;  // [S, (heads + 2 kv_heads) x head_dim]
  const float* cos;
  const float* sin;    // [positions, head_dim / 2]
  float* q;            // [S, heads x head_dim]: Q rotated
  float* key;
  float* value;        // the cache, [kv_heads, buffer, head_dim]
  int64_t tokens, past, heads, kv_heads, head_dim, half, buffer;  // half: the width of a cos/sin row
};

// Token i of the prompt: Q rotated into `q`, K rotated and V written into the cache at position past + i.
void place_token(void* data, size_t index) {
  const Prompt& p = *static_cast<const Prompt*>(data);
  const int64_t i = static_cast<int64_t>(index), d = p.head_dim, half = p.half, position = p.past + i;
  const float* row = p.query + i * (p.heads + 2 * p.kv_heads) * d;
  const float* cos = p.cos + position * half;
  const float* sin = p.sin + position * half;
  float* q = p.q + i * p.heads * d;
  std::memcpy(q, row, static_cast<size_t>(p.heads * d) * sizeof(float));
  for (int64_t h = 0; h < p.heads; ++h) rotate(q + h * d, cos, sin, half);
  for (int64_t g = 0; g < p.kv_heads; ++g) {
    float* key = p.key + (g * p.buffer + position) * d;
    std::memcpy(key, row + (p.heads + g) * d, static_cast<size_t>(d) * sizeof(float));
    rotate(key, cos, sin, half);
    std::memcpy(p.value + (g * p.buffer + position) * d, row + (p.heads + p.kv_heads + g) * d,
                static_cast<size_t>(d) * sizeof(float));
  }
}

OrtStatus* get_output(const Kernel& kernel, OrtKernelContext* context, size_t index, std::vector<int64_t> dims,
                      OrtValue** out) {
  *out = nullptr;
  if (index >= kernel.outputs) return nullptr;
  return kernel.api.KernelContext_GetOutput(context, index, dims.data(), dims.size(), out);
}

// The outputs in the shapes onnxruntime's kernel gives them (its group_query_attention_helper): output [batch,
// sequence, heads x head_dim]; present [batch, kv_heads, max(total, past buffer), head_dim].
OrtStatus* outputs_as_native(const Kernel& kernel, OrtKernelContext* context, OrtValue* outputs[kOutputQk]) {
  const ort::Api& api = kernel.api;
  std::vector<int64_t> query, past;
  if (OrtStatus* status = input_dims(api, context, kQuery, query)) return status;
  if (OrtStatus* status = input_dims(api, context, kPastKey, past)) return status;
  const auto* total_length = static_cast<const int32_t*>(input_data(api, context, kTotalSequenceLength));
  if (query.size() != 3 || total_length == nullptr)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("GroupQueryAttention " + kernel.name +
                                                   ": query is not [batch, sequence, hidden] or "
                                                   "total_sequence_length is missing").c_str());
  const bool packed = input_data(api, context, kKey) == nullptr;
  const int64_t head_dim = query[2] / (packed ? kernel.heads + 2 * kernel.kv_heads : kernel.heads);
  const int64_t present = std::max<int64_t>(*total_length, past.size() == 4 ? past[2] : 0);
  if (OrtStatus* status = get_output(kernel, context, kOutput, {query[0], query[1], kernel.heads * head_dim},
                                     &outputs[kOutput]))
    return status;
  for (Output index : {kPresentKey, kPresentValue})
    if (OrtStatus* status = get_output(kernel, context, index, {query[0], kernel.kv_heads, present, head_dim},
                                       &outputs[index]))
      return status;
  return nullptr;
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* context) {
  const auto& kernel = *static_cast<const Kernel*>(op_kernel);
  const ort::Api& api = kernel.api;
  const OrtValue* inputs[kInputs] = {};
  for (size_t i = 0; i < kernel.inputs && i < kInputs; ++i)
    if (OrtStatus* status = api.KernelContext_GetInput(context, i, &inputs[i])) return status;
  auto native = [&](OrtValue* const* outputs) {
    return api.InvokeOp(context, kernel.native, inputs, static_cast<int>(std::min<size_t>(kernel.inputs, kInputs)),
                        outputs, static_cast<int>(kernel.outputs));
  };
  OrtValue* outputs[kOutputQk] = {};
  if (OrtStatus* status = outputs_as_native(kernel, context, outputs)) return status;
  std::vector<int64_t> query, past, cos, seqlens;
  if (OrtStatus* status = input_dims(api, context, kQuery, query)) return status;
  if (OrtStatus* status = input_dims(api, context, kPastKey, past)) return status;
  if (OrtStatus* status = input_dims(api, context, kCosCache, cos)) return status;
  if (OrtStatus* status = input_dims(api, context, kSeqlensK, seqlens)) return status;
  const int64_t new_tokens = query.size() == 3 ? query[1] : 0;
  const bool many = new_tokens >= kFromTokens;  // a prompt: the bf16 paths; else the float path
  // a form the library's paths take: a prompt where the CPU has bf16, a step anywhere
  bool ours = kernel.form && (!many || kernel.path != AttentionPath::kNone) && query.size() == 3 && query[0] == 1 &&
              query[1] >= 1 && past.size() == 4 && past[0] == 1 && past[1] == kernel.kv_heads && cos.size() == 2 &&
              seqlens.size() == 1 && inputs[kKey] == nullptr && inputs[kValue] == nullptr &&
              inputs[kPositionIds] == nullptr && inputs[kAttentionBias] == nullptr && inputs[kHeadSink] == nullptr;
  const int64_t head_dim = query.size() == 3 ? query[2] / (kernel.heads + 2 * kernel.kv_heads) : 0;
  ours = ours && head_dim > 0 && head_dim <= kMaxAttentionHeadDim &&
         query[2] == (kernel.heads + 2 * kernel.kv_heads) * head_dim &&
         past[3] == head_dim && cos[1] > 0 && cos[1] % 8 == 0 && cos[1] * 2 <= head_dim;
  int64_t total = 0, tokens = ours ? query[1] : 0;
  if (ours) {
    const auto* seqlens_k = static_cast<const int32_t*>(input_data(api, context, kSeqlensK));
    const auto* total_length = static_cast<const int32_t*>(input_data(api, context, kTotalSequenceLength));
    total = total_length ? *total_length : 0;
    ours = seqlens_k != nullptr && seqlens_k[0] + 1 == total && total >= tokens && total <= cos[0] &&
           total <= past[2];
  }
  // a prompt the bf16 paths could take but do not (a form they cannot run: the trace says so)
  const bool missed = kernel.form && kernel.path != AttentionPath::kNone && many;
  if (!ours) {
    if (missed) tell(kernel, kernel.told_native, new_tokens, "through onnxruntime's kernel");
    return native(outputs);
  }
  void *out = nullptr, *key = nullptr, *value = nullptr;
  if (outputs[kOutput]) api.GetTensorMutableData(outputs[kOutput], &out);
  if (outputs[kPresentKey]) api.GetTensorMutableData(outputs[kPresentKey], &key);
  if (outputs[kPresentValue]) api.GetTensorMutableData(outputs[kPresentValue], &value);
  if (out == nullptr || key == nullptr || key != input_data(api, context, kPastKey) || value == nullptr ||
      value != input_data(api, context, kPastValue)) {  // present apart from past: onnxruntime's kernel
    if (missed) tell(kernel, kernel.told_native, new_tokens, "through onnxruntime's kernel");
    return native(outputs);
  }
  if (many)
    tell(kernel, kernel.told_tiles, new_tokens, kernel.path == AttentionPath::kAmx ? "on the bf16 AMX path"
                                                                                   : "on the bf16 AVX-512 path");
  Buffer rotated = aligned_buffer(static_cast<size_t>(tokens * kernel.heads * head_dim) * sizeof(float));
  Prompt prompt{static_cast<const float*>(input_data(api, context, kQuery)),
                static_cast<const float*>(input_data(api, context, kCosCache)),
                static_cast<const float*>(input_data(api, context, kSinCache)),
                static_cast<float*>(rotated.get()),
                static_cast<float*>(key),
                static_cast<float*>(value),
                tokens, total - tokens, kernel.heads, kernel.kv_heads, head_dim, cos[1], past[2]};
  Context ctx{&api, context};
  parallel_for(&ctx, place_token, static_cast<size_t>(tokens), &prompt);
  Attention a;
  a.batch = 1;
  a.q_len = tokens;
  a.kv_len = total;
  a.heads = kernel.heads;
  a.kv_heads = kernel.kv_heads;
  a.head_dim = head_dim;
  a.q = prompt.q;
  a.k = prompt.key;
  a.v = prompt.value;
  a.q_row_stride = kernel.heads * head_dim;
  a.kv_row_stride = head_dim;
  a.kv_head_stride = past[2] * head_dim;
  a.kv_batch_stride = kernel.kv_heads * a.kv_head_stride;
  a.causal_past = prompt.past;
  a.scale = kernel.scale != 0.0f ? kernel.scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  a.out = static_cast<float*>(out);
  if (!many) {
    if (!attention_float(a, kernel.step == StepPath::kAvx512, parallel_for, &ctx))
      return api.CreateStatus(ORT_FAIL, ("GroupQueryAttention " + kernel.name + ": no float path on this CPU").c_str());
    return nullptr;
  }
  if (!attention_bf16(a, kernel.path == AttentionPath::kAmx, parallel_for, &ctx))
    return api.CreateStatus(ORT_FAIL, ("GroupQueryAttention " + kernel.name + ": head_dim " +
                                       std::to_string(head_dim) + " is past the library's tiles").c_str());
  return nullptr;
}

void destroy(void* op_kernel) {
  auto* kernel = static_cast<Kernel*>(op_kernel);
  if (kernel->native) kernel->api.ReleaseOp(kernel->native);
  delete kernel;
}

const char* name(const OrtCustomOp*) { return "GroupQueryAttention"; }
size_t inputs(const OrtCustomOp*) { return kInputs; }
OrtElementType input_type(const OrtCustomOp*, size_t index) {
  return index < kInputs ? kInputTypes[index] : ORT_UNDEFINED;
}
OrtCustomOpCharacteristic input_characteristic(const OrtCustomOp*, size_t index) {
  return index == kQuery ? ORT_REQUIRED : ORT_OPTIONAL;
}
size_t outputs(const OrtCustomOp*) { return kOutputs; }
OrtCustomOpCharacteristic output_characteristic(const OrtCustomOp*, size_t index) {
  return index == kOutput ? ORT_REQUIRED : ORT_OPTIONAL;
}

}  // namespace

const OrtCustomOp& group_query_attention() {
  static const OrtCustomOp op = custom_op(name, inputs, input_type, input_characteristic, outputs,
                                          output_characteristic, create, compute, destroy);
  return op;
}

}  // namespace bp::op
