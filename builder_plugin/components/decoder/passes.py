"""Graph passes on the GenAI builder's output: LongRoPE caches out of the If branches, declared shapes fixed."""

from __future__ import annotations

import onnx_ir as ir

from builder_plugin.errors import DecoderBuildError


def hoist_rope_caches(model: ir.Model, shared: dict[str, ir.TensorProtocol]) -> None:
    """Move the LongRoPE caches out of the If-branch Constant nodes into main-graph initializers.

    Initializers go to external data (deduplicated across variants) instead of bloating each .onnx file; each branch
    keeps an Identity of its outer-scope cache, so the If and the runtime behaviour are unchanged. onnxruntime folds
    those Identity nodes into copies of the caches when a session loads (68 MB of anonymous memory at full size), and
    no other form avoids it: it refuses a branch that returns an outer-scope value without a node, and a branch's own
    initializers with external data load only where the data file is not a symbolic link (1.32: "should be stored in
    ... but it is a symbolic link"), which a Hugging Face snapshot folder's files are.
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
                name = f"model.rotary_emb.{out.name}"  # must differ from the branch output it feeds
                if name not in shared:
                    tensor.name = name
                    shared[name] = tensor
                elif shared[name].tobytes() != tensor.tobytes():
                    raise DecoderBuildError(f"rotary cache {name} differs between decoder variants")
                tensor = shared[name]
                outer = graph.initializers.get(name)
                if outer is None:
                    outer = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                                     const_value=tensor)
                    graph.register_initializer(outer)
                identity = ir.node("Identity", [outer], name=f"{const.name}/Identity", num_outputs=1)
                ir.convenience.replace_nodes_and_values(branch, const, [const], [identity], [out],
                                                        [identity.outputs[0]])


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
