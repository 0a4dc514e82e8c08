"""The vision graph: SigLIP on the valid crops, 2x2 pooling, HD assembly and the projection MLP, all in one ONNX graph.

Inputs are exactly what onnxruntime-genai's phi4mm processor feeds: every image padded to the largest crop count,
crop 0 the global view. The output has one row per image token, images in order (the order in which the embedding
graph writes them over the image placeholders). Semantics follow transformers' native
``Phi4MultimodalImageEmbedding``:

- only crops 0..h*w of each image go through SigLIP (batch-padding crops are gathered away);
- NaViT position ids are bucketised from each crop's patch mask exactly as the native module does (its float32
  arithmetic is tabulated at build time for every possible valid-row count), padded patches get position 0;
- attention is bidirectional with a key-padding mask; layers ``0..num_layers_used-1`` run (feature layer -2 skips
  the last layer, the post-layernorm and the head);
- the HD assembly is a gather over the table ``[pooled rows ; sub_GN ; glb_GN]`` after projection (the projection is
  per row, so projecting the table and then gathering equals gathering and then projecting).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
import torch

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.components.base import ComponentBuilder
from builder_plugin.components.encoder_graph import EncoderGraph
from builder_plugin.components.vision_scan import scan_crops
from builder_plugin.config import Phi4MMConfig, VisionConfig
from builder_plugin.errors import UnsupportedModelError
from builder_plugin.graph import MS_DOMAIN, GraphBuilder
from builder_plugin.layout import GRAPH_FILES, IMAGE_FEATURES
from builder_plugin.options import BuildOptions
from builder_plugin.quant.weights import QuantizationCache
from builder_plugin.spec import Component, IOSpec, TensorSpec

VISION_FILENAME = GRAPH_FILES[Component.VISION]
NUM_CHANNELS = 3

# SigLIP hidden_act -> ONNX Gelu `approximate`; gelu_new / gelu_fast / gelu_pytorch_tanh are the same tanh formula.
GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}

# the per-crop part's boundary values, named so that finish() finds them after quantization
CROP_PIXELS, CROP_MASK, POOLED = "vision/crop_pixels", "vision/crop_mask", "vision/pooled"

_F32 = ir.DataType.FLOAT
_I64 = ir.DataType.INT64


class VisionBuilder(ComponentBuilder):
    """Builds ``phi-4-mm-vision.onnx``.

    ``fused_ops`` (default) uses LayerNormalization, Gelu and com.microsoft.MultiHeadAttention; ``False`` spells the
    encoder out in primitive ops (used to check the fused graph and to time it).
    """

    component = Component.VISION

    def __init__(self, config: Phi4MMConfig, options: BuildOptions, quant_cache: QuantizationCache | None = None, *,
                 fused_ops: bool = True) -> None:
        super().__init__(config, options, quant_cache)
        self.fused_ops = fused_ops
        if config.vision.hidden_act not in GELU_APPROXIMATION:
            raise UnsupportedModelError(
                f"SigLIP hidden_act {config.vision.hidden_act!r} is not supported "
                f"(expected one of {sorted(GELU_APPROXIMATION)})"
            )

    @classmethod
    def io_spec(cls, config: Phi4MMConfig, io_dtype: str, execution_provider: str = "cpu") -> IOSpec:
        v = config.vision
        side, patches = v.image_size, v.patches_per_side
        return IOSpec(
            inputs=(
                TensorSpec("pixel_values", io_dtype, ("num_images", "max_crops", NUM_CHANNELS, side, side)),
                TensorSpec("image_attention_mask", io_dtype, ("num_images", "max_crops", patches, patches),
                           "attention_mask"),
                TensorSpec("image_sizes", "int64", ("num_images", 2)),
            ),
            outputs=(TensorSpec(IMAGE_FEATURES, io_dtype, ("num_image_tokens", config.text.hidden_size)),),
        )

    def build(self, weights: Mapping[str, TensorRef]) -> dict[str, ir.Model]:
        spec = self.io_spec(self.config, self.options.io_dtype)
        g = GraphBuilder(VISION_FILENAME.removesuffix(".onnx"), spec, self.options.weight_dtype)
        graph = _VisionGraph(g, self.config, weights, self.fused_ops)
        return {VISION_FILENAME: graph.build()}

    def finish(self, model: ir.Model, filename: str) -> ir.Model:
        """On CPU, SigLIP one crop at a time (vision_scan.py)."""
        if self.options.execution_provider == "cpu":
            values = {value.name: value for node in model.graph for value in node.outputs}
            scan_crops(model.graph, values[CROP_PIXELS], values[CROP_MASK], values[POOLED],
                       self.config.vision.hidden_size)
        return model


class _VisionGraph(EncoderGraph):
    """One build of the vision graph; methods add the pieces in data-flow order."""

    def __init__(self, g: GraphBuilder, config: Phi4MMConfig, weights: Mapping[str, TensorRef],
                 fused_ops: bool) -> None:
        super().__init__(g, weights, float(config.vision.layer_norm_eps), fused=fused_ops)
        self.v: VisionConfig = config.vision
        self.text_hidden = config.text.hidden_size
        self.io_dtype = g.spec.output(IMAGE_FEATURES).onnx_dtype
        self.pooled_side = (self.v.patches_per_side + 1) // 2  # the native reflection-pads odd sides

    def gelu(self, x: ir.Value, approximate: str) -> ir.Value:
        if self.fused:
            return self.g.op("Gelu", x, approximate=approximate)
        half_x = self.g.op("Mul", x, self.fconst(0.5))
        if approximate == "none":
            inner = self.g.op("Erf", self.g.op("Mul", x, self.fconst(1.0 / np.sqrt(2.0))))
        else:
            cube = self.g.op("Mul", self.g.op("Mul", x, x), x)
            poly = self.g.op("Add", x, self.g.op("Mul", cube, self.fconst(0.044715)))
            inner = self.g.op("Tanh", self.g.op("Mul", poly, self.fconst(np.sqrt(2.0 / np.pi))))
        return self.g.op("Mul", half_x, self.g.op("Add", inner, self.fconst(1.0)))

    # ---- the graph ------------------------------------------------------------------------------------------------
    def build(self) -> ir.Model:
        g = self.g
        pixel_values = g.inputs["pixel_values"]
        mask = g.inputs["image_attention_mask"]
        image_sizes = g.inputs["image_sizes"]
        if pixel_values.dtype != self.dtype:
            pixel_values = self.cast(pixel_values, self.dtype)
        mask_f32 = mask if mask.dtype == _F32 else self.cast(mask, _F32)

        crops = self.crop_grid(image_sizes, mask_f32)
        valid = self.valid_crop_index(crops["num_crops"], pixel_values)
        side, patches = self.v.image_size, self.v.patches_per_side
        crop_pixels = g.op("Gather", g.op("Reshape", pixel_values, self.i64([-1, NUM_CHANNELS, side, side])),
                           valid, axis=0)
        crop_mask = g.op("Gather", g.op("Reshape", mask_f32, self.i64([-1, patches, patches])), valid, axis=0)
        crop_pixels.name, crop_mask.name = CROP_PIXELS, CROP_MASK

        hidden, key_valid = self.embeddings(crop_pixels, crop_mask)
        for i in range(self.v.num_layers_used):
            hidden = self.encoder_layer(hidden, key_valid, f"img_processor.encoder.layers.{i}")
        pooled = self.pool(hidden)
        pooled.name = POOLED
        table = self.projected_table(pooled)
        rows = self.hd_rows(crops, num_pooled=g.op("Shape", pooled, start=0, end=1))
        features = g.op("Gather", table, rows, axis=0)
        if features.dtype != self.io_dtype:
            features = self.cast(features, self.io_dtype)
        g.output(IMAGE_FEATURES, features)
        return g.model()

    def crop_grid(self, image_sizes: ir.Value, mask_f32: ir.Value) -> dict[str, ir.Value]:
        """Per-image [num_images] int64 vectors: sub-crop grid (h, w), crops used (1 + h*w), their offset in the
        valid-crop list, and the useful pooled height/width (uh, uw) taken from the subsampled mask as native does."""
        g = self.g
        grid = g.op("Div", image_sizes, self.i64(self.v.crop_size))  # [N, 2] = (h, w)
        h = g.op("Gather", grid, self.i64(0), axis=1)
        w = g.op("Gather", grid, self.i64(1), axis=1)
        num_crops = g.op("Add", g.op("Mul", h, w), self.i64(1))
        offset = g.op("CumSum", num_crops, self.i64(0), exclusive=1)

        # Column 0 of the sub-grid mask = crops in grid column 0, rows 0::2 of patch column 0; row 0 likewise.
        patches = self.v.patches_per_side
        col0 = g.op("Slice", mask_f32, self.i64([0, 0]), self.i64([patches, 1]), self.i64([2, 3]), self.i64([2, 1]))
        row0 = g.op("Slice", mask_f32, self.i64([0, 0]), self.i64([1, patches]), self.i64([2, 3]), self.i64([1, 2]))
        col_sum = g.op("ReduceSum", col0, self.i64([2, 3]), keepdims=0)  # [N, M]
        row_sum = g.op("ReduceSum", row0, self.i64([2, 3]), keepdims=0)
        crop_id = g.op("Unsqueeze", g.op("Range", self.i64(0), self._max_crops(mask_f32), self.i64(1)),
                       self.i64([0]))  # [1, M]
        sub_id = g.op("Max", g.op("Sub", crop_id, self.i64(1)), self.i64(0))  # [1, M]; crop 0 masked out below
        w_col = g.op("Unsqueeze", g.op("Max", w, self.i64(1)), self.i64([1]))  # [N, 1]
        grid_row = g.op("Div", sub_id, w_col)
        grid_col = g.op("Mod", sub_id, w_col)
        is_sub = g.op("And", g.op("GreaterOrEqual", crop_id, self.i64(1)),
                      g.op("Less", crop_id, g.op("Unsqueeze", num_crops, self.i64([1]))))
        zero = self.f32(0.0)
        in_col0 = g.op("And", is_sub, g.op("Equal", grid_col, self.i64(0)))
        in_row0 = g.op("And", is_sub, g.op("Equal", grid_row, self.i64(0)))
        # native: int(mask.sum()) -> truncation of a float sum
        uh = self.cast(g.op("ReduceSum", g.op("Where", in_col0, col_sum, zero), self.i64([1]), keepdims=0), _I64)
        uw = self.cast(g.op("ReduceSum", g.op("Where", in_row0, row_sum, zero), self.i64([1]), keepdims=0), _I64)
        return {"h": h, "w": w, "num_crops": num_crops, "offset": offset, "uh": uh, "uw": uw}

    def _max_crops(self, x: ir.Value) -> ir.Value:
        return self.g.op("Squeeze", self.g.op("Shape", x, start=1, end=2), self.i64([0]))

    def valid_crop_index(self, num_crops: ir.Value, pixel_values: ir.Value) -> ir.Value:
        """Flat indices (image * max_crops + crop) of the crops that belong to an image, in image/crop order."""
        g = self.g
        crop_id = g.op("Range", self.i64(0), self._max_crops(pixel_values), self.i64(1))
        used = g.op("Less", g.op("Unsqueeze", crop_id, self.i64([0])), g.op("Unsqueeze", num_crops, self.i64([1])))
        return g.op("Reshape", g.op("NonZero", g.op("Reshape", used, self.i64([-1]))), self.i64([-1]))

    def embeddings(self, crop_pixels: ir.Value, crop_mask: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Patch embedding plus NaViT position embedding -> ([V, P*P, C], key-valid mask [V, P*P] bool)."""
        g, v = self.g, self.v
        patches, hidden = v.patches_per_side, v.hidden_size
        prefix = "img_processor.embeddings"
        conv_w = g.weight(f"{prefix}.patch_embedding.weight", self.ref(f"{prefix}.patch_embedding.weight"))
        conv_b = g.weight(f"{prefix}.patch_embedding.bias", self.ref(f"{prefix}.patch_embedding.bias"))
        conv = g.op("Conv", crop_pixels, conv_w, conv_b, kernel_shape=[v.patch_size, v.patch_size],
                    strides=[v.patch_size, v.patch_size])  # [V, C, P, P]
        patch_embeds = g.op("Transpose", g.op("Reshape", conv, self.i64([0, hidden, patches * patches])),
                            perm=[0, 2, 1])

        patch_valid = g.op("Cast", crop_mask, to=ir.DataType.BOOL)  # [V, P, P]; native: mask.to(bool)
        valid_i64 = self.cast(patch_valid, _I64)
        rows = g.op("ReduceSum", g.op("Gather", valid_i64, self.i64(0), axis=2), self.i64([1]), keepdims=1)
        cols = g.op("ReduceSum", g.op("Gather", valid_i64, self.i64(0), axis=1), self.i64([1]), keepdims=1)
        bucket_h = self.position_bucket(rows)  # [V, P]
        bucket_w = self.position_bucket(cols)
        pos = g.op("Add", g.op("Mul", g.op("Unsqueeze", bucket_h, self.i64([2])), self.i64(patches)),
                   g.op("Unsqueeze", bucket_w, self.i64([1])))  # [V, P, P]
        key_valid = g.op("Reshape", patch_valid, self.i64([0, -1]))
        pos = g.op("Where", key_valid, g.op("Reshape", pos, self.i64([0, -1])), self.i64(0))
        table = g.weight(f"{prefix}.position_embedding.weight", self.ref(f"{prefix}.position_embedding.weight"))
        return g.op("Add", patch_embeds, g.op("Gather", table, pos, axis=0)), key_valid

    def position_bucket(self, count: ir.Value) -> ir.Value:
        """NaViT bucket of every patch row (or column) for `count` valid rows: [V, 1] int64 -> [V, P] int64.

        There are only P + 1 possible counts, so the native float32 computation
        ``bucketize(clamp(arange(P) * (1 / count), max=1 - 1e-6), arange(1/P, 1, 1/P), right=True)`` is evaluated here
        with torch for each of them and looked up at run time. Float ties (e.g. P = 31 maps rows 16 and 17 to the same
        bucket) are thereby reproduced bit for bit, whatever the runtime's optimizer does to float arithmetic."""
        g, patches = self.g, self.v.patches_per_side
        boundaries = torch.arange(1 / patches, 1.0, 1 / patches)
        counts = torch.arange(1, patches + 1)
        coords = torch.arange(patches, dtype=torch.float32)[None, :] * (1.0 / counts)[:, None]
        buckets = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)
        table = torch.cat([torch.zeros(1, patches, dtype=torch.int64), buckets])  # row 0: a fully padded crop
        return g.op("Gather", self.i64(table.numpy()), g.op("Squeeze", count, self.i64([1])), axis=0)

    def encoder_layer(self, x: ir.Value, key_valid: ir.Value, prefix: str) -> ir.Value:
        g = self.g
        normed = self.layer_norm(x, f"{prefix}.layer_norm1")
        q = self.linear(normed, f"{prefix}.self_attn.q_proj")
        k = self.linear(normed, f"{prefix}.self_attn.k_proj")
        v = self.linear(normed, f"{prefix}.self_attn.v_proj")
        attn = self.attention(q, k, v, key_valid)
        x = g.op("Add", x, self.linear(attn, f"{prefix}.self_attn.out_proj"))
        normed = self.layer_norm(x, f"{prefix}.layer_norm2")
        mlp = self.gelu(self.linear(normed, f"{prefix}.mlp.fc1"), GELU_APPROXIMATION[self.v.hidden_act])
        return g.op("Add", x, self.linear(mlp, f"{prefix}.mlp.fc2"))

    def attention(self, q: ir.Value, k: ir.Value, v: ir.Value, key_valid: ir.Value) -> ir.Value:
        """Bidirectional multi-head attention over one crop, padded keys masked out. [V, L, C] -> [V, L, C]."""
        g = self.g
        heads, head_dim = self.v.num_attention_heads, self.v.head_dim
        scale = float(head_dim**-0.5)
        if self.fused:
            if not hasattr(self, "_key_padding"):
                self._key_padding = self.cast(key_valid, ir.DataType.INT32)
            return g.op("MultiHeadAttention", q, k, v, None, self._key_padding, domain=MS_DOMAIN, num_heads=heads,
                        scale=scale)
        if not hasattr(self, "_key_bias"):
            big_negative = float(np.finfo(np.float16 if self.dtype == ir.DataType.FLOAT16 else np.float32).min)
            bias = g.op("Where", key_valid, self.fconst(0.0), self.fconst(big_negative))
            self._key_bias = g.op("Unsqueeze", bias, self.i64([1, 2]))  # [V, 1, 1, L]
        split_heads = self.i64([0, 0, heads, head_dim])
        qh, kh, vh = (g.op("Transpose", g.op("Reshape", t, split_heads), perm=[0, 2, 1, 3]) for t in (q, k, v))
        scores = g.op("Mul", g.op("MatMul", qh, g.op("Transpose", kh, perm=[0, 1, 3, 2])), self.fconst(scale))
        probs = g.op("Softmax", g.op("Add", scores, self._key_bias), axis=-1)
        out = g.op("Transpose", g.op("MatMul", probs, vh), perm=[0, 2, 1, 3])
        return g.op("Reshape", out, self.i64([0, 0, heads * head_dim]))

    def pool(self, hidden: ir.Value) -> ir.Value:
        """AvgPool2d(2, 2) over each crop's P x P patch grid -> [V * G * G, C] rows, crop-major, row-major."""
        g, patches, side, c = self.g, self.v.patches_per_side, self.pooled_side, self.v.hidden_size
        grid = g.op("Reshape", hidden, self.i64([-1, patches, patches, c]))
        if patches % 2:
            grid = g.op("Pad", grid, self.i64([0, 0, 1, 1]), None, self.i64([1, 2]), mode="reflect")
        blocks = g.op("Reshape", grid, self.i64([-1, side, 2, side, 2, c]))
        pooled = g.op("ReduceMean", blocks, self.i64([2, 4]), keepdims=0)
        return g.op("Reshape", pooled, self.i64([-1, c]))

    def projected_table(self, pooled: ir.Value) -> ir.Value:
        """Projection MLP over [pooled rows ; sub_GN ; glb_GN] -> [V*G*G + 2, text hidden]."""
        g, c = self.g, self.v.hidden_size
        sub_gn = g.weight("sub_img_feature_extensor", self.ref("sub_img_feature_extensor"),
                          transform=lambda t: t.reshape(1, c))
        glb_gn = g.weight("global_img_feature_extensor", self.ref("global_img_feature_extensor"),
                          transform=lambda t: t.reshape(1, c))
        table = g.op("Concat", pooled, sub_gn, glb_gn, axis=0)
        up = self.gelu(self.linear(table, "img_projection_up"), "none")
        return self.linear(up, "img_projection_down")

    def hd_rows(self, crops: dict[str, ir.Value], num_pooled: ir.Value) -> ir.Value:
        """For every output token, its row in the projected table (sub_glb order, images concatenated).

        Per image with useful pooled size (uh, uw), grid width w and first valid crop `off`:
          tokens [0, uh*(uw+1))        sub grid row-major, column uw = sub_GN
          token  uh*(uw+1)             glb_GN
          tokens after that            global crop, G rows of G+1, column G = sub_GN
        """
        g = self.g
        side = self.pooled_side
        per_crop = side * side
        sub_row = num_pooled  # [1]: rows are [pooled (V*G*G) ; sub_GN ; glb_GN]
        glb_row = g.op("Add", num_pooled, self.i64(1))
        uh, uw, w, offset = crops["uh"], crops["uw"], crops["w"], crops["offset"]
        sub_tokens = g.op("Mul", uh, g.op("Add", uw, self.i64(1)))
        tokens = g.op("Add", sub_tokens, self.i64(1 + side * (side + 1)))  # [N]
        ends = g.op("CumSum", tokens, self.i64(0))
        starts = g.op("Sub", ends, tokens)
        total = g.op("ReduceSum", tokens, self.i64([0]), keepdims=0)
        t = g.op("Range", self.i64(0), total, self.i64(1))  # [T]
        image = g.op("ReduceSum", self.cast(g.op("GreaterOrEqual", g.op("Unsqueeze", t, self.i64([1])),
                                                 g.op("Unsqueeze", ends, self.i64([0]))), _I64),
                     self.i64([1]), keepdims=0)  # [T] image of each token

        def per_token(x: ir.Value) -> ir.Value:
            return g.op("Gather", x, image, axis=0)

        u = g.op("Sub", t, per_token(starts))
        uw_t, w_t, off_t, n_sub_t = per_token(uw), per_token(w), per_token(offset), per_token(sub_tokens)
        side_c = self.i64(side)

        # sub part: (r, c) in the [uh, uw+1] grid; crop 1 + (r//G)*w + c//G, cell (r%G, c%G)
        row_len = g.op("Add", uw_t, self.i64(1))
        r = g.op("Div", u, row_len)
        c = g.op("Mod", u, row_len)
        crop = g.op("Add", g.op("Add", g.op("Mul", g.op("Div", r, side_c), w_t), g.op("Div", c, side_c)),
                    self.i64(1))
        cell = g.op("Add", g.op("Mul", g.op("Mod", r, side_c), side_c), g.op("Mod", c, side_c))
        sub_idx = g.op("Add", g.op("Mul", g.op("Add", off_t, crop), self.i64(per_crop)), cell)
        sub_idx = g.op("Where", g.op("Equal", c, uw_t), sub_row, sub_idx)

        # global part: G rows of G+1 after the glb_GN token; crop `off`
        gu = g.op("Max", g.op("Sub", g.op("Sub", u, n_sub_t), self.i64(1)), self.i64(0))
        gr = g.op("Div", gu, self.i64(side + 1))
        gc = g.op("Mod", gu, self.i64(side + 1))
        glb_idx = g.op("Add", g.op("Add", g.op("Mul", off_t, self.i64(per_crop)), g.op("Mul", gr, side_c)), gc)
        glb_idx = g.op("Where", g.op("Equal", gc, side_c), sub_row, glb_idx)

        rest = g.op("Where", g.op("Equal", u, n_sub_t), glb_row, glb_idx)
        return g.op("Where", g.op("Less", u, n_sub_t), sub_idx, rest)
