"""Checkpoint reading: every tensor of a checkpoint folder (either layout) under its native name, and the LoRA
adapters (inline in the original layout, PEFT folders in the native one), read on their own."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import Phi4MultimodalConfig

from builder_plugin.reference.errors import ReferenceModelError
from builder_plugin.reference.keys import ORIGINAL_LORA_KEY, PEFT_LORA_KEY, rename_original_key
from builder_plugin.reference.native_config import (
    NATIVE_MODEL_TYPE,
    ORIGINAL_MODEL_TYPE,
    native_config_from_dict,
    native_config_from_original,
)

NATIVE_ADAPTER_DIRS = {"vision": "vision-lora", "speech": "speech-lora"}


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter as stored in the checkpoint (tensors in their stored dtype)."""

    name: str
    r: int
    lora_alpha: float
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A [r, in], B [out, r])


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReferenceModelError(f"missing {path}")
    return json.loads(path.read_text(encoding="utf-8"))


def read_safetensors_dir(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
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


def split_original(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, dict[str, torch.Tensor]]]]:
    """-> (native-named base weights, {adapter: {module path: {"A": ..., "B": ...}}})."""
    base: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
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
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for path in files:
        for key, tensor in load_file(str(path)).items():
            match = PEFT_LORA_KEY.search(key)
            if not match:
                raise ReferenceModelError(f"{path.name}: tensor {key} is not a LoRA A/B of a text decoder projection")
            module, side = match.groups()
            sides.setdefault(module, {})[side] = tensor
    return LoraAdapter(name, r, alpha, scaling, lora_pairs(name, sides))


@dataclass(frozen=True)
class Checkpoint:
    config: Phi4MultimodalConfig
    state: dict[str, torch.Tensor]  # native name -> tensor in its stored dtype, LoRA excluded
    adapters: dict[str, LoraAdapter]
    source_format: str  # "original" or "native"


def read_checkpoint(folder: Path) -> Checkpoint:
    """Every tensor of the checkpoint in `folder` under its native name, its native config and its LoRA adapters."""
    raw = read_json(folder / "config.json")
    model_type = raw.get("model_type")
    tensors = read_safetensors_dir(folder)
    if model_type == ORIGINAL_MODEL_TYPE:
        state, lora_sides = split_original(tensors)
        adapters = {}
        for name, sides in lora_sides.items():
            block = raw.get(f"{name}_lora")
            if not block:
                raise ReferenceModelError(f"checkpoint has {name} LoRA tensors but config.json has no {name}_lora")
            r, alpha = int(block["r"]), float(block["lora_alpha"])
            adapters[name] = LoraAdapter(name, r, alpha, alpha / r, lora_pairs(name, sides))
        return Checkpoint(native_config_from_original(raw), state, adapters, "original")
    if model_type == NATIVE_MODEL_TYPE:
        adapters = {name: read_peft_adapter(folder / sub, name)
                    for name, sub in NATIVE_ADAPTER_DIRS.items() if (folder / sub).is_dir()}
        return Checkpoint(native_config_from_dict(raw), dict(tensors), adapters, "native")
    raise ReferenceModelError(
        f"{folder}: model_type {model_type!r} is neither {ORIGINAL_MODEL_TYPE!r} nor {NATIVE_MODEL_TYPE!r}"
    )
