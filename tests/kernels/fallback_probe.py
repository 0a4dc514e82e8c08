"""Run by test_fallback under `qemu-x86_64 -cpu Haswell` (no AVX-512): one MatMulNBits graph with and without the
library; prints a JSON line with both results, the float reference and what the library says of this CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from builder_plugin import kernels
from tests.kernels.matmul_nbits_graphs import random_b, write_graph


def main(folder: str) -> None:
    rng = np.random.default_rng(0)
    b = random_b(rng, 200, 33, 4, 32, zero_points=True)
    path = write_graph(Path(folder) / "g.onnx", b)
    a = rng.standard_normal((3, 200)).astype(np.float32)
    results = []
    for library in (False, True):
        options = ort.SessionOptions()
        if library:
            options.register_custom_ops_library(str(kernels.library_path()))
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        results.append(session.run(None, {"A": a})[0].tolist())
    print(json.dumps({"level": kernels.level(), "builtin": results[0], "library": results[1],
                      "exact": (a.astype(np.float64) @ b.dequantized().T).tolist()}))


if __name__ == "__main__":
    main(sys.argv[1])
