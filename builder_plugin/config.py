"""Phi-4-multimodal configuration, parsed once from a checkpoint folder.

Two input layouts are accepted: the original Hugging Face release (model_type ``phi4mm``, remote-code config keys) and
the transformers-native port (model_type ``phi4_multimodal``). Both are reduced to the same frozen dataclasses. This is
the one reader of the checkpoint's JSON files: ``config.json`` (also for the hub's first look,
`Phi4MMConfig.layout_of`), ``generation_config.json`` (eos ids, sampling defaults), ``preprocessor_config.json`` (the
most crops of one image) and a native layout's adapter configs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from builder_plugin.config_fields import Check, Field, Layout, as_stored, read_fields
from builder_plugin.errors import InputError, UnsupportedModelError
from builder_plugin.layout import AUDIO_TOKEN_ID, GENERATION_CONFIG_FILE, IMAGE_TOKEN_ID

ENDOFTEXT_TOKEN_ID = 199999  # <|endoftext|>: bos, pad and eos when config.json names none
DEFAULT_DYNAMIC_HD = 36  # the most HD crops of one image, as in the original preprocessor_config.json

CONFIG_FILE = "config.json"
PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"

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

CheckpointFormat = Layout


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
    crop_size: int
    feature_layer: int
    hd_transform_order: str

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
    ext_pw_kernel_size: int
    nemo_activation: str
    compression_rate: int

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
    image_token_id: int
    audio_token_id: int
    generation: dict[str, Any] = field(default_factory=dict, compare=False)  # generation_config.json, or empty
    dynamic_hd: int = DEFAULT_DYNAMIC_HD  # preprocessor_config.json: the most crops of one image
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Phi4MMConfig:
        model_dir = Path(model_dir)
        raw = read_json(model_dir / CONFIG_FILE, what="model config")
        if _layout(raw, str(model_dir)) == "original":
            cfg = _from_original(raw)
        else:
            cfg = _from_native(raw, model_dir)
        generation = _optional_json(model_dir / GENERATION_CONFIG_FILE, "generation config")
        eos = _ids(generation.get("eos_token_id")) or cfg.eos_token_ids
        return replace(cfg, eos_token_ids=tuple(eos), generation=generation, dynamic_hd=_dynamic_hd(model_dir),
                       raw=raw)

    @staticmethod
    def layout_of(model_dir: str | Path, label: str | None = None) -> CheckpointFormat:
        """The layout config.json declares, for a first look before the rest is read (the hub's); InputError if it
        is unreadable, UnsupportedModelError naming `label` (default: the folder) for another model."""
        model_dir = Path(model_dir)
        return _layout(read_json(model_dir / CONFIG_FILE, what="model config"), label or str(model_dir))


def _layout(raw: dict[str, Any], label: str) -> CheckpointFormat:
    model_type = raw.get("model_type")
    if model_type == ORIGINAL_MODEL_TYPE:
        return "original"
    if model_type == NATIVE_MODEL_TYPE:
        return "native"
    arch = (raw.get("architectures") or ["?"])[0]
    raise UnsupportedModelError(
        f"{label} is not a Phi-4-multimodal checkpoint (model_type {model_type!r}, architecture {arch!r}); "
        f"expected model_type {ORIGINAL_MODEL_TYPE!r} or {NATIVE_MODEL_TYPE!r}"
    )


def _optional_json(path: Path, what: str) -> dict[str, Any]:
    return read_json(path, what=what) if path.is_file() else {}


def _dynamic_hd(model_dir: Path) -> int:
    path = model_dir / PREPROCESSOR_CONFIG_FILE
    dynamic_hd = _optional_json(path, "preprocessor config").get("dynamic_hd", DEFAULT_DYNAMIC_HD)
    try:
        return int(dynamic_hd)
    except (TypeError, ValueError):
        raise InputError(f"preprocessor config {path}: dynamic_hd must be an integer, got {dynamic_hd!r}") from None


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


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise InputError(f"config.json lacks the required key {key!r}")
    return raw[key]


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _floats(value: Any) -> tuple[float, ...]:
    return tuple(float(x) for x in value)


# The sections the keys below start with. Original layout: config and text = config.json, rope = rope_scaling,
# vision = img_processor, audio = audio_processor.config. Native: config = config.json, text = text_config (or
# config.json), rope = rope_parameters (or rope_scaling), vision = vision_config, audio = audio_config. A missing
# required key is reported with the original layout's name for its section, whatever the layout.
SECTION_NAMES = {"text": "config.json", "rope": "rope_scaling", "audio": "audio_processor.config"}


def _check_longrope(sections: dict[str, Any], values: dict[str, Any]) -> None:
    rope = sections["rope"]
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type != "longrope":
        raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}: Phi-4-multimodal uses longrope")


def _check_factor_count(sections: dict[str, Any], values: dict[str, Any]) -> None:
    short, long = values["short_factor"], values["long_factor"]
    head_dim, prf = values["head_dim"], values["partial_rotary_factor"]
    rotary_half = int(head_dim * prf) // 2
    if len(short) != rotary_half or len(long) != rotary_half:
        raise InputError(
            f"rope_scaling has {len(short)} short / {len(long)} long factors; head_dim {head_dim} with "
            f"partial_rotary_factor {prf} needs {rotary_half}"
        )


# Rows in the order the checks and conversions run, so a config with several faults reports the same one first.
TEXT_FIELDS = (
    Field("hidden_size", "text.hidden_size"),
    Field("num_attention_heads", "text.num_attention_heads"),
    Field("head_dim", "text.head_dim", default=lambda v: v["hidden_size"] // v["num_attention_heads"],
          falsy_is_absent=True),
    Field("partial_rotary_factor", ("rope.partial_rotary_factor", "text.partial_rotary_factor"), default=1.0,
          convert=float),
    Field("max_position_embeddings", "text.max_position_embeddings"),
    Check(_check_longrope),
    Field("short_factor", "rope.short_factor", convert=_floats),
    Field("long_factor", "rope.long_factor", convert=_floats),
    Check(_check_factor_count),
    Field("vocab_size", "text.vocab_size"),
    Field("intermediate_size", "text.intermediate_size"),
    Field("num_hidden_layers", "text.num_hidden_layers"),
    Field("num_key_value_heads", "text.num_key_value_heads", default=lambda v: v["num_attention_heads"],
          falsy_is_absent=True),
    Field("rms_norm_eps", "text.rms_norm_eps", default=1e-5, convert=float),
    Field("hidden_act", "text.hidden_act", default="silu", convert=str),
    Field("rope_theta", ("rope.rope_theta", "text.rope_theta"), default=10000.0, convert=float),
    Field("original_max_position_embeddings",
          ("rope.original_max_position_embeddings", "text.original_max_position_embeddings"),
          default=lambda v: v["max_position_embeddings"], falsy_is_absent=True),
    Field("short_mscale", "rope.short_mscale", default=None, convert=as_stored),
    Field("long_mscale", "rope.long_mscale", default=None, convert=as_stored),
    Field("tie_word_embeddings", "text.tie_word_embeddings", default=False, convert=bool),
    Field("sliding_window", "text.sliding_window", default=None, convert=as_stored),
)  # fmt: skip

VISION_FIELDS = (
    # Both layouts fall back to SigLIP-so400m, key by key.
    *(Field(key, f"vision.{key}", default=value, convert=type(value)) for key, value in SIGLIP_SO400M.items()),
    Field("crop_size", "config.embd_layer.image_embd_layer.crop_size", "vision.crop_size", 448),
    Field("feature_layer", "vision.layer_idx", "vision.feature_layer", -2),
    Field("hd_transform_order", "config.embd_layer.image_embd_layer.hd_transform_order", None, "sub_glb", str),
)

# The original layout requires the sizes; transformers' native config class defaults to the full-size model.
AUDIO_FIELDS = (
    Field("input_size", "audio.input_size", default=80),
    Field("attention_dim", "audio.attention_dim", "audio.hidden_size", native_default=1024),
    Field("attention_heads", "audio.attention_heads", "audio.num_attention_heads", native_default=16),
    Field("num_blocks", "audio.num_blocks", native_default=24),
    Field("linear_units", "audio.linear_units", "audio.intermediate_size", native_default=1536),
    Field("kernel_size", "audio.kernel_size", default=3),
    Field("time_reduction", "audio.time_reduction", default=8),
    Field("nemo_conv_channels", "audio.nemo_conv_settings.conv_channels", "audio.nemo_conv_channels", 256,
          native_default=1024),
    Field("ext_pw_out_channel", "audio.ext_pw_out_channel", default=lambda v: v["attention_dim"]),
    Field("depthwise_separable_out_channel", "audio.depthwise_seperable_out_channel",
          "audio.depthwise_separable_out_channel", lambda v: v["attention_dim"]),
    Field("depthwise_multiplier", "audio.depthwise_multiplier", default=1),
    Field("bias_max_distance", "audio.relative_attention_bias_args.t5_bias_max_distance", "audio.bias_max_distance",
          1000),
    Field("bias_symmetric", "audio.relative_attention_bias_args.t5_bias_symmetric", "audio.bias_symmetric", False,
          bool),
    Field("chunk_size", "audio.chunk_size", default=-1),
    Field("left_chunk", "audio.left_chunk", default=18),
    Field("activation", "audio.activation", default="swish", convert=str),
    Field("conv_activation", "audio.conv_activation", default="swish", convert=str),
    Field("conv_glu_type", "audio.conv_glu_type", default="swish", convert=str),
    Field("bias_in_glu", "audio.bias_in_glu", default=True, convert=bool),
    Field("cnn_layer_norm", "audio.cnn_layer_norm", None, True, bool),
    Field("batch_norm", "audio.batch_norm", None, False, bool),
    Field("causal", "audio.causal", None, True, bool),
    Field("input_layer", "audio.input_layer", None, "nemo_conv", str),
    Field("ext_pw_kernel_size", "audio.ext_pw_kernel_size", None, 1),
    Field("nemo_activation", "audio.nemo_conv_settings.activation", "audio.nemo_activation", "relu", str),
    Field("compression_rate", "config.embd_layer.audio_embd_layer.compression_rate", "audio.time_reduction", 8),
)  # fmt: skip

TOKEN_FIELDS = (
    Field("bos_token_id", "text.bos_token_id", default=ENDOFTEXT_TOKEN_ID),
    Field("pad_token_id", "text.pad_token_id", default=ENDOFTEXT_TOKEN_ID),
    Field("eos_token_ids", "text.eos_token_id", default=ENDOFTEXT_TOKEN_ID, convert=_ids),
    Field("image_token_id", None, "vision.image_token_id", IMAGE_TOKEN_ID),
    Field("audio_token_id", None, "audio.audio_token_id", AUDIO_TOKEN_ID),
)


def _parse(
    layout: Layout,
    sections: dict[str, Any],
    audio_section: Callable[[], dict[str, Any]],
    read_loras: Callable[[], dict[str, LoraConfig]],
) -> Phi4MMConfig:
    """Reads the tables in a fixed order; the audio section and the adapters are read when their turn comes."""
    text = TextConfig(**read_fields(TEXT_FIELDS, layout, sections, SECTION_NAMES))
    vision = VisionConfig(**read_fields(VISION_FIELDS, layout, sections, SECTION_NAMES))
    sections = {**sections, "audio": audio_section()}
    audio = AudioConfig(**read_fields(AUDIO_FIELDS, layout, sections, SECTION_NAMES))
    loras = read_loras()
    tokens = read_fields(TOKEN_FIELDS, layout, sections, SECTION_NAMES)
    return Phi4MMConfig(source_format=layout, text=text, vision=vision, audio=audio, loras=loras, **tokens)


def _lora(name: str, block: dict[str, Any]) -> LoraConfig:
    return LoraConfig(name, int(block["r"]), float(block["lora_alpha"]))


def _from_original(raw: dict[str, Any]) -> Phi4MMConfig:
    rope = dict(_require(raw, "rope_scaling"))
    img = raw.get("img_processor")
    vision = img if isinstance(img, dict) else {}

    def audio_section() -> dict[str, Any]:
        audio = (_require(raw, "audio_processor") or {}).get("config")
        if not isinstance(audio, dict):
            raise InputError("config.json audio_processor has no 'config' object")
        return audio

    def read_loras() -> dict[str, LoraConfig]:
        return {name: _lora(name, raw[f"{name}_lora"]) for name in ("vision", "speech") if raw.get(f"{name}_lora")}

    sections = {"config": raw, "text": raw, "rope": rope, "vision": vision}
    return _parse("original", sections, audio_section, read_loras)


# The folders the hub repository ships the native-format LoRA adapters in, keyed by adapter name.
NATIVE_ADAPTER_DIRS = {"vision": "vision-lora", "speech": "speech-lora"}


def _from_native(raw: dict[str, Any], model_dir: Path) -> Phi4MMConfig:
    text = dict(raw.get("text_config") or raw)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})

    def read_loras() -> dict[str, LoraConfig]:
        loras = {}
        for name, folder in NATIVE_ADAPTER_DIRS.items():
            adapter_cfg = model_dir / folder / "adapter_config.json"
            if adapter_cfg.is_file():
                loras[name] = _lora(name, read_json(adapter_cfg, what=f"{name} LoRA adapter config"))
        return loras

    sections = {"config": raw, "text": text, "rope": rope, "vision": raw.get("vision_config") or {}}
    return _parse("native", sections, lambda: raw.get("audio_config") or {}, read_loras)
