"""Config conversion: a checkpoint's config.json (original ``phi4mm`` or transformers-native) as transformers'
``Phi4MultimodalConfig``. Every size is read from the checkpoint, independently of the builder's own parser."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import Phi4MultimodalAudioConfig, Phi4MultimodalConfig, Phi4MultimodalVisionConfig

from builder_plugin.layout import AUDIO_TOKEN_ID, IMAGE_TOKEN_ID
from builder_plugin.reference.errors import ReferenceModelError

ORIGINAL_MODEL_TYPE = "phi4mm"
NATIVE_MODEL_TYPE = "phi4_multimodal"

# The original remote code builds SigLIP-so400m when config.json has "img_processor": null.
SIGLIP_SO400M = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 448,
    "patch_size": 14,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}


def native_config_from_original(raw: Mapping[str, Any]) -> Phi4MultimodalConfig:
    """Build the transformers-native config from an original (``phi4mm``) config.json dict.

    Every size is read from ``raw``; the native defaults that differ from the release (32 heads, a 2000-row audio
    bias table, untied embeddings) are never relied on.
    """
    if raw.get("model_type") != ORIGINAL_MODEL_TYPE:
        raise ReferenceModelError(f"expected model_type {ORIGINAL_MODEL_TYPE!r}, got {raw.get('model_type')!r}")
    heads = int(raw["num_attention_heads"])
    max_positions = int(raw["max_position_embeddings"])
    original_max = int(raw.get("original_max_position_embeddings") or max_positions)
    sliding_window = raw.get("sliding_window")
    if sliding_window is not None and int(sliding_window) >= max_positions:
        sliding_window = None  # wider than the context: no effect, and keeps the plain causal mask

    eos = raw.get("eos_token_id", 199999)
    text = dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        hidden_act=str(raw.get("hidden_act", "silu")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=max_positions,
        original_max_position_embeddings=original_max,
        resid_pdrop=float(raw.get("resid_pdrop", 0.0)),
        embd_pdrop=float(raw.get("embd_pdrop", 0.0)),
        attention_dropout=float(raw.get("attention_dropout", 0.0)),
        # Phi4MMConfig (a Phi3Config) defaults to untied; the release sets true and ships no lm_head.weight.
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", 199999),
        pad_token_id=raw.get("pad_token_id", 199999),
        eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else [int(eos)],
        sliding_window=sliding_window,
        rope_parameters=_rope_parameters(raw, original_max, max_positions),
    )
    if raw.get("attention_bias") or raw.get("mlp_bias") or raw.get("lm_head_bias"):
        raise ReferenceModelError("attention_bias / mlp_bias / lm_head_bias are not supported by the native port")
    return Phi4MultimodalConfig(
        **text,
        vision_config=Phi4MultimodalVisionConfig(**_vision_kwargs(raw)),
        audio_config=Phi4MultimodalAudioConfig(**_audio_kwargs(raw)),
    )


def native_config_from_dict(raw: Mapping[str, Any]) -> Phi4MultimodalConfig:
    """A transformers-native config.json as its config. A longrope `factor` it leaves out is stated (the ratio
    transformers would derive, with a warning on every load): the same model."""
    raw = dict(raw)
    rope = raw.get("rope_parameters")
    original_max = raw.get("original_max_position_embeddings")
    if isinstance(rope, Mapping) and rope.get("rope_type") == "longrope" and "factor" not in rope:
        original_max = rope.get("original_max_position_embeddings", original_max)
        if original_max and raw.get("max_position_embeddings"):
            raw["rope_parameters"] = {**rope, "factor": max(1.0, raw["max_position_embeddings"] / original_max)}
    return Phi4MultimodalConfig.from_dict(raw)


def _rope_parameters(raw: Mapping[str, Any], original_max: int, max_positions: int) -> dict[str, Any]:
    theta = float(raw.get("rope_theta", 10000.0))
    partial = float(raw.get("partial_rotary_factor", 1.0))
    scaling = raw.get("rope_scaling")
    if not scaling:
        return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    rope_type = scaling.get("type", scaling.get("rope_type"))
    if rope_type not in ("longrope", "su"):
        raise ReferenceModelError(f"unsupported rope_scaling type {rope_type!r} (Phi-4-multimodal uses longrope)")
    params: dict[str, Any] = {
        "rope_type": "longrope",
        "rope_theta": theta,
        "partial_rotary_factor": partial,
        "short_factor": [float(x) for x in scaling["short_factor"]],
        "long_factor": [float(x) for x in scaling["long_factor"]],
        "original_max_position_embeddings": original_max,
        # The ratio transformers derives when it is missing (and warns about): the same rotation and attention factor.
        "factor": max(1.0, max_positions / original_max),
    }
    short_mscale, long_mscale = scaling.get("short_mscale"), scaling.get("long_mscale")
    if short_mscale is not None or long_mscale is not None:
        # The native longrope has a single attention factor for both factor sets.
        if short_mscale != long_mscale:
            raise ReferenceModelError(f"distinct short/long mscale ({short_mscale}, {long_mscale}) are not supported")
        params["attention_factor"] = float(short_mscale)
    return params


def _vision_kwargs(raw: Mapping[str, Any]) -> dict[str, Any]:
    siglip = dict(SIGLIP_SO400M)
    feature_layer = -2
    img = raw.get("img_processor")
    if isinstance(img, Mapping):
        siglip.update({key: img[key] for key in SIGLIP_SO400M if key in img})
        feature_layer = int(img.get("layer_idx", img.get("feature_layer", -2)))
    elif img is not None:
        raise ReferenceModelError(f"img_processor must be null or an object, got {type(img).__name__}")
    image_layer = (raw.get("embd_layer") or {}).get("image_embd_layer") or {}
    order = image_layer.get("hd_transform_order", "sub_glb")
    if order != "sub_glb":
        raise ReferenceModelError(f"hd_transform_order {order!r} is not supported by the native port")
    return dict(
        siglip,
        crop_size=int(image_layer.get("crop_size", siglip["image_size"])),
        feature_layer=feature_layer,
        image_token_id=IMAGE_TOKEN_ID,
    )


def _audio_kwargs(raw: Mapping[str, Any]) -> dict[str, Any]:
    processor = raw.get("audio_processor") or {}
    conf = processor.get("config")
    if not isinstance(conf, Mapping):
        raise ReferenceModelError("config.json audio_processor has no 'config' object")
    unsupported = {
        "input_layer": (conf.get("input_layer", "nemo_conv"), "nemo_conv"),
        "relative_attention_bias_args.type": ((conf.get("relative_attention_bias_args") or {}).get("type", "t5"), "t5"),
        "ext_pw_kernel_size": (conf.get("ext_pw_kernel_size", 1), 1),
        "batch_norm": (conf.get("batch_norm", False), False),
        "cnn_layer_norm": (conf.get("cnn_layer_norm", True), True),
        "bias_in_glu": (conf.get("bias_in_glu", True), True),
        "causal": (conf.get("causal", True), True),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise ReferenceModelError(
                f"audio_processor.config.{key} = {value!r} is not supported (native port: {supported!r})"
            )
    nemo = conf.get("nemo_conv_settings") or {}
    bias_args = conf.get("relative_attention_bias_args") or {}
    audio_layer = (raw.get("embd_layer") or {}).get("audio_embd_layer") or {}
    hidden = int(conf["attention_dim"])
    ext_pw = int(conf.get("ext_pw_out_channel", hidden))
    return dict(
        hidden_size=hidden,
        intermediate_size=int(conf["linear_units"]),
        num_blocks=int(conf["num_blocks"]),
        num_attention_heads=int(conf["attention_heads"]),
        activation=str(conf.get("activation", "swish")),
        chunk_size=int(conf.get("chunk_size", -1)),
        left_chunk=int(conf.get("left_chunk", 18)),
        dropout_rate=float(conf.get("dropout_rate", 0.0)),
        ext_pw_out_channel=ext_pw,
        depthwise_separable_out_channel=int(conf.get("depthwise_seperable_out_channel", ext_pw)),
        depthwise_multiplier=int(conf.get("depthwise_multiplier", 1)),
        kernel_size=int(conf.get("kernel_size", 3)),
        conv_activation=str(conf.get("conv_activation", "swish")),
        input_size=int(conf.get("input_size", 80)),
        conv_glu_type=str(conf.get("conv_glu_type", "swish")),
        time_reduction=int(conf.get("time_reduction", 8)),
        # The original T5 bias default is 1000; the release sets 500 (a 1000-row table).
        bias_max_distance=int(bias_args.get("t5_bias_max_distance", 1000)),
        bias_symmetric=bool(bias_args.get("t5_bias_symmetric", False)),
        nemo_activation=str(nemo.get("activation", "relu")),
        nemo_conv_channels=int(nemo.get("conv_channels", 256)),
        downsample_rate=int(audio_layer.get("downsample_rate", 1)),
        audio_token_id=AUDIO_TOKEN_ID,
    )
