import json
import shutil
from pathlib import Path

import pytest

from builder_plugin.config import SIGLIP_SO400M, Phi4MMConfig
from builder_plugin.errors import InputError, UnsupportedModelError
from builder_plugin.testing.make_checkpoint import PRESETS, original_config


def _config_dir(tmp_path: Path, raw: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_original_tiny_sizes_come_from_config(tiny_checkpoint: Path) -> None:
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    cfg = Phi4MMConfig.from_dir(tiny_checkpoint)
    assert cfg.source_format == "original"
    assert cfg.text.hidden_size == raw["hidden_size"]
    assert cfg.text.head_dim == raw["hidden_size"] // raw["num_attention_heads"]
    assert cfg.text.rotary_dim // 2 == len(raw["rope_scaling"]["short_factor"])
    assert cfg.text.original_max_position_embeddings == raw["original_max_position_embeddings"]
    assert cfg.vision.hidden_size == raw["img_processor"]["hidden_size"]
    assert cfg.vision.num_attention_heads == raw["img_processor"]["num_attention_heads"]
    assert cfg.vision.num_layers_used == raw["img_processor"]["num_hidden_layers"] - 1
    audio = raw["audio_processor"]["config"]
    assert cfg.audio.attention_dim == audio["attention_dim"]
    assert cfg.audio.nemo_conv_channels == audio["nemo_conv_settings"]["conv_channels"]
    assert cfg.audio.bias_max_distance == audio["relative_attention_bias_args"]["t5_bias_max_distance"]
    assert cfg.loras["vision"].r == raw["vision_lora"]["r"]
    assert cfg.loras["speech"].scaling == raw["speech_lora"]["lora_alpha"] / raw["speech_lora"]["r"]
    assert cfg.eos_token_ids == (200020, 199999)  # generation_config.json wins over config.json


def test_img_processor_null_means_siglip_so400m(tmp_path: Path) -> None:
    cfg = Phi4MMConfig.from_dir(_config_dir(tmp_path, original_config("full")))
    assert original_config("full")["img_processor"] is None
    assert cfg.vision.hidden_size == SIGLIP_SO400M["hidden_size"]
    assert cfg.vision.num_hidden_layers == SIGLIP_SO400M["num_hidden_layers"]
    assert cfg.vision.num_attention_heads == SIGLIP_SO400M["num_attention_heads"]
    assert cfg.text.num_key_value_heads == PRESETS["full"]["text"]["num_key_value_heads"]
    assert len(cfg.text.long_factor) == 48


def test_native_layout_parses_to_the_same_sizes(tiny_checkpoint: Path, tiny_native_checkpoint: Path) -> None:
    original = Phi4MMConfig.from_dir(tiny_checkpoint)
    native = Phi4MMConfig.from_dir(tiny_native_checkpoint)
    assert native.source_format == "native"
    assert native.text == original.text
    assert native.vision == original.vision
    assert native.audio.attention_dim == original.audio.attention_dim
    assert native.audio.bias_max_distance == original.audio.bias_max_distance
    assert native.audio.nemo_conv_channels == original.audio.nemo_conv_channels
    assert native.loras == original.loras


def test_llama_config_is_rejected(tmp_path: Path) -> None:
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    with pytest.raises(UnsupportedModelError, match="not a Phi-4-multimodal checkpoint"):
        Phi4MMConfig.from_dir(_config_dir(tmp_path, raw))


def test_wrong_rope_factor_count_is_rejected(tmp_path: Path, tiny_checkpoint: Path) -> None:
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    raw["rope_scaling"]["short_factor"] = raw["rope_scaling"]["short_factor"][:-1]
    with pytest.raises(InputError, match="factors"):
        Phi4MMConfig.from_dir(_config_dir(tmp_path, raw))


def test_missing_or_broken_config(tmp_path: Path, tiny_checkpoint: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        Phi4MMConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        Phi4MMConfig.from_dir(tmp_path)
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    assert Phi4MMConfig.from_dir(tmp_path).text.vocab_size == 200064
