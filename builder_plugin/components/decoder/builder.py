"""DecoderBuilder: the decoder variants of a build, made by the GenAI builder subclass from the routed weights, and
the decoder's quantization and finishing steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.components.base import BuildOutput, ComponentBuilder, DecoderRuntimeSettings
from builder_plugin.components.decoder.genai_builder import genai_builder_class, make_genai_builder, quiet
from builder_plugin.components.decoder.kv import KVLayer
from builder_plugin.components.decoder.mode_routing import (
    add_mode_state,
    route_lora_branches,
)
from builder_plugin.components.decoder.passes import fix_declared_shapes, hoist_rope_caches
from builder_plugin.components.decoder.tree import make_tree
from builder_plugin.components.decoder.variants import DecoderPlan
from builder_plugin.components.decoder.weights import WeightTensors
from builder_plugin.components.embedding import EmbeddingBuilder
from builder_plugin.config import Phi4MMConfig
from builder_plugin.layout import INPUT_IDS, INPUTS_EMBEDS, LOGITS
from builder_plugin.options import BuildOptions
from builder_plugin.quant.matmul import quantize_matmuls
from builder_plugin.quant.plan import QuantPlan
from builder_plugin.quant.weights import QuantizationCache
from builder_plugin.spec import Component, IOSpec, TensorSpec

_ATTN_EPS_WITH_FUSED_ROPE = ("cpu", "cuda", "webgpu")  # dml runs RotaryEmbedding on position_ids instead


class DecoderBuilder(ComponentBuilder):
    """The decoder files of one build (`plan`, made once from the options, which `validate_options` checked)."""

    component = Component.DECODER

    def __init__(self, config: Phi4MMConfig, options: BuildOptions,
                 quant_cache: QuantizationCache | None = None) -> None:
        super().__init__(config, options, quant_cache)
        self.plan = DecoderPlan.for_options(options)

    @classmethod
    def io_spec(cls, config: Phi4MMConfig, io_dtype: str, execution_provider: str = "cpu",
                self_routing: bool = False) -> IOSpec:
        """The graph I/O as the GenAI builder emits it (base.py input/output tables, exclude_embeds, GQA), plus the
        self-routing decoder's `input_ids` and mode KV layer."""
        text = config.text
        kv_heads = text.num_key_value_heads
        layers = range(text.num_hidden_layers)
        # The builder's input table order: attention_mask, position_ids (only without fused RoPE), inputs_embeds.
        inputs = [TensorSpec("attention_mask", "int64", ("batch_size", "total_sequence_length"))]
        if execution_provider not in _ATTN_EPS_WITH_FUSED_ROPE:
            inputs.append(TensorSpec("position_ids", "int64", ("batch_size", "sequence_length")))
        inputs.append(EmbeddingBuilder.io_spec(config, io_dtype).output(INPUTS_EMBEDS))  # what the embedding hands over
        past = ("batch_size", kv_heads, "past_sequence_length", "kv_cache_dim")
        present = ("batch_size", kv_heads, "total_sequence_length", "kv_cache_dim")
        inputs += [TensorSpec(KVLayer(i).past_key, io_dtype, past) for i in layers]
        inputs += [TensorSpec(KVLayer(i).past_value, io_dtype, past) for i in layers]
        outputs = [TensorSpec(LOGITS, io_dtype, ("batch_size", 1, text.vocab_size))]  # last position only
        outputs += [TensorSpec(KVLayer(i).present_key, io_dtype, present) for i in layers]
        outputs += [TensorSpec(KVLayer(i).present_value, io_dtype, present) for i in layers]
        if self_routing:  # after the builder's own I/O, in the order add_mode_state appends them
            state = KVLayer(text.num_hidden_layers)  # the mode's layer
            inputs += [TensorSpec(INPUT_IDS, "int64", ("batch_size", "sequence_length")),
                       TensorSpec(state.past_key, io_dtype, past), TensorSpec(state.past_value, io_dtype, past)]
            outputs += [TensorSpec(state.present_key, io_dtype, present),
                        TensorSpec(state.present_value, io_dtype, present)]
        return IOSpec(tuple(inputs), tuple(outputs))

    @classmethod
    def spec_for(cls, config: Phi4MMConfig, options: BuildOptions) -> IOSpec:
        """The I/O of the decoder(s) `options` build (every variant of one build has the same I/O)."""
        return cls._spec(config, options, DecoderPlan.for_options(options))

    @classmethod
    def _spec(cls, config: Phi4MMConfig, options: BuildOptions, plan: DecoderPlan) -> IOSpec:
        return cls.io_spec(config, options.io_dtype, options.execution_provider, self_routing=plan.self_routing)

    def build(self, weights: Mapping[str, TensorRef]) -> dict[str, ir.Model]:
        """The float graphs (quantization and LoRA routing are the `quantize` and `finish` steps)."""
        return self.build_output(weights).graphs

    def build_output(self, weights: Mapping[str, TensorRef]) -> BuildOutput:
        """The float graph of every variant, made by GenAI builders that share one set of lazy weights, and the
        runtime settings read from the first of them."""
        config, options, plan = self.config, self.options, self.plan
        tensors = WeightTensors(options.io_dtype)
        rope_caches: dict[str, ir.TensorProtocol] = {}
        graphs: dict[str, ir.Model] = {}
        runtime: DecoderRuntimeSettings | None = None
        for variant in plan.variants:
            tree = make_tree(weights, config, variant)
            builder = make_genai_builder(config, options, variant.filename, tree=tree, tensors=tensors)
            if runtime is None:  # as the builder is set up, before it makes a graph
                runtime = _runtime_settings(builder, options, plan)
            with quiet():
                builder.make_model(str(options.model_dir))
            model = builder.model
            model.graph.sort()
            hoist_rope_caches(model, rope_caches)
            fix_declared_shapes(model)
            graphs[variant.filename] = model
        return BuildOutput(graphs, self._spec(config, options, plan), runtime)

    def quantize(self, model: ir.Model) -> ir.Model:
        """int4/int8: MatMulNBits with the per-node schemes of the stock builder's choices, through the shared cache,
        so the variants' base weights are quantized once and the embedding reads the lm_head's very blocks."""
        options = self.options
        if not options.quantize:
            return model
        plan = QuantPlan.for_decoder(options, self.config.text.num_hidden_layers)
        return quantize_matmuls(model, plan, options.accuracy_level, cache=self.quant_cache)

    def finish(self, model: ir.Model, filename: str) -> ir.Model:
        """The self-routing decoder's mode state and LoRA routing (a mode's decoder beside it: the mode state alone,
        its adapter applying always), then the GenAI builder's build metadata.

        Routing comes after quantizing: the adapters are then main-graph branches, as onnxruntime's quantizer (which
        leaves If bodies float for rtn / k_quant) sees the split variants; routing moves the quantized nodes into the
        Ifs unchanged."""
        variant = self.plan.variant(filename)
        if variant.self_routing:
            text = self.config.text
            placeholders = (self.config.image_token_id, self.config.audio_token_id)
            is_vision, is_speech = add_mode_state(model, text.num_hidden_layers, text.num_key_value_heads,
                                                  text.head_dim, placeholders)
            if variant.routes_adapters:
                route_lora_branches(model, is_vision, is_speech)
        genai_builder_class().stamp_build_metadata(model)
        return model


def _runtime_settings(builder: Any, options: BuildOptions, plan: DecoderPlan) -> DecoderRuntimeSettings:
    """What genai_config.json and manifest.json take from this build, read from a GenAI builder set up for it."""
    ep = options.execution_provider
    provider_options = () if ep == "cpu" else ({ep: dict(builder.ep_attrs[ep])},)
    share_buffer = bool(builder.past_present_share_buffer)
    return DecoderRuntimeSettings(share_buffer, provider_options, plan.routing, plan.decoders)
