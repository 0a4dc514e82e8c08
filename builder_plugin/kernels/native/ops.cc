// The library onnxruntime loads (SessionOptions.register_custom_ops_library, genai_config's custom_ops_library): it
// registers a CPU kernel for com.microsoft MatMulNBits, which onnxruntime then prefers to its own for every such node
// of the session, so a package's graphs need no change. On a CPU without AVX-512 VNNI it registers nothing (one line
// on stderr says so) and onnxruntime's own kernel runs.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "matmul_nbits.h"
#include "ort_abi.h"

namespace {

constexpr const char* kDomain = "com.microsoft";
constexpr const char* kLibrary = "builder_plugin ops";

enum Input { kA = 0, kB, kScales, kZeroPoints, kGIdx, kBias, kInputs };
constexpr OrtElementType kInputTypes[kInputs] = {ORT_FLOAT, ORT_UINT8, ORT_FLOAT, ORT_UINT8, ORT_INT32, ORT_FLOAT};

// BUILDER_PLUGIN_OPS_TRACE=1: one line per kernel made (at session load) naming the path it takes.
bool trace() {
  const char* v = std::getenv("BUILDER_PLUGIN_OPS_TRACE");
  return v != nullptr && *v && std::strcmp(v, "0") != 0;
}

// Rows from which the AMX tiles beat AVX-512 VNNI (bench_kernel.py); BUILDER_PLUGIN_OPS_PATH=avx512 or amx forces one
// path for every row count (benchmarks, tests).
constexpr int64_t kAmxFromRows = 12;

struct Kernel {
  ort::Api api;
  int64_t k = 0, n = 0, bits = 4, block = 32, accuracy_level = 0;
  std::string name;
  bool int8_path = false;
  int64_t amx_from_rows = kAmxFromRows;  // INT64_MAX: never
};

int64_t amx_from_rows() {
  const char* forced = std::getenv("BUILDER_PLUGIN_OPS_PATH");
  if (forced != nullptr && std::strcmp(forced, "avx512") == 0) return INT64_MAX;
  if (forced != nullptr && std::strcmp(forced, "amx") == 0) return 1;
  return kAmxFromRows;
}

int64_t attribute(const ort::Api& api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  if (OrtStatus* status = api.KernelInfoGetAttribute_int64(info, name, &value)) {
    api.ReleaseStatus(status);
    return fallback;
  }
  return value;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* table, const OrtKernelInfo* info, void** out) {
  ort::Api api{table};
  auto* kernel = new (std::nothrow) Kernel{api};
  if (kernel == nullptr) return api.CreateStatus(ORT_FAIL, "MatMulNBits: out of memory");
  kernel->k = attribute(api, info, "K", -1);
  kernel->n = attribute(api, info, "N", -1);
  kernel->bits = attribute(api, info, "bits", 4);
  kernel->block = attribute(api, info, "block_size", -1);
  kernel->accuracy_level = attribute(api, info, "accuracy_level", 0);
  size_t size = 0;
  if (OrtStatus* status = api.KernelInfo_GetNodeName(info, nullptr, &size)) api.ReleaseStatus(status);
  if (size > 0) {
    kernel->name.resize(size);
    if (OrtStatus* status = api.KernelInfo_GetNodeName(info, kernel->name.data(), &size)) api.ReleaseStatus(status);
    kernel->name.resize(std::strlen(kernel->name.c_str()));
  }
  if (kernel->k <= 0 || kernel->n <= 0 || kernel->block < 16 || (kernel->block & (kernel->block - 1)) ||
      kernel->bits < 2 || kernel->bits > 8) {
    std::string message = "MatMulNBits " + kernel->name + ": unsupported attributes K=" + std::to_string(kernel->k) +
                          " N=" + std::to_string(kernel->n) + " bits=" + std::to_string(kernel->bits) +
                          " block_size=" + std::to_string(kernel->block);
    delete kernel;
    return api.CreateStatus(ORT_INVALID_ARGUMENT, message.c_str());
  }
  kernel->int8_path = kernel->accuracy_level == 4 && (kernel->bits == 4 || kernel->bits == 8) && bp::cpu().avx512_vnni;
  kernel->amx_from_rows = bp::cpu().amx_int8 ? amx_from_rows() : INT64_MAX;
  if (trace())
    std::fprintf(stderr, "%s: MatMulNBits %s K=%lld N=%lld bits=%lld block=%lld accuracy_level=%lld: %s path\n",
                 kLibrary, kernel->name.c_str(), static_cast<long long>(kernel->k), static_cast<long long>(kernel->n),
                 static_cast<long long>(kernel->bits), static_cast<long long>(kernel->block),
                 static_cast<long long>(kernel->accuracy_level), !kernel->int8_path ? "float"
                 : kernel->amx_from_rows == 1 ? "int8 AMX"
                 : kernel->amx_from_rows == INT64_MAX ? "int8 AVX-512" : "int8 AVX-512 (1 row) / AMX");
  *out = kernel;
  return nullptr;
}

struct Context {
  const ort::Api* api;
  OrtKernelContext* context;
};

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

OrtStatus* compute(void* op_kernel, OrtKernelContext* context) {
  const auto& kernel = *static_cast<const Kernel*>(op_kernel);
  const ort::Api& api = kernel.api;
  const OrtValue* a_value = nullptr;
  if (OrtStatus* status = api.KernelContext_GetInput(context, kA, &a_value)) return status;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* status = api.GetTensorTypeAndShape(a_value, &info)) return status;
  size_t rank = 0;
  OrtStatus* status = api.GetDimensionsCount(info, &rank);
  std::vector<int64_t> dims(rank);
  if (status == nullptr && rank > 0) status = api.GetDimensions(info, dims.data(), rank);
  api.ReleaseTensorTypeAndShapeInfo(info);
  if (status) return status;
  if (rank == 0 || dims.back() != kernel.k)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("MatMulNBits " + kernel.name + ": A's last dimension is not K=" +
                                                   std::to_string(kernel.k)).c_str());
  int64_t m = 1;
  for (size_t i = 0; i + 1 < rank; ++i) m *= dims[i];
  dims.back() = kernel.n;
  OrtValue* y_value = nullptr;
  if (OrtStatus* status = api.KernelContext_GetOutput(context, 0, dims.data(), rank, &y_value)) return status;
  if (m == 0) return nullptr;
  void* y = nullptr;
  if (OrtStatus* status = api.GetTensorMutableData(y_value, &y)) return status;

  bp::Weights w;
  w.n = kernel.n;
  w.k = kernel.k;
  w.bits = kernel.bits;
  w.block = kernel.block;
  w.packed = static_cast<const uint8_t*>(input_data(api, context, kB));
  w.scales = static_cast<const float*>(input_data(api, context, kScales));
  w.zero_points = static_cast<const uint8_t*>(input_data(api, context, kZeroPoints));
  w.g_idx = static_cast<const int32_t*>(input_data(api, context, kGIdx));
  w.bias = static_cast<const float*>(input_data(api, context, kBias));
  const auto* a = static_cast<const float*>(input_data(api, context, kA));
  if (w.packed == nullptr || w.scales == nullptr || a == nullptr)
    return api.CreateStatus(ORT_INVALID_ARGUMENT, ("MatMulNBits " + kernel.name + ": missing input").c_str());
  Context ctx{&api, context};
  auto* out = static_cast<float*>(y);
  bool done = false;
  if (kernel.int8_path && w.g_idx == nullptr) {
    done = m >= kernel.amx_from_rows && bp::matmul_int8_amx(w, a, m, out, parallel_for, &ctx);
    done = done || bp::matmul_int8_avx512(w, a, m, out, parallel_for, &ctx);
  }
  if (!done) bp::matmul_reference(w, a, m, out, parallel_for, &ctx);
  return nullptr;
}

void destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

const char* op_name(const OrtCustomOp*) { return "MatMulNBits"; }
const char* op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
OrtElementType input_type(const OrtCustomOp*, size_t index) { return index < kInputs ? kInputTypes[index] : ORT_UNDEFINED; }
size_t input_count(const OrtCustomOp*) { return kInputs; }
OrtElementType output_type(const OrtCustomOp*, size_t) { return ORT_FLOAT; }
size_t output_count(const OrtCustomOp*) { return 1; }
OrtCustomOpCharacteristic input_characteristic(const OrtCustomOp*, size_t index) {
  return index >= kZeroPoints ? ORT_OPTIONAL : ORT_REQUIRED;
}
OrtCustomOpCharacteristic output_characteristic(const OrtCustomOp*, size_t) { return ORT_REQUIRED; }
int default_memory(const OrtCustomOp*, size_t) { return 0; }
int one(const OrtCustomOp*) { return 1; }
int newest(const OrtCustomOp*) { return 1 << 30; }

OrtCustomOp make_op() {
  OrtCustomOp op{};
  op.version = ort::kApiVersion;
  op.GetName = op_name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = input_characteristic;
  op.GetOutputCharacteristic = output_characteristic;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = one;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = one;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = one;
  op.GetEndVersion = newest;
  return op;
}

