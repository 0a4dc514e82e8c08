"""Quantized weights computed lazily at save time: the pieces of a MatMulNBits weight, each a lazy tensor, and the cache
that shares them between graphs.

Nothing here holds the float graph in memory. A weight that is a `ColumnChunkedTensor` is additionally quantized a slab
of output columns at a time (each column's blocks are quantized independently, so the bytes are the same), which
bounds the float working set to one slab instead of one whole [K, N] matrix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx_ir as ir

from builder_plugin.cpus import available_cpus
from builder_plugin.dtypes import DTYPES, GRAPH_FLOATS
from builder_plugin.quant.k_quant import K_QUANT_COST_PER_VALUE, BlockPool
from builder_plugin.quant.kernels import BlockLayout, QuantScheme, mlas_blocks, neural_compressor_blocks

# Float bytes quantized per slab when a weight can be produced column range by column range. k_quant's search keeps
# a transposed copy of the slab besides its per-thread chunks (builder_plugin.quant.k_quant), so its slabs are smaller.
SLAB_BYTES = 64 << 20
K_QUANT_SLAB_BYTES = 32 << 20
# Time to quantize one float value by each method on one thread (k_quant's search is spread over the jobs), in units
# of the time to write one byte: how the build's time-left estimate weighs a weight (measured on full-width weights).
COST_PER_VALUE = {"default": 10.0, "rtn": 14.0, "k_quant": K_QUANT_COST_PER_VALUE}

QUANTIZABLE = {DTYPES[name].onnx: DTYPES[name].numpy for name in GRAPH_FLOATS}


class ColumnChunkedTensor(ir.LazyTensor):
    """A lazily computed 2-D weight [K, N] that can also produce any column range [K, c1 - c0] on its own.

    `columns(c0, c1)` must return a C-contiguous array of the tensor's dtype; the whole tensor is `columns(0, N)`.
    `key`, if given, identifies the content: tensors with equal keys hold the same values (QuantizationCache).
    """

    def __init__(self, columns: Callable[[int, int], np.ndarray], dtype: ir.DataType, shape: tuple[int, int],
                 name: str, key: Hashable | None = None) -> None:
        k, n = shape
        super().__init__(lambda: ir.tensor(columns(0, n), dtype=dtype, name=name), dtype=dtype,
                         shape=ir.Shape((k, n)), name=name)
        self.columns = columns
        self.key = key


class QuantizedWeight:
    """The quantized form of one float weight, computed on first use and handed out piece by piece.

    One run produces packed weights, scales and zero points together; the pieces are kept only until each has been
    read once, so saving holds at most one quantized weight besides the one being written.
    """

    PIECES = ("packed", "scales", "zero_points")

    def __init__(self, source: ir.TensorProtocol, scheme: QuantScheme, stats: QuantStats | None = None) -> None:
        if source.dtype not in QUANTIZABLE:
            raise ValueError(f"cannot quantize a {source.dtype} weight")
        k, n = (int(d) for d in source.shape)
        self.source = source
        self.scheme = scheme
        self.stats = stats or QuantStats()
        self.layout = BlockLayout(k, n, scheme.block_size, scheme.bits)
        self._pending: dict[str, np.ndarray] = {}
        self._done = False
        self._lock = threading.Lock()

    @property
    def cost(self) -> float:
        """What computing this weight costs, in units of the time to write one byte (COST_PER_VALUE)."""
        per_value = COST_PER_VALUE[self.scheme.method]
        if self.scheme.method == "k_quant":
            per_value /= self.stats.jobs
        return self.layout.k * self.layout.n * per_value

    @property
    def float_dtype(self) -> np.dtype:
        return np.dtype(QUANTIZABLE[self.source.dtype])

    def shape(self, piece: str) -> tuple[int, ...]:
        lay = self.layout
        return {
            "packed": (lay.n, lay.k_blocks, lay.blob_size),
            "scales": (lay.n, lay.k_blocks),
            "zero_points": (lay.n, lay.zero_point_cols),
        }[piece]

    def dtype(self, piece: str) -> ir.DataType:
        return self.source.dtype if piece == "scales" else ir.DataType.UINT8

    def piece(self, piece: str) -> np.ndarray:
        with self._lock:
            if piece not in self._pending:
                started = time.perf_counter()
                self._pending = self._compute()
                self.stats.add(time.perf_counter() - started, first=not self._done)
                self._done = True
            array = self._pending.pop(piece)
            if set(self._pending) <= (set() if self.scheme.has_zero_points else {"zero_points"}):
                self._pending = {}
            return array

    def lazy(self, piece: str, name: str) -> QuantizedPiece:
        return QuantizedPiece(self, piece, name)

    def _compute(self) -> dict[str, np.ndarray]:
        lay = self.layout
        packed = np.zeros(self.shape("packed"), dtype=np.uint8)
        scales = np.zeros(self.shape("scales"), dtype=self.float_dtype)
        zero_points = np.zeros(self.shape("zero_points"), dtype=np.uint8)
        if isinstance(self.source, ColumnChunkedTensor):
            budget = K_QUANT_SLAB_BYTES if self.scheme.method == "k_quant" else SLAB_BYTES
            slab = max(1, budget // max(1, lay.k * self.float_dtype.itemsize))
            ranges = [(c0, min(lay.n, c0 + slab)) for c0 in range(0, lay.n, slab)]
            # the next slab is read while this one is quantized: one more slab in memory, no idle threads meanwhile
            upcoming = self.stats.reader.submit(self.source.columns, *ranges[0])
            for i, (c0, c1) in enumerate(ranges):
                weight = upcoming.result()
                if i + 1 < len(ranges):
                    upcoming = self.stats.reader.submit(self.source.columns, *ranges[i + 1])
                self._quantize(weight, packed[c0:c1], scales[c0:c1], zero_points[c0:c1])
                del weight
        else:
            self._quantize(self.source.numpy(), packed, scales, zero_points)
        return {"packed": packed, "scales": scales, "zero_points": zero_points}

    def _quantize(self, weight: np.ndarray, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> None:
        lay = self.layout
        weight = np.ascontiguousarray(weight, dtype=self.float_dtype)
        rows = weight.shape[0]
        if rows != lay.k:
            raise ValueError(f"weight slab has {rows} rows, expected {lay.k}")
        pad = lay.k_blocks * lay.block_size - rows
        if pad:  # as both reference paths: zero rows up to whole blocks (the MLAS kernel is still told the true K)
            weight = np.pad(weight, ((0, pad), (0, 0)), "constant")
        if self.scheme.method == "default":
            mlas_blocks(weight, rows, lay, self.scheme.symmetric, packed, scales, zero_points)
        else:
            neural_compressor_blocks(weight, lay, self.scheme, packed, scales, zero_points, self.stats.pool)


class QuantizedPiece(ir.LazyTensor):
    """One piece (packed, scales or zero points) of a QuantizedWeight, computed when first read."""

    def __init__(self, weight: QuantizedWeight, piece: str, name: str) -> None:
        super().__init__(lambda: ir.tensor(weight.piece(piece), dtype=weight.dtype(piece), name=name),
                         dtype=weight.dtype(piece), shape=ir.Shape(weight.shape(piece)), name=name)
        self.weight = weight
        self.piece_name = piece


class StoredView(ir.LazyTensor):
    """The stored bytes of `base` read under another shape with as many elements. A graph that needs a weight in
    another shape names this instead of reshaping it: onnxruntime folds a Reshape of an initializer into a copy in
    anonymous memory when a session loads, where an initializer it reads as stored stays in the data file's mapped
    pages (shared with every other session reading them). The package writer stores the base's bytes once for both."""

    def __init__(self, base: ir.TensorProtocol, shape: tuple[int, ...]) -> None:
        if int(np.prod(shape)) != int(np.prod(tuple(base.shape))):
            raise ValueError(f"{base.name}: a view of shape {shape} cannot read {tuple(base.shape)}")
        super().__init__(lambda: ir.tensor(base.numpy().reshape(shape), dtype=base.dtype, name=base.name),
                         dtype=base.dtype, shape=ir.Shape(shape), name=base.name)
        self.base = base


