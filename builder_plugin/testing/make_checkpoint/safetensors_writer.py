"""The streaming safetensors writer: header first, then every tensor's blocks, split over shards of about equal size."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from builder_plugin.testing.make_checkpoint.presets import positive
from builder_plugin.testing.make_checkpoint.tensors import DTYPES, PlannedTensor, tensor_blocks

DEFAULT_SHARD_BYTES = 3 * 1024**3 // 2


def write_safetensors(path: Path, entries: list[tuple[str, PlannedTensor]], seed: int, dtype: str) -> int:
    """Stream `entries` (key, tensor) into one safetensors file; returns the data bytes written."""
    torch_dtype, dtype_tag = DTYPES[dtype]
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
                f.write(tensor_bytes(block))
    return offset


def tensor_bytes(block: torch.Tensor) -> memoryview:
    # bf16 has no numpy dtype: reinterpret the bits as int16 first (little-endian, as safetensors wants).
    if block.dtype == torch.bfloat16:
        block = block.view(torch.int16)
    return memoryview(block.numpy()).cast("B")


def split_shards(
    entries: list[tuple[str, PlannedTensor]], itemsize: int, num_shards: int | None
) -> list[list[tuple[str, PlannedTensor]]]:
    """Contiguous split into shards of about equal bytes; no shard is left empty."""
    sizes = [planned.numel * itemsize for _, planned in entries]
    total = sum(sizes)
    if num_shards is None:
        num_shards = max(1, math.ceil(total / DEFAULT_SHARD_BYTES))
    num_shards = min(positive(num_shards, "shards"), len(entries))
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


def write_sharded(out_dir: Path, entries: list[tuple[str, PlannedTensor]], seed: int, dtype: str,
                   num_shards: int | None) -> tuple[int, int]:  # fmt: skip
    itemsize = torch.empty((), dtype=DTYPES[dtype][0]).element_size()
    shards = split_shards(entries, itemsize, num_shards)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out_dir / filename, shard, seed, dtype)
        weight_map.update({key: filename for key, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out_dir / "model.safetensors.index.json", index)
    return len(shards), total


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
