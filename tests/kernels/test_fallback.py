"""The library on other CPUs, emulated by qemu-user: a Haswell (AVX2 and FMA, no AVX-512, no AMX) runs its AVX2 paths,
which must give the exact int8 block sums as natively; a Sandy Bridge (AVX, no AVX2) registers nothing, says so in
one line, and a session that registers it answers with onnxruntime's own kernel: the same numbers."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builder_plugin import kernels

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="qemu-x86_64 emulates x86-64 on an x86-64 host here")


def probe(tmp_path: Path, cpu: str) -> tuple[dict, list[str]]:
    qemu = shutil.which("qemu-x86_64")
    assert qemu, "apt-get install qemu-user (.ci/run does)"
    assert kernels.library_path() is not None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([qemu, "-cpu", cpu, os.path.realpath(sys.executable), "-m",
                           "tests.kernels.fallback_probe", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    notices = [line for line in done.stderr.splitlines() if line.startswith("builder_plugin ops:")]
    return json.loads(done.stdout.strip().splitlines()[-1]), notices


def test_avx2_paths_on_a_cpu_without_avx512(tmp_path):
    found, notices = probe(tmp_path, "Haswell")
    assert found["level"] == "avx2"
    assert notices == []
    for case in found["cases"]:
        library, int8, exact = (np.array(case[key]) for key in ("library", "int8", "exact"))
        bound = np.array(case["bound"])
        assert np.abs(library - int8).max() <= 1e-5 * (np.abs(exact).max() + 1), case["case"]
        assert np.all(np.abs(library - exact) <= bound * 1.001 + 1e-5), case["case"]
        assert np.all(np.abs(library - np.array(case["builtin"])) <= 2 * bound + 1e-4), case["case"]


def test_library_declines_without_avx2(tmp_path):
    found, notices = probe(tmp_path, "SandyBridge")
    assert found["level"] == "none"
    assert notices == ["builder_plugin ops: this CPU has no AVX2 and FMA; onnxruntime's own MatMulNBits runs"]
    for case in found["cases"]:
        np.testing.assert_array_equal(np.array(case["library"]), np.array(case["builtin"]))
        np.testing.assert_allclose(np.array(case["library"]), np.array(case["exact"]), atol=0.05)
