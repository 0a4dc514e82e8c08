"""Builds the project's onnxruntime operator library (builder_plugin/kernels/native) during `pip install`.

Everything else is declared in pyproject.toml. The library is a plain shared object that onnxruntime loads by path
(no Python module): `builder_plugin.kernels.library_path()` finds it. Its AVX-512 code is compiled with per-function
target attributes and chosen at run time, so it builds with any gcc or clang, on any CPU; where no compiler is
found the install goes on without it and onnxruntime's own MatMulNBits runs.
"""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("builder_plugin") / "kernels" / "native"
LIBRARY = "libbuilder_plugin_ops.so"


class BuildSharedLibrary(build_ext):
    """Names the library plainly (no Python ABI tag) and builds it with the C++ flags it needs."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(Path(*fullname.split(".")[:-1]) / LIBRARY)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return ext.export_symbols  # no PyInit_ function: not a Python module

    def build_extension(self, ext: Extension) -> None:
        if self.compiler.compiler_type == "unix":
            # -g0: no debug information (Python's own flags ask for it); gcc 12 warns about its own intrinsics
            # headers under per-function target attributes (-Wuninitialized)
            ext.extra_compile_args = ["-std=c++17", "-O2", "-g0", "-fvisibility=hidden", "-Wno-uninitialized",
                                      "-Wno-maybe-uninitialized"]
            ext.extra_link_args = ["-Wl,--as-needed"]
        super().build_extension(ext)


setup(
    ext_modules=[Extension("builder_plugin.kernels.ops", sources=sorted(str(p) for p in NATIVE.glob("*.cc")),
                           depends=sorted(str(p) for p in NATIVE.glob("*.h")), language="c++", optional=True)],
    cmdclass={"build_ext": BuildSharedLibrary},
)
