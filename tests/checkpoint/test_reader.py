import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from builder_plugin.checkpoint.reader import INDEX_FILE, CheckpointReader
from builder_plugin.errors import CheckpointError


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_original_is_indexed_lazily_and_bf16(tiny_checkpoint: Path) -> None:
    index = json.loads((tiny_checkpoint / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 1, "the tiny checkpoint should be sharded"
    reader = CheckpointReader(tiny_checkpoint)
    assert set(reader) == set(index)
    ref = reader["model.layers.0.self_attn.qkv_proj.lora_A.vision.weight"]
    assert ref.dtype == "BF16"
    stored = ref.load(None)
    assert stored.dtype == torch.bfloat16
    upcast = ref.load(torch.float32)
    assert upcast.dtype == torch.float32 and torch.equal(upcast, stored.to(torch.float32))


def test_single_file_checkpoint(tmp_path: Path, tiny_checkpoint: Path) -> None:
    reader = CheckpointReader(tiny_checkpoint)
    single = tmp_path / "single"
    single.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, single / name)
    save_file({name: ref.load(None) for name, ref in reader.items()}, str(single / "model.safetensors"))
    again = CheckpointReader(single)
    assert set(again) == set(reader)
    name = "model.embed_tokens_extend.image_embed.glb_GN"
    assert torch.equal(again[name].load(), reader[name].load())


def test_missing_shard_is_named(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        CheckpointReader(ckpt)


def test_truncated_shard_is_named(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        CheckpointReader(ckpt)


def test_native_layout_reads_adapter_folders(tiny_native_checkpoint: Path) -> None:
    reader = CheckpointReader(tiny_native_checkpoint, "native")
    assert "model.layers.0.self_attn.qkv_proj.weight" in reader
    adapters = [n for n in reader if n.startswith(("vision-lora/", "speech-lora/"))]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
