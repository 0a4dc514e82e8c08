"""quantize_matmuls against onnxruntime's own MatMulNBitsQuantizer, for each algorithm the GenAI builder offers: the
default MLAS path (algo_config=None), RTNWeightOnlyQuantConfig and KQuantWeightOnlyQuantConfig, at 4 and 8 bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import (
    KQuantWeightOnlyQuantConfig,
    MatMulNBitsQuantizer,
    RTNWeightOnlyQuantConfig,
)
from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor, quant_tensor_k_quant_cpu

import builder_plugin.quant.weights as quantize
from builder_plugin.quant.kernels import QuantScheme
from builder_plugin.quant.matmul import quantize_matmuls
from builder_plugin.quant.weights import ColumnChunkedTensor, QuantizationCache

FLOAT_TYPES = {np.float32: ir.DataType.FLOAT, np.float16: ir.DataType.FLOAT16}


def _weight(rng: np.random.Generator, k: int, n: int, dtype) -> np.ndarray:
    return (rng.standard_normal((k, n)) * rng.uniform(0.1, 3.0, size=(1, n))).astype(dtype)


def _tensor(name: str, array: np.ndarray, chunked: bool) -> ir.TensorProtocol:
    if not chunked:
        return ir.tensor(array, name=name)
    return ColumnChunkedTensor(lambda c0, c1: np.ascontiguousarray(array[:, c0:c1]), FLOAT_TYPES[array.dtype.type],
                               array.shape, name)


def _initializer(tensor: ir.TensorProtocol) -> ir.Value:
    return ir.Value(name=tensor.name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape),
                    const_value=tensor)


def _model(weights: dict[str, np.ndarray], chunked: bool = False) -> ir.Model:
    """x -> MatMul(W0) -> MatMul(W1) ... (each K matching the previous N), plus a MatMul by a graph input."""
    first = next(iter(weights.values()))
    x = ir.Value(name="x", type=ir.TensorType(FLOAT_TYPES[first.dtype.type]), shape=ir.Shape(["b", first.shape[0]]))
    y = ir.Value(name="y_in", type=ir.TensorType(FLOAT_TYPES[first.dtype.type]), shape=ir.Shape([first.shape[0], 3]))
    nodes, inits, current = [], [], x
    for name, array in weights.items():
        init = _initializer(_tensor(name, array, chunked))
        node = ir.node("MatMul", [current, init], name=f"{name}/MatMul", num_outputs=1)
        node.outputs[0].name = f"{name}/out"
        nodes.append(node)
        inits.append(init)
        current = node.outputs[0]
    side = ir.node("MatMul", [x, y], name="dynamic/MatMul", num_outputs=1)  # B is not a constant: left alone
    side.outputs[0].name = "side"
    graph = ir.Graph([x, y], [current, side.outputs[0]], nodes=[*nodes, side], initializers=inits,
                     opset_imports={"": 21}, name="g")
    return ir.Model(graph, ir_version=10)


def _reference(weights: dict[str, np.ndarray], block_size: int, symmetric: bool, accuracy_level: int,
               exclude: list[str] | None = None, bits: int = 4, method: str = "default",
               node_bits: dict[str, int] | None = None) -> onnx.ModelProto:
    """MatMulNBitsQuantizer as the GenAI builder's to_nbits calls it: rtn / k_quant get every MatMul's bits in
    customized_weight_config (the quantizer's own per-node default is 4)."""
    model = ir.to_proto(_model(weights))
    algo_config = None
    if method != "default":
        config = {f"{name}/MatMul": {"bits": (node_bits or {}).get(f"{name}/MatMul", bits)} for name in weights}
        algo_config = {"rtn": RTNWeightOnlyQuantConfig, "k_quant": KQuantWeightOnlyQuantConfig}[method](
            customized_weight_config=config)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level, nodes_to_exclude=exclude or [],
                                     algo_config=algo_config)
    quantizer.process()
    return quantizer.model.model


