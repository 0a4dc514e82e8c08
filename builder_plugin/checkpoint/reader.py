"""Lazy, memory-mapped access to the tensors of a checkpoint folder.

Nothing is read until a tensor is asked for, and then only that tensor. Shards are validated up front (present,
readable header, every indexed tensor really in its shard) so a broken download fails before any work starts.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from builder_plugin.checkpoint.files import ADAPTER_WEIGHTS_FILE, INDEX_FILE, SINGLE_WEIGHTS_FILE, weight_map
from builder_plugin.config import NATIVE_ADAPTER_DIRS, CheckpointFormat
from builder_plugin.dtypes import BY_SAFETENSORS
from builder_plugin.errors import CheckpointError

# safetensors dtype code -> torch dtype
_TORCH_DTYPES = {code: row.torch for code, row in BY_SAFETENSORS.items()}


def _version(path: Path) -> tuple[int, int, int]:
    """What tells one version of a file from another at the same path (a rewritten file, a reused temporary folder):
    the caches below are keyed by it as well as by the path."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise CheckpointError(f"cannot read weights file {path.name}: {exc}") from exc
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _open(path: Path):
    return _open_version(path, _version(path))


@lru_cache(maxsize=64)
def _open_version(path: Path, version: tuple[int, int, int]):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises bare Exceptions for broken files
        raise CheckpointError(f"cannot read weights file {path.name}: {exc}") from exc


@dataclass(frozen=True)
class TensorRef:
    """A tensor in a safetensors file, read on demand."""

    name: str  # the name inside the file
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code, e.g. "BF16"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _TORCH_DTYPES[self.dtype].itemsize

    def load(self, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The tensor, converted to `dtype` (bf16 -> fp32 is exact); None keeps the stored dtype.

        Read with one positioned read rather than through safetensors' memory map: every mapped page a build touches
        stays resident, and counted in the process's RSS, while the file is open, so a full-size build would appear
        to hold gigabytes of checkpoint it has long converted and written.
        """
        stored = _TORCH_DTYPES.get(self.dtype)
        if stored is None:  # a dtype torch has no plain equivalent for: let safetensors decode it
            try:
                tensor = _open(self.file).get_tensor(self.name)
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"cannot read tensor {self.name} from {self.file.name}: {exc}") from exc
        else:
            tensor = self._read(0, self.numel * stored.itemsize, stored).reshape(self.shape)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def columns_key(self, start: int, stop: int, dtype: str) -> tuple:
        """Identity of the weight whose columns are rows [start, stop) of this tensor in `dtype` (a MatMul B made
        from it), for `ColumnChunkedTensor.key`: graphs that build it separately then share one quantized copy."""
        return ("columns", self, start, stop, dtype)

    def load_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor, converted to `dtype` (one positioned read: only these rows are ever
        resident)."""
        if self.dtype not in _TORCH_DTYPES or len(self.shape) != 2 or not 0 <= start <= stop <= self.shape[0]:
            raise CheckpointError(f"cannot read rows {start}:{stop} of {self.name} ({self.dtype} {self.shape})")
        stored = _TORCH_DTYPES[self.dtype]
        row_bytes = self.shape[1] * stored.itemsize
        rows = self._read(start * row_bytes, (stop - start) * row_bytes, stored)
        return rows.reshape(stop - start, self.shape[1]).to(dtype)

    def _read(self, offset: int, length: int, stored: torch.dtype) -> torch.Tensor:
        """`length` bytes from `offset` within this tensor's data, as a flat tensor of the stored dtype."""
        data_start, offsets = _safetensors_layout(self.file)
        begin, end = offsets.get(self.name, (0, -1))
        if end - begin != self.numel * stored.itemsize:
            raise CheckpointError(f"{self.file.name}: {self.name} is not stored as a {self.dtype} {self.shape} tensor")
        if length == 0:
            return torch.empty(0, dtype=stored)
        buffer = bytearray(length)
        view, filled = memoryview(buffer), 0
        try:
            with open(self.file, "rb", buffering=0) as f:
                f.seek(data_start + begin + offset)
                while filled < length:  # one read returns at most ~2 GiB on Linux
                    count = f.readinto(view[filled:])
                    if not count:
                        raise CheckpointError(f"{self.file.name} is truncated (reading {self.name})")
                    filled += count
        except OSError as exc:
            raise CheckpointError(f"cannot read tensor {self.name} from {self.file.name}: {exc}") from exc
        return torch.frombuffer(buffer, dtype=stored)


def _safetensors_layout(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(offset of the data section, {tensor: (begin, end) within it}) from a safetensors header."""
    return _layout_version(path, _version(path))


@lru_cache(maxsize=64)
def _layout_version(path: Path, version: tuple[int, int, int]) -> tuple[int, dict[str, tuple[int, int]]]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"cannot read the safetensors header of {path.name}: {exc}") from exc
    return 8 + size, {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


class CheckpointReader(Mapping[str, TensorRef]):
    """All tensors of a checkpoint folder by name.

    For the native layout the PEFT adapter folders are read too; their tensors are named ``<folder>/<key>``
    (e.g. ``vision-lora/base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight``).
    """

    def __init__(self, model_dir: str | Path, source_format: CheckpointFormat = "original") -> None:
        self.model_dir = Path(model_dir)
        self._tensors: dict[str, TensorRef] = {}
        for name, ref in _index_folder(self.model_dir).items():
            self._tensors[name] = ref
        if source_format == "native":
            for folder in NATIVE_ADAPTER_DIRS.values():
                adapter = self.model_dir / folder / ADAPTER_WEIGHTS_FILE
                if adapter.is_file():
                    for name, ref in _index_file(adapter).items():
                        self._tensors[f"{folder}/{name}"] = ref

    def __getitem__(self, name: str) -> TensorRef:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def total_bytes(self) -> int:
        return sum(ref.nbytes for ref in self._tensors.values())


def _index_folder(model_dir: Path) -> dict[str, TensorRef]:
    index = weight_map(model_dir)
    if index is not None:
        shards = sorted(set(index.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CheckpointError(f"missing weight shard(s) listed in {INDEX_FILE}: {', '.join(missing)}")
        found: dict[str, TensorRef] = {}
        for shard in shards:
            found.update(_index_file(model_dir / shard))
        absent = [name for name in index if name not in found]
        if absent:
            raise CheckpointError(
                f"{len(absent)} tensor(s) listed in {INDEX_FILE} are not in their shard, e.g. {absent[0]} "
                f"(expected in {index[absent[0]]})"
            )
        return found
    single = model_dir / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return _index_file(single)
    if not any(model_dir.glob("*.safetensors")):
        raise CheckpointError(f"no safetensors weights in {model_dir} (expected {INDEX_FILE} or {SINGLE_WEIGHTS_FILE})")
    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        found.update(_index_file(path))
    return found


def _index_file(path: Path) -> dict[str, TensorRef]:
    handle = _open(path)
    refs = {}
    for name in handle.keys():
        piece = handle.get_slice(name)
        refs[name] = TensorRef(name=name, file=path, shape=tuple(piece.get_shape()), dtype=piece.get_dtype())
    return refs