def stored_tensor(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    """The tensor whose bytes a writer stores for `tensor`: a view's base, else `tensor` itself."""
    return tensor.base if isinstance(tensor, StoredView) else tensor


def work_estimate(tensor: ir.TensorProtocol) -> float:
    """What writing `tensor` costs, in units of the time to write one byte: its bytes, plus the whole weight's
    quantization for the first piece of a QuantizedWeight (the one whose reading computes it; packed comes first)."""
    tensor = stored_tensor(tensor)
    if isinstance(tensor, QuantizedPiece) and tensor.piece_name == "packed":
        return tensor.nbytes + tensor.weight.cost
    return tensor.nbytes


class QuantStats:
    """The threads k-quant runs on (`jobs`, default: the cores this process may use) and the quantization time."""

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs or available_cpus()
        self.seconds = 0.0
        self.weights = 0
        self._pool: BlockPool | None = None
        self._reader: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> BlockPool:
        if self._pool is None:
            self._pool = BlockPool(self.jobs)
        return self._pool

    @property
    def reader(self) -> ThreadPoolExecutor:
        """The thread that reads a weight's next column slab ahead."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="read-ahead")
        return self._reader

    def add(self, seconds: float, first: bool) -> None:
        self.seconds += seconds
        self.weights += first


class QuantizationCache:
    """Shares the quantized form of a float weight between graphs that reference the same weight object (the decoder
    variants) or a weight with the same `ColumnChunkedTensor.key` (the embedding's copy of the tied lm_head), so each
    weight is quantized once per save and written once by a writer that deduplicates by object. `stats` says how
    long quantizing took and holds the threads k-quant runs on."""

    def __init__(self, jobs: int | None = None) -> None:
        self.stats = QuantStats(jobs)
        self._by_source: dict[tuple[Hashable, QuantScheme], tuple[ir.TensorProtocol, dict[str, ir.LazyTensor]]] = {}

    def tensors(self, source: ir.TensorProtocol, scheme: QuantScheme,
                names: dict[str, str]) -> dict[str, ir.LazyTensor]:
        content = source.key if isinstance(source, ColumnChunkedTensor) else None
        key = (id(source) if content is None else content, scheme)
        entry = self._by_source.get(key)
        if entry is None or any(entry[1][p].name != names[p] for p in names):
            weight = QuantizedWeight(source, scheme, self.stats)
            entry = (source, {piece: weight.lazy(piece, name) for piece, name in names.items()})
            self._by_source[key] = entry  # keeps `source` alive, so its id cannot be reused
        return entry[1]
