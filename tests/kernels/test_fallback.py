"""On a CPU without AVX-512 (qemu-user emulating a Haswell: AVX2, no AVX-512, no AMX) the library registers nothing,
says so in one line, and a session that registers it answers with onnxruntime's own kernel: the same numbers."""

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


@pytest.mark.skipif(platform.machine() != "x86_64", reason="qemu-x86_64 emulates x86-64 on an x86-64 host here")
def test_library_declines_without_avx512(tmp_path):
    qemu = shutil.which("qemu-x86_64")
    assert qemu, "apt-get install qemu-user (.ci/run does)"
    assert kernels.library_path() is not None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([qemu, "-cpu", "Haswell", os.path.realpath(sys.executable), "-m",
                           "tests.kernels.fallback_probe", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["level"] == "none"
    notices = [line for line in done.stderr.splitlines() if line.startswith("builder_plugin ops:")]
    assert notices == ["builder_plugin ops: this CPU has no AVX-512 VNNI; onnxruntime's own MatMulNBits runs"]
    np.testing.assert_array_equal(np.array(found["library"]), np.array(found["builtin"]))
    np.testing.assert_allclose(np.array(found["library"]), np.array(found["exact"]), atol=0.05)
