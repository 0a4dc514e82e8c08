"""Lazy decoder weights: checkpoint row ranges, LoRA branches, and the MatMul initializers made from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.dtypes import DTYPES, onnx_dtype
from builder_plugin.quant.weights import ColumnChunkedTensor


@dataclass(frozen=True)
class RowRange:
    """Rows [start, stop) of a 2-D checkpoint tensor [out, in]."""

    ref: TensorRef
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def sub(self, start: int, stop: int) -> RowRange:
        if not 0 <= start <= stop <= self.count:
            raise ValueError(f"rows {start}:{stop} outside {self.count}")
        return RowRange(self.ref, self.start + start, self.start + stop)

    def load(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.count if stop is None else stop
        return self.ref.load_rows(self.start + start, self.start + stop)


@dataclass(frozen=True)
class LoraBranch:
    """One adapter on one projection: y += (x·Aᵀ)·(scaling·B[rows])ᵀ. `a_owner` names the source projection whose
    A MatMul this branch shares (packed qkv / gate_up keep one A for all their row slices)."""

    adapter: str
    a: TensorRef  # [r, in]
    b: RowRange  # [out rows, r]
    scaling: float
    a_owner: str


class WeightTensors:
    """Lazy initializers for MatMul weights, one object per distinct (source, transform, dtype) of a build.

    Every tensor is a `ColumnChunkedTensor` [in, out] (the MatMul B layout), so quantization can stream it in column
    slabs. Column c of a projection is row c of the checkpoint tensor, so a slab is read with a row slice.
    """

    SHARE_MAX_BYTES = 64 << 20  # builder-made initializers (norms, DML rope caches) up to this size are shared

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._cache: dict[tuple[Any, ...], ColumnChunkedTensor] = {}
        self._small: dict[str, ir.TensorProtocol] = {}

    def share(self, tensor: ir.TensorProtocol) -> ir.TensorProtocol:
        """The first-seen object for an initializer the GenAI builder makes itself (norm weights), when an earlier
        variant made the same name with the same bytes; so every variant references one object per weight."""
        if tensor.nbytes > self.SHARE_MAX_BYTES or not tensor.name:
            return tensor
        seen = self._small.get(tensor.name)
        if (seen is not None and seen.dtype == tensor.dtype and tuple(seen.shape) == tuple(tensor.shape)
                and seen.tobytes() == tensor.tobytes()):
            return seen
        self._small.setdefault(tensor.name, tensor)
        return tensor

    def _tensor(self, key: tuple[Any, ...], name: str, shape: tuple[int, int],
                rows: Callable[[int, int], torch.Tensor], content: tuple | None = None) -> ColumnChunkedTensor:
        key = (*key, name)
        tensor = self._cache.get(key)
        if tensor is None:
            torch_dtype = DTYPES[self.dtype].torch

            def columns(c0: int, c1: int) -> np.ndarray:
                return rows(c0, c1).to(torch_dtype).T.contiguous().numpy()

            tensor = ColumnChunkedTensor(columns, onnx_dtype(self.dtype), shape, name, key=content)
            self._cache[key] = tensor
        return tensor

    def base(self, weight: RowRange, name: str) -> ColumnChunkedTensor:
        k = weight.ref.shape[1]
        return self._tensor(("base", weight), name, (k, weight.count), weight.load,
                            content=weight.ref.columns_key(weight.start, weight.stop, self.dtype))

    def merged(self, weight: RowRange, branch: LoraBranch, name: str) -> ColumnChunkedTensor:
        k = weight.ref.shape[1]

        def rows(c0: int, c1: int) -> torch.Tensor:
            # W + s·B@A in fp32 from the stored (bf16) tensors; never rounded back to the stored dtype.
            a = branch.a.load_rows(0, branch.a.shape[0])
            return weight.load(c0, c1) + branch.scaling * (branch.b.load(c0, c1) @ a)

        return self._tensor(("merged", weight, branch), name, (k, weight.count), rows)

    def lora_a(self, branch: LoraBranch, name: str) -> ColumnChunkedTensor:
        r, k = branch.a.shape
        return self._tensor(("lora_a", branch.a), name, (k, r), lambda c0, c1: branch.a.load_rows(c0, c1))

    def lora_b(self, branch: LoraBranch, name: str) -> ColumnChunkedTensor:
        r = branch.a.shape[0]
        # scaling is folded into a fresh copy of B at load time; the checkpoint tensor is never touched
        return self._tensor(("lora_b", branch.b, branch.scaling), name, (r, branch.b.count),
                            lambda c0, c1: branch.b.load(c0, c1) * branch.scaling)
