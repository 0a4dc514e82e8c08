// The library onnxruntime loads (SessionOptions.register_custom_ops_library, genai_config's custom_ops_library): it
// registers a CPU kernel for com.microsoft MatMulNBits (and on CPUs with AMX bf16, MultiHeadAttention and
// GroupQueryAttention: op_attention.cc, op_group_query_attention.cc), which onnxruntime then prefers to its own for
// every such node of the session, so a package's graphs need no change. On a CPU without AVX2 and FMA it registers
// nothing (one line on stderr says so) and onnxruntime's own kernels run.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "matmul_nbits.h"
#include "op_common.h"
#include "ort_abi.h"
#include "resident.h"

namespace {

using namespace bp::op;

constexpr const char* kDomain = "com.microsoft";

enum Input { kA = 0, kB, kScales, kZeroPoints, kGIdx, kBias, kInputs };
constexpr OrtElementType kInputTypes[kInputs] = {ORT_FLOAT, ORT_UINT8, ORT_FLOAT, ORT_UINT8, ORT_INT32, ORT_FLOAT};

// The kernel's paths: few rows (decode steps) on AVX-512 VNNI reading B as stored; many rows (a prompt) on AMX, bf16
// panels of B (bits 4 and 8, no g_idx) or the int8 block products, and without AMX int8 panels of B on AVX-512 VNNI.
// Without AVX-512 VNNI, on AVX2: B read as stored for few rows (blocks of 32 and more), int8 panels of B for many.
// The float path where none applies.
enum class Path { kFloat, kAvx512, kAmxInt8, kAmxBf16, kPanels, kAvx2, kAvx2Panels };
constexpr const char* kPathNames[] = {"float",    "int8 AVX-512",        "int8 AMX", "bf16 AMX",
                                      "int8 AVX-512 panels", "int8 AVX2", "int8 AVX2 panels"};

// Rows from which the many-rows path beats reading B as stored (bench_kernel.py): the bf16 panels, on a CPU with AMX
// int8 only the int8 tiles, without AMX the int8 panels, with AVX2 alone its panels. BUILDER_PLUGIN_OPS_PATH=
// avx512, panels, amx or bf16 forces one path for every row count (benchmarks, tests); a path this CPU lacks leaves
// the default. =vnni takes the paths of a CPU with AVX-512 VNNI but no AMX (what benchmarks emulate on one with it),
// =avx2 those of a CPU with AVX2 alone.
constexpr int64_t kBf16FromRows = 16;
constexpr int64_t kAmxFromRows = 12;
constexpr int64_t kPanelsFromRows = 20;
constexpr int64_t kAvx2PanelsFromRows = 16;
constexpr int64_t kAvx2Panels8FromRows = 24;  // 8 bits

struct Kernel {
  ort::Api api;
  int64_t k = 0, n = 0, bits = 4, block = 32, accuracy_level = 0;
  std::string name;
  Path few = Path::kFloat, many = Path::kFloat;
  int64_t many_from_rows = INT64_MAX;
  // where B is read: BUILDER_PLUGIN_OPS_WEIGHTS as the session makes the kernel (resident.h)
  mutable bp::ResidentWeights resident{bp::weights_home()};
};

// What BUILDER_PLUGIN_OPS_PATH asks for: one path for every row count (kFloat when none is set or this CPU lacks it),
// and whether AMX stays unused (=vnni, or a forced path without AMX: a CPU without it, as benchmarks emulate one).
struct Forced {
  Path path = Path::kFloat;
  bool without_amx = false;
};

Forced forced_setting() {
  const bp::Cpu& cpu = bp::cpu();
  const char* value = std::getenv("BUILDER_PLUGIN_OPS_PATH");
  Forced forced;
  if (value == nullptr) return forced;
  forced.path = std::strcmp(value, "avx512") == 0               ? Path::kAvx512
                : std::strcmp(value, "panels") == 0               ? Path::kPanels
                : std::strcmp(value, "avx2") == 0 && cpu.avx2     ? Path::kAvx2Panels
                : std::strcmp(value, "amx") == 0 && cpu.amx_int8  ? Path::kAmxInt8
                : std::strcmp(value, "bf16") == 0 && cpu.amx_bf16 ? Path::kAmxBf16
                                                                  : Path::kFloat;
  forced.without_amx = std::strcmp(value, "vnni") == 0 || forced.path == Path::kAvx512 ||
                       forced.path == Path::kPanels || forced.path == Path::kAvx2Panels;
  return forced;
}

}  // namespace

AttentionPath bp::op::attention_path() {
  const bp::Cpu& cpu = bp::cpu();
  const Forced forced = forced_setting();
  if (cpu.amx_bf16 && !forced.without_amx && (forced.path == Path::kFloat || forced.path == Path::kAmxBf16))
    return AttentionPath::kAmx;
  return cpu.avx512_bf16 && forced.path == Path::kFloat ? AttentionPath::kAvx512Bf16 : AttentionPath::kNone;
}

