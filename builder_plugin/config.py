"""Phi-4-multimodal configuration, parsed once from a checkpoint folder.

Two input layouts are accepted: the original Hugging Face release (model_type ``phi4mm``, remote-code config keys) and
the transformers-native port (model_type ``phi4_multimodal``). Both are reduced to the same frozen dataclasses, so no
other module reads ``config.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from builder_plugin.errors import InputError, UnsupportedModelError

IMAGE_TOKEN_ID = 200010  # <|endoftext10|>; hard-coded in onnxruntime-genai's phi4mm processor
AUDIO_TOKEN_ID = 200011  # <|endoftext11|>

ORIGINAL_MODEL_TYPE = "phi4mm"
NATIVE_MODEL_TYPE = "phi4_multimodal"

# The original remote code hard-codes SigLIP-so400m when config.json has "img_processor": null.
SIGLIP_SO400M = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "image_size": 448,
    "patch_size": 14,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}

CheckpointFormat = Literal["original", "native"]


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    original_max_position_embeddings: int
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    short_mscale: float | None
    long_mscale: float | None
    tie_word_embeddings: bool
    sliding_window: int | None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    crop_size: int = 448
    feature_layer: int = -2
    hd_transform_order: str = "sub_glb"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        return self.patches_per_side**2

    @property
    def num_layers_used(self) -> int:
        """SigLIP layers that contribute to the features (hidden_states[feature_layer])."""
        if self.feature_layer < 0:
            return self.num_hidden_layers + 1 + self.feature_layer
        return self.feature_layer


@dataclass(frozen=True)
class AudioConfig:
    input_size: int
    attention_dim: int
    attention_heads: int
    num_blocks: int
    linear_units: int
    kernel_size: int
    time_reduction: int
    nemo_conv_channels: int
    ext_pw_out_channel: int
    depthwise_separable_out_channel: int
    depthwise_multiplier: int
    bias_max_distance: int
    bias_symmetric: bool
    chunk_size: int
    left_chunk: int
    activation: str
    conv_activation: str
    conv_glu_type: str
    bias_in_glu: bool
    cnn_layer_norm: bool
    batch_norm: bool
    causal: bool
    input_layer: str
    ext_pw_kernel_size: int = 1
    nemo_activation: str = "relu"
    compression_rate: int = 8

    @property
    def head_dim(self) -> int:
        return self.attention_dim // self.attention_heads

    @property
    def nemo_final_size(self) -> int:
        """Frequency bins left after the stride-2 subsampling convolutions (80 -> 10 for ÷8)."""
        size = self.input_size
        for _ in range(int(math.log2(self.time_reduction))):
            size = (size - 1) // 2 + 1
        return size


@dataclass(frozen=True)
class LoraConfig:
    name: str
    r: int
    lora_alpha: float

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r


@dataclass(frozen=True)
class Phi4MMConfig:
    source_format: CheckpointFormat
    text: TextConfig
    vision: VisionConfig
    audio: AudioConfig
    loras: dict[str, LoraConfig]
    bos_token_id: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    image_token_id: int = IMAGE_TOKEN_ID
    audio_token_id: int = AUDIO_TOKEN_ID
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Phi4MMConfig:
        model_dir = Path(model_dir)
        raw = read_json(model_dir / "config.json", what="model config")
        model_type = raw.get("model_type")
        if model_type == ORIGINAL_MODEL_TYPE:
            cfg = _from_original(raw)
        elif model_type == NATIVE_MODEL_TYPE:
            cfg = _from_native(raw, model_dir)
        else:
            arch = (raw.get("architectures") or ["?"])[0]
            raise UnsupportedModelError(
                f"{model_dir} is not a Phi-4-multimodal checkpoint (model_type {model_type!r}, architecture {arch!r}); "
                f"expected model_type {ORIGINAL_MODEL_TYPE!r} or {NATIVE_MODEL_TYPE!r}"
            )
        eos = _generation_eos(model_dir) or cfg.eos_token_ids
        return _replace(cfg, eos_token_ids=tuple(eos), raw=raw)


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise InputError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise InputError(f"{what} {path} is not a JSON object")
    return data


def _replace(cfg: Phi4MMConfig, **changes: Any) -> Phi4MMConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


def _require(raw: dict[str, Any], key: str, where: str = "config.json") -> Any:
    if key not in raw or raw[key] is None:
        raise InputError(f"{where} lacks the required key {key!r}")
    return raw[key]


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _text_config(raw: dict[str, Any], rope: dict[str, Any]) -> TextConfig:
    hidden = int(_require(raw, "hidden_size"))
    heads = int(_require(raw, "num_attention_heads"))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    prf = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    original = rope.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    max_pos = int(_require(raw, "max_position_embeddings"))
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type != "longrope":
        raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}: Phi-4-multimodal uses longrope")
    short = tuple(float(x) for x in _require(rope, "short_factor", "rope_scaling"))
    long = tuple(float(x) for x in _require(rope, "long_factor", "rope_scaling"))
    rotary_half = int(head_dim * prf) // 2
    if len(short) != rotary_half or len(long) != rotary_half:
        raise InputError(
            f"rope_scaling has {len(short)} short / {len(long)} long factors; head_dim {head_dim} with "
            f"partial_rotary_factor {prf} needs {rotary_half}"
        )
    return TextConfig(
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_hidden_layers=int(_require(raw, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        partial_rotary_factor=prf,
        max_position_embeddings=max_pos,
        original_max_position_embeddings=int(original or max_pos),
        short_factor=short,
        long_factor=long,
        short_mscale=rope.get("short_mscale"),
        long_mscale=rope.get("long_mscale"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=raw.get("sliding_window"),
    )


def _from_original(raw: dict[str, Any]) -> Phi4MMConfig:
    rope = dict(_require(raw, "rope_scaling"))
    rope.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    text = _text_config(raw, rope)

    img = raw.get("img_processor")
    siglip = dict(SIGLIP_SO400M)
    if isinstance(img, dict):
        siglip.update({k: img[k] for k in SIGLIP_SO400M if k in img})
    image_layer = (raw.get("embd_layer") or {}).get("image_embd_layer") or {}
    vision = VisionConfig(
        hidden_size=int(siglip["hidden_size"]),
        intermediate_size=int(siglip["intermediate_size"]),
        num_hidden_layers=int(siglip["num_hidden_layers"]),
        num_attention_heads=int(siglip["num_attention_heads"]),
        image_size=int(siglip["image_size"]),
        patch_size=int(siglip["patch_size"]),
        layer_norm_eps=float(siglip["layer_norm_eps"]),
        hidden_act=str(siglip["hidden_act"]),
        crop_size=int(image_layer.get("crop_size", 448)),
        feature_layer=int((img or {}).get("layer_idx", -2)) if isinstance(img, dict) else -2,
        hd_transform_order=str(image_layer.get("hd_transform_order", "sub_glb")),
    )

    audio_raw = (_require(raw, "audio_processor") or {}).get("config")
    if not isinstance(audio_raw, dict):
        raise InputError("config.json audio_processor has no 'config' object")
    audio_layer = (raw.get("embd_layer") or {}).get("audio_embd_layer") or {}
    bias_args = audio_raw.get("relative_attention_bias_args") or {}
    audio = AudioConfig(
        input_size=int(audio_raw.get("input_size", 80)),
        attention_dim=int(_require(audio_raw, "attention_dim", "audio_processor.config")),
        attention_heads=int(_require(audio_raw, "attention_heads", "audio_processor.config")),
        num_blocks=int(_require(audio_raw, "num_blocks", "audio_processor.config")),
        linear_units=int(_require(audio_raw, "linear_units", "audio_processor.config")),
        kernel_size=int(audio_raw.get("kernel_size", 3)),
        time_reduction=int(audio_raw.get("time_reduction", 8)),
        nemo_conv_channels=int((audio_raw.get("nemo_conv_settings") or {}).get("conv_channels", 256)),
        ext_pw_out_channel=int(audio_raw.get("ext_pw_out_channel", audio_raw["attention_dim"])),
        depthwise_separable_out_channel=int(
            audio_raw.get("depthwise_seperable_out_channel", audio_raw["attention_dim"])
        ),
        depthwise_multiplier=int(audio_raw.get("depthwise_multiplier", 1)),
        bias_max_distance=int(bias_args.get("t5_bias_max_distance", 1000)),
        bias_symmetric=bool(bias_args.get("t5_bias_symmetric", False)),
        chunk_size=int(audio_raw.get("chunk_size", -1)),
        left_chunk=int(audio_raw.get("left_chunk", 18)),
        activation=str(audio_raw.get("activation", "swish")),
        conv_activation=str(audio_raw.get("conv_activation", "swish")),
        conv_glu_type=str(audio_raw.get("conv_glu_type", "swish")),
        bias_in_glu=bool(audio_raw.get("bias_in_glu", True)),
        cnn_layer_norm=bool(audio_raw.get("cnn_layer_norm", True)),
        batch_norm=bool(audio_raw.get("batch_norm", False)),
        causal=bool(audio_raw.get("causal", True)),
        input_layer=str(audio_raw.get("input_layer", "nemo_conv")),
        ext_pw_kernel_size=int(audio_raw.get("ext_pw_kernel_size", 1)),
        nemo_activation=str((audio_raw.get("nemo_conv_settings") or {}).get("activation", "relu")),
        compression_rate=int(audio_layer.get("compression_rate", 8)),
    )

    loras = {}
    for name in ("vision", "speech"):
        block = raw.get(f"{name}_lora")
        if block:
            loras[name] = LoraConfig(name, int(block["r"]), float(block["lora_alpha"]))
    return Phi4MMConfig(
        source_format="original",
        text=text,
        vision=vision,
        audio=audio,
        loras=loras,
        bos_token_id=int(raw.get("bos_token_id", 199999)),
        pad_token_id=int(raw.get("pad_token_id", 199999)),
        eos_token_ids=_ids(raw.get("eos_token_id", 199999)),
    )


# The folders the hub repository ships the native-format LoRA adapters in, keyed by adapter name.
NATIVE_ADAPTER_DIRS = {"vision": "vision-lora", "speech": "speech-lora"}


def _from_native(raw: dict[str, Any], model_dir: Path) -> Phi4MMConfig:
    text_raw = dict(raw.get("text_config") or raw)
    rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    text = _text_config(text_raw, rope)

    v = raw.get("vision_config") or {}
    vision = VisionConfig(
        hidden_size=int(v.get("hidden_size", SIGLIP_SO400M["hidden_size"])),
        intermediate_size=int(v.get("intermediate_size", SIGLIP_SO400M["intermediate_size"])),
        num_hidden_layers=int(v.get("num_hidden_layers", SIGLIP_SO400M["num_hidden_layers"])),
        num_attention_heads=int(v.get("num_attention_heads", SIGLIP_SO400M["num_attention_heads"])),
        image_size=int(v.get("image_size", 448)),
        patch_size=int(v.get("patch_size", 14)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        crop_size=int(v.get("crop_size", 448)),
        feature_layer=int(v.get("feature_layer", -2)),
    )
    a = raw.get("audio_config") or {}
    hidden = int(a.get("hidden_size", 1024))
    audio = AudioConfig(
        input_size=int(a.get("input_size", 80)),
        attention_dim=hidden,
        attention_heads=int(a.get("num_attention_heads", 16)),
        num_blocks=int(a.get("num_blocks", 24)),
        linear_units=int(a.get("intermediate_size", 1536)),
        kernel_size=int(a.get("kernel_size", 3)),
        time_reduction=int(a.get("time_reduction", 8)),
        nemo_conv_channels=int(a.get("nemo_conv_channels", 1024)),
        ext_pw_out_channel=int(a.get("ext_pw_out_channel", hidden)),
        depthwise_separable_out_channel=int(a.get("depthwise_separable_out_channel", hidden)),
        depthwise_multiplier=int(a.get("depthwise_multiplier", 1)),
        bias_max_distance=int(a.get("bias_max_distance", 1000)),
        bias_symmetric=bool(a.get("bias_symmetric", False)),
        chunk_size=int(a.get("chunk_size", -1)),
        left_chunk=int(a.get("left_chunk", 18)),
        activation=str(a.get("activation", "swish")),
        conv_activation=str(a.get("conv_activation", "swish")),
        conv_glu_type=str(a.get("conv_glu_type", "swish")),
        bias_in_glu=bool(a.get("bias_in_glu", True)),
        cnn_layer_norm=True,
        batch_norm=False,
        causal=True,
        input_layer="nemo_conv",
        nemo_activation=str(a.get("nemo_activation", "relu")),
        compression_rate=int(a.get("time_reduction", 8)),
    )
    loras = {}
    for name, folder in NATIVE_ADAPTER_DIRS.items():
        adapter_cfg = model_dir / folder / "adapter_config.json"
        if adapter_cfg.is_file():
            block = read_json(adapter_cfg, what=f"{name} LoRA adapter config")
            loras[name] = LoraConfig(name, int(block["r"]), float(block["lora_alpha"]))
    return Phi4MMConfig(
        source_format="native",
        text=text,
        vision=vision,
        audio=audio,
        loras=loras,
        bos_token_id=int(text_raw.get("bos_token_id", 199999)),
        pad_token_id=int(text_raw.get("pad_token_id", 199999)),
        eos_token_ids=_ids(text_raw.get("eos_token_id", 199999)),
        image_token_id=int(v.get("image_token_id", IMAGE_TOKEN_ID)),
        audio_token_id=int(a.get("audio_token_id", AUDIO_TOKEN_ID)),
    )


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    return _ids(read_json(path, what="generation config").get("eos_token_id"))
