"""The project's onnxruntime operator library: a CPU kernel for com.microsoft MatMulNBits (native/, built from source
by `pip install`) that reads the package's int4/int8 weights in place (or from a copy of its own:
BUILDER_PLUGIN_OPS_WEIGHTS) for a few rows (decode steps, AVX-512 VNNI or AVX2) and runs many rows (prompts,
encoders) on bf16 tiles where the CPU has AMX, on int8 panels where it does not; the encoders' and the prompts'
attention in bf16 (AMX tiles, or AVX-512 BF16); and a decode step's attention in float (AVX-512 or AVX2).

Registered on a session (onnxruntime's `SessionOptions.register_custom_ops_library`, genai_config's
`session_options.custom_ops_library`), onnxruntime prefers it to its own kernel for every MatMulNBits of that
session; the graphs are unchanged. On a CPU without AVX2 and FMA the library registers nothing and onnxruntime's
kernel runs. Stdlib only.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

LIBRARY_NAME = "libbuilder_plugin_ops.so"
# What the library does on this CPU (its BuilderPluginOpsLevel()): the order of LEVELS. "avx2": its AVX2 paths (a CPU
# without AVX-512 VNNI); "amx": AMX int8 tiles; "amx_bf16": and AMX bf16, the path of many rows (prompts).
LEVELS = ("none", "avx2", "avx512_vnni", "amx", "amx_bf16")
# The smallest block_size whose packages the library runs faster than onnxruntime's kernel, per level (others: any):
# with AVX2 alone, decode steps read B in place from blocks of 32 (blocks of 16 would unpack all of B every step).
MIN_BLOCK_SIZE = {"avx2": 32}
# /proc/cpuinfo flags under which the library has a faster path than onnxruntime's kernel.
FAST_PATH_FLAGS = ("avx2",)


def library_path() -> Path | None:
    """The built library, or None where it was not built (no compiler at install time, not Linux)."""
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    return path if path.is_file() else None


@functools.cache
def level() -> str:
    """What the library would do in this process: "none" (registers nothing), "avx2", "avx512_vnni", "amx" or
    "amx_bf16"; "none" without the library."""
    path = library_path()
    if path is None:
        return "none"
    return LEVELS[ctypes.CDLL(str(path)).BuilderPluginOpsLevel()]


@functools.cache
def paths() -> str:
    """The paths the library's MatMulNBits takes in this process for the builder's CPU packages (4 or 8 bits,
    accuracy_level 4), as its trace names them: "int8 AVX-512 (up to 15 rows) / bf16 AMX" (few rows: decode steps;
    many: prompts); "" where it registers nothing or was not built."""
    return _library_text("BuilderPluginOpsPaths")


def attention() -> str:
    """Where the library runs the encoders' and the prompts' attention in this process (the CPU and
    BUILDER_PLUGIN_OPS_PATH as they are now), as its trace names it: "bf16 AMX", "bf16 AVX-512" (a CPU with AVX-512
    BF16 but no AMX), or "" (onnxruntime's own kernels; also without the library)."""
    return _library_text("BuilderPluginAttentionPath")


def step_attention() -> str:
    """Where the library runs a decode step's attention (GroupQueryAttention with fewer than 16 new tokens) in this
    process, as its trace names it: "float AVX-512" (a CPU with AVX-512 VNNI), "float AVX2" (or
    BUILDER_PLUGIN_OPS_PATH=avx2), or "" (it registers nothing here, or was not built)."""
    return _library_text("BuilderPluginStepAttentionPath")


def _library_text(symbol: str) -> str:
    """What the library's function `symbol` (no arguments, a C string) answers; "" without the library."""
    path = library_path()
    if path is None:
        return ""
    function = getattr(ctypes.CDLL(str(path)), symbol)
    function.restype = ctypes.c_char_p
    return function().decode()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        for line in cpuinfo.read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def missing_notice() -> str | None:
    """One line for the user where this CPU has a faster path than onnxruntime's kernel but the library is absent."""
    if library_path() is None and any(flag in cpu_flags() for flag in FAST_PATH_FLAGS):
        return (f"builder_plugin: {LIBRARY_NAME} was not built (no C++ compiler at install time?); this CPU's "
                "faster MatMulNBits paths are off and onnxruntime's kernel runs")
    return None
