"""Self-routing text decoder: one graph that applies the LoRA adapter of the conversation's input mode.

onnxruntime-genai cannot switch adapters for phi4mm, and it feeds a decoder nothing that names the input mode. What it
does feed, to a decoder that declares it, is ``input_ids``: the prompt with one image or audio placeholder id per
feature row (the checkpoint's ``image_token_id`` / ``audio_token_id``), then the new ids of each step. The graph reads
the mode from those ids and keeps it across steps in one extra KV-cache "layer", which the runtime allocates, carries
and rewinds like every other layer:

- each call writes, for each of its positions, a value row whose first two channels say "this call holds an image
  placeholder" / "an audio placeholder" (FLAG, else 0);
- a GroupQueryAttention with zero queries over that layer averages the value rows of every position so far (softmax of
  equal scores), so a channel is positive exactly when some call of the conversation set it.

The mode is then the original model's rule for the whole conversation: any image -> vision LoRA (also with audio),
else any audio -> speech LoRA, else no LoRA. The LoRA branches, built as separate MatMuls next to the base MatMul,
move into ``If`` nodes, one per adapter and projection, chained: ``x = If(vision){base + vision LoRA} else {base}``,
then ``If(speech){x + speech LoRA} else {x}``. The base MatMuls stay in the main graph, so every base weight has one
kernel (prepacked once), and a mode computes only its own adapter.

Limit: with ``search.chunk_size`` (chunked prefill) a chunk is routed by the placeholders seen up to that chunk, so
media must start in the first chunk; the package does not set chunk_size.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from builder_plugin.components.decoder.kv import KVLayer
from builder_plugin.components.decoder.lora_names import parse_lora_node
from builder_plugin.graph import MS_DOMAIN
from builder_plugin.layout import INPUT_IDS, INPUTS_EMBEDS

FLAG = 1024.0  # large enough that flag / context_length stays a normal fp16 number
ROUTED_ADAPTERS = ("vision", "speech")  # If order: vision first, as an image wins over audio


class _Emitter:
    """Appends nodes to a graph with unique names under one prefix."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph = graph
        self.prefix = prefix
        self.count = 0

    def __call__(self, op: str, inputs: list[ir.Value | None], domain: str = "", **attributes: object) -> ir.Value:
        self.count += 1
        node = ir.node(op, inputs, attributes=attributes or None, domain=domain,
                       name=f"{self.prefix}/{op}_{self.count}", num_outputs=1)
        node.outputs[0].name = f"{node.name}/output_0"
        self.graph.append(node)
        return node.outputs[0]

    def const(self, array: np.ndarray, name: str) -> ir.Value:
        return self("Constant", [], value=ir.tensor(array, name=f"{self.prefix}/{name}"))


def add_mode_state(model: ir.Model, num_layers: int, kv_heads: int, head_size: int,
                   placeholder_ids: tuple[int, int]) -> tuple[ir.Value, ir.Value]:
    """Add ``input_ids`` and the mode KV layer to a decoder graph; returns the (is_vision, is_speech) booleans.
    `placeholder_ids`: the (image, audio) placeholder token ids."""
    graph = model.graph
    first_past = graph.inputs[[v.name for v in graph.inputs].index(KVLayer(0).past_key)]
    first_present = next(v for v in graph.outputs if v.name == KVLayer(0).present_key)
    gqa = next(n for n in graph if n.op_type == "GroupQueryAttention")
    seqlens_k, total_length = gqa.inputs[5], gqa.inputs[6]
    embeds = next(v for v in graph.inputs if v.name == INPUTS_EMBEDS)
    dtype = first_past.dtype
    np_dtype = dtype.numpy()
    state = KVLayer(num_layers)  # the mode's layer, after the model's own

    ids = ir.Value(name=INPUT_IDS, shape=ir.Shape(["batch_size", "sequence_length"]),
                   type=ir.TensorType(ir.DataType.INT64))
    past = {name: ir.Value(name=name, shape=first_past.shape, type=first_past.type)
            for name in (state.past_key, state.past_value)}
    graph.inputs.extend([ids, *past.values()])

    emit = _Emitter(graph, "/model/mode")
    width = kv_heads * head_size
    seen = []
    for token in placeholder_ids:
        hit = emit("Cast", [emit("Equal", [ids, emit.const(np.array(token, np.int64), f"token_{token}")])],
                   to=ir.DataType.FLOAT)
        seen.append(emit("ReduceMax", [hit], keepdims=0))  # over the whole call: 1.0 if the placeholder occurs
    flags = emit("Mul", [emit("Concat", [emit("Unsqueeze", [f, emit.const(np.array([0], np.int64), "axis0")])
                                          for f in seen], axis=0),
                         emit.const(np.array(FLAG, np.float32), "flag")])
    row = emit("Concat", [flags, emit.const(np.zeros(width - 2, np.float32), "zeros")], axis=0)  # [width]
    rows_shape = emit("Concat", [emit("Slice", [emit("Shape", [embeds]), emit.const(np.array([0], np.int64), "s0"),
                                                emit.const(np.array([2], np.int64), "s2")]),
                                 emit.const(np.array([width], np.int64), "width")], axis=0)  # [batch, seq, width]
    value = emit("Cast", [emit("Expand", [row, rows_shape])], to=dtype)
    zeros = emit("ConstantOfShape", [rows_shape], value=ir.tensor(np.zeros(1, np_dtype)))
    attention = ir.node(
        "GroupQueryAttention", [zeros, zeros, value, past[state.past_key], past[state.past_value], seqlens_k,
                                total_length],
        attributes={"num_heads": kv_heads, "kv_num_heads": kv_heads, "scale": 1.0, "do_rotary": 0},
        domain=MS_DOMAIN, name="/model/mode/GroupQueryAttention", num_outputs=3)
    graph.append(attention)
    averaged, present_key, present_value = attention.outputs
    averaged.name = "/model/mode/GroupQueryAttention/output_0"
    for out, name in ((present_key, state.present_key), (present_value, state.present_value)):
        out.name = name
        out.shape = first_present.shape
        out.type = first_present.type
        graph.outputs.append(out)

    # Position 0 of this call has attended to every earlier position and to this call's own flags.
    first = emit("Gather", [emit("Gather", [averaged, emit.const(np.array(0, np.int64), "i0")], axis=1),
                            emit.const(np.array(0, np.int64), "b0")], axis=0)  # [width]
    first = emit("Cast", [first], to=ir.DataType.FLOAT)
    zero = emit.const(np.array(0.0, np.float32), "zero")
    image_seen = emit("Greater", [emit("Gather", [first, emit.const(np.array(0, np.int64), "c0")], axis=0), zero])
    audio_seen = emit("Greater", [emit("Gather", [first, emit.const(np.array(1, np.int64), "c1")], axis=0), zero])
    is_speech = emit("And", [emit("Not", [image_seen]), audio_seen])
    image_seen.name = "/model/mode/is_vision"
    is_speech.name = "/model/mode/is_speech"
    model.opset_imports.setdefault(MS_DOMAIN, 1)
    return image_seen, is_speech