const char* bp::op::attention_path_name(AttentionPath path) {
  return path == AttentionPath::kAmx ? "bf16 AMX" : path == AttentionPath::kAvx512Bf16 ? "bf16 AVX-512" : "";
}

StepPath bp::op::step_path() {
  return bp::cpu().avx512_vnni && forced_setting().path != Path::kAvx2Panels ? StepPath::kAvx512 : StepPath::kAvx2;
}

const char* bp::op::step_path_name(StepPath path) {
  return path == StepPath::kAvx512 ? "float AVX-512" : "float AVX2";
}

namespace {

// A CPU with AVX2 and FMA but no AVX-512 VNNI (or =avx2): few rows in place from blocks of 32 (matmul_int8_avx2's
// nodes), otherwise the panels (matmul_int8_panels_avx2's).
void choose_avx2_paths(Kernel& kernel) {
  const bool in_place = kernel.block >= 32 && kernel.block <= 256;
  kernel.many = Path::kAvx2Panels;
  kernel.few = in_place ? Path::kAvx2 : Path::kAvx2Panels;
  kernel.many_from_rows = !in_place ? INT64_MAX : kernel.bits == 4 ? kAvx2PanelsFromRows : kAvx2Panels8FromRows;
}

void choose_paths(Kernel& kernel) {
  const bp::Cpu& cpu = bp::cpu();
  if (kernel.accuracy_level != 4 || (kernel.bits != 4 && kernel.bits != 8) || !cpu.avx2) return;
  const Forced forced = forced_setting();
  if (!cpu.avx512_vnni || forced.path == Path::kAvx2Panels) return choose_avx2_paths(kernel);
  kernel.few = kernel.many = Path::kAvx512;
  if (cpu.amx_bf16 && !forced.without_amx) {
    kernel.many = Path::kAmxBf16;
    kernel.many_from_rows = kBf16FromRows;
  } else if (cpu.amx_int8 && !forced.without_amx) {
    kernel.many = Path::kAmxInt8;
    kernel.many_from_rows = kAmxFromRows;
  } else {
    kernel.many = Path::kPanels;
    kernel.many_from_rows = kPanelsFromRows;
  }
  if (forced.path != Path::kFloat) {
    kernel.few = kernel.many = forced.path;
    kernel.many_from_rows = INT64_MAX;
  }
}

// The kernel's paths, as the trace and BuilderPluginOpsPaths name them.
std::string describe(const Kernel& kernel) {
  std::string paths = kPathNames[static_cast<int>(kernel.few)];
  if (kernel.many_from_rows != INT64_MAX)
    paths += " (up to " + std::to_string(kernel.many_from_rows - 1) + " rows) / " +
             kPathNames[static_cast<int>(kernel.many)];
  return paths;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* table, const OrtKernelInfo* info, void** out) {
  ort::Api api{table};
  auto* kernel = new (std::nothrow) Kernel{api};
  if (kernel == nullptr) return api.CreateStatus(ORT_FAIL, "MatMulNBits: out of memory");
  kernel->k = attribute(api, info, "K", int64_t{-1});
  kernel->n = attribute(api, info, "N", int64_t{-1});
  kernel->bits = attribute(api, info, "bits", int64_t{4});
  kernel->block = attribute(api, info, "block_size", int64_t{-1});
  kernel->accuracy_level = attribute(api, info, "accuracy_level", int64_t{0});
  kernel->name = node_name(api, info);
  if (kernel->k <= 0 || kernel->n <= 0 || kernel->block < 16 || (kernel->block & (kernel->block - 1)) ||
      kernel->bits < 2 || kernel->bits > 8) {
    std::string message = "MatMulNBits " + kernel->name + ": unsupported attributes K=" + std::to_string(kernel->k) +
                          " N=" + std::to_string(kernel->n) + " bits=" + std::to_string(kernel->bits) +
                          " block_size=" + std::to_string(kernel->block);
    delete kernel;
    return api.CreateStatus(ORT_INVALID_ARGUMENT, message.c_str());
  }
  choose_paths(*kernel);
  if (trace())
    std::fprintf(stderr, "%s: MatMulNBits %s K=%lld N=%lld bits=%lld block=%lld accuracy_level=%lld: %s path\n",
                 kLibrary, kernel->name.c_str(), static_cast<long long>(kernel->k), static_cast<long long>(kernel->n),
                 static_cast<long long>(kernel->bits), static_cast<long long>(kernel->block),
                 static_cast<long long>(kernel->accuracy_level), describe(*kernel).c_str());
  *out = kernel;
  return nullptr;
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* context) {
  const auto& kernel = *static_cast<const Kernel*>(op_kernel);
  const ort::Api& api = kernel.api;
  std::vector<int64_t> dims;
  if (OrtStatus* status = input_dims(api, context, kA, dims)) return status;
  const size_t rank = dims.size();
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
  if (w.g_idx == nullptr && kernel.few != Path::kFloat) w = kernel.resident.apply(w, parallel_for, &ctx);
  if (w.g_idx == nullptr) {
    const Path path = m >= kernel.many_from_rows ? kernel.many : kernel.few;
    if (path == Path::kAmxBf16) done = bp::matmul_bf16_amx(w, a, m, out, parallel_for, &ctx);
    if (path == Path::kAmxInt8) done = bp::matmul_int8_amx(w, a, m, out, parallel_for, &ctx);
    if (path == Path::kPanels) done = bp::matmul_int8_panels(w, a, m, out, parallel_for, &ctx);
    if (path == Path::kAvx2) done = bp::matmul_int8_avx2(w, a, m, out, parallel_for, &ctx);
    if (path == Path::kAvx2Panels) done = bp::matmul_int8_panels_avx2(w, a, m, out, parallel_for, &ctx);
    if (path != Path::kFloat) done = done || bp::matmul_int8_avx512(w, a, m, out, parallel_for, &ctx);
  }
  if (!done) bp::matmul_reference(w, a, m, out, parallel_for, &ctx);
  return nullptr;
}

void destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

const char* op_name(const OrtCustomOp*) { return "MatMulNBits"; }
OrtElementType input_type(const OrtCustomOp*, size_t index) { return index < kInputs ? kInputTypes[index] : ORT_UNDEFINED; }
size_t input_count(const OrtCustomOp*) { return kInputs; }
size_t output_count(const OrtCustomOp*) { return 1; }
OrtCustomOpCharacteristic input_characteristic(const OrtCustomOp*, size_t index) {
  return index >= kZeroPoints ? ORT_OPTIONAL : ORT_REQUIRED;
}
OrtCustomOpCharacteristic output_characteristic(const OrtCustomOp*, size_t) { return ORT_REQUIRED; }

const OrtCustomOp kMatMulNBits = custom_op(op_name, input_count, input_type, input_characteristic, output_count,
                                           output_characteristic, create_kernel, compute, destroy_kernel);
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
  if (!bp::cpu().avx2) {
    static std::once_flag told;
    std::call_once(told, [] {
      std::fprintf(stderr, "%s: this CPU has no AVX2 and FMA; onnxruntime's own MatMulNBits runs\n", kLibrary);
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
  // the encoders' and the prompts' attention in bf16 where the CPU has it (elsewhere onnxruntime's own); decode
  // steps' attention in float on every CPU the library registers on
  if (attention_path() != AttentionPath::kNone)
    if (OrtStatus* status = api.CustomOpDomain_Add(domain, &multi_head_attention())) return status;
  if (OrtStatus* status = api.CustomOpDomain_Add(domain, &group_query_attention())) return status;
  return api.AddCustomOpDomain(options, domain);
}

// The declarations of ort_abi.h against the onnxruntime that `base` comes from (OrtGetApiBase of its library): the
// API version served, a status and a domain made and read back, and an operator attribute made, through their slots.
// "" when all hold.
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
  OrtOpAttr* attr = nullptr;
  const int64_t heads = 2;
  if (OrtStatus* failed = api.CreateOpAttr("num_heads", &heads, 1, ORT_OP_ATTR_INT, &attr)) {
    api.ReleaseStatus(failed);
    return "CreateOpAttr failed";
  }
  api.ReleaseOpAttr(attr);
  return "";
}

// Where the library runs the encoders' and the prompts' attention in this process, as the trace names it: "bf16 AMX",
// "bf16 AVX-512", or "" (onnxruntime's own kernels).
__attribute__((visibility("default"))) const char* BuilderPluginAttentionPath() {
  return attention_path_name(attention_path());
}

// Where the library runs a decode step's attention in this process: "float AVX-512", "float AVX2", or "" (it
// registers nothing on this CPU).
__attribute__((visibility("default"))) const char* BuilderPluginStepAttentionPath() {
  return bp::cpu().avx2 ? step_path_name(step_path()) : "";
}

// What the library would do on this CPU, for the Python side and the tests: 0 registers nothing, 1 the AVX2 paths,
// 2 the AVX-512 VNNI int8 paths, 3 those and AMX int8 tiles granted, 4 those and AMX bf16 (the many-rows path of
// prompts).
__attribute__((visibility("default"))) int BuilderPluginOpsLevel() {
  const bp::Cpu& cpu = bp::cpu();
  return cpu.amx_bf16 && cpu.amx_int8 ? 4 : cpu.amx_int8 ? 3 : cpu.avx512_vnni ? 2 : cpu.avx2 ? 1 : 0;
}

// The paths a 4-bit MatMulNBits node with accuracy_level 4 (the builder's CPU packages) takes on this CPU, as the
// trace names them ("int8 AVX-512 (up to 15 rows) / bf16 AMX"); "" where the library registers nothing.
__attribute__((visibility("default"))) const char* BuilderPluginOpsPaths() {
  static std::string paths;
  static std::once_flag made;
  std::call_once(made, [] {
    Kernel kernel{ort::Api{nullptr}};
    kernel.accuracy_level = 4;
    if (bp::cpu().avx2) {
      choose_paths(kernel);
      paths = describe(kernel);
    }
  });
  return paths.c_str();
}

}  // extern "C"
