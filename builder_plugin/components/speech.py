"""The speech graph (``phi-4-mm-speech.onnx``): the Conformer audio encoder plus both audio projection MLPs.

Built node by node with onnx-ir; transformers' native ``Phi4MultimodalAudioModel`` defines the semantics:

    log-mel [N, F, 80] -> (x - mean) * invstd -> NeMo dw-striding conv subsampling (÷time_reduction)
    -> conformer blocks (T5-style linear relative bias, 500-frame chunks for long inputs)
    -> rows of each clip -> up/down projection chosen by audio_projection_mode (2 speech pair, 3 vision pair)

Every clip comes out exactly as the original encodes that clip alone (a single clip gets no mask there), whatever it
is batched with. The native batched path does not guarantee this (the padding of a clip batched with longer ones
leaks into its features); this graph keeps the clips apart:
- padded frames are zeroed after the normalisation and again beyond each subsampling stage's valid length, so every
  strided convolution sees at its right edge the zeros the clip alone would see;
- the blocks run on [clips * chunks, chunk, D] with a per-chunk key mask: a clip longer than one chunk attends all
  keys of its chunks (its padded tail zeroed at block input, as the original pads), a shorter clip only its valid
  keys; the causal depthwise convolution and the relative bias are per chunk, as in the original.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import onnx_ir as ir
import torch

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.components.base import ComponentBuilder
from builder_plugin.components.encoder_graph import EncoderGraph
from builder_plugin.config import AudioConfig, Phi4MMConfig
from builder_plugin.errors import UnsupportedModelError
from builder_plugin.graph import MS_DOMAIN, GraphBuilder, transposed
from builder_plugin.layout import AUDIO_FEATURES, GRAPH_FILES
from builder_plugin.spec import Component, IOSpec, TensorSpec

SPEECH_FILENAME = GRAPH_FILES[Component.SPEECH]

# The original encoder hard-codes this chunk length (``max_seq_len = 500`` in Phi4MultimodalAudioModel.forward):
# longer subsampled sequences are cut into independent chunks of this many frames.
MAX_CHUNK_FRAMES = 500

# audio_projection_mode value that selects the *_for_vision_speech projection (image and audio in the prompt).
VISION_SPEECH_MODE = 3

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm default, used by every conformer LayerNorm


class SpeechBuilder(ComponentBuilder):
    """Builds ``phi-4-mm-speech.onnx``."""

    component = Component.SPEECH

    @classmethod
    def io_spec(cls, config: Phi4MMConfig, io_dtype: str, execution_provider: str = "cpu") -> IOSpec:
        return IOSpec(
            inputs=(
                TensorSpec("audio_embeds", io_dtype, ("num_audios", "num_frames", config.audio.input_size)),
                TensorSpec("audio_attention_mask", "bool", ("num_audios", "num_frames"), "attention_mask"),
                TensorSpec("audio_sizes", "int64", ("num_audios",)),
                TensorSpec("audio_projection_mode", "int64", (1,)),
            ),
            outputs=(TensorSpec(AUDIO_FEATURES, io_dtype, ("num_audio_tokens", config.text.hidden_size)),),
        )

    def build(self, weights: Mapping[str, TensorRef]) -> dict[str, ir.Model]:
        check_supported(self.config.audio)
        spec = self.io_spec(self.config, self.options.io_dtype)
        g = GraphBuilder(SPEECH_FILENAME.removesuffix(".onnx"), spec, self.options.weight_dtype)
        graph = _SpeechGraph(g, self.config, weights)
        return {SPEECH_FILENAME: graph.build()}


def check_supported(audio: AudioConfig) -> None:
    """Reject encoder variants the native port (and so this graph) does not implement."""
    required = {
        "input_layer": (audio.input_layer, "nemo_conv"),
        "batch_norm": (audio.batch_norm, False),
        "cnn_layer_norm": (audio.cnn_layer_norm, True),
        "causal": (audio.causal, True),
        "bias_in_glu": (audio.bias_in_glu, True),
        "ext_pw_kernel_size": (audio.ext_pw_kernel_size, 1),
    }
    for key, (value, wanted) in required.items():
        if value != wanted:
            raise UnsupportedModelError(f"audio encoder {key} = {value!r} is not supported (only {wanted!r})")
    if audio.chunk_size > 0:
        raise UnsupportedModelError(f"streaming audio encoder (chunk_size {audio.chunk_size}) is not supported")
    if audio.bias_symmetric:
        # The native symmetric table has max_distance rows but indexes it with |clamp(j - i)| up to max_distance.
        raise UnsupportedModelError("symmetric relative attention bias (t5_bias_symmetric) is not supported")
    if audio.time_reduction < 2 or audio.time_reduction & (audio.time_reduction - 1):
        raise UnsupportedModelError(f"audio time_reduction {audio.time_reduction} is not a power of two")
    if audio.attention_dim != audio.ext_pw_out_channel or audio.attention_dim != audio.depthwise_separable_out_channel:
        raise UnsupportedModelError(
            "audio ext_pw_out_channel and depthwise_separable_out_channel must equal attention_dim (residual adds)"
        )
    for name in (audio.activation, audio.conv_activation, audio.conv_glu_type, audio.nemo_activation):
        if name not in _ACTIVATIONS:
            raise UnsupportedModelError(f"audio activation {name!r} is not supported ({sorted(_ACTIVATIONS)})")


class _SpeechGraph(EncoderGraph):
    """One build of the speech graph; methods add the nodes of one module each."""

    def __init__(self, g: GraphBuilder, config: Phi4MMConfig, weights: Mapping[str, TensorRef]) -> None:
        super().__init__(g, weights, LAYER_NORM_EPS)
        self.audio = config.audio
        self.hidden_size = config.text.hidden_size
        self.io_dtype = g.spec.input("audio_embeds").onnx_dtype

    # ---- small pieces -----------------------------------------------------------------------------------------
    def act(self, x: ir.Value, name: str) -> ir.Value:
        return _ACTIVATIONS[name](self.g, x)

    def zero_beyond(self, x: ir.Value, lengths: ir.Value, time_axis: int, rank: int) -> ir.Value:
        """Zero the positions of `x` at or beyond each clip's valid length along `time_axis` (batch is axis 0)."""
        steps = self.g.op("Gather", self.g.op("Shape", x), self.i64(time_axis), axis=0)
        positions = self.g.op("Range", self.i64(0), steps, self.i64(1))
        valid = self.g.op("Less", self.g.op("Unsqueeze", positions, self.i64([0])),
                           self.g.op("Unsqueeze", lengths, self.i64([1])))  # [N, T]
        broadcast_axes = [a for a in range(1, rank) if a != time_axis]
        if broadcast_axes:
            valid = self.g.op("Unsqueeze", valid, self.i64(broadcast_axes))
        # A multiply by a 0/1 mask: much faster than a broadcasting Where on the large subsampling maps.
        return self.g.op("Mul", x, self.g.op("Cast", valid, to=self.dtype))

    def halved(self, lengths: ir.Value) -> ir.Value:
        """ceil(lengths / 2): the output length of a kernel-3, stride-2, padding-1 convolution."""
        return self.g.op("Div", self.g.op("Add", lengths, self.i64(1)), self.i64(2))

    # ---- the graph --------------------------------------------------------------------------------------------
    def build(self) -> ir.Model:
        g = self.g
        features = g.inputs["audio_embeds"]
        if self.io_dtype != self.dtype:
            features = g.op("Cast", features, to=self.dtype)
        frames = g.op("ReduceSum", g.op("Cast", g.inputs["audio_attention_mask"], to=ir.DataType.INT64),
                       self.i64([1]), keepdims=0)  # valid frames per clip [N]

        mean = g.weight("encoder.encoder_embedding.global_mean", self.ref("encoder.encoder_embedding.global_mean"))
        invstd = g.weight("encoder.encoder_embedding.global_invstd",
                           self.ref("encoder.encoder_embedding.global_invstd"))
        x = g.op("Mul", g.op("Sub", features, mean), invstd)
        x = self.zero_beyond(x, frames, time_axis=1, rank=3)
        x, lengths = self.subsample(x, frames)
        x = self.encoder(x, lengths)
        x = self.select_rows(x)
        out = self.projection(x)
        if self.io_dtype != self.dtype:
            out = g.op("Cast", out, to=self.io_dtype)
        g.output(AUDIO_FEATURES, out)
        return g.model()

    def subsample(self, x: ir.Value, lengths: ir.Value) -> tuple[ir.Value, ir.Value]:
        """NeMo dw_striding: [N, F, M] -> [N, ceil(F / time_reduction), D]; also returns the valid lengths."""
        g, audio = self.g, self.audio
        channels = audio.nemo_conv_channels
        x = g.op("Unsqueeze", x, self.i64([1]))  # [N, 1, F, M]
        conv = "encoder.embed.conv"
        x = g.op("Conv", x, g.weight(f"{conv}.0.weight", self.ref(f"{conv}.0.weight")),
                  g.weight(f"{conv}.0.bias", self.ref(f"{conv}.0.bias")),
                  kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
        activation = _ACTIVATIONS[audio.nemo_activation]
        x = activation(g, x)
        lengths = self.halved(lengths)
        for stage in range(1, int(math.log2(audio.time_reduction))):
            dw, pw = f"{conv}.{3 * stage - 1}", f"{conv}.{3 * stage}"
            # The stride-2 conv reads one frame past the last valid output: make it the zero the clip alone has.
            x = self.zero_beyond(x, lengths, time_axis=2, rank=4)
            x = g.op("Conv", x, g.weight(f"{dw}.weight", self.ref(f"{dw}.weight")),
                      g.weight(f"{dw}.bias", self.ref(f"{dw}.bias")),
                      kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], group=channels)
            x = activation(g, self.pointwise_conv2d(x, pw))
            lengths = self.halved(lengths)
        # [N, C, T', F'] -> [N, T', C * F'] (channel-major, as the native transpose(1, 2).reshape)
        x = g.op("Transpose", x, perm=[0, 2, 1, 3])
        x = g.op("Reshape", x, self.i64([0, 0, channels * audio.nemo_final_size]))
        return self.linear(x, "encoder.embed.out"), lengths

    def pointwise_conv2d(self, x: ir.Value, prefix: str) -> ir.Value:
        """1x1 Conv2d on [N, C, T, F] as W [out, in] @ x [N, in, T * F] (measured faster than Conv here)."""
        g = self.g
        ref = self.ref(f"{prefix}.weight")
        weight = g.weight(f"{prefix}.weight", ref, shape=ref.shape[:2], transform=lambda w: w[:, :, 0, 0])
        bias = g.weight(f"{prefix}.bias", self.ref(f"{prefix}.bias"), shape=(ref.shape[0], 1),
                         transform=lambda b: b[:, None])
        shape = g.op("Shape", x)
        flat = g.op("Reshape", x, self.i64([0, 0, -1]))
        return g.op("Reshape", g.op("Add", g.op("MatMul", weight, flat), bias), shape)

    def encoder(self, x: ir.Value, lengths: ir.Value) -> ir.Value:
        """Conformer blocks on [N, T', D] with valid lengths [N]; returns [N * chunks, chunk, D], where chunk is
        min(T', MAX_CHUNK_FRAMES) and the clips' sequences are zero-padded to whole chunks."""
        g, audio = self.g, self.audio
        dim = audio.attention_dim
        steps = g.op("Shape", x, start=1, end=2)  # [1] = T'
        chunk = g.op("Min", steps, self.i64([MAX_CHUNK_FRAMES]))
        num_chunks = g.op("Div", g.op("Sub", g.op("Add", steps, chunk), self.i64([1])), chunk)
        padded = g.op("Mul", num_chunks, chunk)

        # The original zero-pads the subsampled sequence to whole chunks; zero each clip's tail the same way.
        x = self.zero_beyond(x, lengths, time_axis=1, rank=3)
        pads = g.op("Concat", self.i64([0, 0, 0, 0]), g.op("Sub", padded, steps), self.i64([0]), axis=0)
        x = g.op("Pad", x, pads)
        x = g.op("Reshape", x, g.op("Concat", self.i64([-1]), chunk, self.i64([dim]), axis=0))

        # Key mask per chunk: a clip longer than one chunk attends every key of its chunks (the original runs it
        # without a mask), a shorter clip only its valid keys.
        positions = g.op("Range", self.i64(0), g.op("Squeeze", padded, self.i64([0])), self.i64(1))
        lengths_col = g.op("Unsqueeze", lengths, self.i64([1]))
        key_valid = g.op("Or", g.op("Greater", lengths_col, self.i64(MAX_CHUNK_FRAMES)),
                          g.op("Less", g.op("Unsqueeze", positions, self.i64([0])), lengths_col))
        key_mask = g.op("Reshape", g.op("Cast", key_valid, to=ir.DataType.INT32),
                         g.op("Concat", self.i64([-1]), chunk, axis=0))

        bias = self.relative_bias(chunk)
        for index in range(audio.num_blocks):
            x = self.block(x, f"encoder.encoders.{index}", key_mask, bias)
        return x

    def relative_bias(self, chunk: ir.Value) -> ir.Value:
        """T5-style linear relative bias [1, H, chunk, chunk]: table[clamp(j - i, -max, max - 1) + max]."""
        g, audio = self.g, self.audio
        max_distance = audio.bias_max_distance
        positions = g.op("Range", self.i64(0), g.op("Squeeze", chunk, self.i64([0])), self.i64(1))
        relative = g.op("Sub", g.op("Unsqueeze", positions, self.i64([0])),
                         g.op("Unsqueeze", positions, self.i64([1])))  # [i, j] = j - i
        relative = g.op("Clip", relative, self.i64(-max_distance), self.i64(max_distance - 1))
        index = g.op("Add", relative, self.i64(max_distance))
        name = "encoder.relative_attention_bias_layer.bias_values.weight"
        table = g.weight(name, self.ref(name))  # [buckets, H]
        bias = g.op("Gather", table, index, axis=0)  # [chunk, chunk, H]
        return g.op("Unsqueeze", g.op("Transpose", bias, perm=[2, 0, 1]), self.i64([0]))

    def block(self, x: ir.Value, prefix: str, key_mask: ir.Value, bias: ir.Value) -> ir.Value:
        g = self.g
        x = g.op("Add", x, self.feed_forward(x, f"{prefix}.feed_forward_in"))
        x = g.op("Add", x, self.attention(self.layer_norm(x, f"{prefix}.layer_norm_att"), f"{prefix}.self_attn",
                                           key_mask, bias))
        x = g.op("Add", x, self.conv_module(x, f"{prefix}.conv"))
        x = g.op("Add", x, self.feed_forward(x, f"{prefix}.feed_forward_out"))
        return self.layer_norm(x, f"{prefix}.layer_norm")

    def feed_forward(self, x: ir.Value, prefix: str) -> ir.Value:
        """0.5 * down(value * act(gate)) with gate_up rows [value ; gate] (the half step folded into down)."""
        g = self.g
        units = self.audio.linear_units
        hidden = self.linear(self.layer_norm(x, f"{prefix}.layer_norm"), f"{prefix}.gate_up_proj")
        value, gate = g.op_multi("Split", hidden, self.i64([units, units]), num_outputs=2, axis=-1)
        hidden = g.op("Mul", value, self.act(gate, self.audio.activation))
        return self.linear(hidden, f"{prefix}.down_proj", scale=0.5)

    def attention(self, x: ir.Value, prefix: str, key_mask: ir.Value, bias: ir.Value) -> ir.Value:
        g, audio = self.g, self.audio
        dim = audio.attention_dim
        refs = [self.ref(f"{prefix}.{p}_proj.weight") for p in "qkv"]
        bias_refs = [self.ref(f"{prefix}.{p}_proj.bias") for p in "qkv"]
        qkv_weight = g.weight(f"{prefix}.qkv_proj.weight", refs[0], shape=(dim, 3 * dim),
                               transform=lambda q: torch.cat([q, refs[1].load(), refs[2].load()]).t())
        qkv_bias = g.weight(f"{prefix}.qkv_proj.bias", bias_refs[0], shape=(3 * dim,),
                             transform=lambda q: torch.cat([q, bias_refs[1].load(), bias_refs[2].load()]))
        qkv = g.op("Add", g.op("MatMul", x, qkv_weight), qkv_bias)
        q, k, v = g.op_multi("Split", qkv, self.i64([dim, dim, dim]), num_outputs=3, axis=-1)
        # Masked keys get mask_filter_value (-10000) added: exp() of it is exactly 0 next to the valid keys' scores.
        out = g.op("MultiHeadAttention", q, k, v, None, key_mask, bias, domain=MS_DOMAIN,
                    num_heads=audio.attention_heads, scale=audio.head_dim**-0.5)
        return self.linear(out, f"{prefix}.o_proj")

    def conv_module(self, x: ir.Value, prefix: str) -> ir.Value:
        """LayerNorm -> GLU pointwise conv -> causal depthwise conv -> pointwise conv -> act -> pointwise conv, all
        on [batch, time, channels] (the k=1 convolutions as MatMuls)."""
        g, audio = self.g, self.audio
        dim, out_channels = audio.attention_dim, audio.ext_pw_out_channel
        x = self.layer_norm(x, f"{prefix}.layer_norm")

        glu = f"{prefix}.glu"
        b1, b2 = self.ref(f"{glu}.b1"), self.ref(f"{glu}.b2")
        glu_weight = g.weight(f"{glu}.ext_pw_conv_1d.weight", self.ref(f"{glu}.ext_pw_conv_1d.weight"),
                               shape=(dim, 2 * out_channels), transform=lambda w: w[:, :, 0].t())
        # b1 / b2 are added right after the conv bias: fold them into it.
        glu_bias = g.weight(f"{glu}.ext_pw_conv_1d.bias", self.ref(f"{glu}.ext_pw_conv_1d.bias"),
                             transform=lambda b: b + torch.cat([b1.load().reshape(-1), b2.load().reshape(-1)]),
                             shape=(2 * out_channels,))
        hidden = g.op("Add", g.op("MatMul", x, glu_weight), glu_bias)
        value, gate = g.op_multi("Split", hidden, self.i64([out_channels, out_channels]), num_outputs=2, axis=-1)
        x = g.op("Mul", value, self.act(gate, audio.conv_glu_type))

        x = self.causal_depthwise_conv(x, f"{prefix}.dw_sep_conv_1d.dw_conv")
        x = self.pointwise_conv(x, f"{prefix}.dw_sep_conv_1d.pw_conv")
        x = self.act(x, audio.conv_activation)
        return self.pointwise_conv(x, f"{prefix}.ext_pw_conv_1d")

    def pointwise_conv(self, x: ir.Value, prefix: str) -> ir.Value:
        ref = self.ref(f"{prefix}.weight")
        weight = self.g.weight(f"{prefix}.weight", ref, shape=(ref.shape[1], ref.shape[0]),
                                transform=lambda w: w[:, :, 0].t())
        bias = self.g.weight(f"{prefix}.bias", self.ref(f"{prefix}.bias"))
        return self.g.op("Add", self.g.op("MatMul", x, weight), bias)

    def causal_depthwise_conv(self, x: ir.Value, prefix: str) -> ir.Value:
        """Conv1d(k, groups=channels, padding k-1) with the last k-1 outputs dropped, i.e. out[t] = bias +
        sum_j w[j] * x[t - (k-1) + j] with zeros before the chunk start; done as shifted multiply-adds on
        [batch, time, channels]."""
        g, audio = self.g, self.audio
        kernel, multiplier = audio.kernel_size, audio.depthwise_multiplier
        if multiplier > 1:  # output channel c * multiplier + r reads input channel c
            repeat = [c for c in range(audio.attention_dim) for _ in range(multiplier)]
            x = g.op("Gather", x, self.i64(repeat), axis=2)
        ref = self.ref(f"{prefix}.weight")  # [channels * multiplier, 1, k]
        bias = g.weight(f"{prefix}.bias", self.ref(f"{prefix}.bias"))
        if kernel == 1:
            weight = g.weight(f"{prefix}.weight", ref, shape=(ref.shape[0],), transform=lambda w: w[:, 0, 0])
            return g.op("Add", g.op("Mul", x, weight), bias)
        x = g.op("Pad", x, self.i64([0, kernel - 1, 0, 0, 0, 0]))
        out = bias
        for tap in range(kernel):
            weight = g.weight(f"{prefix}.weight.tap{tap}", ref, shape=(ref.shape[0],),
                               transform=lambda w, j=tap: w[:, 0, j])
            end = tap - (kernel - 1)
            shifted = g.op("Slice", x, self.i64([tap]), self.i64([end if end < 0 else 2**62]), self.i64([1]))
            out = g.op("Add", out, g.op("Mul", shifted, weight))
        return out

    def select_rows(self, x: ir.Value) -> ir.Value:
        """[N, P, D] -> the first audio_sizes[i] rows of every clip, in order: [sum(audio_sizes), D]."""
        g = self.g
        dim = self.audio.attention_dim
        x = g.op("Reshape", x, g.op("Concat", g.op("Shape", g.inputs["audio_sizes"]), self.i64([-1, dim]),
                                      axis=0))
        positions = g.op("Range", self.i64(0), g.op("Gather", g.op("Shape", x), self.i64(1), axis=0),
                          self.i64(1))
        keep = g.op("Less", g.op("Unsqueeze", positions, self.i64([0])),
                     g.op("Unsqueeze", g.inputs["audio_sizes"], self.i64([1])))
        x = g.op("Reshape", x, self.i64([-1, dim]))
        return g.op("Compress", x, g.op("Reshape", keep, self.i64([-1])), axis=0)

    def projection(self, x: ir.Value) -> ir.Value:
        """up -> exact GELU -> down with the pair audio_projection_mode selects; an If, so only one pair runs."""
        g = self.g
        is_vision = g.op("Equal", g.inputs["audio_projection_mode"], self.i64([VISION_SPEECH_MODE]))
        branches = {}
        for branch, pair in (("then", "vision_speech"), ("else", "speech")):
            nodes = _Subgraph(f"projection_{pair}")
            hidden = self._branch_linear(nodes, x, f"up_proj_for_{pair}")
            hidden = nodes.op("Gelu", hidden)  # opset 20 Gelu, approximate="none": the erf form
            out = self._branch_linear(nodes, hidden, f"down_proj_for_{pair}")
            out.dtype = self.dtype
            out.shape = ir.Shape(["num_audio_tokens", self.hidden_size])
            branches[branch] = ir.Graph(inputs=[], outputs=[out], nodes=nodes.nodes, name=nodes.prefix)
        return g.op("If", is_vision, then_branch=branches["then"], else_branch=branches["else"])

    def _branch_linear(self, nodes: _Subgraph, x: ir.Value, prefix: str) -> ir.Value:
        weight = self.g.weight(f"{prefix}.weight", self.ref(f"{prefix}.weight"), transform=transposed)
        bias = self.g.weight(f"{prefix}.bias", self.ref(f"{prefix}.bias"))
        return nodes.op("Add", nodes.op("MatMul", x, weight), bias)


class _Subgraph:
    """Records the nodes of an If branch (their values read the outer graph's initializers by name)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, *inputs: ir.Value) -> ir.Value:
        name = f"{self.prefix}/{op_type}_{len(self.nodes)}"
        node = ir.node(op_type, list(inputs), name=name)
        node.outputs[0].name = f"{name}/out"
        self.nodes.append(node)
        return node.outputs[0]


def _swish(g: GraphBuilder, x: ir.Value) -> ir.Value:
    return g.op("Mul", x, g.op("Sigmoid", x))


def _gelu(g: GraphBuilder, x: ir.Value) -> ir.Value:
    return g.op("Gelu", x)


def _relu(g: GraphBuilder, x: ir.Value) -> ir.Value:
    return g.op("Relu", x)


_ACTIVATIONS: dict[str, Callable[[GraphBuilder, ir.Value], ir.Value]] = {
    "swish": _swish,
    "silu": _swish,
    "gelu": _gelu,
    "relu": _relu,
}
