// The part of onnxruntime's C ABI this library uses, declared by the project (onnxruntime's PyPI wheel ships no C
// headers). OrtApi is a table of function pointers that only ever grows at its end, so a function is found by its
// slot: the slots below are those of onnxruntime's public header (the same in every release that has them), and the
// library asks for API version kApiVersion, which onnxruntime refuses (GetApi returns null) when it is older.
// tests/kernels/test_library.py checks the library against the installed onnxruntime.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtShapeInferContext;
struct OrtApi;
struct OrtOp;
struct OrtOpAttr;

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };

enum OrtElementType {
  ORT_UNDEFINED = 0, ORT_FLOAT = 1, ORT_UINT8 = 2, ORT_INT32 = 6, ORT_INT64 = 7, ORT_FLOAT16 = 10,
};

enum OrtOpAttrType { ORT_OP_ATTR_INT = 1, ORT_OP_ATTR_FLOAT = 3 };

enum OrtCustomOpCharacteristic { ORT_REQUIRED = 0, ORT_OPTIONAL = 1 };

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// OrtCustomOp as of version 17 (onnxruntime reads the fields after GetEndVersion only from version 18 on).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  OrtElementType (*GetInputType)(const OrtCustomOp*, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  OrtElementType (*GetOutputType)(const OrtCustomOp*, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  OrtCustomOpCharacteristic (*GetInputCharacteristic)(const OrtCustomOp*, size_t index);
  OrtCustomOpCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp*, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
};

}  // extern "C"

// Typed access to the OrtApi slots used, by slot number.
namespace ort {

// onnxruntime 1.17 introduced KernelContext_ParallelFor and custom-op version ranges: the oldest API served here.
constexpr uint32_t kApiVersion = 17;

using Status = OrtStatus*;

template <typename F>
inline F slot(const OrtApi* api, size_t index) {
  return reinterpret_cast<F const*>(api)[index];
}

struct Api {
  const OrtApi* table;

