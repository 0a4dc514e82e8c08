"""Packages on a CPU with AVX2 only (qemu-user emulating a Haswell: no AVX-512, no AMX), against the native run of the
same package: as the run-time helper loads them (the kernel library's AVX2 paths), and with onnxruntime's own AVX2
kernels (BUILDER_PLUGIN_KERNELS=0).

onnxruntime's issue 29853 reports wrong results from exactly that path of onnxruntime (one row, int4 with zero
points, AVX2-only CPUs); the default int4 package has zero points and its decode steps are one row. Natively,
onnxruntime's own kernel computes what the AVX2 one should (the same int8 activations per block): close to float
rounding. The library's AVX2 paths compute the int8 numbers of its native paths; where the native run's prompt takes
bf16 (AMX, or the attention on AVX-512 BF16) they differ by that arithmetic only: within a bound far below what a
wrong kernel gives. Kept small: qemu is slow (~20 s a run)."""

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
SAME_KERNEL = (0.02, 1e-3)  # the same int8 arithmetic on two CPUs (onnxruntime's AVX2 against AVX-512: 0.0065, 2e-4)
LIBRARY = (0.25, 0.1)  # int8 against the library's bf16 prompt path (measured: 0.079, 0.023)

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
    onnxruntime = probe(package, BUILDER_PLUGIN_KERNELS="0")
    emulated_onnxruntime = probe(package, qemu=True, BUILDER_PLUGIN_KERNELS="0")
    relative, kl = differences(emulated_onnxruntime["logits"], onnxruntime["logits"])
    assert relative.max() <= SAME_KERNEL[0] and kl.max() <= SAME_KERNEL[1], (relative, kl)
    emulated = probe(package, qemu=True)
    assert emulated["level"] == "avx2"  # the library's AVX2 paths
    assert emulated["prompt_tokens"] >= 16  # a prompt long enough for the many-rows paths
    native = probe(package)
    assert native["level"] == kernels.level()
    relative, kl = differences(emulated["logits"], native["logits"])
    # bf16 natively (AMX prompts, or the prompts' attention on AVX-512 BF16); elsewhere both runs are int8 throughout
    bound = LIBRARY if native["level"] == "amx_bf16" or kernels.attention() else SAME_KERNEL
    assert relative.max() <= bound[0] and kl.max() <= bound[1], (relative, kl)
    relative, kl = differences(emulated["logits"], onnxruntime["logits"])
    assert relative.max() <= SAME_KERNEL[0] and kl.max() <= SAME_KERNEL[1], (relative, kl)
