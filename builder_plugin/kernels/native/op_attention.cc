// com.microsoft MultiHeadAttention for the encoders (SigLIP: a key padding mask; the conformer: that and a relative
// position bias), registered only on CPUs with AMX bf16, where attention.h's kernel runs it. What the builder's
// encoders do not use (packed Q/K/V, a bias input, past and present, unidirectional, other mask forms, the qk output)
// is refused with a one-line error naming it: onnxruntime's own kernel (BUILDER_PLUGIN_KERNELS=0) runs those.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "attention.h"
#include "op_common.h"

namespace bp::op {
namespace {

enum Input {
  kQuery = 0, kKey, kValue, kBias, kKeyPaddingMask, kAttentionBias, kPastKey, kPastValue, kPastSequenceLength,
  kCacheIndirection, kInputs
};
constexpr OrtElementType kInputTypes[kInputs] = {ORT_FLOAT, ORT_FLOAT, ORT_FLOAT, ORT_FLOAT, ORT_INT32,
                                                  ORT_FLOAT, ORT_FLOAT, ORT_FLOAT, ORT_INT32, ORT_INT32};
constexpr size_t kOutputs = 4;  // output, present_key, present_value, qk

struct Kernel {
  ort::Api api;
  int64_t heads = 0;
  float scale = 0.0f, mask_value = -10000.0f;
  std::string name;
  AttentionPath path = AttentionPath::kNone;  // as the session found it when it made the kernel
};

OrtStatus* refuse(const ort::Api& api, const Kernel* kernel, const std::string& what) {
  return api.CreateStatus(ORT_INVALID_ARGUMENT,
                          ("MultiHeadAttention " + (kernel ? kernel->name : std::string()) + ": " + what +
                           " is not supported by the builder_plugin library's kernel (BUILDER_PLUGIN_KERNELS=0 "
                           "runs onnxruntime's)").c_str());
}

OrtStatus* create(const OrtCustomOp*, const OrtApi* table, const OrtKernelInfo* info, void** out) {
  ort::Api api{table};
  auto* kernel = new (std::nothrow) Kernel{api};
  if (kernel == nullptr) return api.CreateStatus(ORT_FAIL, "MultiHeadAttention: out of memory");
  kernel->name = node_name(api, info);
  kernel->heads = attribute(api, info, "num_heads", int64_t{0});
  kernel->scale = attribute(api, info, "scale", 0.0f);
  kernel->mask_value = attribute(api, info, "mask_filter_value", -10000.0f);
  OrtStatus* refused = nullptr;
  if (attribute(api, info, "unidirectional", int64_t{0}) != 0) refused = refuse(api, kernel, "unidirectional");
  if (kernel->heads <= 0) refused = refuse(api, kernel, "num_heads " + std::to_string(kernel->heads));
  if (refused) {
    delete kernel;
    return refused;
  }
  kernel->path = attention_path();
  if (trace())
    std::fprintf(stderr, "%s: MultiHeadAttention %s num_heads=%lld: %s path\n", kLibrary, kernel->name.c_str(),
                 static_cast<long long>(kernel->heads), attention_path_name(kernel->path));
  *out = kernel;
  return nullptr;
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* context) {
  const auto& kernel = *static_cast<const Kernel*>(op_kernel);
  const ort::Api& api = kernel.api;
  std::vector<int64_t> q, k, v, dims;
  if (OrtStatus* status = input_dims(api, context, kQuery, q)) return status;
  if (OrtStatus* status = input_dims(api, context, kKey, k)) return status;
  if (OrtStatus* status = input_dims(api, context, kValue, v)) return status;
  if (q.size() != 3 || k.size() != 3 || k != v || k[0] != q[0] || k[2] != q[2] || q[2] % kernel.heads)
    return refuse(api, &kernel, "a query, key and value other than [batch, sequence, heads x head_dim]");
  for (Input absent : {kBias, kPastKey, kPastValue, kPastSequenceLength, kCacheIndirection}) {
    if (OrtStatus* status = input_dims(api, context, absent, dims)) return status;
    if (!dims.empty() || input_data(api, context, absent) != nullptr)
      return refuse(api, &kernel, "input " + std::to_string(static_cast<int>(absent)));
  }
  size_t outputs = 0;
  if (OrtStatus* status = api.KernelContext_GetOutputCount(context, &outputs)) return status;
  if (outputs > 1) return refuse(api, &kernel, "present_key, present_value or qk as outputs");
  Attention a;
  a.batch = q[0];
  a.q_len = q[1];
  a.kv_len = k[1];
  a.heads = kernel.heads;
  a.head_dim = q[2] / kernel.heads;
  a.scale = kernel.scale != 0.0f ? kernel.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  a.mask_value = kernel.mask_value;
  if (OrtStatus* status = input_dims(api, context, kKeyPaddingMask, dims)) return status;
  if (!dims.empty()) {
    if (dims.size() != 2 || dims[0] != a.batch || dims[1] != a.kv_len)
      return refuse(api, &kernel, "a key_padding_mask other than [batch, kv_sequence]");
    a.key_padding = static_cast<const int32_t*>(input_data(api, context, kKeyPaddingMask));
  }
  if (OrtStatus* status = input_dims(api, context, kAttentionBias, dims)) return status;
  if (!dims.empty()) {
    if (dims.size() != 4 || (dims[0] != 1 && dims[0] != a.batch) || (dims[1] != 1 && dims[1] != a.heads) ||
        dims[2] != a.q_len || dims[3] != a.kv_len)
      return refuse(api, &kernel, "an attention_bias other than [batch or 1, heads or 1, sequence, kv_sequence]");
    a.bias = static_cast<const float*>(input_data(api, context, kAttentionBias));
    a.bias_head_stride = dims[1] == 1 ? 0 : a.q_len * a.kv_len;
    a.bias_batch_stride = dims[0] == 1 ? 0 : dims[1] * a.q_len * a.kv_len;
  }
  OrtValue* out_value = nullptr;
  if (OrtStatus* status = api.KernelContext_GetOutput(context, 0, q.data(), q.size(), &out_value)) return status;
  if (a.batch * a.q_len == 0) return nullptr;
  void* out = nullptr;
  if (OrtStatus* status = api.GetTensorMutableData(out_value, &out)) return status;
  a.q = static_cast<const float*>(input_data(api, context, kQuery));
  a.k = static_cast<const float*>(input_data(api, context, kKey));
  a.v = static_cast<const float*>(input_data(api, context, kValue));
  a.out = static_cast<float*>(out);
  packed_rows(a);
  if (a.kv_len == 0) {  // nothing to attend to: onnxruntime's softmax over no keys gives zeros too
    std::fill(a.out, a.out + a.batch * a.q_len * q[2], 0.0f);
    return nullptr;
  }
  Context ctx{&api, context};
  if (!attention_bf16(a, kernel.path == AttentionPath::kAmx, parallel_for, &ctx))
    return refuse(api, &kernel, "head_dim " + std::to_string(a.head_dim));
  return nullptr;
}

void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }

const char* name(const OrtCustomOp*) { return "MultiHeadAttention"; }
size_t inputs(const OrtCustomOp*) { return kInputs; }
OrtElementType input_type(const OrtCustomOp*, size_t index) { return index < kInputs ? kInputTypes[index] : ORT_UNDEFINED; }
OrtCustomOpCharacteristic input_characteristic(const OrtCustomOp*, size_t index) {
  return index == kQuery ? ORT_REQUIRED : ORT_OPTIONAL;
}
size_t outputs(const OrtCustomOp*) { return kOutputs; }
OrtCustomOpCharacteristic output_characteristic(const OrtCustomOp*, size_t index) {
  return index == 0 ? ORT_REQUIRED : ORT_OPTIONAL;
}

}  // namespace

const OrtCustomOp& multi_head_attention() {
  static const OrtCustomOp op = custom_op(name, inputs, input_type, input_characteristic, outputs,
                                          output_characteristic, create, compute, destroy);
  return op;
}

}  // namespace bp::op
