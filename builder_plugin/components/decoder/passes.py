"""Graph passes on the GenAI builder's output: LongRoPE caches stored as branch initializers, declared shapes fixed."""

from __future__ import annotations

import onnx_ir as ir

from builder_plugin.errors import DecoderBuildError


def store_rope_caches(model: ir.Model, shared: dict[str, ir.TensorProtocol]) -> None:
    """Make the LongRoPE caches, Constant nodes in the If branches, initializers of those branches.

    Initializers go to external data (deduplicated across variants: `shared` holds one tensor per cache) instead of
    bloating each .onnx file, and onnxruntime reads them in the data file's mapped pages. They stay in their branch:
    read there through an Identity of a main-graph initializer, they were folded by onnxruntime into copies of its
    own when a session loaded (68 MB of anonymous memory at full size). The If and its answers are unchanged.
    """
    graph = model.graph
    for node in list(graph):
        if node.op_type != "If":
            continue
        for attr_name in ("then_branch", "else_branch"):
            branch = node.attributes[attr_name].value
            for const in list(branch):
                if const.op_type != "Constant" or "value" not in const.attributes:
                    continue
                out = const.outputs[0]
                tensor = const.attributes["value"].value
                name = f"model.rotary_emb.{out.name}"
                if name not in shared:
                    tensor.name = name
                    shared[name] = tensor
                elif shared[name].tobytes() != tensor.tobytes():
                    raise DecoderBuildError(f"rotary cache {name} differs between decoder variants")
                tensor = shared[name]
                stored = ir.Value(name=out.name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                                  const_value=tensor)
                ir.convenience.replace_all_uses_with(out, stored, replace_graph_outputs=True)
                branch.remove(const, safe=True)
                branch.register_initializer(stored)


def fix_declared_shapes(model: ir.Model) -> None:
    """Correct shape annotations the builder gets wrong, which strict shape inference (onnx.checker full_check)
    rejects: every `/model/constants/...` output is declared a scalar, also the 1-D ones ("[1]"); and on DML the
    LongRoPE position-id subgraph declares ReduceMax(keepdims=0) as [1]. ONNX-domain values are re-inferred exactly,
    so the wrong ones are replaced by the real shape or dropped."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Constant" and "value" in node.attributes:
            tensor = node.attributes["value"].value
            node.outputs[0].shape = ir.Shape(tensor.shape)
            node.outputs[0].dtype = tensor.dtype
        elif (node.name or "").startswith("/model/pos_ids_reformat/") and node.domain == "":
            for out in node.outputs:
                if not out.is_graph_output():
                    out.shape = None
