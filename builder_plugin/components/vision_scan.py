"""SigLIP one crop at a time: the vision graph's per-crop part (patch and position embedding, the encoder layers and the
2x2 pooling) moved into a Scan over the valid crops, for CPU packages.

A whole photo is up to 37 crops of 1,025 patches. Run as one batch, each of SigLIP's activations holds every crop,
and onnxruntime's arena keeps the largest of them for the session's life (2.0 GB after a 2048 x 1536 photo's 21 crops,
full size, measured with the vision graph alone); the products then also meet more rows than stay in the caches
(2.2 s a crop against 1.9 s a crop for a 448 x 448 image's two). A Scan runs the same nodes on one crop per
iteration, so the activations are one crop's. Each crop's computation is the batch's row for row: nothing in the part
mixes crops. The weights stay initializers of the main graph, read from the body (onnxruntime prepacks those).
Only the CPU provider gets it (not every provider runs Scan).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

SCAN_NAME = "vision/crops/Scan"


def scan_crops(graph: ir.Graph, pixels: ir.Value, mask: ir.Value, pooled: ir.Value, hidden_size: int) -> None:
    """Move the nodes that compute `pooled` ([crops * G * G, hidden]) from `pixels` ([crops, 3, S, S]) and `mask`
    ([crops, P, P]) into a Scan over their first axis, in place. Raises ValueError if that part reads anything else
    than those two and initializers, or if a value of it other than `pooled` is read outside it."""
    part = _part(graph, {pixels, mask}, pooled)
    inside = set(part)
    for node in part:
        for value in node.outputs:
            if value is not pooled and any(use.node not in inside for use in value.uses()):
                raise ValueError(f"vision: {value.name} of the per-crop part is read outside it")

    body_nodes: list[ir.Node] = []
    zero = _node(body_nodes, "Constant", [], "vision/crops/axis", value=ir.tensor(np.array([0], np.int64)))
    renamed: dict[ir.Value, ir.Value] = {}  # the part's values -> the body's
    crops = []  # the body's inputs: one crop of each
    for outer in (pixels, mask):
        crop = ir.Value(name=f"{outer.name}/crop", type=outer.type,
                        shape=ir.Shape(outer.shape[1:]) if outer.shape is not None else None)
        crops.append(crop)
        renamed[outer] = _node(body_nodes, "Unsqueeze", [crop, zero], f"{outer.name}/crop/Unsqueeze")
    for node in part:
        copy = ir.node(node.op_type, [renamed.get(v, v) for v in node.inputs], attributes=dict(node.attributes),
                       domain=node.domain, name=node.name, num_outputs=len(node.outputs))
        for old, new in zip(node.outputs, copy.outputs):
            new.name, new.shape, new.type = old.name, old.shape, old.type
            renamed[old] = new
        body_nodes.append(copy)
    body = ir.Graph(crops, [renamed[pooled]], nodes=body_nodes, name="vision/crops")

    scan = ir.node("Scan", [pixels, mask], attributes={"body": body, "num_scan_inputs": 2}, name=SCAN_NAME,
                   num_outputs=1)
    scan.outputs[0].name = f"{SCAN_NAME}/output_0"
    flat_shape = ir.Value(name="vision/crops/flat_shape", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.INT64),
                          const_value=ir.tensor(np.array([-1, hidden_size], np.int64), name="vision/crops/flat_shape"))
    graph.register_initializer(flat_shape)
    flat = ir.node("Reshape", [scan.outputs[0], flat_shape], name="vision/crops/Reshape", num_outputs=1)
    flat.outputs[0].name = "vision/crops/pooled"
    flat.outputs[0].shape, flat.outputs[0].type = pooled.shape, pooled.type
    first_reader = next(node for node in graph if any(use.node is node for use in pooled.uses()))
    graph.insert_before(first_reader, [scan, flat])
    pooled.replace_all_uses_with(flat.outputs[0])
    graph.remove(part, safe=True)


def _part(graph: ir.Graph, starts: set[ir.Value], end: ir.Value) -> list[ir.Node]:
    """The nodes `end` depends on back to `starts`, in graph order; anything else they read must be an
    initializer."""
    found: set[ir.Node] = set()
    stack = [end.producer()]
    while stack:
        node = stack.pop()
        if node is None or node in found:
            continue
        found.add(node)
        for value in node.inputs:
            if value is None or value in starts or value.is_initializer():
                continue
            if value.producer() is None:
                raise ValueError(f"vision: the per-crop part reads {value.name}, not one crop's")
            stack.append(value.producer())
    return [node for node in graph if node in found]


def _node(nodes: list[ir.Node], op: str, inputs: list[ir.Value], name: str, **attributes: object) -> ir.Value:
    node = ir.node(op, inputs, attributes=attributes, name=name, num_outputs=1)
    node.outputs[0].name = f"{name}/output_0"
    nodes.append(node)
    return node.outputs[0]