const OrtCustomOp kMatMulNBits = make_op();
std::mutex domains_lock;
std::vector<OrtCustomOpDomain*> domains;  // kept for the process' life: sessions hold on to them

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                     const OrtApiBase* base) {
  const OrtApi* table = base ? base->GetApi(ort::kApiVersion) : nullptr;
  if (table == nullptr) {
    std::fprintf(stderr, "%s: onnxruntime %s is older than 1.17; its own MatMulNBits runs\n", kLibrary,
                 base ? base->GetVersionString() : "?");
    return nullptr;
  }
  if (!bp::cpu().avx512_vnni) {
    static std::once_flag told;
    std::call_once(told, [] {
      std::fprintf(stderr, "%s: this CPU has no AVX-512 VNNI; onnxruntime's own MatMulNBits runs\n", kLibrary);
    });
    return nullptr;
  }
  ort::Api api{table};
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* status = api.CreateCustomOpDomain(kDomain, &domain)) return status;
  {
    std::lock_guard<std::mutex> hold(domains_lock);
    domains.push_back(domain);
  }
  if (OrtStatus* status = api.CustomOpDomain_Add(domain, &kMatMulNBits)) return status;
  return api.AddCustomOpDomain(options, domain);
}

// The declarations of ort_abi.h against the onnxruntime that `base` comes from (OrtGetApiBase of its library): the
// API version served, and a status and a domain made and read back through their slots. "" when all hold.
__attribute__((visibility("default"))) const char* BuilderPluginOpsCheckApi(const OrtApiBase* base) {
  const OrtApi* table = base->GetApi(ort::kApiVersion);
  if (table == nullptr) return "GetApi refused the API version";
  ort::Api api{table};
  OrtStatus* status = api.CreateStatus(ORT_INVALID_ARGUMENT, "probe");
  const bool status_ok = std::strcmp(api.GetErrorMessage(status), "probe") == 0 &&
                         api.GetErrorCode(status) == ORT_INVALID_ARGUMENT;
  api.ReleaseStatus(status);
  if (!status_ok) return "CreateStatus / GetErrorMessage / GetErrorCode disagree";
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* failed = api.CreateCustomOpDomain("builder_plugin.probe", &domain)) {
    api.ReleaseStatus(failed);
    return "CreateCustomOpDomain failed";
  }
  if (OrtStatus* failed = api.CustomOpDomain_Add(domain, &kMatMulNBits)) {
    api.ReleaseStatus(failed);
    api.ReleaseCustomOpDomain(domain);
    return "CustomOpDomain_Add failed";
  }
  api.ReleaseCustomOpDomain(domain);
  return "";
}

// What the library would do on this CPU, for the Python side and the tests: 0 registers nothing, 1 the AVX-512 VNNI
// int8 path, 2 that and AMX tiles granted.
__attribute__((visibility("default"))) int BuilderPluginOpsLevel() {
  return bp::cpu().amx_int8 ? 2 : (bp::cpu().avx512_vnni ? 1 : 0);
}

}  // extern "C"
