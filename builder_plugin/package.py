"""Writing a package: shared external data and the all-or-nothing output folder (file names: `builder_plugin.layout`).

Every graph's initializers go to an external data file, one tensor at a time (lazy tensors are computed, written and
released), and a tensor whose bytes are already in that file is not written again — so the decoder variants, which
share their base weights, store them once, and the embedding's view of the lm_head's blocks (`StoredView`) reads the
decoder's bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir
from tqdm import tqdm

from builder_plugin.errors import OutputError
from builder_plugin.quant.weights import QuantizedPiece, stored_tensor, work_estimate

INLINE_LIMIT_BYTES = 1024  # smaller initializers (shape constants, scalars) stay inside the .onnx file
_ALIGNMENT = 64


@dataclass
class ExternalDataStore:
    """An append-only external data file that writes identical tensors once."""

    path: Path
    written_bytes: int = 0
    reused_bytes: int = 0
    _index: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    _by_object: dict[int, tuple[ir.TensorProtocol, tuple[int, int]]] = field(default_factory=dict)
    _size: int = 0

    def put(self, tensor: ir.TensorProtocol) -> tuple[int, int]:
        """Append `tensor` unless the same bytes (same dtype and shape) are stored already; returns (offset, length).

        A tensor object already written (shared by several graphs) is not even computed again, and a view is its
        base's bytes."""
        tensor = stored_tensor(tensor)
        seen = self._by_object.get(id(tensor))
        if seen is not None:
            self.reused_bytes += seen[1][1]
            return seen[1]
        location = self._put_bytes(tensor)
        if isinstance(tensor, ir.LazyTensor):  # cheap to hold (no data); holding it keeps its id from being reused
            self._by_object[id(tensor)] = (tensor, location)
        return location

    def has(self, tensor: ir.TensorProtocol) -> bool:
        """Whether this very tensor object (a view: its base) is written already (so putting it again costs
        nothing)."""
        return id(stored_tensor(tensor)) in self._by_object

    def _put_bytes(self, tensor: ir.TensorProtocol) -> tuple[int, int]:
        data = tensor.tobytes()
        key = (tensor.dtype, tuple(tensor.shape), hashlib.blake2b(data, digest_size=20).digest())
        found = self._index.get(key)
        if found is not None:
            self.reused_bytes += len(data)
            return found
        offset = -(-self._size // _ALIGNMENT) * _ALIGNMENT
        with open(self.path, "ab") as f:
            if offset > self._size:
                f.write(b"\0" * (offset - self._size))
            f.write(data)
        self._size = offset + len(data)
        self.written_bytes += len(data)
        self._index[key] = (offset, len(data))
        return offset, len(data)


def initializers(graph: ir.Graph) -> Iterator[ir.Value]:
    """The initializers of `graph` and of every graph inside it (If branches and loop bodies hold some)."""
    yield from graph.initializers.values()
    for subgraph in graph.subgraphs():  # every nested graph once
        yield from subgraph.initializers.values()


class PackageWriter:
    """Saves graphs into a folder, with one ExternalDataStore per data file."""

    def __init__(self, folder: Path, progress: bool = True) -> None:
        self.folder = folder
        self.progress = progress
        self.stores: dict[str, ExternalDataStore] = {}
        self.files: list[Path] = []

    def store(self, data_file: str) -> ExternalDataStore:
        if data_file not in self.stores:
            self.stores[data_file] = ExternalDataStore(self.folder / data_file)
            self.files.append(self.folder / data_file)
        return self.stores[data_file]

    def save(self, model: ir.Model, filename: str, data_file: str) -> Path:
        store = self.store(data_file)
        values = [v for v in initializers(model.graph) if v.const_value is not None]
        large = [v for v in values if v.const_value.nbytes > INLINE_LIMIT_BYTES]
        # disable=None: a bar on a terminal only (into a log or a pipe it would write a \r-line per update).
        # The bar advances by each tensor's estimated time (quantizing it included), so its time left is an estimate
        # of the time; it counts the weights.
        work = [0.0 if store.has(v.const_value) else work_estimate(v.const_value) for v in large]
        quantizing = any(isinstance(v.const_value, QuantizedPiece) for v in large)
        desc = f"{filename}: {'quantizing and writing' if quantizing else 'writing'}"
        with tqdm(total=sum(work), desc=desc, leave=False, disable=None if self.progress else True, smoothing=0.05,
                  bar_format="{desc} {percentage:3.0f}%|{bar:20}| {elapsed} elapsed, {remaining} left{postfix}",
                  ) as bar:
            for done, (value, cost) in enumerate(zip(large, work, strict=True)):
                # e.g. 12/345 weights, model.layers.12.attn.qkv_proj.MatMul.weight_Q4
                bar.set_postfix_str(f"{done}/{len(large)} weights, {value.name}", refresh=False)
                tensor = value.const_value
                offset, length = store.put(tensor)
                value.const_value = ir.ExternalTensor(
                    location=data_file, offset=offset, length=length, dtype=tensor.dtype, shape=tensor.shape,
                    name=value.name, base_dir=self.folder,
                )
                bar.update(cost)
        path = self.folder / filename
        ir.save(model, path)
        self.files.append(path)
        return path


class OutputFolder:
    """Build into a hidden sibling folder and move it into place only on success.

    A failed or interrupted build removes the partial folder and leaves any existing output untouched; an existing
    non-empty output is replaced only with `overwrite`.
    """

    def __init__(self, final: Path, overwrite: bool) -> None:
        self.final = final.resolve()
        self.overwrite = overwrite
        self.staging = self.final.parent / f".{self.final.name}.partial-{os.getpid()}"
        self._committed = False

    def check(self) -> None:
        if self.final.exists() and not self.final.is_dir():
            raise OutputError(f"output path {self.final} exists and is not a folder")
        if self.final.is_dir() and any(self.final.iterdir()) and not self.overwrite:
            raise OutputError(f"output folder {self.final} is not empty (use --overwrite to replace it)")

    def __enter__(self) -> Path:
        self.check()
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            if self.staging.exists():
                shutil.rmtree(self.staging)
            self.staging.mkdir()
        except OSError as exc:
            raise OutputError(f"cannot create the output folder next to {self.final}: {exc}") from exc
        return self.staging

    def commit(self) -> None:
        backup = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
        if self.final.exists():
            os.replace(self.final, backup)
        os.replace(self.staging, self.final)
        self._committed = True
        if backup.exists():
            shutil.rmtree(backup, ignore_errors=True)

    def __exit__(self, *exc_info: object) -> None:
        if not self._committed:
            shutil.rmtree(self.staging, ignore_errors=True)
