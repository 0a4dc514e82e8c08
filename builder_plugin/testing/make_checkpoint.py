"""Write a random Phi-4-multimodal checkpoint in the original Hugging Face layout or the transformers-native one.

    python -m builder_plugin.testing.make_checkpoint OUT [--preset tiny|full] [--seed N] [--format original|native]
        [--text-layers N] [--vision-layers N] [--audio-blocks N] [--shards N] [--dtype bfloat16|float32] [--overwrite]

The tensor list comes from transformers' native ``Phi4MultimodalForCausalLM`` built on the meta device, renamed to
the original ``phi4mm`` keys with one table (``NATIVE_TO_ORIGINAL``); a native name the table does not cover is an
error. Every tensor is drawn from a generator seeded by (seed, original tensor name) and written straight to its
safetensors shard in fixed-size blocks, so the full-size model never sits in memory and both formats carry the
same numbers for the same seed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from builder_plugin.config import SIGLIP_SO400M  # what the original code assumes for "img_processor": null
from builder_plugin.testing.tokenizer import AUDIO_TOKEN, ENDOFTEXT_ID, IMAGE_TOKEN, ROLE_TOKENS, write_tokenizer

if TYPE_CHECKING:
    from transformers import Phi4MultimodalConfig

IMAGE_TOKEN_ID = 200010
AUDIO_TOKEN_ID = 200011
END_TOKEN_ID = ROLE_TOKENS["<|end|>"]
ORIGINAL_TRANSFORMERS_VERSION = "4.46.1"

# Long-RoPE long factors of the released checkpoint (48 = 128 head dims * 0.75 / 2).
REAL_LONG_FACTORS = (
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
)  # fmt: skip


VISION_LORA_LAYER_REGEX = r"layers.*((self_attn\.(qkv_proj|o_proj))|(mlp\.(gate_up|down)_proj))"
SPEECH_LORA_LAYER_REGEX = r"((layers.*self_attn\.(qkv|o)_proj)|(layers.*mlp\.(gate_up|down)_proj))"
# PEFT full-matches target_modules against names relative to Phi4MultimodalForCausalLM; anchoring on model.layers
# keeps it off the conformer's own o_proj / gate_up_proj / down_proj.
PEFT_TARGET_MODULES = r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))"
NATIVE_ADAPTER_DIRS = {"vision": "vision-lora", "speech": "speech-lora"}
LORA_DROPOUT = {"vision": 0.0, "speech": 0.01}

PRESETS: dict[str, dict] = {
    "full": {
        "text": {
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
        },
        "vision": None,  # img_processor null: the hard-coded SigLIP-so400m
        "audio": {
            "attention_dim": 1024,
            "attention_heads": 16,
            "num_blocks": 24,
            "linear_units": 1536,
            "conv_channels": 1024,
            "ext_pw_out_channel": 1024,
            "depthwise_seperable_out_channel": 1024,
        },
        "vision_lora": {"r": 256, "lora_alpha": 512},
        "speech_lora": {"r": 320, "lora_alpha": 640},
        "num_shards": None,  # at most 1.5 GiB per shard
    },
    "tiny": {
        "text": {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,  # head_dim 64: the smallest that ORT GQA's fused rotary accepts with 0.75
            "num_key_value_heads": 2,
            "max_position_embeddings": 16384,
            "original_max_position_embeddings": 128,
        },
        "vision": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4},
        "audio": {
            "attention_dim": 64,
            "attention_heads": 4,
            "num_blocks": 2,
            "linear_units": 96,
            "conv_channels": 32,
            "ext_pw_out_channel": 64,
            "depthwise_seperable_out_channel": 64,
        },
        "vision_lora": {"r": 8, "lora_alpha": 16},  # scaling 2.0
        "speech_lora": {"r": 12, "lora_alpha": 36},  # scaling 3.0, unlike vision, so a swapped scale shows
        "num_shards": 2,
    },
}

DEFAULT_SHARD_BYTES = 3 * 1024**3 // 2
BLOCK_ELEMENTS = 1 << 22  # random numbers are drawn in blocks of this many elements, whatever the tensor size

# Initialisation scales (see _distribution).
LOGIT_STD = 3.0  # std of the logits over the vocabulary for a unit-RMS final hidden state
LORA_RELATIVE_DELTA = 0.3  # RMS of scaling * B @ A @ x relative to W @ x for unit-RMS inputs
# Decoder q/k/v weights are drawn this much wider than 1/sqrt(fan_in): sharper, position-dependent attention makes
# the next token depend on the context, not only on the last token, so greedy decoding does not settle on a
# repeated token (measured: 16 distinct tokens out of 16 for 9 seed/prompt pairs, against 2-12 without it).
ATTENTION_GAIN = 2.0
NORM_WEIGHT_NOISE = 0.05
BIAS_STD = 0.02

_DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float32": (torch.float32, "F32")}


# ------------------------------------------------------------------------------------------------------------------
# Configuration


def long_rope_factors(count: int) -> tuple[list[float], list[float]]:
    """(short, long) factors. With the real count the real values; otherwise a resampled copy of the real curve."""
    if count == len(REAL_LONG_FACTORS):
        return [1.0] * count, [float(x) for x in REAL_LONG_FACTORS]
    last = len(REAL_LONG_FACTORS) - 1
    long = []
    for i in range(count):
        pos = i * last / max(count - 1, 1)
        lo = min(int(pos), last - 1)
        frac = pos - lo
        long.append(round(REAL_LONG_FACTORS[lo] * (1 - frac) + REAL_LONG_FACTORS[lo + 1] * frac, 6))
    # Slightly non-uniform short factors, so a builder that ignores them gives different rotary angles.
    short = [round(1.0 + 0.05 * i / max(count - 1, 1), 6) for i in range(count)]
    return short, long


def original_config(
    preset: str = "tiny",
    text_layers: int | None = None,
    vision_layers: int | None = None,
    audio_blocks: int | None = None,
) -> dict[str, Any]:
    """config.json of the original ``phi4mm`` checkpoint for a preset, with optional layer-count overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    values = PRESETS[preset]
    text = dict(values["text"])
    if text_layers is not None:
        text["num_hidden_layers"] = _positive(text_layers, "text layers")
    audio = dict(values["audio"])
    if audio_blocks is not None:
        audio["num_blocks"] = _positive(audio_blocks, "audio blocks")
    img_processor: dict[str, Any] | None = None
    if values["vision"] is not None or vision_layers is not None:
        img_processor = dict(SIGLIP_SO400M, **(values["vision"] or {}))
        if vision_layers is not None:
            img_processor["num_hidden_layers"] = _positive(vision_layers, "vision layers")
        if img_processor == SIGLIP_SO400M:
            img_processor = None

    head_dim = text["hidden_size"] // text["num_attention_heads"]
    short, long = long_rope_factors(int(head_dim * 0.75) // 2)
    return {
        "architectures": ["Phi4MMForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "audio_processor": {
            "config": {
                "activation": "swish",
                "attention_dim": audio["attention_dim"],
                "attention_heads": audio["attention_heads"],
                "batch_norm": False,
                "bias_in_glu": True,
                "causal": True,
                "chunk_size": -1,
                "cnn_layer_norm": True,
                "conv_activation": "swish",
                "conv_glu_type": "swish",
                "depthwise_multiplier": 1,
                "depthwise_seperable_out_channel": audio["depthwise_seperable_out_channel"],
                "dropout_rate": 0.0,
                "encoder_embedding_config": {"input_size": 80},
                "ext_pw_kernel_size": 1,
                "ext_pw_out_channel": audio["ext_pw_out_channel"],
                "input_layer": "nemo_conv",
                "input_size": 80,
                "kernel_size": 3,
                "left_chunk": 18,
                "linear_units": audio["linear_units"],
                "nemo_conv_settings": {"conv_channels": audio["conv_channels"]},
                "num_blocks": audio["num_blocks"],
                "relative_attention_bias_args": {"t5_bias_max_distance": 500, "type": "t5"},
                "time_reduction": 8,
            },
            "name": "cascades",
        },
        "auto_map": {
            "AutoConfig": "configuration_phi4mm.Phi4MMConfig",
            "AutoModelForCausalLM": "modeling_phi4mm.Phi4MMForCausalLM",
        },
        "bos_token_id": ENDOFTEXT_ID,
        "embd_layer": {
            "audio_embd_layer": {
                "compression_rate": 8,
                "downsample_rate": 1,
                "embedding_cls": "audio",
                "enable_gradient_checkpointing": True,
                "projection_cls": "mlp",
                "use_conv_downsample": False,
                "use_qformer": False,
            },
            "embedding_cls": "image_audio",
            "image_embd_layer": {
                "crop_size": 448,
                "embedding_cls": "tune_image",
                "enable_gradient_checkpointing": True,
                "hd_transform_order": "sub_glb",
                "image_token_compression_cls": "avg_pool_2d",
                "projection_cls": "mlp",
                "use_hd_transform": True,
                "with_learnable_separator": True,
            },
        },
        "embd_pdrop": 0.0,
        "eos_token_id": ENDOFTEXT_ID,
        "full_attn_mod": 1,
        "hidden_act": "silu",
        "hidden_size": text["hidden_size"],
        "img_processor": img_processor,
        "initializer_range": 0.02,
        "intermediate_size": text["intermediate_size"],
        "interpolate_factor": 1,
        "lm_head_bias": False,
        "max_position_embeddings": text["max_position_embeddings"],
        "mlp_bias": False,
        "model_type": "phi4mm",
        "num_attention_heads": text["num_attention_heads"],
        "num_hidden_layers": text["num_hidden_layers"],
        "num_key_value_heads": text["num_key_value_heads"],
        "original_max_position_embeddings": text["original_max_position_embeddings"],
        "pad_token_id": ENDOFTEXT_ID,
        "partial_rotary_factor": 0.75,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": long, "short_factor": short, "type": "longrope"},
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "speech_lora": {
            "dp": LORA_DROPOUT["speech"],
            "layer": SPEECH_LORA_LAYER_REGEX,
            "lora_alpha": values["speech_lora"]["lora_alpha"],
            "r": values["speech_lora"]["r"],
        },
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": ORIGINAL_TRANSFORMERS_VERSION,
        "use_cache": True,
        "vision_lora": {
            "dp": LORA_DROPOUT["vision"],
            "layer": VISION_LORA_LAYER_REGEX,
            "lora_alpha": values["vision_lora"]["lora_alpha"],
            "r": values["vision_lora"]["r"],
        },
        "vocab_size": 200064,
    }


def native_config(original: dict[str, Any]) -> Phi4MultimodalConfig:
    """The equivalent transformers-native ``Phi4MultimodalConfig``, checked against `original`."""
    from transformers import Phi4MultimodalConfig

    audio = original["audio_processor"]["config"]
    audio_layer = original["embd_layer"]["audio_embd_layer"]
    vision = original["img_processor"] or SIGLIP_SO400M
    rope = original["rope_scaling"]
    config = Phi4MultimodalConfig(
        vocab_size=original["vocab_size"],
        hidden_size=original["hidden_size"],
        intermediate_size=original["intermediate_size"],
        num_hidden_layers=original["num_hidden_layers"],
        num_attention_heads=original["num_attention_heads"],
        num_key_value_heads=original["num_key_value_heads"],
        resid_pdrop=original["resid_pdrop"],
        embd_pdrop=original["embd_pdrop"],
        attention_dropout=original["attention_dropout"],
        hidden_act=original["hidden_act"],
        max_position_embeddings=original["max_position_embeddings"],
        original_max_position_embeddings=original["original_max_position_embeddings"],
        initializer_range=original["initializer_range"],
        rms_norm_eps=original["rms_norm_eps"],
        use_cache=original["use_cache"],
        tie_word_embeddings=original["tie_word_embeddings"],
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": original["rope_theta"],
            "partial_rotary_factor": original["partial_rotary_factor"],
            "short_factor": list(rope["short_factor"]),
            "long_factor": list(rope["long_factor"]),
            "original_max_position_embeddings": original["original_max_position_embeddings"],
        },
        bos_token_id=original["bos_token_id"],
        eos_token_id=original["eos_token_id"],
        pad_token_id=original["pad_token_id"],
        sliding_window=original["sliding_window"],
        vision_config={
            "hidden_size": vision["hidden_size"],
            "intermediate_size": vision["intermediate_size"],
            "num_hidden_layers": vision["num_hidden_layers"],
            "num_attention_heads": vision["num_attention_heads"],
            "image_size": vision["image_size"],
            "patch_size": vision["patch_size"],
            "hidden_act": vision["hidden_act"],
            "layer_norm_eps": vision["layer_norm_eps"],
            "crop_size": original["embd_layer"]["image_embd_layer"]["crop_size"],
            "feature_layer": -2,
            "image_token_id": IMAGE_TOKEN_ID,
        },
        audio_config={
            "hidden_size": audio["attention_dim"],
            "intermediate_size": audio["linear_units"],
            "num_blocks": audio["num_blocks"],
            "num_attention_heads": audio["attention_heads"],
            "activation": audio["activation"],
            "chunk_size": audio["chunk_size"],
            "left_chunk": audio["left_chunk"],
            "dropout_rate": audio["dropout_rate"],
            "ext_pw_out_channel": audio["ext_pw_out_channel"],
            "depthwise_separable_out_channel": audio["depthwise_seperable_out_channel"],
            "depthwise_multiplier": audio["depthwise_multiplier"],
            "kernel_size": audio["kernel_size"],
            "conv_activation": audio["conv_activation"],
            "input_size": audio["input_size"],
            "conv_glu_type": audio["conv_glu_type"],
            "time_reduction": audio["time_reduction"],
            "bias_max_distance": audio["relative_attention_bias_args"]["t5_bias_max_distance"],
            "bias_symmetric": False,
            "nemo_activation": "relu",
            "nemo_conv_channels": audio["nemo_conv_settings"]["conv_channels"],
            "downsample_rate": audio_layer["downsample_rate"],
            "feature_layer": -2,
            "audio_token_id": AUDIO_TOKEN_ID,
        },
    )
    config.architectures = ["Phi4MultimodalForCausalLM"]
    config.dtype = "bfloat16"
    _check_native_config(original, config)
    return config