  Status CreateStatus(OrtErrorCode code, const char* message) const {
    return slot<Status (*)(OrtErrorCode, const char*)>(table, 0)(code, message);
  }
  const char* GetErrorMessage(const OrtStatus* status) const {
    return slot<const char* (*)(const OrtStatus*)>(table, 2)(status);
  }
  Status CreateCustomOpDomain(const char* domain, OrtCustomOpDomain** out) const {
    return slot<Status (*)(const char*, OrtCustomOpDomain**)>(table, 26)(domain, out);
  }
  Status CustomOpDomain_Add(OrtCustomOpDomain* domain, const OrtCustomOp* op) const {
    return slot<Status (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(table, 27)(domain, op);
  }
  Status AddCustomOpDomain(OrtSessionOptions* options, OrtCustomOpDomain* domain) const {
    return slot<Status (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(table, 28)(options, domain);
  }
  Status GetTensorMutableData(OrtValue* value, void** out) const {
    return slot<Status (*)(OrtValue*, void**)>(table, 51)(value, out);
  }
  Status GetTensorElementType(const OrtTensorTypeAndShapeInfo* info, OrtElementType* out) const {
    return slot<Status (*)(const OrtTensorTypeAndShapeInfo*, OrtElementType*)>(table, 60)(info, out);
  }
  Status GetDimensionsCount(const OrtTensorTypeAndShapeInfo* info, size_t* out) const {
    return slot<Status (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(table, 61)(info, out);
  }
  Status GetDimensions(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count) const {
    return slot<Status (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(table, 62)(info, dims, count);
  }
  Status GetTensorTypeAndShape(const OrtValue* value, OrtTensorTypeAndShapeInfo** out) const {
    return slot<Status (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(table, 65)(value, out);
  }
  Status KernelInfoGetAttribute_float(const OrtKernelInfo* info, const char* name, float* out) const {
    return slot<Status (*)(const OrtKernelInfo*, const char*, float*)>(table, 85)(info, name, out);
  }
  Status KernelInfoGetAttribute_int64(const OrtKernelInfo* info, const char* name, int64_t* out) const {
    return slot<Status (*)(const OrtKernelInfo*, const char*, int64_t*)>(table, 86)(info, name, out);
  }
  Status KernelContext_GetInputCount(const OrtKernelContext* context, size_t* out) const {
    return slot<Status (*)(const OrtKernelContext*, size_t*)>(table, 88)(context, out);
  }
  Status KernelContext_GetOutputCount(const OrtKernelContext* context, size_t* out) const {
    return slot<Status (*)(const OrtKernelContext*, size_t*)>(table, 89)(context, out);
  }
  Status KernelContext_GetInput(const OrtKernelContext* context, size_t index, const OrtValue** out) const {
    return slot<Status (*)(const OrtKernelContext*, size_t, const OrtValue**)>(table, 90)(context, index, out);
  }
  Status KernelContext_GetOutput(OrtKernelContext* context, size_t index, const int64_t* dims, size_t count,
                                 OrtValue** out) const {
    return slot<Status (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(table, 91)(
        context, index, dims, count, out);
  }
  OrtErrorCode GetErrorCode(const OrtStatus* status) const {
    return slot<OrtErrorCode (*)(const OrtStatus*)>(table, 1)(status);
  }
  void ReleaseStatus(OrtStatus* status) const { slot<void (*)(OrtStatus*)>(table, 93)(status); }
  void ReleaseCustomOpDomain(OrtCustomOpDomain* domain) const {
    slot<void (*)(OrtCustomOpDomain*)>(table, 101)(domain);
  }
  void ReleaseTensorTypeAndShapeInfo(OrtTensorTypeAndShapeInfo* info) const {
    slot<void (*)(OrtTensorTypeAndShapeInfo*)>(table, 99)(info);
  }
  // A native onnxruntime kernel run from inside a custom one (the cases a library kernel leaves to onnxruntime's).
  Status CreateOpAttr(const char* name, const void* data, int len, OrtOpAttrType type, OrtOpAttr** out) const {
    return slot<Status (*)(const char*, const void*, int, OrtOpAttrType, OrtOpAttr**)>(table, 211)(name, data, len,
                                                                                                  type, out);
  }
  void ReleaseOpAttr(OrtOpAttr* attr) const { slot<void (*)(OrtOpAttr*)>(table, 212)(attr); }
  Status CreateOp(const OrtKernelInfo* info, const char* name, const char* domain, int version,
                  const char** type_names, const OrtElementType* type_values, int type_count,
                  const OrtOpAttr* const* attrs, int attr_count, int inputs, int outputs, OrtOp** out) const {
    return slot<Status (*)(const OrtKernelInfo*, const char*, const char*, int, const char**, const OrtElementType*,
                           int, const OrtOpAttr* const*, int, int, int, OrtOp**)>(table, 213)(
        info, name, domain, version, type_names, type_values, type_count, attrs, attr_count, inputs, outputs, out);
  }
  Status InvokeOp(const OrtKernelContext* context, const OrtOp* op, const OrtValue* const* inputs, int input_count,
                  OrtValue* const* outputs, int output_count) const {
    return slot<Status (*)(const OrtKernelContext*, const OrtOp*, const OrtValue* const*, int, OrtValue* const*,
                           int)>(table, 214)(context, op, inputs, input_count, outputs, output_count);
  }
  void ReleaseOp(OrtOp* op) const { slot<void (*)(OrtOp*)>(table, 215)(op); }
  Status KernelInfo_GetInputCount(const OrtKernelInfo* info, size_t* out) const {
    return slot<Status (*)(const OrtKernelInfo*, size_t*)>(table, 230)(info, out);
  }
  Status KernelInfo_GetOutputCount(const OrtKernelInfo* info, size_t* out) const {
    return slot<Status (*)(const OrtKernelInfo*, size_t*)>(table, 231)(info, out);
  }
  Status KernelInfo_GetNodeName(const OrtKernelInfo* info, char* out, size_t* size) const {
    return slot<Status (*)(const OrtKernelInfo*, char*, size_t*)>(table, 244)(info, out, size);
  }
  Status KernelInfoGetConstantInput_tensor(const OrtKernelInfo* info, size_t index, int* is_constant,
                                           const OrtValue** out) const {
    return slot<Status (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(table, 249)(
        info, index, is_constant, out);
  }
  Status KernelContext_ParallelFor(const OrtKernelContext* context, void (*fn)(void*, size_t), size_t total,
                                   size_t num_batch, void* data) const {
    return slot<Status (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(table, 274)(
        context, fn, total, num_batch, data);
  }
};

}  // namespace ort
