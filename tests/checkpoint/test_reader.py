import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from builder_plugin.checkpoint.files import INDEX_FILE, SINGLE_WEIGHTS_FILE
from builder_plugin.checkpoint.reader import CheckpointReader
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


def test_positioned_reads_equal_safetensors(tmp_path: Path) -> None:
    """load / load_rows read the file directly (no memory map); they must give safetensors' own tensors bit for bit,
    for every stored dtype and shape the checkpoints use, and name a file whose data section is cut short."""
    from safetensors import safe_open

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "bf16_matrix": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "fp32_vector": torch.randn(11, generator=generator),
        "fp16_cube": torch.randn(2, 3, 4, generator=generator).to(torch.float16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    reader = CheckpointReader(tmp_path)
    with safe_open(str(path), framework="pt") as f:
        for name in tensors:
            want = f.get_tensor(name)
            got = reader[name].load(None)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert torch.equal(reader["bf16_matrix"].load_rows(2, 6), tensors["bf16_matrix"][2:6].float())
    assert torch.equal(reader["fp32_vector"].load(torch.float64), tensors["fp32_vector"].double())

    data = path.read_bytes()
    path.write_bytes(data[:-8])  # the header still parses; the last tensor's bytes are short
    last = max(tensors, key=lambda n: json.loads(data[8:8 + int.from_bytes(data[:8], "little")])[n]["data_offsets"][1])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        reader[last].load()


def test_a_file_rewritten_at_the_same_path_is_read_anew(tmp_path: Path) -> None:
    """The header and handle caches follow the file, not only its path (a rewritten file, a reused temp folder)."""
    from safetensors.torch import load_file

    for shape in ((80,), (3, 64)):
        save_file({"w": torch.randn(shape)}, str(tmp_path / SINGLE_WEIGHTS_FILE))
        ref = CheckpointReader(tmp_path)["w"]
        assert ref.shape == shape and torch.equal(ref.load(), load_file(str(tmp_path / SINGLE_WEIGHTS_FILE))["w"])
