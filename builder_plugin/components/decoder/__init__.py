"""Text decoder: onnxruntime-genai's own Phi-4-multimodal builder class, fed lazily from the routed weights.

The graph is made by a subclass of the GenAI builder's ``Phi4MMModel`` (``builders/phi.py``), so it has exactly the
runtime's expectations: GroupQueryAttention with the shared KV buffer and RoPE fused into attention (no
``position_ids``), LongRoPE via the builder's ``If`` on the attention-mask length (short factors up to
``original_max_position_embeddings``, long beyond), ``inputs_embeds`` instead of an embedding, and the tied lm_head.

What the subclass changes:

- Weights: the builder walks a light module tree whose projections are `LazyLinear` placeholders. Every MatMul
  weight becomes a lazy initializer read from the checkpoint only when the model is saved, one tensor (or column slab)
  at a time, and never mutated (the stock LoRA path scales ``lora_B`` in place). The same initializer objects are
  shared by every variant of one build, so a writer that deduplicates stores the base weights once.
- LoRA: per input mode instead of "vision always on". Each adapter is an extra branch ``((x·A)·(s·B))`` added to the
  base MatMul, with one A MatMul per source projection (packed qkv stays one MatMul; gate and up share A). With
  ``merge_lora`` a single adapter is folded into the base weights in fp32 instead. The default ``routed`` decoder holds
  both adapters behind ``If`` nodes and picks one per conversation from the placeholder ids (`mode_routing`); ``split``
  writes one decoder file per input mode instead.
- int4/int8: the float graph is rewritten by `builder_plugin.quant.matmul.quantize_matmuls` (lazy, streaming) with
  the per-node schemes of `builder_plugin.quant.plan.QuantPlan`, rather than the builder's whole-graph ``to_nbits``.
- The LongRoPE cos/sin caches, which the builder puts in ``If`` branches as Constant nodes inside ``model.onnx``, are
  hoisted to main-graph initializers so they go to external data and are shared between variants.

The modules, by job: `variants` (the decoder plan: which files a build makes), `weights` (lazy initializers), `tree`
(the module tree the builder walks), `genai_builder` (the builder subclass), `lora_names` (the LoRA node names it
writes), `passes` (graph fixes on its output), `mode_routing` (the self-routing decoder) and `builder` (DecoderBuilder:
the component's build hooks).
"""

from __future__ import annotations

from builder_plugin.components.base import DecoderRuntimeSettings
from builder_plugin.components.decoder.builder import DecoderBuilder
from builder_plugin.components.decoder.genai_builder import genai_builder_class, genai_text_config
from builder_plugin.components.decoder.variants import DecoderPlan, DecoderVariant
from builder_plugin.errors import DecoderBuildError
from builder_plugin.layout import MAIN_DECODER

__all__ = [
    "MAIN_DECODER",
    "DecoderBuildError",
    "DecoderBuilder",
    "DecoderPlan",
    "DecoderRuntimeSettings",
    "DecoderVariant",
    "genai_builder_class",
    "genai_text_config",
]
