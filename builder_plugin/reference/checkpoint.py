"""Checkpoint reading: every tensor of a checkpoint folder (either layout) under its native name, and the LoRA
adapters (inline in the original layout, PEFT folders in the native one), read on their own.

Opening a checkpoint reads the safetensors headers only; a tensor, or a range of its rows, is read when asked for,
with a plain positioned read. Nothing is memory-mapped: every page of a mapped file that is touched stays resident
while the file is open, so a layer-by-layer pass over a full-size checkpoint would end up holding all of it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Phi4MultimodalConfig

from builder_plugin.reference.errors import ReferenceModelError
from builder_plugin.reference.keys import LORA_TARGET, ORIGINAL_LORA_KEY, PEFT_LORA_KEY, rename_original_key
from builder_plugin.reference.native_config import (
    NATIVE_MODEL_TYPE,
    ORIGINAL_MODEL_TYPE,
    native_config_from_dict,
    native_config_from_original,
)

NATIVE_ADAPTER_DIRS = {"vision": "vision-lora", "speech": "speech-lora"}
WEIGHT_INDEX = "model.safetensors.index.json"
# The safetensors dtype codes a Phi-4-multimodal checkpoint can hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor in a safetensors file, in its stored dtype, read on demand."""

    file: Path
    key: str  # its name in the file
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the file

    def load(self) -> torch.Tensor:
        """The whole tensor, in its stored dtype."""
        return self._read(0, math.prod(self.shape)).reshape(self.shape)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor along its first axis, in its stored dtype (only these bytes are read)."""
        if not self.shape or not 0 <= start <= stop <= self.shape[0]:
            raise ReferenceModelError(f"{self.key} {list(self.shape)} has no rows {start}:{stop}")
        row = math.prod(self.shape[1:])
        return self._read(start * row, (stop - start) * row).reshape(stop - start, *self.shape[1:])

    def _read(self, first: int, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=self.dtype)
        size = self.dtype.itemsize
        with open(self.file, "rb") as f:
            f.seek(self.offset + first * size)
            raw = np.fromfile(f, dtype=np.uint8, count=count * size)
        if raw.size != count * size:
            raise ReferenceModelError(f"{self.file.name} ends inside {self.key}")
        return torch.from_numpy(raw).view(self.dtype)


def index_safetensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, from its header (no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ReferenceModelError(f"cannot read the safetensors header of {path}: {exc}") from exc
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ReferenceModelError(f"{path.name}: {key} has dtype {entry['dtype']}, not a dtype of this model")
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ReferenceModelError(f"{path.name}: {key} is not stored as {entry['dtype']} {list(shape)}")
        tensors[key] = StoredTensor(path, key, dtype, shape, 8 + length + begin)
    return tensors


def index_safetensors_dir(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a folder's shards: those its weight index names, else every *.safetensors file in it."""
    index = folder / WEIGHT_INDEX
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ReferenceModelError(f"no safetensors files in {folder}")
    tensors: dict[str, StoredTensor] = {}
    for name in files:
        shard = index_safetensors(folder / name)
        repeated = tensors.keys() & shard.keys()
        if repeated:
            raise ReferenceModelError(f"{folder / name} repeats tensors of another shard: {sorted(repeated)[:5]}")
        tensors.update(shard)
    return tensors


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReferenceModelError(f"missing {path}")
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter as stored in the checkpoint: its (A, B) pairs on disk, or in memory once `loaded`."""

    name: str
    r: int
    lora_alpha: float
    scaling: float
    weights: dict[str, tuple[Any, Any]]  # module path -> (A [r, in], B [out, r]): StoredTensor, or torch.Tensor

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of `module`, in their stored dtype."""
        a, b = self.weights[module]
        return (a, b) if isinstance(a, torch.Tensor) else (a.load(), b.load())

    def loaded(self) -> LoraAdapter:
        """This adapter with every pair read into memory."""
        return replace(self, weights={module: self.pair(module) for module in self.weights})


