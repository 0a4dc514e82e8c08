"""The LoRA node names: the one format and its parser agree (also on the names the quantizer gives the MatMuls it
rewrites), other names are refused, and a float decoder built by the GenAI builder subclass names every LoRA node and
weight this way."""

from __future__ import annotations

import pytest

from builder_plugin.components.decoder import DecoderBuilder
from builder_plugin.components.decoder.lora_names import LoraNode, lora_node, parse_lora_node, weight_name
from builder_plugin.layout import SPLIT_DECODERS
from builder_plugin.options import BuildOptions
from builder_plugin.spec import Component

SITES = ("/model/layers.0/attn/qkv_proj", "/model/layers.12/mlp/gate_proj", "/model/layers.3/attn/o_proj")


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("adapter", ["vision", "speech"])
@pytest.mark.parametrize("part", ["A", "B", "Add"])
def test_format_and_parse_round_trip(site: str, adapter: str, part: str) -> None:
    name = lora_node(site, adapter, part)
    assert name.startswith(f"{site}/lora")
    assert parse_lora_node(name) == LoraNode(site, adapter, part)
    if part != "Add":  # the quantizer renames the MatMuls it rewrites
        for suffix in ("_Q4", "_Q8"):
            assert parse_lora_node(name + suffix) == LoraNode(site, adapter, part)


@pytest.mark.parametrize("name", [
    None, "", "/model/layers.0/attn/qkv_proj/MatMul", "/model/layers.0/attn/qkv_proj/MatMul_Q4",
    "/model/layers.0/attn/qkv_proj/lora_A.vision/Add",  # an Add of a matrix
    "/model/layers.0/attn/qkv_proj/lora.vision/MatMul",  # a MatMul of the sum
    "/model/layers.0/attn/qkv_proj/lora_C.vision/MatMul", "/model/layers.0/attn/qkv_proj/lora_A.vision/Mul",
    "/model/layers.0/attn/qkv_proj/lora_A.vision/MatMul/extra", "/model/layers.0/attn/qkv_proj/lora_A./MatMul",
])
def test_other_names_are_not_lora_nodes(name: str | None) -> None:
    assert parse_lora_node(name) is None


def test_weight_names_follow_the_node_names() -> None:
    assert weight_name("/model/layers.0/attn/qkv_proj/lora_A.vision/MatMul") == (
        "model.layers.0.attn.qkv_proj.lora_A.vision.MatMul.weight")


def test_the_genai_builder_subclass_writes_these_names(tiny_checkpoint, tiny_config, tiny_weights) -> None:
    """In a float decoder with the vision LoRA: every LoRA node parses, its weight is named after it, and each layer
    has one A per source projection (packed qkv and gate_up share theirs) and a B and an Add per projection."""
    options = BuildOptions(model_dir=tiny_checkpoint, output_dir=tiny_checkpoint / "unused", precision="fp32",
                           lora="split")
    graphs = DecoderBuilder(tiny_config, options).build(tiny_weights[Component.DECODER])
    graph = graphs[SPLIT_DECODERS["vision"]].graph
    parsed = {node.name: parse_lora_node(node.name) for node in graph}
    lora = {name: part for name, part in parsed.items() if part is not None}
    for node in graph:
        if node.name in lora and lora[node.name].part != "Add":
            assert node.op_type == "MatMul" and node.inputs[1].name == weight_name(node.name)
        if node.name in lora and lora[node.name].part == "Add":
            assert node.op_type == "Add"
    assert {part.adapter for part in lora.values()} == {"vision"}
    for layer in range(tiny_config.text.num_hidden_layers):
        prefix = f"/model/layers.{layer}/"
        sites = {part: {p.site for p in lora.values() if p.part == part and p.site.startswith(prefix)}
                 for part in ("A", "B", "Add")}
        owners = {prefix + p for p in ("attn/qkv_proj", "attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj")}
        projections = {prefix + p for p in ("attn/qkv_proj", "attn/o_proj", "mlp/gate_proj", "mlp/up_proj",
                                            "mlp/down_proj")}
        assert sites["A"] == owners
        assert sites["B"] == sites["Add"] == projections
