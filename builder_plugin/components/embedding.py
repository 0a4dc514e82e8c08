"""The embedding graph: token lookup, then image and audio feature rows written over their placeholder tokens.

onnxruntime-genai runs this graph at every step, the prompt's and each generated token's. On the prompt step
``input_ids`` holds one ``image_token_id`` per image-feature row and one ``audio_token_id`` per audio-feature row, in
order; on decode steps both feature inputs are ``[0, hidden]``. Semantics follow transformers' native
``Phi4MultimodalFeatureEmbedding``: placeholder positions, in row-major (batch, sequence) order, take the feature rows
in order. Every float tensor is in the I/O dtype, so nothing is cast.

Placement is ``ScatterND(embeds, NonZero(ids == token_id)^T, features)``: zero placeholders and zero rows scatter
nothing, so decode steps cost one small NonZero per modality. It was preferred to the pad-with-a-zero-row / CumSum /
Gather / Where formulation, whose broadcast Where is slow in ORT's CPU kernel (full size, 1000 prompt tokens: ~40 ms
per modality vs ~5-20 ms for ScatterND; decode steps ~45 vs ~25 us). A feature/placeholder count mismatch is an ORT
shape error instead of silently misplaced rows.

Token table layout (``table_layout``), measured with ORT 1.32 on 2 loaded cores at full width (vocab 200064, hidden
3072, fp32, whole graph, text-only inputs):
- "rows": the checkpoint's ``[vocab, hidden]`` and a plain Gather: decode step ~20-30 us (~50 us for a token not in
  cache), 100 prompt tokens ~0.2-0.3 ms, 1000 prompt tokens ~45-70 ms.
- "transposed": ``[hidden, vocab]`` read with Gather(axis=1) + Transpose: decode step ~70-90 us (~250 us for a token
  not in cache), 100 prompt tokens ~100 ms, 1000 prompt tokens ~0.8-0.9 s (one strided read per element). Its bytes
  are exactly the tied lm_head MatMul weight of the decoder, so the shared data file stores the table once (2.46 GB
  saved in fp32, 1.23 GB in fp16).
- "quantized" (int4/int8 builds): GatherBlockQuantized over the tied lm_head's MatMulNBits weights, scales and zero
  points, as the GenAI builder does for tied embeddings, with the lm_head's own scheme (4 or 8 bits, any method: a
  mixed-precision int8 lm_head gives an 8-bit lookup). They are computed by the same quantizer from the same float
  values, so they are byte-identical to the decoder's and stored once; the lookup dequantizes only the gathered rows.
  The packed weights are read in GatherBlockQuantized's ``[vocab, K]`` shape through a view of the stored bytes
  (`StoredView`), not a Reshape node: onnxruntime folds a Reshape of an initializer into a copy of its own when a
  session loads (full size, 8-bit lm_head: 600 MB of anonymous memory), where the view stays in the data file's mapped
  pages, which the decoder's lm_head reads too.
The default is "transposed" for float builds and for an lm_head kept float by nodes_to_exclude (the extra ~0.2 ms per
decode step and ~1 ms per prompt token are ~1% of a full-size decoder step), else "quantized".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
import onnx_ir as ir

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.components.base import ComponentBuilder
from builder_plugin.components.speech import SpeechBuilder
from builder_plugin.components.vision import VisionBuilder
from builder_plugin.config import Phi4MMConfig
from builder_plugin.dtypes import DTYPES
from builder_plugin.errors import SpecMismatchError
from builder_plugin.graph import MS_DOMAIN, GraphBuilder, transposed
from builder_plugin.layout import AUDIO_FEATURES, GRAPH_FILES, IMAGE_FEATURES, INPUT_IDS, INPUTS_EMBEDS
from builder_plugin.options import BuildOptions
from builder_plugin.quant.kernels import QuantScheme
from builder_plugin.quant.plan import LM_HEAD_NODE, LM_HEAD_WEIGHT, QuantPlan
from builder_plugin.quant.weights import ColumnChunkedTensor, QuantizationCache, StoredView
from builder_plugin.spec import Component, IOSpec, TensorSpec

EMBEDDING_FILENAME = GRAPH_FILES[Component.EMBEDDING]
TOKEN_TABLE = "embed_tokens.weight"  # routed local name; also the initializer name of the "rows" layout
TRANSPOSED_TOKEN_TABLE = "embed_tokens.weight.transposed"

TableLayout = Literal["transposed", "rows", "quantized"]
TABLE_LAYOUTS: tuple[str, ...] = ("transposed", "rows", "quantized")


class EmbeddingBuilder(ComponentBuilder):
    """Builds ``phi-4-mm-embedding.onnx``; ``table_layout`` (default: by precision, see the module docstring) picks
    how the token table is stored."""

    component = Component.EMBEDDING

    def __init__(self, config: Phi4MMConfig, options: BuildOptions, quant_cache: QuantizationCache | None = None, *,
                 table_layout: TableLayout | None = None) -> None:
        super().__init__(config, options, quant_cache)
        self.lm_head_scheme: QuantScheme | None = None
        if options.quantize:  # the decoder's lm_head quantization, which the quantized layout must read
            self.lm_head_scheme = QuantPlan.for_decoder(options, config.text.num_hidden_layers).scheme(LM_HEAD_NODE)
        if table_layout is None:
            table_layout = "quantized" if self.lm_head_scheme is not None else "transposed"
        if table_layout == "quantized" and self.lm_head_scheme is None:
            raise ValueError("the quantized table layout needs a quantized lm_head (-p int4/int8, not excluded)")
        if table_layout not in TABLE_LAYOUTS:
            raise ValueError(f"table_layout must be one of {TABLE_LAYOUTS}, got {table_layout!r}")
        self.table_layout = table_layout

    @classmethod
    def io_spec(cls, config: Phi4MMConfig, io_dtype: str, execution_provider: str = "cpu") -> IOSpec:
        hidden = config.text.hidden_size
        return IOSpec(
            inputs=(
                TensorSpec(INPUT_IDS, "int64", ("batch_size", "sequence_length")),
                # the feature inputs are the encoders' outputs: one declaration of each name, dtype and shape
                VisionBuilder.io_spec(config, io_dtype).output(IMAGE_FEATURES),
                SpeechBuilder.io_spec(config, io_dtype).output(AUDIO_FEATURES),
            ),
            outputs=(TensorSpec(INPUTS_EMBEDS, io_dtype, ("batch_size", "sequence_length", hidden)),),
        )

    def build(self, weights: Mapping[str, TensorRef]) -> dict[str, ir.Model]:
        io_dtype = self.options.io_dtype
        if self.options.weight_dtype != io_dtype:
            # The features arrive in the I/O dtype and are selected against the table rows without a cast.
            raise SpecMismatchError(f"embedding: weight dtype {self.options.weight_dtype} differs from I/O dtype "
                                    f"{io_dtype}")
        text = self.config.text
        table = weights[TOKEN_TABLE]
        if tuple(table.shape) != (text.vocab_size, text.hidden_size):
            raise SpecMismatchError(f"embedding: {TOKEN_TABLE} has shape {tuple(table.shape)}, expected "
                                    f"{(text.vocab_size, text.hidden_size)}")

        g = GraphBuilder(EMBEDDING_FILENAME.removesuffix(".onnx"), self.io_spec(self.config, io_dtype),
                         self.options.weight_dtype)
        ids = g.inputs[INPUT_IDS]
        if self.table_layout == "transposed":
            table_t = g.weight(TRANSPOSED_TOKEN_TABLE, table, transform=transposed)
            columns = g.op("Gather", table_t, ids, axis=1)  # [hidden, batch, seq]
            embeds = g.op("Transpose", columns, perm=[1, 2, 0])
        elif self.table_layout == "quantized":
            embeds = self._quantized_lookup(g, table, ids)
        else:
            embeds = g.op("Gather", g.weight(TOKEN_TABLE, table), ids, axis=0)

        for token_id, features in ((self.config.image_token_id, IMAGE_FEATURES),
                                   (self.config.audio_token_id, AUDIO_FEATURES)):
            embeds = _place_features(g, embeds, ids, token_id, g.inputs[features])
        g.output(INPUTS_EMBEDS, embeds)
        return {EMBEDDING_FILENAME: g.model()}


    def _quantized_lookup(self, g: GraphBuilder, table: TensorRef, ids: ir.Value) -> ir.Value:
        """Rows of the quantized lm_head weights (MatMulNBits layout [vocab, blocks, blob], the decoder's scheme)
        dequantized by GatherBlockQuantized (4 or 8 bits, with the zero points when the scheme has them)."""
        vocab, hidden = table.shape
        float_dtype = DTYPES[self.options.weight_dtype].onnx
        np_dtype = DTYPES[self.options.weight_dtype].numpy

        def columns(c0: int, c1: int) -> np.ndarray:  # columns of lm_head.weight [hidden, vocab] = rows of the table
            return np.ascontiguousarray(table.load_rows(c0, c1).t().numpy().astype(np_dtype))

        scheme = self.lm_head_scheme
        lm_head = ColumnChunkedTensor(columns, float_dtype, (hidden, vocab), LM_HEAD_WEIGHT,
                                      key=table.columns_key(0, vocab, self.options.weight_dtype))
        # the decoder's lm_head finds these very tensors in the shared cache: quantized once, written once
        tensors = self.quant_cache.tensors(lm_head, scheme, scheme.names(LM_HEAD_WEIGHT))
        _, blocks, blob = (int(d) for d in tensors["packed"].shape)
        # [vocab, blocks * blob] as GatherBlockQuantized reads it: a view of the stored bytes, not a Reshape node,
        # which onnxruntime would fold into a second copy of the table in anonymous memory
        stored = {**tensors, "packed": StoredView(tensors["packed"], (vocab, blocks * blob))}
        pieces = [g.initializer(tensor) for tensor in stored.values()]
        rows = g.op("GatherBlockQuantized", pieces[0], ids, *pieces[1:], domain=MS_DOMAIN, bits=scheme.bits,
                    block_size=scheme.block_size, gather_axis=0, quantize_axis=1)
        padded = blocks * scheme.block_size
        if padded != hidden:  # the quantized rows are padded to whole blocks
            rows = g.op("Slice", rows, g.const([0]), g.const([hidden]), g.const([-1]))
        return rows


def _place_features(g: GraphBuilder, embeds: ir.Value, ids: ir.Value, token_id: int, features: ir.Value) -> ir.Value:
    """``embeds`` with the rows of `features`, in order, at the positions of `ids` equal to `token_id`."""
    positions = g.op("NonZero", g.op("Equal", ids, g.const(token_id)))  # [2, rows], row-major (batch, sequence)
    return g.op("ScatterND", embeds, g.op("Transpose", positions, perm=[1, 0]), features)
