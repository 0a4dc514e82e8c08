"""Where the library's MatMulNBits reads its weights (native/resident.cc, BUILDER_PLUGIN_OPS_WEIGHTS): each choice
gives the int8 path's numbers, for weights in the graph or in an external data file (which onnxruntime maps); the
copy unmaps the file's pages it was made from, and they still read as stored where another node reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from builder_plugin import kernels
from tests.kernels.matmul_nbits_graphs import QuantizedB, int8_reference, random_b

ACTIVE = kernels.level() != "none"
WEIGHTS = "BUILDER_PLUGIN_OPS_WEIGHTS"
CHOICES = ("in-place", "copy", "huge-pages")

pytestmark = pytest.mark.skipif(not ACTIVE, reason="the library registers nothing on this CPU (test_matmul_nbits "
                                                    "checks that onnxruntime's kernel answers there)")


def write(folder: Path, b: QuantizedB, external: bool, read_back: bool) -> Path:
    """MatMulNBits(A) -> Y; with `read_back`, B and its scales also go out through Identity nodes (another reader of
    the same memory). `external`: the weights in g.data, 4 KB-aligned as the builder writes them."""
    initializers = [numpy_helper.from_array(b.packed(), "B"), numpy_helper.from_array(b.scales.reshape(-1), "scales"),
                    numpy_helper.from_array(b.packed_zero_points(), "zero_points")]
    nodes = [helper.make_node("MatMulNBits", ["A", "B", "scales", "zero_points"], ["Y"], domain="com.microsoft",
                              K=b.k, N=b.n, bits=b.bits, block_size=b.block, accuracy_level=4)]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, b.n])]
    if read_back:
        nodes += [helper.make_node("Identity", ["B"], ["B_read"]), helper.make_node("Identity", ["scales"], ["s_read"])]
        outputs += [helper.make_tensor_value_info("B_read", TensorProto.UINT8, None),
                    helper.make_tensor_value_info("s_read", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, b.k])],
                              outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    path = folder / "g.onnx"
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="g.data",
                  size_threshold=0)
    else:
        onnx.save(model, str(path))
    return path


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Identity nodes stay
    options.register_custom_ops_library(str(kernels.library_path()))
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def mapped_kb(data_file: Path) -> int:
    """Resident kB of this process' mappings of `data_file` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            inside = line.endswith(str(data_file))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("external", [True, False], ids=["external data", "in the graph"])
@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_gives_the_int8_numbers(tmp_path, monkeypatch, choice, external):
    monkeypatch.setenv(WEIGHTS, choice)
    rng = np.random.default_rng(5)
    b = random_b(rng, 1000, 300, 4, 32, zero_points=True)  # B 150 KB: whole pages to unmap
    a = rng.standard_normal((3, b.k)).astype(np.float32)
    model = session(write(tmp_path, b, external, read_back=True))
    scale = np.abs(a.astype(np.float64) @ b.dequantized().T).max() + 1
    for _ in range(3):  # the first run copies; the later ones read the copy, and the Identity nodes the stored B
        y, b_read, scales_read = model.run(None, {"A": a})
        assert np.abs(y - int8_reference(b, a)).max() <= 1e-5 * scale
        np.testing.assert_array_equal(b_read, b.packed())
        np.testing.assert_array_equal(scales_read, b.scales.reshape(-1))


@pytest.mark.parametrize("choice", CHOICES)
def test_a_copy_unmaps_the_file_pages(tmp_path, monkeypatch, choice):
    monkeypatch.setenv(WEIGHTS, choice)
    rng = np.random.default_rng(6)
    b = random_b(rng, 2048, 512, 4, 32, zero_points=True)  # B 512 KB, its scales 128 KB
    model = session(write(tmp_path, b, external=True, read_back=False))
    model.run(None, {"A": rng.standard_normal((1, b.k)).astype(np.float32)})
    resident = mapped_kb(tmp_path / "g.data")
    if choice == "in-place":
        assert resident >= 512 + 128  # the kernel read B and its scales where onnxruntime mapped them
    else:
        assert resident <= 4  # at most the zero points' one page, which no whole page of theirs covers


def test_an_unknown_choice_is_named_and_reads_in_place(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(WEIGHTS, "nearby")
    rng = np.random.default_rng(7)
    b = random_b(rng, 256, 64, 8, 32, zero_points=True)
    a = rng.standard_normal((2, b.k)).astype(np.float32)
    model = session(write(tmp_path, b, external=True, read_back=False))
    y = model.run(None, {"A": a})[0]
    assert np.abs(y - int8_reference(b, a)).max() <= 1e-5 * (np.abs(a.astype(np.float64) @ b.dequantized().T).max() + 1)
    assert mapped_kb(tmp_path / "g.data") >= 16  # B (16 KB) read where onnxruntime mapped it
    assert ("BUILDER_PLUGIN_OPS_WEIGHTS=nearby is not in-place, copy or huge-pages; reading in place"
            in capfd.readouterr().err)
