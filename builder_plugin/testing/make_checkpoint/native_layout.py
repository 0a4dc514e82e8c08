"""The transformers-native layout: Phi4MultimodalConfig from the original config, PEFT adapter folders, and the
folder they make up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder_plugin.config import NATIVE_ADAPTER_DIRS, SIGLIP_SO400M
from builder_plugin.layout import AUDIO_TOKEN_ID, IMAGE_TOKEN_ID
from builder_plugin.testing.make_checkpoint.original_layout import generation_config
from builder_plugin.testing.make_checkpoint.safetensors_writer import write_json, write_safetensors, write_sharded
from builder_plugin.testing.make_checkpoint.tensors import PlannedTensor

if TYPE_CHECKING:
    from transformers import Phi4MultimodalConfig


# PEFT full-matches target_modules against names relative to Phi4MultimodalForCausalLM; anchoring on model.layers
# keeps it off the conformer's own o_proj / gate_up_proj / down_proj.
PEFT_TARGET_MODULES = r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))"


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
            # The ratio transformers derives when it is missing (and warns about): the same rotation, stated.
            "factor": max(1.0, original["max_position_embeddings"] / original["original_max_position_embeddings"]),
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


def write_native(
    staging: Path, original: dict[str, Any], native: Phi4MultimodalConfig, plan: list[PlannedTensor], seed: int,
    dtype: str, num_shards: int | None,
) -> tuple[int, int, int]:  # fmt: skip
    """The weights under their native keys, one PEFT folder per adapter, config.json and the side files;
    (shards, data bytes, tensors)."""
    import transformers

    entries = [(p.native_name, p) for p in plan if p.adapter is None]
    shards, total = write_sharded(staging, entries, seed, dtype, num_shards)
    count = len(entries)
    for adapter, folder in NATIVE_ADAPTER_DIRS.items():
        adapter_dir = staging / folder
        adapter_dir.mkdir()
        adapter_entries = [(p.peft_name, p) for p in plan if p.adapter == adapter]
        total += write_safetensors(adapter_dir / "adapter_model.safetensors", adapter_entries, seed, dtype)
        write_json(adapter_dir / "adapter_config.json", peft_adapter_config(original, adapter))
        count += len(adapter_entries)
    native_dict = native.to_dict()
    native_dict["dtype"] = dtype
    (staging / "config.json").write_text(json.dumps(native_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_json(staging / "generation_config.json", generation_config(transformers.__version__))
    write_json(staging / "preprocessor_config.json", native_preprocessor_config())
    return shards, total, count
