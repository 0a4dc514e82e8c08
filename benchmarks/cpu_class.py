"""Run a command as if on a smaller x86 machine class, on this machine's cores: a preloaded library
(native/cpu_class.c) answers every CPUID with the class's missing features cleared, so onnxruntime, numpy and the
project's kernel library take the paths they take on such a CPU, at this CPU's clock and memory speed.

    python -m benchmarks.cpu_class avx2 -- python -m benchmarks.bench_prompt PKG --kernels library

Needs Linux, CPUID faulting (the `cpuid_fault` flag of /proc/cpuinfo; virtual machines may lack it) and gcc. The
results' machine description names the class (benchmarks.common.machine_info). A process that installs its own SIGSEGV
handler (Python's faulthandler) would take the faults instead: the benchmarks do not. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "native" / "cpu_class.c"
ENV = "BUILDER_PLUGIN_BENCH_CPU_CLASS"  # the class a process runs as, for its report


@dataclass(frozen=True)
class CpuClass:
    description: str
    # CPUID bits cleared: leaf 7 subleaf 0 EBX, ECX, EDX; leaf 7 subleaf 1 EAX, EDX
    leaf7_ebx: tuple[int, ...] = ()
    leaf7_ecx: tuple[int, ...] = ()
    leaf7_edx: tuple[int, ...] = ()
    leaf7_1_eax: tuple[int, ...] = ()
    leaf7_1_edx: tuple[int, ...] = ()
    hidden_flags: tuple[str, ...] = ()  # /proc/cpuinfo flags (prefixes) the class lacks, for the report

    def defines(self) -> list[str]:
        masks = {"HIDE_LEAF7_EBX": self.leaf7_ebx, "HIDE_LEAF7_ECX": self.leaf7_ecx, "HIDE_LEAF7_EDX": self.leaf7_edx,
                 "HIDE_LEAF7_1_EAX": self.leaf7_1_eax, "HIDE_LEAF7_1_EDX": self.leaf7_1_edx}
        return [f"-D{name}={sum(1 << bit for bit in bits):#x}u" for name, bits in masks.items()]

    def shows(self, flag: str) -> bool:
        return not flag.startswith(self.hidden_flags)


CLASSES = {
    "avx2": CpuClass(
        "AVX2 and FMA without AVX-512, AVX-VNNI or AMX (AMD Zen 2 and 3, Intel cores before Ice Lake and Alder Lake)",
        # AVX512 F, DQ, IFMA, PF, ER, CD, BW, VL
        leaf7_ebx=(16, 17, 21, 26, 27, 28, 30, 31),
        # AVX512 VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ
        leaf7_ecx=(1, 6, 11, 12, 14),
        # AVX512 4VNNIW, 4FMAPS, VP2INTERSECT; AMX-BF16; AVX512-FP16; AMX-TILE, AMX-INT8
        leaf7_edx=(2, 3, 8, 22, 23, 24, 25),
        # AVX-VNNI, AVX512-BF16, AMX-FP16, AVX-IFMA
        leaf7_1_eax=(4, 5, 21, 23),
        # AVX-VNNI-INT8, AVX10
        leaf7_1_edx=(4, 19),
        hidden_flags=("avx512", "avx_vnni", "amx"),
    ),
}


class ClassError(Exception):
    """This machine cannot run as the class (no CPUID faulting, no compiler)."""


def preload(name: str) -> Path:
    """The shim of class `name`, built once per source and class into the temporary folder."""
    cpu_class = CLASSES[name]
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text(encoding="utf-8", errors="replace").split() if cpuinfo.is_file() else []
    if "cpuid_fault" not in flags:
        raise ClassError("this CPU or its kernel has no CPUID faulting (cpuid_fault in /proc/cpuinfo)")
    command = ["gcc", "-O2", "-shared", "-fPIC", *cpu_class.defines(), str(SOURCE)]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(command).encode()).hexdigest()[:16]
    built = Path(tempfile.gettempdir()) / "builder_plugin-cpu-class" / f"{name}-{digest}.so"
    if not built.is_file():
        built.parent.mkdir(parents=True, exist_ok=True)
        partial = built.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run([*command, "-o", str(partial)], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise ClassError(f"building the CPUID shim failed: {getattr(exc, 'stderr', None) or exc}") from exc
        partial.replace(built)
    return built


def environment(name: str) -> dict[str, str]:
    """The variables that make a process (and the processes it starts) run as class `name`."""
    loaded = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": f"{preload(name)} {loaded}".strip(), ENV: name}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cpu_class", choices=sorted(CLASSES), help="; ".join(
        f"{name}: {cpu_class.description}" for name, cpu_class in CLASSES.items()))
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        env = {**os.environ, **environment(args.cpu_class)}
    except ClassError as exc:
        print(f"cpu_class: {exc}", file=sys.stderr)
        return 2
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
