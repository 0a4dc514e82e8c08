"""The project's onnxruntime operator library: a CPU kernel for com.microsoft MatMulNBits (native/, built from source
by `pip install`) that reads the package's int4/int8 weights in place with AVX-512 VNNI.

Registered on a session (onnxruntime's `SessionOptions.register_custom_ops_library`, genai_config's
`session_options.custom_ops_library`), onnxruntime prefers it to its own kernel for every MatMulNBits of that
session; the graphs are unchanged. On a CPU without AVX-512 VNNI the library registers nothing and onnxruntime's
kernel runs. Stdlib only.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

LIBRARY_NAME = "libbuilder_plugin_ops.so"
# What the library does on this CPU (its BuilderPluginOpsLevel()): the order of LEVELS.
LEVELS = ("none", "avx512_vnni", "amx")
# /proc/cpuinfo flags under which the library has a faster path than onnxruntime's kernel.
FAST_PATH_FLAGS = ("avx512_vnni",)


def library_path() -> Path | None:
    """The built library, or None where it was not built (no compiler at install time, not Linux)."""
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    return path if path.is_file() else None


@functools.cache
def level() -> str:
    """What the library would do in this process: "none" (registers nothing), "avx512_vnni" or "amx"; "none"
    without the library."""
    path = library_path()
    if path is None:
        return "none"
    return LEVELS[ctypes.CDLL(str(path)).BuilderPluginOpsLevel()]


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
                "AVX-512 VNNI MatMulNBits path is off and onnxruntime's kernel runs")
    return None