def _check_native_config(original: dict[str, Any], native: Phi4MultimodalConfig) -> None:
    """The native defaults differ from the checkpoint in places (32 heads, bias_max_distance 1000): catch that."""
    audio = original["audio_processor"]["config"]
    expected = {
        "num_attention_heads": original["num_attention_heads"],
        "num_key_value_heads": original["num_key_value_heads"],
        "num_hidden_layers": original["num_hidden_layers"],
        "tie_word_embeddings": True,
        "rope_parameters.partial_rotary_factor": original["partial_rotary_factor"],
        "rope_parameters.rope_type": "longrope",
        "audio_config.bias_max_distance": audio["relative_attention_bias_args"]["t5_bias_max_distance"],
        "audio_config.num_attention_heads": audio["attention_heads"],
        "audio_config.num_blocks": audio["num_blocks"],
        "vision_config.num_hidden_layers": (original["img_processor"] or SIGLIP_SO400M)["num_hidden_layers"],
    }
    for path, want in expected.items():
        got: Any = native
        for part in path.split("."):
            got = got[part] if isinstance(got, dict) else getattr(got, part)
        if got != want:
            raise AssertionError(f"native config {path} = {got!r}, expected {want!r}")


# ------------------------------------------------------------------------------------------------------------------
# Tensor plan: names, shapes, init


