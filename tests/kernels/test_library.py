"""The library's own declarations of onnxruntime's C ABI (builder_plugin/kernels/native/ort_abi.h) against the
installed onnxruntime: the API version it asks for is served and the slots it calls do what their names say."""

from __future__ import annotations

import ctypes
from pathlib import Path

import onnxruntime

from builder_plugin import kernels


def onnxruntime_api_base() -> int:
    capi = Path(onnxruntime.__file__).parent / "capi"
    library = ctypes.CDLL(str(next(capi.glob("libonnxruntime.so*"))))
    library.OrtGetApiBase.restype = ctypes.c_void_p
    return library.OrtGetApiBase()


class ApiBase(ctypes.Structure):
    _fields_ = [("GetApi", ctypes.c_void_p), ("GetVersionString", ctypes.CFUNCTYPE(ctypes.c_char_p))]


def test_declarations_match_the_installed_onnxruntime():
    base = onnxruntime_api_base()
    assert ApiBase.from_address(base).GetVersionString().decode() == onnxruntime.__version__
    ops = ctypes.CDLL(str(kernels.library_path()))
    ops.BuilderPluginOpsCheckApi.argtypes = [ctypes.c_void_p]
    ops.BuilderPluginOpsCheckApi.restype = ctypes.c_char_p
    assert ops.BuilderPluginOpsCheckApi(base).decode() == ""


def test_level_names_what_the_cpu_offers():
    flags = kernels.cpu_flags()
    expected = "amx" if {"avx512_vnni", "amx_tile", "amx_int8"} <= flags else (
        "avx512_vnni" if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags else "none")
    assert kernels.level() == expected