def _initializer_arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _assert_same(ours: onnx.ModelProto, theirs: onnx.ModelProto, ordered: bool = True) -> None:
    """Same initializers byte for byte and the same nodes (in the same order, unless the reference re-sorts them:
    rtn_quantize appends its new nodes and sorts topologically)."""
    a, b = _initializer_arrays(ours), _initializer_arrays(theirs)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name
    nodes = [[n.SerializeToString() for n in model.graph.node] for model in (ours, theirs)]
    assert nodes[0] == nodes[1] if ordered else sorted(nodes[0]) == sorted(nodes[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
def test_byte_identical_to_onnxruntime_quantizer(dtype, symmetric, chunked, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    # K = 96 divides 32, K = 100 needs padding; 32 x 40 has fewer rows than block 128.
    weights = {"w0": _weight(rng, 96, 100, dtype), "w1": _weight(rng, 100, 40, dtype),
               "w2": _weight(rng, 40, 24, dtype)}
    if chunked:
        monkeypatch.setattr(quantize, "SLAB_BYTES", 7 * 100 * 4)  # a few columns per slab, uneven last slab
    for block_size, accuracy_level in ((32, 4), (128, 0)):
        ours = quantize_matmuls(_model(weights, chunked), QuantScheme(4, block_size, symmetric), accuracy_level)
        _assert_same(ir.to_proto(ours), _reference(weights, block_size, symmetric, accuracy_level))


@pytest.mark.parametrize("method", ["default", "rtn", "k_quant"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_every_method_and_bit_width_byte_identical_to_onnxruntime_quantizer(method, bits, symmetric,
                                                                             monkeypatch) -> None:
    rng = np.random.default_rng(10)
    # Even block counts along K (the reference packs 4-bit zero points across columns otherwise); K = 100 is padded.
    weights = {"w0": _weight(rng, 64, 100, np.float32), "w1": _weight(rng, 100, 64, np.float32)}
    monkeypatch.setattr(quantize, "SLAB_BYTES", 9 * 100 * 4)
    monkeypatch.setattr(quantize, "K_QUANT_SLAB_BYTES", 9 * 100 * 4)
    scheme = QuantScheme(bits, 32, symmetric, method)
    ours = quantize_matmuls(_model(weights, chunked=True), scheme, 4)
    theirs = _reference(weights, 32, symmetric, 4, bits=bits, method=method)
    _assert_same(ir.to_proto(ours), theirs, ordered=method == "default")
    names = {t.name for t in theirs.graph.initializer}
    assert set(scheme.names("w0").values()) <= names  # the reference's names, zero points only where it has them


@pytest.mark.parametrize("method", ["rtn", "k_quant"])
def test_per_node_bits_equal_customized_weight_config(method) -> None:
    """Mixed precision: per-node bits as the GenAI builder passes them (customized_weight_config), one node excluded."""
    rng = np.random.default_rng(11)
    weights = {"w0": _weight(rng, 64, 64, np.float32), "w1": _weight(rng, 64, 64, np.float32),
               "w2": _weight(rng, 64, 32, np.float32)}
    bits = {"w0/MatMul": 8, "w1/MatMul": 4}

    def plan(node: ir.Node) -> QuantScheme | None:
        return None if node.name == "w2/MatMul" else QuantScheme(bits[node.name], 32, True, method)

    ours = quantize_matmuls(_model(weights), plan, 4)
    _assert_same(ir.to_proto(ours), _reference(weights, 32, True, 4, exclude=["w2/MatMul"], method=method,
                                               node_bits=bits), ordered=False)
    assert {n.name: n.attributes["bits"].value for n in ours.graph if n.op_type == "MatMulNBits"} == {
        "w0/MatMul_Q8": 8, "w1/MatMul_Q4": 4}


@pytest.mark.parametrize("method", ["rtn", "k_quant"])
@pytest.mark.parametrize("bits", [4, 8])
def test_odd_block_count_zero_points_in_matmulnbits_layout(method, bits, tmp_path) -> None:
    """K = 72 (3 blocks) and K = 8 (1 block, a tiny LoRA B): the reference packs 4-bit zero points of the flattened
    [N * blocks] array and cannot reshape them to [N, ...]; ours packs them per column as MatMulNBits reads them. The
    weights MatMulNBits then applies equal those onnxruntime's own routine computes."""
    rng = np.random.default_rng(12)
    for k in (72, 8):
        w = _weight(rng, k, 10, np.float32)
        model = quantize_matmuls(_model({"w": w}), QuantScheme(bits, 32, False, method), 0)
        session = ort.InferenceSession(ir.to_proto(model).SerializeToString())
        eye = np.eye(k, dtype=np.float32)
        applied = session.run(None, {"x": eye, "y_in": np.zeros((k, 3), np.float32)})[0]  # = the dequantized W
        padded = np.pad(w, ((0, -k % 32), (0, 0)))
        if method == "k_quant":
            q, scale, zp = quant_tensor_k_quant_cpu(padded.T, bits, 32)
        else:
            q, scale, zp = quant_tensor(padded.T, bits, 32, "asym", "uint", 1)
        expected = ((q - zp) * scale.astype(np.float32)).reshape(10, -1)[:, :k].T
        np.testing.assert_allclose(applied, expected, rtol=0, atol=1e-6)


def test_rtn_and_k_quant_leave_subgraph_matmuls_as_the_reference_does() -> None:
    """rtn_quantize walks the main graph only; the default path also quantizes If/Loop bodies (tested below)."""
    model = _if_model(np.random.default_rng(13))
    quantize_matmuls(model, QuantScheme(method="rtn"), 4)
    assert [n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_type.startswith("Mat")] == [
        "MatMul", "MatMul"]


def test_outputs_equal_onnxruntime_quantizer_and_track_float(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    weights = {"w0": _weight(rng, 64, 72, np.float32), "w1": _weight(rng, 72, 48, np.float32)}
    ir.save(quantize_matmuls(_model(weights, chunked=True), QuantScheme(), 4), tmp_path / "ours.onnx")
    onnx.save(_reference(weights, 32, True, 4), tmp_path / "theirs.onnx")
    feeds = {"x": rng.standard_normal((5, 64)).astype(np.float32), "y_in": np.zeros((64, 3), np.float32)}
    ours = ort.InferenceSession(str(tmp_path / "ours.onnx")).run(None, feeds)[0]
    theirs = ort.InferenceSession(str(tmp_path / "theirs.onnx")).run(None, feeds)[0]
    np.testing.assert_array_equal(ours, theirs)
    exact = feeds["x"] @ weights["w0"] @ weights["w1"]
    assert np.abs(ours - exact).max() < 0.2 * np.abs(exact).max()


def test_exclude_keeps_float_matmul_like_nodes_to_exclude() -> None:
    rng = np.random.default_rng(2)
    weights = {"w0": _weight(rng, 64, 64, np.float32), "w1": _weight(rng, 64, 32, np.float32)}
    ours = quantize_matmuls(_model(weights), lambda node: None if node.name == "w1/MatMul" else QuantScheme(), 4)
    _assert_same(ir.to_proto(ours), _reference(weights, 32, True, 4, exclude=["w1/MatMul"]))
    ops = [n.op_type for n in ours.graph]
    assert ops == ["MatMulNBits", "MatMul", "MatMul"] and "w1" in ours.graph.initializers
    assert "w0" not in ours.graph.initializers  # the float weight left without users is dropped


def _if_model(rng: np.random.Generator) -> ir.Model:
    """An If whose two branches MatMul the input by one outer-scope initializer w [64, 16]."""
    w = _weight(rng, 64, 16, np.float32)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["b", 64]))
    cond = ir.Value(name="cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    init = _initializer(ir.tensor(w, name="w"))
    branches = []
    for branch_name in ("then", "else"):
        node = ir.node("MatMul", [x, init], name=f"{branch_name}/MatMul", num_outputs=1)
        node.outputs[0].name = f"{branch_name}_out"
        node.outputs[0].type, node.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["b", 16])
        branches.append(ir.Graph([], node.outputs, nodes=[node], name=branch_name))
    if_node = ir.node("If", [cond], attributes={"then_branch": branches[0], "else_branch": branches[1]},
                      name="if", num_outputs=1)
    if_node.outputs[0].name = "out"
    if_node.outputs[0].type, if_node.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["b", 16])
    return ir.Model(ir.Graph([x, cond], if_node.outputs, nodes=[if_node], initializers=[init],
                             opset_imports={"": 21}, name="main"), ir_version=10)


def test_matmul_inside_a_subgraph_uses_the_outer_initializer() -> None:
    rng = np.random.default_rng(3)
    model = _if_model(rng)
    w = model.graph.initializers["w"].const_value.numpy()
    quantize_matmuls(model, QuantScheme(), 4)
    assert sorted(model.graph.initializers) == ["w_Q4", "w_scales"]  # one quantized copy, shared by both branches
    inner = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_type.startswith("MatMul")]
    assert [n.op_type for n in inner] == ["MatMulNBits", "MatMulNBits"]
    assert inner[0].inputs[1] is inner[1].inputs[1] is model.graph.initializers["w_Q4"]
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    feeds = {"x": rng.standard_normal((2, 64)).astype(np.float32), "cond": np.array(True)}
    got = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]
    assert np.abs(got - feeds["x"] @ w).max() < 0.2 * np.abs(feeds["x"] @ w).max()


def test_quantizing_is_lazy_and_streams_one_weight_at_a_time(monkeypatch) -> None:
    """Rewriting the graph reads no weight; saving computes each weight's int4 form once (packed and scales from one
    kernel run), reading a chunked weight only a slab of columns at a time."""
    rng = np.random.default_rng(4)
    arrays = {"w0": _weight(rng, 64, 96, np.float32), "w1": _weight(rng, 96, 32, np.float32)}
    reads: list[tuple[str, int, int]] = []

    def chunked(name: str) -> ColumnChunkedTensor:
        def columns(c0: int, c1: int) -> np.ndarray:
            reads.append((name, c0, c1))
            return np.ascontiguousarray(arrays[name][:, c0:c1])

        return ColumnChunkedTensor(columns, ir.DataType.FLOAT, arrays[name].shape, name)

    monkeypatch.setattr(quantize, "SLAB_BYTES", 64 * 4 * 40)  # 40 columns of w0 (K 64), 26 of w1 (K 96) per slab
    model = _model(arrays)
    for name in arrays:
        model.graph.initializers[name].const_value = chunked(name)
    quantize_matmuls(model, QuantScheme(), 4)
    assert reads == []
    proto = ir.to_proto(model)  # serializes every initializer
    assert sorted(reads) == [("w0", 0, 40), ("w0", 40, 80), ("w0", 80, 96), ("w1", 0, 26), ("w1", 26, 32)]
    _assert_same(proto, _reference(arrays, 32, True, 4))


def test_cache_shares_quantized_tensors_between_models() -> None:
    rng = np.random.default_rng(5)
    shared = ir.tensor(_weight(rng, 64, 32, np.float32), name="w0")
    models = [_model({"w0": np.zeros((64, 32), np.float32)}) for _ in range(2)]
    for model in models:
        model.graph.initializers["w0"].const_value = shared
    cache = QuantizationCache()
    for model in models:
        quantize_matmuls(model, QuantScheme(), 4, cache=cache)
    a, b = (m.graph.initializers for m in models)
    assert a["w0_Q4"].const_value is b["w0_Q4"].const_value
    assert a["w0_scales"].const_value is b["w0_scales"].const_value


def test_rejects_bad_block_size() -> None:
    for block_size in (8, 48):
        with pytest.raises(ValueError, match="block_size"):
            QuantScheme(block_size=block_size)
