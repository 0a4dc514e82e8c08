"""Independent PyTorch reference for Phi-4-multimodal parity tests.

Everything numeric here comes from transformers' native ``Phi4MultimodalForCausalLM`` (eager attention, fp32). This
module must never import ``builder_plugin`` code outside ``builder_plugin.testing`` but the package's names
(``builder_plugin.layout``: the placeholder ids and the input-mode rule the runtime shares): it is the yardstick the
ONNX graphs are measured against, so it reads checkpoints, converts configs and merges LoRA on its own.

Semantics reproduced from the original ``Phi4MMForCausalLM``:

- LoRA per input mode: text only -> none, any image -> vision adapter, audio only -> speech adapter; merged into the
  text decoder weights as ``W + (alpha / r) * B @ A`` from one pristine copy of the base weights.
- Audio projection: the ``*_vision_speech`` pair iff an image is present, else the ``*_for_speech`` pair.
- Audio clips are encoded one at a time, trimmed to their valid frames and without a mask, as the original does for a
  single clip (the native batched path leaks padding: a clip batched with longer ones gets other features).
- Decoding is prefill plus one-token KV-cached steps (the incremental forward ORT GenAI matches), never ``generate()``,
  which drops the cache at the LongRoPE boundary.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import (
    Phi4MultimodalAudioConfig,
    Phi4MultimodalConfig,
    Phi4MultimodalForCausalLM,
    Phi4MultimodalVisionConfig,
)
from transformers.cache_utils import DynamicCache

from builder_plugin.layout import AUDIO_TOKEN_ID, IMAGE_TOKEN_ID, MODE_LORA, mode_of

ORIGINAL_MODEL_TYPE = "phi4mm"
NATIVE_MODEL_TYPE = "phi4_multimodal"
NATIVE_ADAPTER_DIRS = {"vision": "vision-lora", "speech": "speech-lora"}
LORA_MODES = tuple(MODE_LORA.values())  # "none" and the adapters

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

# Text-decoder Linear layers that carry LoRA; a module path relative to Phi4MultimodalForCausalLM.
LORA_TARGET = re.compile(r"model\.layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))")
_ORIGINAL_LORA_KEY = re.compile(rf"^({LORA_TARGET.pattern})\.lora_([AB])\.([A-Za-z0-9_]+)\.weight$")
_PEFT_LORA_KEY = re.compile(rf"({LORA_TARGET.pattern})\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")

_IMAGE_EMBED = r"model\.embed_tokens_extend\.image_embed"
_AUDIO_EMBED = r"model\.embed_tokens_extend\.audio_embed"
# Original (remote-code) key -> native key. First match wins; keys matching no rule keep their name and are then
# caught by the strict load (unexpected key), so a stale table cannot pass silently.
ORIGINAL_TO_NATIVE_KEYS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (rf"^({LORA_TARGET.pattern})\.base_layer\.weight$", r"\1.weight"),
        (rf"^({_IMAGE_EMBED})\.glb_GN$", r"\1.global_img_feature_extensor"),
        (rf"^({_IMAGE_EMBED})\.sub_GN$", r"\1.sub_img_feature_extensor"),
        (rf"^({_IMAGE_EMBED})\.img_projection\.0\.(weight|bias)$", r"\1.img_projection_up.\2"),
        (rf"^({_IMAGE_EMBED})\.img_projection\.2\.(weight|bias)$", r"\1.img_projection_down.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.speech\.0\.(weight|bias)$", r"\1.up_proj_for_speech.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.speech\.2\.(weight|bias)$", r"\1.down_proj_for_speech.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.vision\.0\.(weight|bias)$", r"\1.up_proj_for_vision_speech.\2"),
        (rf"^({_AUDIO_EMBED})\.audio_projection\.vision\.2\.(weight|bias)$", r"\1.down_proj_for_vision_speech.\2"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.feed_forward_(?:in|out))\.net\.0\.linear\.(weight|bias)$",
         r"\1.gate_up_proj.\2"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.feed_forward_(?:in|out))\.net\.2\.(weight|bias)$",
         r"\1.down_proj.\2"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.self_attn)\.linear_([qkv])\.(weight|bias)$", r"\1.\2_proj.\3"),
        (rf"^({_AUDIO_EMBED}\.encoder\.encoders\.\d+\.self_attn)\.linear_out\.(weight|bias)$", r"\1.o_proj.\2"),
    )
)


class ReferenceModelError(ValueError):
    """Raised when a checkpoint or an input does not fit the reference model."""


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter as stored in the checkpoint (tensors in their stored dtype)."""

    name: str
    r: int
    lora_alpha: float
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A [r, in], B [out, r])


