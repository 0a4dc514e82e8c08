"""Weight-only quantization of a graph's MatMuls: each becomes a com.microsoft MatMulNBits (4 or 8 bits) whose packed
weights, scales and zero points are lazy initializers (`builder_plugin.quant.weights`), computed when the model is
saved, one weight at a time, byte-identical to onnxruntime's MatMulNBitsQuantizer (`builder_plugin.quant.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from builder_plugin.graph import MS_DOMAIN
from builder_plugin.quant.kernels import QuantScheme
from builder_plugin.quant.weights import QUANTIZABLE, QuantizationCache, QuantizedWeight


def is_quantizable_matmul(node: ir.Node) -> bool:
    """A MatMul whose B is a 2-D float (fp32/fp16) initializer."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    weight = node.inputs[1]
    tensor = weight.const_value if weight is not None and weight.is_initializer() else None
    return tensor is not None and tensor.dtype in QUANTIZABLE and len(tensor.shape) == 2


def wants_prepacking(model: ir.Model) -> bool | None:
    """Whether onnxruntime's CPU prepacking helps the graph: True when it has a MatMulNBits (in If bodies included),
    whose packed form is its fast path; False when its MatMul weights are all float, which prepacking copies into
    packed buffers for a few percent of speed; None when it has neither (e.g. the embedding's lookup)."""
    float_weights = False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "MatMulNBits":
            return True
        float_weights = float_weights or is_quantizable_matmul(node)
    return False if float_weights else None


SchemeChoice = QuantScheme | Callable[[ir.Node], QuantScheme | None]


def quantize_matmuls(model: ir.Model, schemes: SchemeChoice, accuracy_level: int, *,
                     cache: QuantizationCache | None = None) -> ir.Model:
    """Replace every MatMul with a constant 2-D float B [K, N] by MatMulNBits, in place; returns `model`.

    `schemes` is one QuantScheme for every MatMul, or a function of the node giving its scheme, None to keep it float
    (nodes_to_exclude). Node `X` becomes `X_Q4` / `X_Q8`; initializer `W` becomes the pieces `QuantScheme.names` lists
    (uint8 [N, ceil(K/bs), bs*bits/8], scales [N, ceil(K/bs)] in the float dtype of W, zero points) -- the names and
    layouts of onnxruntime's MatMulNBitsQuantizer for that method. A float weight left without users is dropped.
    """
    cache = cache or QuantizationCache()
    choose = schemes if callable(schemes) else (lambda node: schemes)
    targets = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        scheme = choose(node) if is_quantizable_matmul(node) else None
        if scheme is not None and (scheme.subgraphs or node.graph is model.graph):
            targets.append((node, scheme))
    for node, scheme in targets:
        _replace(node, scheme, accuracy_level, cache)
    if targets:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return model


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    existing = graph.initializers.get(name)
    if existing is not None:
        if existing.const_value is not tensor:
            raise ValueError(f"initializer {name} already exists with other content")
        return existing
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _replace(node: ir.Node, scheme: QuantScheme, accuracy_level: int, cache: QuantizationCache) -> None:
    activation, weight = node.inputs
    source = weight.const_value
    owner = weight.graph  # the graph that holds the initializer (may enclose the node's subgraph)
    graph = node.graph
    k, n = (int(d) for d in source.shape)
    names = scheme.names(weight.name)
    tensors = cache.tensors(source, scheme, names)
    inputs = [activation] + [_initializer(owner, names[p], tensors[p]) for p in QuantizedWeight.PIECES if p in names]
    attributes: dict[str, int] = {"K": k, "N": n, "bits": scheme.bits, "block_size": scheme.block_size}
    if accuracy_level:  # omitted when 0, as onnxruntime's quantizer does
        attributes["accuracy_level"] = accuracy_level
    attributes = dict(sorted(attributes.items()))  # onnx.helper.make_node's order, as the reference quantizer emits
    new_node = ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN,
                       name=f"{node.name}_Q{scheme.bits}" if node.name else None, num_outputs=1)
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new_node], list(node.outputs),
                                            list(new_node.outputs))
    if not weight.uses() and not weight.is_graph_output():
        owner.initializers.pop(weight.name)
