"""The weight-routing table: checkpoint tensor -> (component, local name, expected shape).

One row per tensor template. ``original`` is the key in the original release (remote-code names, LoRA inline),
``native`` the key in the transformers-native layout (LoRA in PEFT adapter folders, named ``<folder>/<peft key>``).
Templates are expanded over the layer counts read from the config, so the expanded table lists every tensor the model
must have: a checkpoint tensor that matches no row and no IGNORED row, a row with no tensor, or a tensor of the wrong
shape is an error that names the tensor.

Local names are the transformers-native module paths relative to the component (``layers.0.self_attn.qkv_proj.weight``
for the decoder, ``img_processor.encoder.layers.0.mlp.fc1.weight`` for vision, ...). Builders read weights by these
names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.config import NATIVE_ADAPTER_DIRS, Phi4MMConfig
from builder_plugin.errors import CheckpointError, RoutingError
from builder_plugin.spec import Component

Shape = tuple[int, ...]
Expand = Callable[[Phi4MMConfig], Iterable[dict[str, object]]]

# Key prefixes of the image and audio encoders (the same in both layouts).
IMAGE_EMBED = "model.embed_tokens_extend.image_embed."
AUDIO_EMBED = "model.embed_tokens_extend.audio_embed."


def _text_layers(c: Phi4MMConfig) -> Iterable[dict[str, object]]:
    return ({"i": i} for i in range(c.text.num_hidden_layers))


def _lora(c: Phi4MMConfig) -> Iterable[dict[str, object]]:
    return (
        {"i": i, "a": name, "dir": NATIVE_ADAPTER_DIRS[name]}
        for i in range(c.text.num_hidden_layers)
        for name in c.loras
    )


def _vision_layers_used(c: Phi4MMConfig) -> Iterable[dict[str, object]]:
    return ({"i": i} for i in range(c.vision.num_layers_used))


def _vision_layers_unused(c: Phi4MMConfig) -> Iterable[dict[str, object]]:
    return ({"i": i} for i in range(c.vision.num_layers_used, c.vision.num_hidden_layers))


def _audio_blocks(c: Phi4MMConfig) -> Iterable[dict[str, object]]:
    return ({"i": i} for i in range(c.audio.num_blocks))


def _subsampling_stages(c: Phi4MMConfig) -> Iterable[dict[str, object]]:
    # NeMo dw_striding: conv.0 (+ReLU at 1), then per further ÷2 stage a depthwise conv at 3s-1 and a pointwise at 3s.
    return ({"dw": 3 * s - 1, "pw": 3 * s} for s in range(1, int(math.log2(c.audio.time_reduction))))


def _once(c: Phi4MMConfig) -> Iterable[dict[str, object]]:
    return ({},)


@dataclass(frozen=True)
class Route:
    original: str
    native: str
    component: Component
    local: str
    shape: Callable[[Phi4MMConfig], Shape]
    expand: Expand = _once
    required: Callable[[Phi4MMConfig], bool] = lambda c: True


@dataclass(frozen=True)
class Ignored:
    """Tensors the checkpoint has but no graph uses, each with the reason."""

    original: str
    native: str
    reason: str
    expand: Expand = _once


def _route(original: str, native: str, component: Component, local: str, shape, expand: Expand = _once, **kw) -> Route:
    return Route(original, native, component, local, shape, expand, **kw)


def _text(suffix_orig: str, suffix_native: str, local: str, shape, expand: Expand = _text_layers) -> Route:
    return _route("model." + suffix_orig, "model." + suffix_native, Component.DECODER, local, shape, expand)


def _proj_shapes(c: Phi4MMConfig) -> dict[str, Shape]:
    t = c.text
    return {
        "self_attn.qkv_proj": (t.q_size + 2 * t.kv_size, t.hidden_size),
        "self_attn.o_proj": (t.hidden_size, t.q_size),
        "mlp.gate_up_proj": (2 * t.intermediate_size, t.hidden_size),
        "mlp.down_proj": (t.hidden_size, t.intermediate_size),
    }


def _lora_routes() -> list[Route]:
    routes = []
    for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        routes.append(
            _route(
                f"model.layers.{{i}}.{proj}.lora_A.{{a}}.weight",
                f"{{dir}}/base_model.model.model.layers.{{i}}.{proj}.lora_A.weight",
                Component.DECODER,
                f"layers.{{i}}.{proj}.lora_A.{{a}}.weight",
                lambda c, p=proj, **v: (c.loras[v["a"]].r, _proj_shapes(c)[p][1]),
                _lora,
            )
        )
        routes.append(
            _route(
                f"model.layers.{{i}}.{proj}.lora_B.{{a}}.weight",
                f"{{dir}}/base_model.model.model.layers.{{i}}.{proj}.lora_B.weight",
                Component.DECODER,
                f"layers.{{i}}.{proj}.lora_B.{{a}}.weight",
                lambda c, p=proj, **v: (_proj_shapes(c)[p][0], c.loras[v["a"]].r),
                _lora,
            )
        )
    return routes


def _vision(orig: str, native: str, shape, expand: Expand = _once) -> Route:
    return _route(IMAGE_EMBED + orig, IMAGE_EMBED + native, Component.VISION, native, shape, expand)


def _siglip_layer(name: str, shape) -> Route:
    path = f"img_processor.encoder.layers.{{i}}.{name}"
    return _vision(path, path, shape, _vision_layers_used)


def _speech(orig: str, native: str, shape, expand: Expand = _once) -> Route:
    return _route(AUDIO_EMBED + orig, AUDIO_EMBED + native, Component.SPEECH, native, shape, expand)


def _block(orig: str, native: str, shape) -> Route:
    return _speech(f"encoder.encoders.{{i}}.{orig}", f"encoder.encoders.{{i}}.{native}", shape, _audio_blocks)


def _vec(size: Callable[[Phi4MMConfig], int]) -> Callable[[Phi4MMConfig], Shape]:
    return lambda c, **_: (size(c),)


def _text_hidden(c: Phi4MMConfig) -> int:
    return c.text.hidden_size


def _vision_hidden(c: Phi4MMConfig) -> int:
    return c.vision.hidden_size


def _audio_dim(c: Phi4MMConfig) -> int:
    return c.audio.attention_dim


WEIGHT_ROUTES: tuple[Route, ...] = (
    # --- token embedding (the decoder's tied lm_head reads the same tensor) ---
    _route("model.embed_tokens.weight", "model.embed_tokens.weight", Component.EMBEDDING, "embed_tokens.weight",
       lambda c, **_: (c.text.vocab_size, c.text.hidden_size)),
    _route("model.embed_tokens.weight", "model.embed_tokens.weight", Component.DECODER, "embed_tokens.weight",
       lambda c, **_: (c.text.vocab_size, c.text.hidden_size)),
    _route("lm_head.weight", "lm_head.weight", Component.DECODER, "lm_head.weight",
       lambda c, **_: (c.text.vocab_size, c.text.hidden_size), required=lambda c: not c.text.tie_word_embeddings),
    # --- text decoder ---
    _text("layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight",
          "layers.{i}.input_layernorm.weight", _vec(_text_hidden)),
    _text("layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm.weight",
          "layers.{i}.post_attention_layernorm.weight", _vec(_text_hidden)),
    *(
        _text(f"layers.{{i}}.{proj}.base_layer.weight", f"layers.{{i}}.{proj}.weight", f"layers.{{i}}.{proj}.weight",
              lambda c, p=proj, **_: _proj_shapes(c)[p])
        for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ),
    *_lora_routes(),
    _text("norm.weight", "norm.weight", "norm.weight", _vec(_text_hidden), _once),
    # --- vision: SigLIP tower, HD separators, projection ---
    _vision("glb_GN", "global_img_feature_extensor", lambda c, **_: (1, 1, c.vision.hidden_size)),
    _vision("sub_GN", "sub_img_feature_extensor", lambda c, **_: (1, 1, 1, c.vision.hidden_size)),
    _vision("img_projection.0.weight", "img_projection_up.weight", lambda c, **_: (_text_hidden(c), _vision_hidden(c))),
    _vision("img_projection.0.bias", "img_projection_up.bias", _vec(_text_hidden)),
    _vision("img_projection.2.weight", "img_projection_down.weight", lambda c, **_: (_text_hidden(c), _text_hidden(c))),
    _vision("img_projection.2.bias", "img_projection_down.bias", _vec(_text_hidden)),
    _vision("img_processor.embeddings.patch_embedding.weight", "img_processor.embeddings.patch_embedding.weight",
            lambda c, **_: (_vision_hidden(c), 3, c.vision.patch_size, c.vision.patch_size)),
    _vision("img_processor.embeddings.patch_embedding.bias", "img_processor.embeddings.patch_embedding.bias",
            _vec(_vision_hidden)),
    _vision("img_processor.embeddings.position_embedding.weight",
            "img_processor.embeddings.position_embedding.weight",
            lambda c, **_: (c.vision.num_positions, _vision_hidden(c))),
    *(
        _siglip_layer(f"{norm}.{p}", _vec(_vision_hidden))
        for norm in ("layer_norm1", "layer_norm2")
        for p in ("weight", "bias")
    ),
    *(
        _siglip_layer(f"self_attn.{proj}.{p}",
                      (lambda c, **_: (_vision_hidden(c), _vision_hidden(c))) if p == "weight"
                      else _vec(_vision_hidden))
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
        for p in ("weight", "bias")
    ),
    _siglip_layer("mlp.fc1.weight", lambda c, **_: (c.vision.intermediate_size, _vision_hidden(c))),
    _siglip_layer("mlp.fc1.bias", _vec(lambda c: c.vision.intermediate_size)),
    _siglip_layer("mlp.fc2.weight", lambda c, **_: (_vision_hidden(c), c.vision.intermediate_size)),
    _siglip_layer("mlp.fc2.bias", _vec(_vision_hidden)),
    # --- speech: conformer encoder and both projection pairs ---
    *(
        _speech(f"audio_projection.{branch}.{idx}.{p}", f"{direction}_proj_for_{native}.{p}",
                (lambda c, d=direction, **_: (_text_hidden(c), _audio_dim(c) if d == "up" else _text_hidden(c)))
                if p == "weight" else _vec(_text_hidden))
        for branch, native in (("speech", "speech"), ("vision", "vision_speech"))
        for idx, direction in ((0, "up"), (2, "down"))
        for p in ("weight", "bias")
    ),
    _speech("encoder.encoder_embedding.global_mean", "encoder.encoder_embedding.global_mean",
            _vec(lambda c: c.audio.input_size)),
    _speech("encoder.encoder_embedding.global_invstd", "encoder.encoder_embedding.global_invstd",
            _vec(lambda c: c.audio.input_size)),
    _speech("encoder.embed.conv.0.weight", "encoder.embed.conv.0.weight",
            lambda c, **_: (c.audio.nemo_conv_channels, 1, 3, 3)),
    _speech("encoder.embed.conv.0.bias", "encoder.embed.conv.0.bias", _vec(lambda c: c.audio.nemo_conv_channels)),
    _speech("encoder.embed.conv.{dw}.weight", "encoder.embed.conv.{dw}.weight",
            lambda c, **_: (c.audio.nemo_conv_channels, 1, 3, 3), _subsampling_stages),
    _speech("encoder.embed.conv.{dw}.bias", "encoder.embed.conv.{dw}.bias",
            _vec(lambda c: c.audio.nemo_conv_channels), _subsampling_stages),
    _speech("encoder.embed.conv.{pw}.weight", "encoder.embed.conv.{pw}.weight",
            lambda c, **_: (c.audio.nemo_conv_channels, c.audio.nemo_conv_channels, 1, 1), _subsampling_stages),
    _speech("encoder.embed.conv.{pw}.bias", "encoder.embed.conv.{pw}.bias",
            _vec(lambda c: c.audio.nemo_conv_channels), _subsampling_stages),
    _speech("encoder.embed.out.weight", "encoder.embed.out.weight",
            lambda c, **_: (_audio_dim(c), c.audio.nemo_conv_channels * c.audio.nemo_final_size)),
    _speech("encoder.embed.out.bias", "encoder.embed.out.bias", _vec(_audio_dim)),
    _speech("encoder.relative_attention_bias_layer.bias_values.weight",
            "encoder.relative_attention_bias_layer.bias_values.weight",
            lambda c, **_: (2 * c.audio.bias_max_distance, c.audio.attention_heads)),
    *(
        r
        for ff in ("feed_forward_in", "feed_forward_out")
        for r in (
            _block(f"{ff}.layer_norm.weight", f"{ff}.layer_norm.weight", _vec(_audio_dim)),
            _block(f"{ff}.layer_norm.bias", f"{ff}.layer_norm.bias", _vec(_audio_dim)),
            _block(f"{ff}.net.0.linear.weight", f"{ff}.gate_up_proj.weight",
                   lambda c, **_: (2 * c.audio.linear_units, _audio_dim(c))),
            _block(f"{ff}.net.0.linear.bias", f"{ff}.gate_up_proj.bias", _vec(lambda c: 2 * c.audio.linear_units)),
            _block(f"{ff}.net.2.weight", f"{ff}.down_proj.weight",
                   lambda c, **_: (_audio_dim(c), c.audio.linear_units)),
            _block(f"{ff}.net.2.bias", f"{ff}.down_proj.bias", _vec(_audio_dim)),
        )
    ),
    *(
        _block(f"self_attn.linear_{orig}.{p}", f"self_attn.{native}_proj.{p}",
               (lambda c, **_: (_audio_dim(c), _audio_dim(c))) if p == "weight" else _vec(_audio_dim))
        for orig, native in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"))
        for p in ("weight", "bias")
    ),
    *(
        _block(f"{norm}.{p}", f"{norm}.{p}", _vec(_audio_dim))
        for norm in ("conv.layer_norm", "layer_norm_att", "layer_norm")
        for p in ("weight", "bias")
    ),
    _block("conv.glu.b1", "conv.glu.b1", lambda c, **_: (1, c.audio.ext_pw_out_channel, 1)),
    _block("conv.glu.b2", "conv.glu.b2", lambda c, **_: (1, c.audio.ext_pw_out_channel, 1)),
    _block("conv.glu.ext_pw_conv_1d.weight", "conv.glu.ext_pw_conv_1d.weight",
           lambda c, **_: (2 * c.audio.ext_pw_out_channel, _audio_dim(c), c.audio.ext_pw_kernel_size)),
    _block("conv.glu.ext_pw_conv_1d.bias", "conv.glu.ext_pw_conv_1d.bias",
           _vec(lambda c: 2 * c.audio.ext_pw_out_channel)),
    _block("conv.dw_sep_conv_1d.dw_conv.weight", "conv.dw_sep_conv_1d.dw_conv.weight",
           lambda c, **_: (_audio_dim(c) * c.audio.depthwise_multiplier, 1, c.audio.kernel_size)),
    _block("conv.dw_sep_conv_1d.dw_conv.bias", "conv.dw_sep_conv_1d.dw_conv.bias",
           _vec(lambda c: _audio_dim(c) * c.audio.depthwise_multiplier)),
    _block("conv.dw_sep_conv_1d.pw_conv.weight", "conv.dw_sep_conv_1d.pw_conv.weight",
           lambda c, **_: (c.audio.depthwise_separable_out_channel, _audio_dim(c) * c.audio.depthwise_multiplier, 1)),
    _block("conv.dw_sep_conv_1d.pw_conv.bias", "conv.dw_sep_conv_1d.pw_conv.bias",
           _vec(lambda c: c.audio.depthwise_separable_out_channel)),
    _block("conv.ext_pw_conv_1d.weight", "conv.ext_pw_conv_1d.weight",
           lambda c, **_: (_audio_dim(c), c.audio.depthwise_separable_out_channel, 1)),
    _block("conv.ext_pw_conv_1d.bias", "conv.ext_pw_conv_1d.bias", _vec(_audio_dim)),
)

IGNORED: tuple[Ignored, ...] = (
    Ignored(IMAGE_EMBED + "img_processor.encoder.layers.{i}.", IMAGE_EMBED + "img_processor.encoder.layers.{i}.",
            "SigLIP layer after the feature layer (hidden_states[-2])", _vision_layers_unused),
    Ignored(IMAGE_EMBED + "img_processor.post_layernorm.", IMAGE_EMBED + "img_processor.post_layernorm.",
            "SigLIP post-layernorm, not on the feature path"),
    Ignored(IMAGE_EMBED + "img_processor.head.", IMAGE_EMBED + "img_processor.head.",
            "SigLIP attention-pooling head, not on the feature path"),
    Ignored("lm_head.weight", "lm_head.weight", "tied to model.embed_tokens.weight"),
)


RoutedWeights = dict[Component, dict[str, TensorRef]]


def expanded_routes(config: Phi4MMConfig) -> list[tuple[str, Route, str, Shape]]:
    """(source key, route, local name, expected shape) for every tensor the config implies."""
    rows = []
    fmt = config.source_format
    for route in WEIGHT_ROUTES:
        if not route.required(config):
            continue
        for fields in route.expand(config):
            source = (route.original if fmt == "original" else route.native).format(**fields)
            rows.append((source, route, route.local.format(**fields), tuple(route.shape(config, **fields))))
    return rows


def ignored_prefixes(config: Phi4MMConfig) -> list[tuple[str, str]]:
    out = []
    for ign in IGNORED:
        if ign.original == "lm_head.weight" and not config.text.tie_word_embeddings:
            continue
        for fields in ign.expand(config):
            pattern = (ign.original if config.source_format == "original" else ign.native).format(**fields)
            out.append((pattern, ign.reason))
    return out


def route_weights(tensors: Mapping[str, TensorRef], config: Phi4MMConfig) -> RoutedWeights:
    """Route every checkpoint tensor to its component(s).

    Raises RoutingError naming the tensors that match no route (unknown) or that the config requires but the
    checkpoint lacks (missing), and CheckpointError for a tensor whose shape differs from the config's.
    """
    routed: RoutedWeights = {c: {} for c in Component}
    claimed: set[str] = set()
    missing: list[str] = []
    for source, route, local, shape in expanded_routes(config):
        ref = tensors.get(source)
        if ref is None:
            missing.append(source)
            continue
        if ref.shape != shape:
            raise CheckpointError(f"tensor {source} has shape {list(ref.shape)}, the config implies {list(shape)}")
        routed[route.component][local] = ref
        claimed.add(source)
    if missing:
        raise RoutingError(_name_list("checkpoint lacks", missing))
    ignored = ignored_prefixes(config)
    unknown = [
        name
        for name in tensors
        if name not in claimed and not any(_matches_ignored(name, pattern) for pattern, _ in ignored)
    ]
    if unknown:
        raise RoutingError(_name_list("checkpoint has unexpected", unknown))
    return routed


def _matches_ignored(name: str, pattern: str) -> bool:
    return name == pattern or (pattern.endswith(".") and name.startswith(pattern))


def _name_list(what: str, names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{what} tensor(s) {shown}{more} (is this checkpoint complete and matching its config.json?)"


def describe_routes(config: Phi4MMConfig) -> str:
    """A printable listing of the expanded table (for --list-routes)."""
    lines = []
    for source, route, local, shape in expanded_routes(config):
        lines.append(f"{source} -> {route.component.value}:{local} {list(shape)}")
    for pattern, reason in ignored_prefixes(config):
        lines.append(f"{pattern}* -> ignored ({reason})")
    return "\n".join(lines)