@dataclass
class _Site:
    """One projection output with LoRA: the base MatMul's output and, per adapter, its B MatMul and Add."""

    base: ir.Value
    out: ir.Value  # the value after the last LoRA Add: what the rest of the graph reads
    b_nodes: dict[str, ir.Node]
    add_nodes: dict[str, ir.Node]


def route_lora_branches(model: ir.Model, is_vision: ir.Value, is_speech: ir.Value) -> int:
    """Move every LoRA branch (A MatMul -> B MatMuls -> Adds, one set per adapter) into If nodes selected by the mode;
    returns the number of If nodes made. Each projection may carry any of the adapters in ROUTED_ADAPTERS."""
    graph = model.graph
    groups: dict[str, dict[str, ir.Node]] = defaultdict(dict)  # owner -> adapter -> A node
    for node in graph:
        part = parse_lora_node(node.name)
        if part is not None and part.part == "A":
            groups[part.site][part.adapter] = node
    routed = 0
    conditions = {"vision": is_vision, "speech": is_speech}
    for owner, a_nodes in groups.items():
        if not set(a_nodes) <= set(ROUTED_ADAPTERS):
            raise ValueError(f"{owner}: LoRA adapters {sorted(a_nodes)}, expected some of {list(ROUTED_ADAPTERS)}")
        sites = _sites(a_nodes)
        outputs = _route_group(graph, owner, a_nodes, sites, conditions)
        for site, new in zip(sites, outputs):
            ir.convenience.replace_all_uses_with(site.out, new)
            if site.out.is_graph_output():
                raise ValueError(f"{owner}: a LoRA output is a graph output")
        graph.remove([*a_nodes.values(), *(n for s in sites for n in (*s.b_nodes.values(), *s.add_nodes.values()))],
                     safe=True)
        routed += len(a_nodes)
    graph.sort()
    return routed


def _sites(a_nodes: dict[str, ir.Node]) -> list[_Site]:
    """The projections fed by one owner's A MatMuls, in a stable order, each with its B and Add per adapter."""
    by_base: dict[int, _Site] = {}
    order: list[int] = []
    for adapter in (a for a in ROUTED_ADAPTERS if a in a_nodes):
        for b_node in [use.node for use in a_nodes[adapter].outputs[0].uses()]:
            (add_use,) = list(b_node.outputs[0].uses())
            add = add_use.node
            base = add.inputs[1 - add_use.idx]  # the base output, or the previous adapter's Add: walk back to it
            while base.producer() is not None and _part(base.producer()) == "Add":
                base = next(i for i in base.producer().inputs if i.producer() is None or _part(i.producer()) != "B")
            key = id(base)
            if key not in by_base:
                by_base[key] = _Site(base, add.outputs[0], {}, {})
                order.append(key)
            site = by_base[key]
            site.b_nodes[adapter] = b_node
            site.add_nodes[adapter] = add
    for site in by_base.values():
        site.out = _last_add(site)
    return [by_base[k] for k in order]


