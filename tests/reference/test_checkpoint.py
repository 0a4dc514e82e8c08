"""The reference's own checkpoint reading: tensors and row ranges read from the headers' offsets equal what the
safetensors library loads, both layouts give the native names, and a checkpoint that is not the native model's (a
tensor missing, extra, misshapen, a LoRA pair that does not fit, a truncated file) is refused with the name."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Phi4MultimodalForCausalLM

from builder_plugin.reference.checkpoint import StoredTensor, index_safetensors_dir, open_checkpoint
from builder_plugin.reference.errors import ReferenceModelError
from builder_plugin.reference.keys import rename_original_key


def native_model(config) -> torch.nn.Module:
    with torch.device("meta"):
        return Phi4MultimodalForCausalLM(config)


def test_tensors_and_rows_are_the_stored_ones(tiny_checkpoint: Path) -> None:
    stored = {}
    for shard in sorted(tiny_checkpoint.glob("*.safetensors")):
        stored.update(load_file(str(shard)))
    index = index_safetensors_dir(tiny_checkpoint)
    assert index.keys() == stored.keys()
    for name, tensor in stored.items():
        got = index[name].load()
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    table = index["model.embed_tokens.weight"]
    assert torch.equal(table.rows(5, 9), stored["model.embed_tokens.weight"][5:9])
    assert table.rows(3, 3).shape == (0, table.shape[1])
    with pytest.raises(ReferenceModelError, match="no rows"):
        table.rows(0, table.shape[0] + 1)


def test_both_layouts_give_the_native_names(tiny_checkpoint: Path, tiny_native_checkpoint: Path) -> None:
    original, native = open_checkpoint(tiny_checkpoint), open_checkpoint(tiny_native_checkpoint)
    assert (original.source_format, native.source_format) == ("original", "native")
    assert original.tensors.keys() == native.tensors.keys()
    assert all(".lora_" not in name for name in original.tensors)
    # the same random tensors under both layouts' names (make_checkpoint draws them from one seed)
    stored = load_file(str(sorted(tiny_checkpoint.glob("*.safetensors"))[0]))
    for key, tensor in stored.items():
        if ".lora_" not in key:
            assert torch.equal(original.tensors[rename_original_key(key)].load(), tensor), key
    for name in original.tensors:
        assert torch.equal(original.tensors[name].load(), native.tensors[name].load()), name
    assert original.adapters.keys() == native.adapters.keys() == {"vision", "speech"}
    for name, adapter in original.adapters.items():
        other = native.adapters[name]
        assert (adapter.r, adapter.scaling) == (other.r, other.scaling)
        assert adapter.weights.keys() == other.weights.keys()
        module = next(iter(adapter.weights))
        assert all(torch.equal(x, y) for x, y in zip(adapter.pair(module), other.pair(module)))
    for checkpoint in (original, native):
        checkpoint.check(native_model(checkpoint.config))
        assert checkpoint.config._attn_implementation == "eager"


def test_a_checkpoint_that_is_not_the_native_model_is_refused(tiny_checkpoint: Path) -> None:
    checkpoint = open_checkpoint(tiny_checkpoint)
    model = native_model(checkpoint.config)
    tensors = checkpoint.tensors
    norm = "model.layers.1.post_attention_layernorm.weight"

    def refused(match: str, **changes) -> None:
        with pytest.raises(ReferenceModelError, match=match):
            dataclasses.replace(checkpoint, **changes).check(model)

    refused(rf"1 missing \['{norm}'\]", tensors={k: v for k, v in tensors.items() if k != norm})
    extra = "model.layers.2.input_layernorm.weight"
    refused(rf"1 unexpected \['{extra}'\]", tensors={**tensors, extra: tensors[norm]})
    wider = dataclasses.replace(tensors[norm], shape=(tensors[norm].shape[0] + 1,))
    refused(f"wrong shape: {norm}", tensors={**tensors, norm: wider})
    vision = checkpoint.adapters["vision"]
    module = "model.layers.0.self_attn.o_proj"
    a, b = vision.weights[module]
    moved = {**vision.weights, "model.layers.0.self_attn.v_proj": (a, b)}
    refused("vision LoRA targets unknown modules", adapters={"vision": dataclasses.replace(vision, weights=moved)})
    crossed = {**vision.weights, module: vision.weights["model.layers.0.mlp.gate_up_proj"]}
    refused(f"vision LoRA for {module}: B@A", adapters={"vision": dataclasses.replace(vision, weights=crossed)})


def test_a_truncated_shard_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy)
    index = index_safetensors_dir(copy)
    last: StoredTensor = max(index.values(), key=lambda t: t.offset)
    with open(last.file, "r+b") as f:
        f.truncate(last.offset + 2)
    with pytest.raises(ReferenceModelError, match=f"ends inside {last.key}"):
        last.load()