@dataclass
class GreedyResult:
    tokens: list[int]  # new tokens only
    step_logits: list[torch.Tensor]  # [vocab] fp32 per step; [0] = last position of the prefill
    top2_gap: list[float]  # top-1 minus top-2 logit per step, to spot near-ties
    lora: str  # "none" | "vision" | "speech"
    projection: str | None  # audio projection pair used ("speech" | "vision"), None without audio
    prompt_length: int = 0
    inputs_embeds: torch.Tensor | None = field(default=None, repr=False)  # [1, S, hidden] prefill embeddings


# --------------------------------------------------------------------------------------------------------------
# Config conversion


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


# --------------------------------------------------------------------------------------------------------------
# Checkpoint reading


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReferenceModelError(f"missing {path}")
    return json.loads(path.read_text(encoding="utf-8"))


def _read_safetensors_dir(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ReferenceModelError(f"no safetensors files in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        shard = load_file(str(folder / name))
        duplicated = tensors.keys() & shard.keys()
        if duplicated:
            raise ReferenceModelError(f"{folder / name} repeats tensors of another shard: {sorted(duplicated)[:5]}")
        tensors.update(shard)
    return tensors


def rename_original_key(key: str) -> str:
    """Original checkpoint key -> native key (LoRA keys are handled separately)."""
    key = key.replace("._checkpoint_wrapped_module.", ".")
    for pattern, replacement in ORIGINAL_TO_NATIVE_KEYS:
        if pattern.match(key):
            return pattern.sub(replacement, key)
    return key


def _split_original(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, dict[str, torch.Tensor]]]]:
    """-> (native-named base weights, {adapter: {module path: {"A": ..., "B": ...}}})."""
    base: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _ORIGINAL_LORA_KEY.match(key)
        if match:
            module, side, adapter = match.groups()
            lora.setdefault(adapter, {}).setdefault(module, {})[side] = tensor
            continue
        if ".lora_" in key:
            raise ReferenceModelError(f"LoRA tensor outside the text decoder projections: {key}")
        native = rename_original_key(key)
        if native in base:
            raise ReferenceModelError(f"two checkpoint keys map to {native}")
        base[native] = tensor
    return base, lora


def _pairs(
    adapter: str, sides: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pairs = {}
    for module, ab in sorted(sides.items()):
        if set(ab) != {"A", "B"}:
            raise ReferenceModelError(f"{adapter} LoRA for {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ReferenceModelError(
                f"{adapter} LoRA for {module}: A {tuple(a.shape)} and B {tuple(b.shape)} disagree"
            )
        pairs[module] = (a, b)
    return pairs


def _read_peft_adapter(folder: Path, name: str) -> LoraAdapter:
    conf = _read_json(folder / "adapter_config.json")
    if conf.get("peft_type", "LORA") != "LORA":
        raise ReferenceModelError(f"{folder} is not a LoRA adapter (peft_type {conf.get('peft_type')!r})")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise ReferenceModelError(f"{folder}: per-module rank/alpha patterns are not supported")
    r, alpha = int(conf["r"]), float(conf["lora_alpha"])
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ReferenceModelError(f"no adapter weights (*.safetensors) in {folder}")
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for path in files:
        for key, tensor in load_file(str(path)).items():
            match = _PEFT_LORA_KEY.search(key)
            if not match:
                raise ReferenceModelError(f"{path.name}: tensor {key} is not a LoRA A/B of a text decoder projection")
            module, side = match.groups()
            sides.setdefault(module, {})[side] = tensor
    return LoraAdapter(name, r, alpha, scaling, _pairs(name, sides))


# --------------------------------------------------------------------------------------------------------------
# Reference model


def _as_tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(value)))
    return tensor.to(dtype) if dtype is not None else tensor