# native name pattern -> original name template; first match wins, and every native name must match one row.
_E = r"model\.embed_tokens_extend\."
NATIVE_TO_ORIGINAL: tuple[tuple[str, str | None], ...] = (
    (r"lm_head\.weight", None),  # tied to model.embed_tokens.weight, absent from the checkpoint
    (r"model\.layers\.(\d+)\.(self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))\.weight",
     r"model.layers.\1.\2.base_layer.weight"),
    (r"model\.(embed_tokens\.weight|norm\.weight|layers\.\d+\.(?:input|post_attention)_layernorm\.weight)",
     r"model.\1"),
    (_E + r"image_embed\.global_img_feature_extensor", r"model.embed_tokens_extend.image_embed.glb_GN"),
    (_E + r"image_embed\.sub_img_feature_extensor", r"model.embed_tokens_extend.image_embed.sub_GN"),
    (_E + r"image_embed\.img_projection_up\.(weight|bias)",
     r"model.embed_tokens_extend.image_embed.img_projection.0.\1"),
    (_E + r"image_embed\.img_projection_down\.(weight|bias)",
     r"model.embed_tokens_extend.image_embed.img_projection.2.\1"),
    (_E + r"image_embed\.img_processor\.("
     r"embeddings\.(?:patch_embedding\.(?:weight|bias)|position_embedding\.weight)"
     r"|encoder\.layers\.\d+\.(?:layer_norm[12]|mlp\.fc[12]|self_attn\.(?:q|k|v|out)_proj)\.(?:weight|bias)"
     r"|post_layernorm\.(?:weight|bias)"
     r"|head\.(?:probe|attention\.in_proj_(?:weight|bias)|attention\.out_proj\.(?:weight|bias)"
     r"|layernorm\.(?:weight|bias)|mlp\.fc[12]\.(?:weight|bias)))",
     r"model.embed_tokens_extend.image_embed.img_processor.\1"),
    (_E + r"audio_embed\.up_proj_for_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.speech.0.\1"),
    (_E + r"audio_embed\.down_proj_for_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.speech.2.\1"),
    (_E + r"audio_embed\.up_proj_for_vision_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.vision.0.\1"),
    (_E + r"audio_embed\.down_proj_for_vision_speech\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.audio_projection.vision.2.\1"),
    (_E + r"audio_embed\.encoder\.encoders\.(\d+)\.(feed_forward_(?:in|out))\.gate_up_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.\2.net.0.linear.\3"),
    (_E + r"audio_embed\.encoder\.encoders\.(\d+)\.(feed_forward_(?:in|out))\.down_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.\2.net.2.\3"),
    (_E + r"audio_embed\.encoder\.encoders\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.self_attn.linear_\2.\3"),
    (_E + r"audio_embed\.encoder\.encoders\.(\d+)\.self_attn\.o_proj\.(weight|bias)",
     r"model.embed_tokens_extend.audio_embed.encoder.encoders.\1.self_attn.linear_out.\2"),
    (_E + r"audio_embed\.encoder\.(encoders\.\d+\.(?:"
     r"feed_forward_(?:in|out)\.layer_norm\.(?:weight|bias)"
     r"|conv\.(?:layer_norm|glu\.ext_pw_conv_1d|dw_sep_conv_1d\.dw_conv|dw_sep_conv_1d\.pw_conv|ext_pw_conv_1d)"
     r"\.(?:weight|bias)"
     r"|conv\.glu\.b[12]"
     r"|(?:layer_norm_att|layer_norm)\.(?:weight|bias)))",
     r"model.embed_tokens_extend.audio_embed.encoder.\1"),
    (_E + r"audio_embed\.encoder\.(embed\.(?:conv\.\d+|out)\.(?:weight|bias)"
     r"|encoder_embedding\.global_(?:mean|invstd)"
     r"|relative_attention_bias_layer\.bias_values\.weight)",
     r"model.embed_tokens_extend.audio_embed.encoder.\1"),
)  # fmt: skip
_NATIVE_TO_ORIGINAL_COMPILED = tuple((re.compile(pattern), target) for pattern, target in NATIVE_TO_ORIGINAL)
_LORA_TARGET = re.compile(r"model\.layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))")


