"""The module tree the GenAI builder walks: one decoder layer per config layer, each projection the rows of its
checkpoint tensor with the LoRA branches of the variant (or the merged one), norms read from the checkpoint, the tied
lm_head on the token table; slices of a projection join back into it; a missing or misfitting weight is named."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from builder_plugin.components.decoder.tree import LazyLinear, make_tree
from builder_plugin.components.decoder.variants import DecoderVariant
from builder_plugin.components.decoder.weights import RowRange
from builder_plugin.errors import CheckpointError
from builder_plugin.layout import MAIN_DECODER
from builder_plugin.spec import Component

PROJECTIONS = {"self_attn.qkv_proj": ("self_attn", "qkv_proj"), "self_attn.o_proj": ("self_attn", "o_proj"),
               "mlp.gate_up_proj": ("mlp", "gate_up_proj"), "mlp.down_proj": ("mlp", "down_proj")}


@pytest.fixture(scope="module")
def decoder_weights(tiny_weights):
    return tiny_weights[Component.DECODER]


def projection(tree, layer: int, target: str) -> LazyLinear:
    module, name = PROJECTIONS[target]
    return getattr(getattr(tree.model.layers[layer], module), name)


@pytest.mark.parametrize("variant", [
    DecoderVariant(MAIN_DECODER, "routed", adapters=("vision", "speech")),
    DecoderVariant(MAIN_DECODER, "none"),
    DecoderVariant(MAIN_DECODER, "vision", merged="vision"),
], ids=["routed", "none", "merged-vision"])
def test_the_tree_holds_the_checkpoint_rows_and_the_variants_lora(variant, tiny_config, decoder_weights) -> None:
    text = tiny_config.text
    tree = make_tree(decoder_weights, tiny_config, variant)
    assert len(tree.model.layers) == text.num_hidden_layers
    assert type(tree.model.layers[0]).__name__.endswith("DecoderLayer")  # what the builder's walk looks for
    shapes = {"self_attn.qkv_proj": (text.q_size + 2 * text.kv_size, text.hidden_size),
              "self_attn.o_proj": (text.hidden_size, text.q_size),
              "mlp.gate_up_proj": (2 * text.intermediate_size, text.hidden_size),
              "mlp.down_proj": (text.hidden_size, text.intermediate_size)}
    for layer in range(text.num_hidden_layers):
        for target, shape in shapes.items():
            proj = projection(tree, layer, target)
            weight = decoder_weights[f"layers.{layer}.{target}.weight"]
            assert proj.rows == RowRange(weight, 0, shape[0]) and (proj.out_features, proj.in_features) == shape
            assert proj.weight.shape == shape and proj.weight.is_meta and proj.bias is None
            assert [b.adapter for b in proj.loras] == list(variant.adapters)
            assert (proj.merged.adapter if proj.merged else None) == variant.merged
            for branch in (*proj.loras, *([proj.merged] if proj.merged else [])):
                prefix = f"layers.{layer}.{target}.lora_"
                assert branch.a is decoder_weights[f"{prefix}A.{branch.adapter}.weight"]
                assert branch.b == RowRange(decoder_weights[f"{prefix}B.{branch.adapter}.weight"], 0, shape[0])
                assert branch.scaling == tiny_config.loras[branch.adapter].scaling
        norm = tree.model.layers[layer].input_layernorm.weight
        assert torch.equal(norm, decoder_weights[f"layers.{layer}.input_layernorm.weight"].load(torch.float32))
    assert torch.equal(tree.model.norm.weight, decoder_weights["norm.weight"].load(torch.float32))
    assert text.tie_word_embeddings  # the tiny checkpoint ties them, as the release does
    head = tree.lm_head.projection
    assert head.rows.ref is decoder_weights["embed_tokens.weight"] and head.loras == () and head.merged is None
    assert tree.lm_head.out_features == text.vocab_size


def test_slices_join_back_into_their_projection(tiny_config, decoder_weights) -> None:
    text = tiny_config.text
    tree = make_tree(decoder_weights, tiny_config, DecoderVariant(MAIN_DECODER, "routed", adapters=("vision",)))
    qkv = projection(tree, 0, "self_attn.qkv_proj")
    cuts = (0, text.q_size, text.q_size + text.kv_size, qkv.out_features)
    parts = tuple(qkv.slice(start, stop) for start, stop in itertools.pairwise(cuts))
    assert [p.out_features for p in parts] == [text.q_size, text.kv_size, text.kv_size]
    assert parts[1].rows == RowRange(qkv.rows.ref, text.q_size, text.q_size + text.kv_size)
    assert parts[1].loras[0].a is qkv.loras[0].a  # the A of the packed projection is shared by its slices
    assert parts[1].loras[0].b == RowRange(qkv.loras[0].b.ref, text.q_size, text.q_size + text.kv_size)
    joined = LazyLinear.join(parts)
    assert (joined.rows, joined.loras, joined.merged) == (qkv.rows, qkv.loras, qkv.merged)
    assert LazyLinear.join((parts[0], parts[2])) is None  # not adjacent
    other = projection(tree, 1, "self_attn.qkv_proj").slice(text.q_size, text.q_size + text.kv_size)
    assert LazyLinear.join((parts[0], other)) is None  # another tensor


def test_a_missing_or_misfitting_weight_is_named(tiny_config, decoder_weights) -> None:
    variant = DecoderVariant(MAIN_DECODER, "vision", adapters=("vision",))
    missing = {k: v for k, v in decoder_weights.items() if k != "layers.1.mlp.down_proj.lora_B.vision.weight"}
    with pytest.raises(CheckpointError, match=r"layers.1.mlp.down_proj.lora_B.vision.weight is missing"):
        make_tree(missing, tiny_config, variant)
    b = decoder_weights["layers.0.self_attn.o_proj.lora_B.vision.weight"]
    wrong = {**decoder_weights, "layers.0.self_attn.o_proj.lora_B.vision.weight":
             dataclasses.replace(b, shape=(b.shape[0] + 1, b.shape[1]))}
    with pytest.raises(CheckpointError, match=r"vision LoRA of layers.0.self_attn.o_proj"):
        make_tree(wrong, tiny_config, variant)
