"""The original ``phi4mm`` layout: config.json for a preset, its side files, and the folder they make up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builder_plugin.config import SIGLIP_SO400M  # what the original code assumes for "img_processor": null
from builder_plugin.testing.make_checkpoint.presets import PRESETS, long_rope_factors, positive
from builder_plugin.testing.make_checkpoint.safetensors_writer import write_json, write_sharded
from builder_plugin.testing.make_checkpoint.tensors import PlannedTensor
from builder_plugin.testing.tokenizer import ENDOFTEXT_ID, ROLE_TOKENS

END_TOKEN_ID = ROLE_TOKENS["<|end|>"]
ORIGINAL_TRANSFORMERS_VERSION = "4.46.1"

VISION_LORA_LAYER_REGEX = r"layers.*((self_attn\.(qkv_proj|o_proj))|(mlp\.(gate_up|down)_proj))"
SPEECH_LORA_LAYER_REGEX = r"((layers.*self_attn\.(qkv|o)_proj)|(layers.*mlp\.(gate_up|down)_proj))"
LORA_DROPOUT = {"vision": 0.0, "speech": 0.01}


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
        text["num_hidden_layers"] = positive(text_layers, "text layers")
    audio = dict(values["audio"])
    if audio_blocks is not None:
        audio["num_blocks"] = positive(audio_blocks, "audio blocks")
    img_processor: dict[str, Any] | None = None
    if values["vision"] is not None or vision_layers is not None:
        img_processor = dict(SIGLIP_SO400M, **(values["vision"] or {}))
        if vision_layers is not None:
            img_processor["num_hidden_layers"] = positive(vision_layers, "vision layers")
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


def write_original(
    staging: Path, original: dict[str, Any], plan: list[PlannedTensor], seed: int, dtype: str, num_shards: int | None
) -> tuple[int, int, int]:
    """The weights under their original keys, config.json and the side files; (shards, data bytes, tensors)."""
    entries = [(p.original_name, p) for p in plan]
    shards, total = write_sharded(staging, entries, seed, dtype, num_shards)
    write_json(staging / "config.json", original)
    write_json(staging / "generation_config.json", generation_config(ORIGINAL_TRANSFORMERS_VERSION))
    write_json(staging / "preprocessor_config.json", original_preprocessor_config())
    return shards, total, len(entries)
