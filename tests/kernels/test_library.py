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
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags
    amx = vnni and {"amx_tile", "amx_int8"} <= flags
    avx2 = {"avx2", "fma"} <= flags
    expected = "amx_bf16" if amx and {"amx_bf16", "avx512_bf16"} <= flags else (
        "amx" if amx else ("avx512_vnni" if vnni else ("avx2" if avx2 else "none")))
    assert kernels.level() == expected


def test_notice_only_where_a_faster_path_is_missing(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n", encoding="ascii")
    flags = kernels.cpu_flags(cpuinfo)
    assert {"avx2", "avx512_vnni"} <= flags
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "library_path", lambda: None)
    assert "libbuilder_plugin_ops.so was not built" in kernels.missing_notice()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx", "sse4_2"})
    assert kernels.missing_notice() is None
