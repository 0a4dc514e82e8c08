/* Preloaded into a benchmark (benchmarks/cpu_class.py), makes every thread's CPUID instruction fault (Linux's
 * ARCH_SET_CPUID, on CPUs with CPUID faulting) and answers it from the real CPUID with the features of a smaller
 * machine class cleared, so that onnxruntime, numpy and the project's library take the paths they take on such a CPU,
 * on these cores. Built with -DHIDE_LEAF7_EBX=... and the other masks below; a SIGSEGV that is not a CPUID gets the
 * default action. */
#define _GNU_SOURCE
#include <cpuid.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_SET_CPUID 0x1012 /* arch/x86/include/uapi/asm/prctl.h */

static void answer_cpuid(int sig, siginfo_t *info, void *raw) {
  (void)sig;
  (void)info;
  greg_t *r = ((ucontext_t *)raw)->uc_mcontext.gregs;
  const uint8_t *ip = (const uint8_t *)r[REG_RIP];
  if (ip[0] != 0x0F || ip[1] != 0xA2) {
    signal(SIGSEGV, SIG_DFL); /* a real fault: returning re-runs the instruction, which now ends the process */
    return;
  }
  unsigned leaf = (unsigned)r[REG_RAX], sub = (unsigned)r[REG_RCX], a, b, c, d;
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
  __cpuid_count(leaf, sub, a, b, c, d);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
  if (leaf == 7 && sub == 0) {
    b &= ~(unsigned)(HIDE_LEAF7_EBX);
    c &= ~(unsigned)(HIDE_LEAF7_ECX);
    d &= ~(unsigned)(HIDE_LEAF7_EDX);
  } else if (leaf == 7 && sub == 1) {
    a &= ~(unsigned)(HIDE_LEAF7_1_EAX);
    d &= ~(unsigned)(HIDE_LEAF7_1_EDX);
  }
  r[REG_RAX] = a;
  r[REG_RBX] = b;
  r[REG_RCX] = c;
  r[REG_RDX] = d;
  r[REG_RIP] += 2;
}

__attribute__((constructor)) static void hide_features(void) {
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = answer_cpuid;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigaction(SIGSEGV, &action, 0);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0); /* inherited by the threads and processes made after it */
}
