"""The passes on the GenAI builder's output, on small graphs made here: the LongRoPE caches leave the If branches for
main-graph initializers (shared between the variants of a build, the same answers in onnxruntime before and after),
and the shape annotations the builder gets wrong are corrected."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from builder_plugin.components.decoder.passes import fix_declared_shapes, hoist_rope_caches
from builder_plugin.errors import DecoderBuildError

FLOAT = ir.TensorType(ir.DataType.FLOAT)


def constant(name: str, array: np.ndarray) -> ir.Node:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(array, name=name)}, name=f"{name}/Constant")
    node.outputs[0].name = name
    node.outputs[0].type = FLOAT
    node.outputs[0].shape = ir.Shape(array.shape)
    return node


def rope_switch(short: np.ndarray, long: np.ndarray) -> ir.Model:
    """long ? (cos_cache_large, sin_cache_large) : (cos_cache_small, sin_cache_small), as Constants in the branches
    (the builder's LongRoPE switch), each output added to x so the caches reach the graph outputs."""
    cond = ir.val("long", shape=[], type=ir.TensorType(ir.DataType.BOOL))
    x = ir.val("x", shape=list(short.shape), type=FLOAT)
    branches = {}
    for size, caches in (("large", long), ("small", short)):
        nodes = [constant(f"cos_cache_{size}", caches), constant(f"sin_cache_{size}", -caches)]
        branches[size] = ir.Graph([], [n.outputs[0] for n in nodes], nodes=nodes, name=size)
    switch = ir.node("If", [cond], attributes={"then_branch": branches["large"], "else_branch": branches["small"]},
                     name="/model/rotary_emb/If", num_outputs=2)
    adds = []
    for i, out in enumerate(switch.outputs):
        out.name, out.type = f"/model/rotary_emb/If/output_{i}", FLOAT
        add = ir.node("Add", [x, out], name=f"/model/out/Add_{i}")
        add.outputs[0].name = f"y{i}"
        adds.append(add)
    graph = ir.Graph([cond, x], [a.outputs[0] for a in adds], nodes=[switch, *adds], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def run(model: ir.Model, long: bool, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"long": np.array(long), "x": x})


def test_rope_caches_leave_the_branches_and_answer_the_same() -> None:
    rng = np.random.default_rng(0)
    short, long = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    model = rope_switch(short, long)
    before = {flag: run(model, flag, x) for flag in (False, True)}
    shared: dict[str, ir.TensorProtocol] = {}
    hoist_rope_caches(model, shared)
    names = [f"model.rotary_emb.{kind}_cache_{size}" for size in ("large", "small") for kind in ("cos", "sin")]
    assert sorted(shared) == sorted(names) and sorted(model.graph.initializers) == sorted(names)
    np.testing.assert_array_equal(model.graph.initializers["model.rotary_emb.cos_cache_small"].const_value.numpy(),
                                  short)
    switch = next(n for n in model.graph if n.op_type == "If")
    for attr in ("then_branch", "else_branch"):
        branch = switch.attributes[attr].value
        assert [n.op_type for n in branch] == ["Identity", "Identity"]
        assert all(n.inputs[0].name in model.graph.initializers for n in branch)
    for flag, caches in ((False, short), (True, long)):
        after = run(model, flag, x)
        assert [a.tobytes() for a in after] == [a.tobytes() for a in before[flag]]
        np.testing.assert_array_equal(after, [x + caches, x - caches])

    # a second variant of the same build reads the very tensors the first one stored
    other = rope_switch(short, long)
    hoist_rope_caches(other, shared)
    assert all(other.graph.initializers[n].const_value is model.graph.initializers[n].const_value for n in names)
    # caches that differ between variants of one build cannot share a name
    with pytest.raises(DecoderBuildError, match="model.rotary_emb.cos_cache_large differs"):
        hoist_rope_caches(rope_switch(short, long + 1), shared)


def test_wrong_declared_shapes_are_corrected() -> None:
    one = constant("/model/constants/INT64/[1]", np.array([1.0], np.float32))
    one.outputs[0].shape = ir.Shape([])  # the builder declares every constant a scalar
    x = ir.val("x", shape=[2], type=FLOAT)
    reduce = ir.node("ReduceMax", [x], attributes={"keepdims": 0}, name="/model/pos_ids_reformat/ReduceMax")
    reduce.outputs[0].name, reduce.outputs[0].type, reduce.outputs[0].shape = "max", FLOAT, ir.Shape([1])
    shape = ir.node("Shape", [x], name="/model/pos_ids_reformat/Shape")
    shape.outputs[0].name, shape.outputs[0].shape = "shape", ir.Shape([1])
    add = ir.node("Add", [reduce.outputs[0], one.outputs[0]], name="/model/out/Add")
    add.outputs[0].name, add.outputs[0].shape = "y", ir.Shape([1])
    graph = ir.Graph([x], [add.outputs[0], shape.outputs[0]], nodes=[one, reduce, shape, add],
                     opset_imports={"": 21})
    fix_declared_shapes(ir.Model(graph, ir_version=10))
    assert one.outputs[0].shape == ir.Shape([1]) and one.outputs[0].dtype == ir.DataType.FLOAT
    assert reduce.outputs[0].shape is None  # left to shape inference (a scalar, not [1])
    assert shape.outputs[0].shape == ir.Shape([1])  # a graph output keeps its declaration
    assert add.outputs[0].shape == ir.Shape([1])  # not a pos_ids_reformat node