def merge_lora(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32, a new tensor (``base`` is left as it is). Summed in fp32 it differs from a
    float64 sum by ~1e-6 of the weights' scale and holds nothing but its result (a float64 sum of a full-size gate_up
    projection took 3x the time, and its temporaries)."""
    return torch.addmm(base.float(), b.float(), a.float(), alpha=scaling)


def split_original(
    tensors: Mapping[str, StoredTensor],
) -> tuple[dict[str, StoredTensor], dict[str, dict[str, dict[str, StoredTensor]]]]:
    """-> (native-named base weights, {adapter: {module path: {"A": ..., "B": ...}}})."""
    base: dict[str, StoredTensor] = {}
    lora: dict[str, dict[str, dict[str, StoredTensor]]] = {}
    for key, tensor in tensors.items():
        match = ORIGINAL_LORA_KEY.match(key)
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


def lora_pairs(
    adapter: str, sides: Mapping[str, Mapping[str, StoredTensor]]
) -> dict[str, tuple[StoredTensor, StoredTensor]]:
    pairs = {}
    for module, ab in sorted(sides.items()):
        if set(ab) != {"A", "B"}:
            raise ReferenceModelError(f"{adapter} LoRA for {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise ReferenceModelError(f"{adapter} LoRA for {module}: A {list(a.shape)} and B {list(b.shape)} disagree")
        pairs[module] = (a, b)
    return pairs


def read_peft_adapter(folder: Path, name: str) -> LoraAdapter:
    conf = read_json(folder / "adapter_config.json")
    if conf.get("peft_type", "LORA") != "LORA":
        raise ReferenceModelError(f"{folder} is not a LoRA adapter (peft_type {conf.get('peft_type')!r})")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise ReferenceModelError(f"{folder}: per-module rank/alpha patterns are not supported")
    r, alpha = int(conf["r"]), float(conf["lora_alpha"])
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ReferenceModelError(f"no adapter weights (*.safetensors) in {folder}")
    sides: dict[str, dict[str, StoredTensor]] = {}
    for path in files:
        for key, tensor in index_safetensors(path).items():
            match = PEFT_LORA_KEY.search(key)
            if not match:
                raise ReferenceModelError(f"{path.name}: tensor {key} is not a LoRA A/B of a text decoder projection")
            module, side = match.groups()
            sides.setdefault(module, {})[side] = tensor
    return LoraAdapter(name, r, alpha, scaling, lora_pairs(name, sides))


@dataclass(frozen=True)
class Checkpoint:
    config: Phi4MultimodalConfig  # on eager attention (sdpa makes the native SigLIP causal; the original is not)
    tensors: dict[str, StoredTensor]  # native name -> tensor on disk, LoRA excluded
    adapters: dict[str, LoraAdapter]
    source_format: str  # "original" or "native"

    def check(self, model: torch.nn.Module) -> None:
        """The tensors are the native `model`'s, name for name and shape for shape (a tied lm_head may be absent),
        and every adapter pair fits the projection it adapts. `model` may live on the meta device."""
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        if self.config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
            if "lm_head.weight" in self.tensors:
                expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
        missing = sorted(expected.keys() - self.tensors.keys())
        unexpected = sorted(self.tensors.keys() - expected.keys())
        if missing or unexpected:
            raise ReferenceModelError(
                f"checkpoint does not match the native model: {len(missing)} missing {missing[:8]}, "
                f"{len(unexpected)} unexpected {unexpected[:8]}"
            )
        misshapen = [f"{name} {list(t.shape)} (native {list(expected[name])})"
                     for name, t in self.tensors.items() if t.shape != expected[name]]
        if misshapen:
            raise ReferenceModelError(f"checkpoint tensors of the wrong shape: {', '.join(misshapen[:5])}")
        for adapter in self.adapters.values():
            stray = [m for m in adapter.weights if not LORA_TARGET.fullmatch(m) or f"{m}.weight" not in expected]
            if stray:
                raise ReferenceModelError(f"{adapter.name} LoRA targets unknown modules: {sorted(stray)[:5]}")
            for module, (a, b) in adapter.weights.items():
                if (b.shape[0], a.shape[1]) != expected[f"{module}.weight"]:
                    raise ReferenceModelError(f"{adapter.name} LoRA for {module}: B@A {[b.shape[0], a.shape[1]]} "
                                              f"vs weight {list(expected[module + '.weight'])}")


def open_checkpoint(folder: Path) -> Checkpoint:
    """The checkpoint in `folder`: its native config, every tensor under its native name and its LoRA adapters, all
    left on disk."""
    raw = read_json(folder / "config.json")
    model_type = raw.get("model_type")
    tensors = index_safetensors_dir(folder)
    if model_type == ORIGINAL_MODEL_TYPE:
        state, lora_sides = split_original(tensors)
        adapters = {}
        for name, sides in lora_sides.items():
            block = raw.get(f"{name}_lora")
            if not block:
                raise ReferenceModelError(f"checkpoint has {name} LoRA tensors but config.json has no {name}_lora")
            r, alpha = int(block["r"]), float(block["lora_alpha"])
            adapters[name] = LoraAdapter(name, r, alpha, alpha / r, lora_pairs(name, sides))
        config, source_format = native_config_from_original(raw), "original"
    elif model_type == NATIVE_MODEL_TYPE:
        state = tensors
        adapters = {name: read_peft_adapter(folder / sub, name)
                    for name, sub in NATIVE_ADAPTER_DIRS.items() if (folder / sub).is_dir()}
        config, source_format = native_config_from_dict(raw), "native"
    else:
        raise ReferenceModelError(
            f"{folder}: model_type {model_type!r} is neither {ORIGINAL_MODEL_TYPE!r} nor {NATIVE_MODEL_TYPE!r}"
        )
    config._attn_implementation = "eager"
    return Checkpoint(config, state, adapters, source_format)
