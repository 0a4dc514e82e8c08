// What the CPU and the operating system allow, read once: cpuid, the registers the OS saves (XCR0), and on Linux the
// AMX tile data this process must ask for (arch_prctl ARCH_REQ_XCOMP_PERM) before its first tile instruction.
#include "matmul_nbits.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace bp {
namespace {

uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool request_amx_tiles() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;  // arch/x86/include/uapi/asm/prctl.h
  constexpr long kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
#else
  return false;
#endif
}

Cpu detect() {
  Cpu found;
  unsigned a, b, c, d;
  __cpuid(0, a, b, c, d);
  found.one_stream = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return found;  // OSXSAVE
  const bool fma = c & (1u << 12);
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return found;
  __cpuid_count(7, 0, a, b, c, d);
  const uint64_t saved = xcr0();
  found.avx2 = (saved & 0x6) == 0x6 && fma && (b & (1u << 5));  // SSE and AVX state saved
  const bool zmm_saved = (saved & 0xE6) == 0xE6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));
  found.avx512_vnni = zmm_saved && avx512 && (c & (1u << 11));
  const bool amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25), amx_bf16 = d & (1u << 22);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  const bool avx512_bf16 = a1 & (1u << 5);
  found.avx512_bf16 = found.avx512_vnni && avx512_bf16;
  const bool tiles_saved = (saved & (3ull << 17)) == (3ull << 17);
  const bool tiles = found.avx512_vnni && amx_tile && tiles_saved && (amx_int8 || amx_bf16) && request_amx_tiles();
  found.amx_int8 = tiles && amx_int8;
  found.amx_bf16 = tiles && amx_bf16 && avx512_bf16;
  return found;
}

}  // namespace

const Cpu& cpu() {
  static const Cpu found = detect();
  return found;
}

}  // namespace bp

#else

namespace bp {
const Cpu& cpu() {
  static const Cpu none;
  return none;
}
}  // namespace bp

#endif