def _top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


# --------------------------------------------------------------------------------------------------------------
# Encoders and the placeholder scatter, on the native modules (shared by Reference and the streaming verify reference)


def count_image_tokens(vision: Phi4MultimodalVisionConfig, image_attention_mask: Any, image_sizes: Any) -> list[int]:
    """Feature rows per image, from the HD canvas size and the crop masks: the useful sub-crop grid (uh rows of uw + 1,
    the last a separator), one global separator, the global crop (G rows of G + 1), G the 2x2-pooled side."""
    mask = _as_tensor(image_attention_mask, torch.float32)
    sizes = _as_tensor(image_sizes, torch.int64).view(-1, 2)
    patches = vision.image_size // vision.patch_size
    grid = (patches + 1) // 2  # side of the 2x2-pooled grid (the native pads odd sides by reflection)
    counts = []
    for index in range(sizes.shape[0]):
        h, w = (int(v) // vision.crop_size for v in sizes[index])
        sub = (
            mask[index, 1 : 1 + h * w, 0::2, 0::2]
            .reshape(h, w, grid, grid)
            .transpose(1, 2)
            .reshape(h * grid, w * grid)
        )
        useful_h, useful_w = int(sub[:, 0].sum()), int(sub[0, :].sum())
        counts.append(grid * (grid + 1) + 1 + useful_h * (useful_w + 1))
    return counts


@torch.no_grad()
def encode_images(image_embed: torch.nn.Module, config: Phi4MultimodalConfig, pixel_values: Any,
                  image_attention_mask: Any, image_sizes: Any) -> torch.Tensor:
    """[sum of image tokens, hidden] fp32 from a native Phi4MultimodalImageEmbedding, images in order."""
    pixels = _as_tensor(pixel_values, torch.float32)
    mask = _as_tensor(image_attention_mask, torch.float32)
    sizes = _as_tensor(image_sizes, torch.int64)
    if pixels.dim() != 5 or mask.dim() != 4 or pixels.shape[:2] != mask.shape[:2]:
        raise ReferenceModelError(
            f"expected pixel_values [images, crops, C, H, W] and image_attention_mask [images, crops, h, w], got "
            f"{tuple(pixels.shape)} and {tuple(mask.shape)}"
        )
    total = sum(count_image_tokens(config.vision_config, mask, sizes))
    # The native ImageEmbedding runs SigLIP, the HD assembly and the projection, then scatters into the
    # placeholder positions; with placeholders only, its output is the feature matrix itself.
    ids = torch.full((1, total), config.vision_config.image_token_id, dtype=torch.long)
    canvas = torch.zeros(1, total, config.hidden_size, dtype=torch.float32)
    try:
        out = image_embed(ids, canvas, image_pixel_values=pixels, image_sizes=sizes, image_attention_mask=mask)
    except RuntimeError as exc:
        raise ReferenceModelError(f"native image embedding disagrees with the expected {total} rows: {exc}") from exc
    return out[0]


@torch.no_grad()
def encode_audio(audio_embed: torch.nn.Module, config: Phi4MultimodalConfig, audio_embeds: Any,
                 audio_attention_mask: Any, audio_sizes: Any, projection: str) -> torch.Tensor:
    """[sum(audio_sizes), hidden] fp32 from a native Phi4MultimodalAudioEmbedding; each clip encoded alone on its
    valid frames, then projected by the ``projection`` pair ("speech" or "vision")."""
    if projection not in ("speech", "vision"):
        raise ReferenceModelError(f"projection must be 'speech' or 'vision', got {projection!r}")
    features = _as_tensor(audio_embeds, torch.float32)
    sizes = [int(s) for s in _as_tensor(audio_sizes, torch.int64).reshape(-1)]
    if features.dim() != 3 or features.shape[0] != len(sizes):
        raise ReferenceModelError(
            f"expected audio_embeds [clips, frames, mel] with one audio_size per clip, got "
            f"{tuple(features.shape)} and {len(sizes)} sizes"
        )
    if audio_attention_mask is None:
        valid_frames = [features.shape[1]] * len(sizes)
    else:
        mask = _as_tensor(audio_attention_mask).to(torch.bool)
        valid_frames = [int(n) for n in mask.sum(dim=1)]
        for clip, n in enumerate(valid_frames):
            if not bool(mask[clip, :n].all()):
                raise ReferenceModelError(f"audio_attention_mask of clip {clip} is not a prefix of valid frames")
    if projection == "speech":
        up, down = audio_embed.up_proj_for_speech, audio_embed.down_proj_for_speech
    else:
        up, down = audio_embed.up_proj_for_vision_speech, audio_embed.down_proj_for_vision_speech
    rows = []
    for clip, (frames, size) in enumerate(zip(valid_frames, sizes)):
        # One clip, no mask: what the original passes for a single clip (batched native audio leaks padding).
        hidden = audio_embed.encoder(features[clip : clip + 1, :frames], None)
        if size > hidden.shape[1]:
            raise ReferenceModelError(
                f"audio clip {clip}: audio_sizes asks for {size} rows but {frames} frames give {hidden.shape[1]}"
            )
        # project all rows, then keep the first `size`, in the native order of operations
        rows.append(down(torch.nn.functional.gelu(up(hidden)))[0, :size])
    if not rows:
        return torch.zeros(0, config.hidden_size)
    return torch.cat(rows, dim=0)


def scatter_features(config: Phi4MultimodalConfig, ids: torch.Tensor, embeds: torch.Tensor,
                     image_features: torch.Tensor | None, audio_features: torch.Tensor | None) -> torch.Tensor:
    """`embeds` [B, S, hidden] of `ids` with image rows over the image placeholders and audio rows over the audio
    ones; the placeholder counts must equal the feature rows."""
    for token_id, features, what in (
        (config.vision_config.image_token_id, image_features, "image"),
        (config.audio_config.audio_token_id, audio_features, "audio"),
    ):
        positions = torch.nonzero(ids == token_id, as_tuple=True)
        rows = 0 if features is None else int(features.shape[0])
        if positions[0].numel() != rows:
            raise ReferenceModelError(
                f"input_ids has {positions[0].numel()} {what} placeholders ({token_id}) but {rows} {what} "
                "feature rows were given"
            )
        if rows:
            embeds = embeds.index_put(positions, features.to(embeds.dtype), accumulate=False)
    return embeds


def encode_inputs(
    image_embed: torch.nn.Module, audio_embed: torch.nn.Module, config: Phi4MultimodalConfig, inputs: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, str | None]:
    """The processor tensors of onnxruntime-genai's MultiModalProcessor -> (input_ids [1, S], image features or None,
    audio features or None, audio projection used or None), checked for consistency. The audio projection follows
    the input mode as in the original model: the vision pair iff an image is present."""
    ids = _as_tensor(inputs["input_ids"], torch.long)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ReferenceModelError(f"input_ids must be [1, S] (batch 1, as ORT GenAI), got {tuple(ids.shape)}")
    has_image = "pixel_values" in inputs and np.asarray(inputs["pixel_values"]).shape[0] > 0
    has_audio = "audio_embeds" in inputs and np.asarray(inputs["audio_embeds"]).shape[0] > 0
    if "audio_projection_mode" in inputs:
        given = int(np.asarray(inputs["audio_projection_mode"]).reshape(-1)[0])
        expected = (2 if has_audio else 0) + (1 if has_image else 0)
        if given != expected:
            raise ReferenceModelError(
                f"audio_projection_mode {given} does not match the inputs (image: {has_image}, audio: {has_audio})"
            )

    image_features = None
    if has_image:
        counts = count_image_tokens(config.vision_config, inputs["image_attention_mask"], inputs["image_sizes"])
        if "num_image_tokens" in inputs:
            given_counts = [int(n) for n in np.asarray(inputs["num_image_tokens"]).reshape(-1)]
            if given_counts != counts:
                raise ReferenceModelError(f"num_image_tokens {given_counts} != image token counts {counts}")
        image_features = encode_images(
            image_embed, config, inputs["pixel_values"], inputs["image_attention_mask"], inputs["image_sizes"]
        )
    projection = None
    audio_features = None
    if has_audio:
        projection = "vision" if has_image else "speech"
        audio_features = encode_audio(
            audio_embed, config, inputs["audio_embeds"], inputs.get("audio_attention_mask"), inputs["audio_sizes"],
            projection,
        )
    return ids, image_features, audio_features, projection


class Reference:
    """Native transformers Phi-4-multimodal in fp32 with eager attention, plus per-mode LoRA merging."""

    def __init__(
        self,
        model: Phi4MultimodalForCausalLM,
        base_weights: dict[str, torch.Tensor],
        adapters: dict[str, LoraAdapter],
        source_format: str,
    ) -> None:
        self.model = model
        self.config: Phi4MultimodalConfig = model.config
        self.adapters = adapters
        self.source_format = source_format
        self._base_weights = base_weights  # pristine, stored dtype; merges always start from these
        self._active_lora = "none"

    # ---- loading ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> Reference:
        folder = Path(checkpoint_dir)
        raw = _read_json(folder / "config.json")
        model_type = raw.get("model_type")
        tensors = _read_safetensors_dir(folder)
        if model_type == ORIGINAL_MODEL_TYPE:
            config = native_config_from_original(raw)
            state, lora_sides = _split_original(tensors)
            adapters = {}
            for name, sides in lora_sides.items():
                block = raw.get(f"{name}_lora")
                if not block:
                    raise ReferenceModelError(f"checkpoint has {name} LoRA tensors but config.json has no {name}_lora")
                r, alpha = int(block["r"]), float(block["lora_alpha"])
                adapters[name] = LoraAdapter(name, r, alpha, alpha / r, _pairs(name, sides))
        elif model_type == NATIVE_MODEL_TYPE:
            config = native_config_from_dict(raw)
            state = dict(tensors)
            adapters = {
                name: _read_peft_adapter(folder / sub, name)
                for name, sub in NATIVE_ADAPTER_DIRS.items()
                if (folder / sub).is_dir()
            }
        else:
            raise ReferenceModelError(
                f"{folder}: model_type {model_type!r} is neither {ORIGINAL_MODEL_TYPE!r} nor {NATIVE_MODEL_TYPE!r}"
            )
        model = cls._build_model(config, state)
        targets = {name for name, _ in model.named_parameters() if LORA_TARGET.fullmatch(name.removesuffix(".weight"))}
        for adapter in adapters.values():
            stray = set(adapter.weights) - {t.removesuffix(".weight") for t in targets}
            if stray:
                raise ReferenceModelError(f"{adapter.name} LoRA targets unknown modules: {sorted(stray)[:5]}")
            for module, (a, b) in adapter.weights.items():
                weight = model.get_parameter(module + ".weight")
                if (b.shape[0], a.shape[1]) != tuple(weight.shape):
                    shape = (b.shape[0], a.shape[1])
                    raise ReferenceModelError(
                        f"{adapter.name} LoRA for {module}: B@A {shape} vs weight {tuple(weight.shape)}"
                    )
        base_weights = {name: state[name] for name in sorted(targets)}
        source_format = "original" if model_type == ORIGINAL_MODEL_TYPE else "native"
        return cls(model, base_weights, adapters, source_format)

    @staticmethod
    def _build_model(config: Phi4MultimodalConfig, state: dict[str, torch.Tensor]) -> Phi4MultimodalForCausalLM:
        config._attn_implementation = "eager"  # sdpa makes SigLIP causal; the original attends both ways
        # Build on the meta device (no random init), then assign the checkpoint tensors upcast to fp32.
        with torch.device("meta"):
            model = Phi4MultimodalForCausalLM(config)
        # copy=True: the model must never alias the pristine tensors that LoRA merges start from.
        fp32_state = {key: value.to(torch.float32, copy=True) for key, value in state.items()}
        result = model.load_state_dict(fp32_state, strict=False, assign=True)
        missing = [key for key in result.missing_keys if not (key == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or result.unexpected_keys:
            raise ReferenceModelError(
                f"checkpoint does not match the native model: {len(missing)} missing {missing[:8]}, "
                f"{len(result.unexpected_keys)} unexpected {result.unexpected_keys[:8]}"
            )
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        # The rotary buffers are not persistent, so nothing above filled them.
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        still_meta = [name for name, t in tensors if t.is_meta]
        if still_meta:
            raise ReferenceModelError(f"tensors left uninitialised after loading: {still_meta[:8]}")
        not_fp32 = [name for name, t in tensors if t.is_floating_point() and t.dtype != torch.float32]
        if not_fp32:
            raise ReferenceModelError(f"tensors not in fp32 after loading: {not_fp32[:8]}")
        model.eval()
        not_eager = [
            type(m).__name__
            for m in model.modules()
            if getattr(getattr(m, "config", None), "_attn_implementation", "eager") != "eager"
        ]
        if not_eager:
            raise ReferenceModelError(f"modules not on eager attention: {sorted(set(not_eager))}")
        return model

    # ---- LoRA ---------------------------------------------------------------------------------------------------

    def set_lora(self, lora: str) -> None:
        """Make the decoder weights base (``"none"``) or base + the named adapter, rebuilt from the pristine copy."""
        lora = "none" if lora in ("none", "text", None) else lora
        if lora not in LORA_MODES:
            raise ReferenceModelError(f"unknown LoRA mode {lora!r}; expected one of {LORA_MODES}")
        if lora == self._active_lora:
            return
        if lora != "none" and lora not in self.adapters:
            raise ReferenceModelError(f"checkpoint has no {lora} LoRA adapter (has {sorted(self.adapters)})")
        adapter = self.adapters.get(lora)
        with torch.no_grad():
            for name, base in self._base_weights.items():
                param = self.model.get_parameter(name)
                pair = adapter.weights.get(name.removesuffix(".weight")) if adapter else None
                if pair is None:
                    param.copy_(base.to(torch.float32))
                else:
                    a, b = pair
                    merged = base.double() + adapter.scaling * (b.double() @ a.double())
                    param.copy_(merged.to(torch.float32))
        self._active_lora = lora

    @property
    def active_lora(self) -> str:
        return self._active_lora

    @staticmethod
    def mode_for(has_image: bool, has_audio: bool) -> str:
        """Input mode -> "text" | "vision" | "speech" (which LoRA the original model activates)."""
        return mode_of(has_image, has_audio)

    @staticmethod
    def lora_for_mode(mode: str) -> str:
        return MODE_LORA[mode]

    # ---- features -----------------------------------------------------------------------------------------------

    def num_image_tokens(self, image_attention_mask: Any, image_sizes: Any) -> list[int]:
        """Feature rows per image, from the HD canvas size and the crop masks (see `count_image_tokens`)."""
        return count_image_tokens(self.config.vision_config, image_attention_mask, image_sizes)

    def image_features(self, pixel_values: Any, image_attention_mask: Any, image_sizes: Any) -> torch.Tensor:
        """[sum of image tokens, hidden] fp32, after the projection MLP, images in order."""
        return encode_images(self.model.model.embed_tokens_extend.image_embed, self.config, pixel_values,
                             image_attention_mask, image_sizes)

    def audio_features(
        self, audio_embeds: Any, audio_attention_mask: Any, audio_sizes: Any, projection: str
    ) -> torch.Tensor:
        """[sum(audio_sizes), hidden] fp32; each clip encoded alone on its valid frames, then projected."""
        return encode_audio(self.model.model.embed_tokens_extend.audio_embed, self.config, audio_embeds,
                            audio_attention_mask, audio_sizes, projection)

    @torch.no_grad()
    def embeddings(
        self,
        input_ids: Any,
        image_features: torch.Tensor | None = None,
        audio_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with image rows scattered over the image placeholders and audio rows over the audio ones."""
        ids = _as_tensor(input_ids, torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        return scatter_features(self.config, ids, self.model.model.embed_tokens(ids), image_features, audio_features)

    # ---- decoder ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, inputs_embeds: torch.Tensor, lora: str, last_n: int | None = None) -> torch.Tensor:
        """Full-sequence forward without cache: [B, S, vocab] fp32 (or the last ``last_n`` positions)."""
        self.set_lora(lora)
        embeds = inputs_embeds if inputs_embeds.dim() == 3 else inputs_embeds[None]
        out = self.model(inputs_embeds=embeds.to(torch.float32), use_cache=False, logits_to_keep=last_n or 0)
        return out.logits

    def _step(self, embeds: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.model(inputs_embeds=embeds, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].clone()

    def _token_embedding(self, token: int) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.tensor([[token]], dtype=torch.long))

    @torch.no_grad()
    def decode_logits(
        self, inputs_embeds_prefix: torch.Tensor, new_token_ids: Iterable[int], lora: str
    ) -> list[torch.Tensor]:
        """Prefill on the embeddings, then feed ``new_token_ids`` one at a time through the KV cache.

        Returns the last-position logits [vocab] after the prefill and after each fed token (1 + len(tokens) items).
        """
        self.set_lora(lora)
        embeds = inputs_embeds_prefix if inputs_embeds_prefix.dim() == 3 else inputs_embeds_prefix[None]
        cache = DynamicCache(config=self.config)
        steps = [self._step(embeds.to(torch.float32), cache)]
        for token in new_token_ids:
            steps.append(self._step(self._token_embedding(int(token)), cache))
        return steps

    @torch.no_grad()
    def prefill_and_greedy(
        self,
        inputs: Mapping[str, Any],
        max_new_tokens: int,
        lora: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        recompute_at_switch: bool = False,
    ) -> GreedyResult:
        """Greedy generation from the tensors onnxruntime-genai's MultiModalProcessor produces.

        The LoRA (unless given) and the audio projection follow the input mode as in the original model. Decoding
        runs exactly ``max_new_tokens`` steps unless ``eos_token_ids`` is given, in which case it stops after the
        first of them is emitted. With ``recompute_at_switch`` the loop behaves like the original model's
        generation: when the sequence first reaches ``original_max_position_embeddings + 1`` tokens on a cache of at
        most that many, the cache is dropped and every position runs again (with the long LongRoPE factors).
        """
        if max_new_tokens < 1:
            raise ReferenceModelError("max_new_tokens must be at least 1")
        extend = self.model.model.embed_tokens_extend
        ids, image_features, audio_features, projection = encode_inputs(
            extend.image_embed, extend.audio_embed, self.config, inputs
        )
        has_image, has_audio = image_features is not None, audio_features is not None
        embeds = self.embeddings(ids, image_features, audio_features)

        chosen = lora if lora is not None else self.lora_for_mode(self.mode_for(has_image, has_audio))
        self.set_lora(chosen)
        stop = {int(t) for t in eos_token_ids} if eos_token_ids is not None else set()
        switch = self.config.original_max_position_embeddings
        cache = DynamicCache(config=self.config)
        step_logits = [self._step(embeds, cache)]
        tokens: list[int] = []
        while True:
            token = int(torch.argmax(step_logits[-1]))
            tokens.append(token)
            if len(tokens) >= max_new_tokens or token in stop:
                break
            length = embeds.shape[1] + len(tokens)
            if recompute_at_switch and length >= switch + 1 and cache.get_seq_length() <= switch:
                cache = DynamicCache(config=self.config)
                generated = torch.cat([self._token_embedding(t) for t in tokens], dim=1)
                step_logits.append(self._step(torch.cat([embeds, generated], dim=1), cache))
                continue
            step_logits.append(self._step(self._token_embedding(token), cache))
        return GreedyResult(
            tokens=tokens,
            step_logits=step_logits,
            top2_gap=[_top2_gap(step) for step in step_logits],
            lora=self._active_lora,
            projection=projection,
            prompt_length=int(ids.shape[1]),
            inputs_embeds=embeds,
        )