_TEXT_QKV = re.compile(r"model\.layers\.\d+\.self_attn\.qkv_proj\.weight")


class UncoveredTensorError(KeyError):
    """A native tensor name that the rename table does not cover (the native module changed)."""


def original_name(native_name: str) -> str | None:
    """Original checkpoint key of a native key; None for the tied lm_head."""
    for pattern, target in _NATIVE_TO_ORIGINAL_COMPILED:
        match = pattern.fullmatch(native_name)
        if match:
            return None if target is None else match.expand(target)
    raise UncoveredTensorError(f"native tensor {native_name!r} is not covered by NATIVE_TO_ORIGINAL")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor: its key in each layout, shape, and the normal distribution it is drawn from."""

    original_name: str  # also the identity the random stream is seeded with
    native_name: str | None  # key in the native model shards; None for LoRA tensors
    adapter: str | None  # "vision" / "speech" for LoRA tensors
    peft_name: str | None  # key inside the native adapter_model.safetensors
    shape: tuple[int, ...]
    mean: float
    std: float
    log_normal: bool = False  # exp(mean + std * z): strictly positive

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def native_state_shapes(config: Phi4MultimodalConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry of Phi4MultimodalForCausalLM (parameters and persistent buffers) with its shape."""
    from transformers import Phi4MultimodalForCausalLM

    with torch.device("meta"):
        model = Phi4MultimodalForCausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def plan_tensors(original: dict[str, Any], native_shapes: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    hidden = original["hidden_size"]
    loras = {name: original[f"{name}_lora"] for name in ("vision", "speech")}
    plan = []
    for native_name, shape in native_shapes.items():
        name = original_name(native_name)
        if name is None:
            if not original["tie_word_embeddings"]:
                raise AssertionError("lm_head.weight is only dropped for tied embeddings")
            continue
        mean, std, log_normal = _distribution(native_name, shape, hidden)
        plan.append(PlannedTensor(name, native_name, None, None, shape, mean, std, log_normal))
        module = native_name.removesuffix(".weight")
        if _LORA_TARGET.fullmatch(module):
            out_features, in_features = shape
            for adapter, lora in loras.items():
                r, scaling = int(lora["r"]), lora["lora_alpha"] / lora["r"]
                b_std = LORA_RELATIVE_DELTA / (scaling * math.sqrt(r))
                for part, part_shape, part_std in (
                    ("lora_A", (r, in_features), 1.0 / math.sqrt(in_features)),
                    ("lora_B", (out_features, r), b_std),
                ):
                    plan.append(
                        PlannedTensor(
                            original_name=f"{module}.{part}.{adapter}.weight",
                            native_name=None,
                            adapter=adapter,
                            peft_name=f"base_model.model.{module}.{part}.weight",
                            shape=part_shape,
                            mean=0.0,
                            std=part_std,
                        )
                    )
    return plan


def _distribution(native_name: str, shape: tuple[int, ...], text_hidden: int) -> tuple[float, float, bool]:
    """(mean, std, log_normal) chosen so activations stay O(1) and every tensor has a visible effect."""
    leaf = native_name.rsplit(".", 1)[-1]
    module = native_name.rsplit(".", 2)[-2] if native_name.count(".") >= 1 else ""
    if native_name == "model.embed_tokens.weight":
        return 0.0, LOGIT_STD / math.sqrt(text_hidden), False  # tied: logits = norm(h) @ E.T
    if leaf == "global_invstd":
        return 0.0, 0.1, True
    if leaf == "global_mean":
        return 0.0, 0.5, False  # small next to log-mel values (about 5..30), but a missing subtraction shows
    if native_name.endswith("relative_attention_bias_layer.bias_values.weight"):
        return 0.0, 0.1, False
    if leaf in ("global_img_feature_extensor", "sub_img_feature_extensor", "probe"):
        return 0.0, 0.5, False
    if native_name.endswith("position_embedding.weight"):
        return 0.0, 0.2, False
    if leaf in ("b1", "b2"):
        return 0.0, BIAS_STD, False
    if len(shape) == 1:
        if "norm" in module and leaf == "weight":
            return 1.0, NORM_WEIGHT_NOISE, False
        return 0.0, BIAS_STD, False
    fan_in = math.prod(shape[1:])  # Linear [out, in]; Conv [out, in/groups, *kernel]
    gain = ATTENTION_GAIN if _TEXT_QKV.fullmatch(native_name) else 1.0
    return 0.0, gain / math.sqrt(fan_in), False


# ------------------------------------------------------------------------------------------------------------------
# Deterministic tensor data and streaming safetensors writer


def tensor_blocks(seed: int, planned: PlannedTensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor's values, flattened, in blocks of BLOCK_ELEMENTS; depends only on (seed, original name)."""
    digest = hashlib.sha256(f"{seed}/{planned.original_name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    remaining = planned.numel
    while remaining:
        count = min(remaining, BLOCK_ELEMENTS)
        block = torch.randn(count, generator=generator, dtype=torch.float32)
        block.mul_(planned.std).add_(planned.mean)
        if planned.log_normal:
            block.exp_()
        yield block.to(dtype)
        remaining -= count


def generate_tensor(seed: int, planned: PlannedTensor, dtype: str = "bfloat16") -> torch.Tensor:
    """The whole tensor in memory (tests, small tensors)."""
    torch_dtype = _DTYPES[dtype][0]
    return torch.cat(list(tensor_blocks(seed, planned, torch_dtype))).reshape(planned.shape)


def _write_safetensors(path: Path, entries: list[tuple[str, PlannedTensor]], seed: int, dtype: str) -> int:
    """Stream `entries` (key, tensor) into one safetensors file; returns the data bytes written."""
    torch_dtype, dtype_tag = _DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, planned in entries:
        nbytes = planned.numel * itemsize
        header[key] = {"dtype": dtype_tag, "shape": list(planned.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for _, planned in entries:
            for block in tensor_blocks(seed, planned, torch_dtype):
                f.write(_tensor_bytes(block))
    return offset


def _tensor_bytes(block: torch.Tensor) -> memoryview:
    # bf16 has no numpy dtype: reinterpret the bits as int16 first (little-endian, as safetensors wants).
    if block.dtype == torch.bfloat16:
        block = block.view(torch.int16)
    return memoryview(block.numpy()).cast("B")


def _split_shards(
    entries: list[tuple[str, PlannedTensor]], itemsize: int, num_shards: int | None
) -> list[list[tuple[str, PlannedTensor]]]:
    """Contiguous split into shards of about equal bytes; no shard is left empty."""
    sizes = [planned.numel * itemsize for _, planned in entries]
    total = sum(sizes)
    if num_shards is None:
        num_shards = max(1, math.ceil(total / DEFAULT_SHARD_BYTES))
    num_shards = min(_positive(num_shards, "shards"), len(entries))
    shards: list[list[tuple[str, PlannedTensor]]] = [[]]
    filled = 0
    for i, (entry, size) in enumerate(zip(entries, sizes)):
        unopened = num_shards - len(shards)
        must_open = unopened >= len(entries) - i  # one entry left per remaining shard
        past_quota = filled + size / 2 > total * len(shards) / num_shards
        if shards[-1] and unopened > 0 and (must_open or past_quota):
            shards.append([])
        shards[-1].append(entry)
        filled += size
    return shards


def _write_sharded(out_dir: Path, entries: list[tuple[str, PlannedTensor]], seed: int, dtype: str,
                   num_shards: int | None) -> tuple[int, int]:  # fmt: skip
    itemsize = torch.empty((), dtype=_DTYPES[dtype][0]).element_size()
    shards = _split_shards(entries, itemsize, num_shards)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_safetensors(out_dir / filename, shard, seed, dtype)
        weight_map.update({key: filename for key, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / "model.safetensors.index.json", index)
    return len(shards), total


# ------------------------------------------------------------------------------------------------------------------
# Side files


def generation_config(transformers_version: str) -> dict[str, Any]:
    return {
        "_from_model_config": True,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [END_TOKEN_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "transformers_version": transformers_version,
    }


def original_preprocessor_config() -> dict[str, Any]:
    return {
        "auto_map": {
            "AutoProcessor": "processing_phi4mm.Phi4MMProcessor",
            "AutoImageProcessor": "processing_phi4mm.Phi4MMImageProcessor",
            "AutoFeatureExtractor": "processing_phi4mm.Phi4MMAudioFeatureExtractor",
        },
        "image_processor_type": "Phi4MMImageProcessor",
        "processor_class": "Phi4MMProcessor",
        "feature_extractor_type": "Phi4MMAudioFeatureExtractor",
        "audio_compression_rate": 8,
        "audio_downsample_rate": 1,
        "audio_feat_stride": 1,
        "sampling_rate": 16000,
        "dynamic_hd": 36,
    }


def native_preprocessor_config() -> dict[str, Any]:
    return {
        "processor_class": "Phi4MultimodalProcessor",
        "image_processor_type": "Phi4MultimodalImageProcessor",
        "feature_extractor_type": "Phi4MultimodalFeatureExtractor",
        "size": {"height": 448, "width": 448},
        "patch_size": 14,
        "dynamic_hd": 36,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "feature_size": 80,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 512,
        "win_length": 400,
        "preemphasis": 0.97,
        "padding_value": 0.0,
        "audio_compression_rate": 8,
        "audio_downsample_rate": 1,
        "audio_feat_stride": 1,
        "mel_min_frequency": 0,
        "mel_max_frequency": 7690,
        "return_attention_mask": True,
    }


def peft_adapter_config(original: dict[str, Any], adapter: str) -> dict[str, Any]:
    lora = original[f"{adapter}_lora"]
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": lora["lora_alpha"],
        "lora_dropout": lora["dp"],
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": lora["r"],
        "rank_pattern": {},
        "target_modules": PEFT_TARGET_MODULES,
        "task_type": None,
        "use_dora": False,
        "use_rslora": False,
    }


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------------------------------
# Entry points


@dataclass(frozen=True)
class BuildSummary:
    path: Path
    fmt: str
    preset: str
    seed: int
    num_tensors: int
    num_shards: int
    total_bytes: int
    seconds: float


def make_checkpoint(out_dir: str | Path, preset: str = "tiny", **options: Any) -> Path:
    """Write a random checkpoint to `out_dir` (atomically) and return its path; `options` are build_checkpoint's
    (seed, fmt, text_layers, vision_layers, audio_blocks, num_shards, dtype, overwrite)."""
    return build_checkpoint(out_dir, preset, **options).path


def build_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    fmt: str = "original",
    text_layers: int | None = None,
    vision_layers: int | None = None,
    audio_blocks: int | None = None,
    num_shards: int | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> BuildSummary:
    """make_checkpoint, returning what was written."""
    start = time.perf_counter()
    if fmt not in ("original", "native"):
        raise ValueError(f"unknown format {fmt!r}; choose 'original' or 'native'")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    if seed < 0:
        raise ValueError("seed must be >= 0")
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True / --overwrite)")

    original = original_config(preset, text_layers, vision_layers, audio_blocks)
    if dtype != "bfloat16":
        original["torch_dtype"] = dtype
    native = native_config(original)
    plan = plan_tensors(original, native_state_shapes(native))
    if num_shards is None:
        num_shards = PRESETS[preset]["num_shards"]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        writer = _write_original if fmt == "original" else _write_native
        shards, total_bytes, num_tensors = writer(staging, original, native, plan, seed, dtype, num_shards)
        max_length = original["max_position_embeddings"]
        extra_tokens = {"image_token": IMAGE_TOKEN, "audio_token": AUDIO_TOKEN} if fmt == "native" else None
        write_tokenizer(staging, model_max_length=max_length, extra_special_tokens=extra_tokens)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return BuildSummary(out_dir, fmt, preset, seed, num_tensors, shards, total_bytes, time.perf_counter() - start)


def _write_original(
    staging: Path, original: dict[str, Any], native: Phi4MultimodalConfig, plan: list[PlannedTensor], seed: int,
    dtype: str, num_shards: int | None,
) -> tuple[int, int, int]:  # fmt: skip
    entries = [(p.original_name, p) for p in plan]
    shards, total = _write_sharded(staging, entries, seed, dtype, num_shards)
    _write_json(staging / "config.json", original)
    _write_json(staging / "generation_config.json", generation_config(ORIGINAL_TRANSFORMERS_VERSION))
    _write_json(staging / "preprocessor_config.json", original_preprocessor_config())
    return shards, total, len(entries)


def _write_native(
    staging: Path, original: dict[str, Any], native: Phi4MultimodalConfig, plan: list[PlannedTensor], seed: int,
    dtype: str, num_shards: int | None,
) -> tuple[int, int, int]:  # fmt: skip
    import transformers

    entries = [(p.native_name, p) for p in plan if p.adapter is None]
    shards, total = _write_sharded(staging, entries, seed, dtype, num_shards)
    count = len(entries)
    for adapter, folder in NATIVE_ADAPTER_DIRS.items():
        adapter_dir = staging / folder
        adapter_dir.mkdir()
        adapter_entries = [(p.peft_name, p) for p in plan if p.adapter == adapter]
        total += _write_safetensors(adapter_dir / "adapter_model.safetensors", adapter_entries, seed, dtype)
        _write_json(adapter_dir / "adapter_config.json", peft_adapter_config(original, adapter))
        count += len(adapter_entries)
    native_dict = native.to_dict()
    native_dict["dtype"] = dtype
    (staging / "config.json").write_text(json.dumps(native_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _write_json(staging / "generation_config.json", generation_config(transformers.__version__))
    _write_json(staging / "preprocessor_config.json", native_preprocessor_config())
    return shards, total, count


def _replace_dir(staging: Path, out_dir: Path) -> None:
    if out_dir.exists():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            staging.rename(out_dir)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
            return
    staging.rename(out_dir)


def _positive(value: int, what: str) -> int:
    if int(value) < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m builder_plugin.testing.make_checkpoint",
        description="Write a random Phi-4-multimodal checkpoint (original phi4mm layout or transformers-native).",
    )
    parser.add_argument("out", type=Path, help="output folder (created atomically)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", dest="fmt", choices=("original", "native"), default="original")
    parser.add_argument("--text-layers", type=int, help="override the number of decoder layers")
    parser.add_argument("--vision-layers", type=int, help="override the number of SigLIP layers")
    parser.add_argument("--audio-blocks", type=int, help="override the number of conformer blocks")
    parser.add_argument("--shards", type=int, help="shard count (default: the preset's, else <= 1.5 GiB each)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    # The native config warns that longrope prefers 'factor' over original_max_position_embeddings: noise here.
    transformers_logging.set_verbosity_error()
    try:
        summary = build_checkpoint(
            args.out, args.preset, args.seed, args.fmt, args.text_layers, args.vision_layers, args.audio_blocks,
            args.shards, args.dtype, args.overwrite,
        )  # fmt: skip
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {summary.path} ({summary.fmt}, preset {summary.preset}, seed {summary.seed}): "
        f"{summary.num_tensors} tensors, {summary.total_bytes / 1e6:.1f} MB in {summary.num_shards} shard(s), "
        f"{summary.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
