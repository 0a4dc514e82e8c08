"""Packages on a CPU with AVX2 only (qemu-user emulating a Haswell: no AVX-512, no AMX), where the kernel library
registers nothing and onnxruntime's AVX2 kernels run every MatMulNBits, against the native run of the same package.

onnxruntime's issue 29853 reports wrong results from exactly that path (one row, int4 with zero points, AVX2-only
CPUs); the default int4 package has zero points and its decode steps are one row. Natively, onnxruntime's own kernel
(BUILDER_PLUGIN_KERNELS=0) computes what the AVX2 one should (the same int8 activations per block): close to float
rounding. The native run as the run-time helper makes it (the library: bf16 prefill, int8 decode steps) differs by
its arithmetic only: within a bound far below what a wrong kernel gives. Kept small: qemu is slow (~20 s a run)."""

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

from tests.conftest import build_tiny_package

ROOT = Path(__file__).resolve().parents[2]
# (max |Δ logits| of the logit scale, max KL in nats) per position
SAME_KERNEL = (0.02, 1e-3)  # onnxruntime's AVX2 kernel against its AVX-512 one (measured: 0.0065, 2e-4)
LIBRARY = (0.25, 0.1)  # against the library's paths (measured: 0.079, 0.023)

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="qemu-x86_64 emulates x86-64 on an x86-64 host here")


def probe(package: Path, qemu: bool = False, **env: str) -> dict:
    command = [os.path.realpath(sys.executable), "-m", "tests.runtime.cpu_probe", str(package)]
    if qemu:
        command = [shutil.which("qemu-x86_64"), "-cpu", "Haswell", *command]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["stderr"] = done.stderr
    return found


def differences(got: list, want: list) -> tuple[np.ndarray, np.ndarray]:
    """Per position: max |Δ logits| of the reference's scale, KL(want ‖ got)."""
    a, b = np.array(got, np.float64), np.array(want, np.float64)
    relative = np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)
    la = a - a.max(axis=-1, keepdims=True)
    la -= np.log(np.exp(la).sum(axis=-1, keepdims=True))
    lb = b - b.max(axis=-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(axis=-1, keepdims=True))
    return relative, (np.exp(lb) * (lb - la)).sum(axis=-1)


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_avx2_only_cpu_answers_like_the_native_run(tmp_path_factory, tiny_checkpoint, precision):
    assert shutil.which("qemu-x86_64"), "apt-get install qemu-user (.ci/run does)"
    from builder_plugin import kernels

    package = build_tiny_package(tmp_path_factory, tiny_checkpoint, precision=precision)
    emulated = probe(package, qemu=True)
    assert emulated["level"] == "none"  # the library registers nothing there
    assert emulated["prompt_tokens"] >= 16  # a prompt long enough for a many-rows path natively
    onnxruntime = probe(package, BUILDER_PLUGIN_KERNELS="0")
    relative, kl = differences(emulated["logits"], onnxruntime["logits"])
    assert relative.max() <= SAME_KERNEL[0] and kl.max() <= SAME_KERNEL[1], (relative, kl)
    native = probe(package)
    assert native["level"] == kernels.level()
    relative, kl = differences(emulated["logits"], native["logits"])
    assert relative.max() <= LIBRARY[0] and kl.max() <= LIBRARY[1], (relative, kl)