def _part(node: ir.Node) -> str | None:
    """Which part of a LoRA branch `node` is ("A", "B", "Add"), or None."""
    part = parse_lora_node(node.name)
    return part.part if part is not None else None


def _last_add(site: _Site) -> ir.Value:
    """The Add output no other LoRA Add of the site reads."""
    adds = set(site.add_nodes.values())
    for add in adds:
        if not any(use.node in adds for use in add.outputs[0].uses()):
            return add.outputs[0]
    raise ValueError("LoRA Adds form a cycle")


def _route_group(graph: ir.Graph, owner: str, a_nodes: dict[str, ir.Node], sites: list[_Site],
                 conditions: dict[str, ir.Value]) -> list[ir.Value]:
    """One If per adapter, in sequence: ``If(mode){x + LoRA(input)} else {x}``, x being the previous If's output
    (the base MatMul's for the first). The modes exclude each other, so at most one adds its LoRA.

    The Ifs are chained, not nested: onnxruntime prepacks a weight read from an If branch only when the weight is an
    initializer of the graph right above the branch; a nested branch's MatMulNBits ran unpacked (about 9x slower
    decoding in that mode, and a dequantized copy of the adapter in memory)."""
    current = [site.base for site in sites]
    for adapter in (a for a in ROUTED_ADAPTERS if a in a_nodes):
        branch = _adapter_branch(owner, adapter, a_nodes[adapter], sites, current)
        identity_nodes = [ir.node("Identity", [value], name=f"{owner}/lora.{adapter}/skip/Identity_{i}",
                                  num_outputs=1) for i, value in enumerate(current)]
        for node in identity_nodes:
            node.outputs[0].name = f"{node.name}/output_0"
        skip = ir.Graph([], [n.outputs[0] for n in identity_nodes], nodes=identity_nodes,
                        name=f"{owner}/lora.{adapter}/skip")
        node = _if_node(f"{owner}/lora.{adapter}/If", conditions[adapter], branch, skip, sites)
        graph.append(node)
        current = list(node.outputs)
    return current


def _if_node(name: str, cond: ir.Value, then_graph: ir.Graph, else_graph: ir.Graph, sites: list[_Site]) -> ir.Node:
    node = ir.node("If", [cond], attributes={"then_branch": then_graph, "else_branch": else_graph}, name=name,
                   num_outputs=len(sites))
    for i, (out, site) in enumerate(zip(node.outputs, sites)):
        out.name = f"{name}/output_{i}"
        out.shape = site.out.shape
        out.type = site.out.type
    return node


def _adapter_branch(owner: str, adapter: str, a_node: ir.Node, sites: list[_Site],
                    inputs: list[ir.Value]) -> ir.Graph:
    """A branch graph computing input + LoRA for every site of the group (`inputs`: one value per site).

    The adapter weights stay main-graph initializers read from the branch (outer scope): onnxruntime then prepacks
    them once and frees the raw copy, which it does not do for initializers held inside a branch graph. Measured at
    full size, int4 CPU, with onnxruntime's own kernels: the same anonymous memory either way, and 0.4 GB more of the
    data file's pages resident in the branch form (an earlier count gave ~0.8 GB more resident). With the kernel
    library, which reads weights in place, the two forms hold the same memory, and the branch form decoded 1-3 %
    faster in pairs (1.031 text, 1.011 image, quartiles either side of 1): the outer-scope reads, not the Ifs
    themselves, are most of the routing's cost (an If whose branches read no outer weight ran at 1.006 of the If-free
    graph's step time, the routed graph at 1.020). The branch form is not an option anyway: onnxruntime 1.32 loads a
    branch's own initializers only where the data file is not a symbolic link, which a Hugging Face snapshot's files
    are."""
    nodes: list[ir.Node] = []

    def clone(node: ir.Node, inputs: list[ir.Value]) -> ir.Node:
        copy = ir.node(node.op_type, inputs, attributes=dict(node.attributes), domain=node.domain,
                       name=node.name, num_outputs=1)
        copy.outputs[0].name = node.outputs[0].name
        copy.outputs[0].shape = node.outputs[0].shape
        copy.outputs[0].type = node.outputs[0].type
        nodes.append(copy)
        return copy

    a_copy = clone(a_node, list(a_node.inputs))  # MatMul, or MatMulNBits with its scales (and zero points)
    outputs = []
    for site, value in zip(sites, inputs):
        b_node = site.b_nodes[adapter]
        b_copy = clone(b_node, [a_copy.outputs[0], *b_node.inputs[1:]])
        add = ir.node("Add", [value, b_copy.outputs[0]], name=site.add_nodes[adapter].name, num_outputs=1)
        add.outputs[0].name = f"{add.name}/output_0"
        add.outputs[0].shape = site.out.shape
        add.outputs[0].type = site.out.type
        nodes.append(add)
        outputs.append(add.outputs[0])
    return ir.Graph([], outputs, nodes=nodes, name=f"{owner}/lora.{adapter}")
