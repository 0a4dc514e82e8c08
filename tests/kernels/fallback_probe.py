"""Run by test_fallback under `qemu-x86_64 -cpu <model>`: MatMulNBits graphs (the node kinds and row counts of
CASES) with and without the library; prints a JSON line with what the library says of this CPU and, per case, both
results, the exact int8 block sums and the float result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from builder_plugin import kernels
from tests.kernels.matmul_nbits_graphs import int8_reference, quantization_bound, random_b, write_graph

# (bits, block, zero points, rows): with AVX2 alone, 4 bits in place (1 and 3 rows) and on panels (20 rows), blocks
# of 16 on panels, 8 bits in place; K ends inside a block, N past a panel.
CASES = [(4, 32, True, 1), (4, 32, False, 3), (4, 64, True, 20), (4, 16, True, 2), (8, 32, True, 1),
         (8, 128, False, 20)]


def main(folder: str) -> None:
    rng = np.random.default_rng(0)
    found = []
    for index, (bits, block, zero_points, rows) in enumerate(CASES):
        b = random_b(rng, 5 * block + 7, 37, bits, block, zero_points)
        path = write_graph(Path(folder) / f"g{index}.onnx", b)
        a = rng.standard_normal((rows, b.k)).astype(np.float32)
        results = []
        for library in (False, True):
            options = ort.SessionOptions()
            if library:
                options.register_custom_ops_library(str(kernels.library_path()))
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            results.append(session.run(None, {"A": a})[0].tolist())
        found.append({"case": [bits, block, zero_points, rows], "builtin": results[0], "library": results[1],
                      "int8": int8_reference(b, a).tolist(), "bound": quantization_bound(b, a).tolist(),
                      "exact": (a.astype(np.float64) @ b.dequantized().T).tolist()})
    print(json.dumps({"level": kernels.level(), "cases": found}))


if __name__ == "__main__":
    main(sys.argv[1])
