// What the custom operators share (op_common.h).
#include "op_common.h"

#include <cstdlib>
#include <cstring>

namespace bp::op {

bool trace() {
  const char* v = std::getenv("BUILDER_PLUGIN_OPS_TRACE");
  return v != nullptr && *v && std::strcmp(v, "0") != 0;
}

bool has_attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, int64_t* value) {
  if (OrtStatus* status = api.KernelInfoGetAttribute_int64(info, name, value)) {
    api.ReleaseStatus(status);
    return false;
  }
  return true;
}

bool has_attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, float* value) {
  if (OrtStatus* status = api.KernelInfoGetAttribute_float(info, name, value)) {
    api.ReleaseStatus(status);
    return false;
  }
  return true;
}

int64_t attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  return has_attribute(api, info, name, &value) ? value : fallback;
}

float attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, float fallback) {
  float value = fallback;
  return has_attribute(api, info, name, &value) ? value : fallback;
}

std::string node_name(const ort::Api& api, const OrtKernelInfo* info) {
  std::string name;
  size_t size = 0;
  if (OrtStatus* status = api.KernelInfo_GetNodeName(info, nullptr, &size)) api.ReleaseStatus(status);
  if (size > 0) {
    name.resize(size);
    if (OrtStatus* status = api.KernelInfo_GetNodeName(info, name.data(), &size)) api.ReleaseStatus(status);
    name.resize(std::strlen(name.c_str()));
  }
  return name;
}

const void* input_data(const ort::Api& api, OrtKernelContext* context, size_t index) {
  const OrtValue* value = nullptr;
  if (OrtStatus* status = api.KernelContext_GetInput(context, index, &value)) {
    api.ReleaseStatus(status);
    return nullptr;
  }
  if (value == nullptr) return nullptr;
  void* data = nullptr;
  if (OrtStatus* status = api.GetTensorMutableData(const_cast<OrtValue*>(value), &data)) {
    api.ReleaseStatus(status);
    return nullptr;
  }
  return data;
}

OrtStatus* input_dims(const ort::Api& api, OrtKernelContext* context, size_t index, std::vector<int64_t>& dims) {
  dims.clear();
  size_t count = 0;
  if (OrtStatus* status = api.KernelContext_GetInputCount(context, &count)) return status;
  if (index >= count) return nullptr;
  const OrtValue* value = nullptr;
  if (OrtStatus* status = api.KernelContext_GetInput(context, index, &value)) return status;
  if (value == nullptr) return nullptr;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* status = api.GetTensorTypeAndShape(value, &info)) return status;
  size_t rank = 0;
  OrtStatus* status = api.GetDimensionsCount(info, &rank);
  dims.resize(rank);
  if (status == nullptr && rank > 0) status = api.GetDimensions(info, dims.data(), rank);
  api.ReleaseTensorTypeAndShapeInfo(info);
  return status;
}

void parallel_for(void* data, void (*fn)(void*, size_t), size_t total, void* job) {
  const auto* ctx = static_cast<const Context*>(data);
  if (total == 1) {
    fn(job, 0);
    return;
  }
  if (OrtStatus* status = ctx->api->KernelContext_ParallelFor(ctx->context, fn, total, 0, job)) {
    ctx->api->ReleaseStatus(status);  // no thread pool to hand the work to: run it here
    for (size_t i = 0; i < total; ++i) fn(job, i);
  }
}

namespace {

const char* cpu_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
OrtElementType float_output(const OrtCustomOp*, size_t) { return ORT_FLOAT; }
int default_memory(const OrtCustomOp*, size_t) { return 0; }
int one(const OrtCustomOp*) { return 1; }
int newest(const OrtCustomOp*) { return 1 << 30; }

}  // namespace

OrtCustomOp custom_op(const char* (*name)(const OrtCustomOp*), size_t (*inputs)(const OrtCustomOp*),
                      OrtElementType (*input_type)(const OrtCustomOp*, size_t),
                      OrtCustomOpCharacteristic (*input_characteristic)(const OrtCustomOp*, size_t),
                      size_t (*outputs)(const OrtCustomOp*),
                      OrtCustomOpCharacteristic (*output_characteristic)(const OrtCustomOp*, size_t),
                      OrtStatus* (*create)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**),
                      OrtStatus* (*compute)(void*, OrtKernelContext*), void (*destroy)(void*)) {
  OrtCustomOp op{};
  op.version = ort::kApiVersion;
  op.GetName = name;
  op.GetExecutionProviderType = cpu_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = inputs;
  op.GetOutputType = float_output;
  op.GetOutputTypeCount = outputs;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = input_characteristic;
  op.GetOutputCharacteristic = output_characteristic;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = one;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = one;
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = one;
  op.GetEndVersion = newest;
  return op;
}

}  // namespace bp::op
