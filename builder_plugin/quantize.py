"""Weight-only quantization of MatMul weights (MatMulNBits, 4 or 8 bits), computed lazily at save time.

`quantize_matmuls` rewrites the graph only: every MatMul whose B input is a 2-D float initializer [K, N] becomes a
com.microsoft MatMulNBits whose packed weights, scales and zero points are lazy initializers. The numbers are produced
when the model is saved, one weight at a time, by the very routines onnxruntime's
`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` runs for each algorithm (`QuantScheme.method`),
with the same padding, layouts and names, so the result is byte-identical to that quantizer's:

- "default" (`algo_config=None` there, DefaultWeightOnlyQuantConfig): the MLAS kernels `quantize_matmul_4bits` /
  `quantize_matmul_8bits`; names `W_Q4` / `W_Q8`, `W_scales`, `W_zero_points` (asymmetric only).
- "rtn" (RTNWeightOnlyQuantConfig) and "k_quant" (KQuantWeightOnlyQuantConfig): neural_compressor's `quant_tensor` /
  `quant_tensor_k_quant_cuda` (which runs its CPU version without CUDA) and the packing of
  `make_matmul_weight_only_node`; names `W_Q4G32`, `W_scale`, `W_zp` (k_quant always has zero points). Like
  `rtn_quantize`, these two quantize main-graph MatMuls only.

Nothing here holds the float graph in memory. A weight that is a `ColumnChunkedTensor` is additionally quantized a slab
of output columns at a time (each column's blocks are quantized independently, so the bytes are the same), which
bounds the float working set to one slab instead of one whole [K, N] matrix. k_quant's search runs in
`builder_plugin.k_quant`, a few thousand blocks at a time on `jobs` threads, with the reference's bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from builder_plugin.cpus import available_cpus
from builder_plugin.dtypes import DTYPES, GRAPH_FLOATS
from builder_plugin.extra_options import METHODS
from builder_plugin.graph import MS_DOMAIN
from builder_plugin.k_quant import K_QUANT_COST_PER_VALUE, BlockPool, k_quant_weight

BITS_CHOICES: tuple[int, ...] = (4, 8)
# Float bytes quantized per slab when a weight can be produced column range by column range. k_quant's search keeps
# a transposed copy of the slab besides its per-thread chunks (builder_plugin.k_quant), so its slabs are smaller.
SLAB_BYTES = 64 << 20
K_QUANT_SLAB_BYTES = 32 << 20
# Time to quantize one float value by each method on one thread (k_quant's search is spread over the jobs), in units
# of the time to write one byte: how the build's time-left estimate weighs a weight (measured on full-width weights).
COST_PER_VALUE = {"default": 10.0, "rtn": 14.0, "k_quant": K_QUANT_COST_PER_VALUE}

_QUANTIZABLE = {DTYPES[name].onnx: DTYPES[name].numpy for name in GRAPH_FLOATS}


@dataclass(frozen=True)
class QuantScheme:
    """How one weight is quantized: onnxruntime's algorithm, bits, block size along K and symmetry."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True
    method: str = "default"

    def __post_init__(self) -> None:
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.bits not in BITS_CHOICES:
            raise ValueError(f"bits must be one of {BITS_CHOICES}, got {self.bits}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")

    @property
    def has_zero_points(self) -> bool:
        return self.method == "k_quant" or not self.symmetric

    @property
    def subgraphs(self) -> bool:
        """Whether MatMuls inside If/Loop bodies are quantized (MatMulNBitsQuantizer's default path only)."""
        return self.method == "default"

    def names(self, weight: str) -> dict[str, str]:
        """Initializer names of the quantized pieces of weight `weight`, as the reference quantizer names them."""
        if self.method == "default":
            names = {"packed": f"{weight}_Q{self.bits}", "scales": f"{weight}_scales",
                     "zero_points": f"{weight}_zero_points"}
        else:
            names = {"packed": f"{weight}_Q{self.bits}G{self.block_size}", "scales": f"{weight}_scale",
                     "zero_points": f"{weight}_zp"}
        if not self.has_zero_points:
            del names["zero_points"]
        return names


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


@dataclass(frozen=True)
class _Layout:
    k: int
    n: int
    block_size: int
    bits: int

    @property
    def k_blocks(self) -> int:
        return (self.k + self.block_size - 1) // self.block_size

    @property
    def blob_size(self) -> int:
        return self.block_size * self.bits // 8

    @property
    def zero_point_cols(self) -> int:
        per_byte = 8 // self.bits
        return (self.k_blocks + per_byte - 1) // per_byte


class QuantizedWeight:
    """The quantized form of one float weight, computed on first use and handed out piece by piece.

    One run produces packed weights, scales and zero points together; the pieces are kept only until each has been
    read once, so saving holds at most one quantized weight besides the one being written.
    """

    PIECES = ("packed", "scales", "zero_points")

    def __init__(self, source: ir.TensorProtocol, scheme: QuantScheme, stats: QuantStats | None = None) -> None:
        if source.dtype not in _QUANTIZABLE:
            raise ValueError(f"cannot quantize a {source.dtype} weight")
        k, n = (int(d) for d in source.shape)
        self.source = source
        self.scheme = scheme
        self.stats = stats or QuantStats()
        self.layout = _Layout(k, n, scheme.block_size, scheme.bits)
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
        return np.dtype(_QUANTIZABLE[self.source.dtype])

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
            _mlas(weight, rows, lay, self.scheme.symmetric, packed, scales, zero_points)
        else:
            _neural_compressor(weight, lay, self.scheme, packed, scales, zero_points, self.stats.pool)


def _mlas(weight: np.ndarray, rows: int, lay: _Layout, symmetric: bool, packed: np.ndarray, scales: np.ndarray,
          zero_points: np.ndarray) -> None:
    """DefaultWeightOnlyQuantizer.qbits_block_quant (QOperator) on a column slab."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    kernel = quantize_matmul_8bits if lay.bits == 8 else quantize_matmul_4bits
    cols = weight.shape[1]
    out_packed = np.zeros((cols, lay.k_blocks, lay.blob_size), dtype=np.uint8)
    out_scales = np.zeros((cols, lay.k_blocks), dtype=weight.dtype)
    out_zp = np.zeros((cols, lay.zero_point_cols), dtype=np.uint8)
    kernel(out_packed, weight, out_scales, out_zp, lay.block_size, cols, rows, symmetric)
    packed[...] = out_packed
    scales[...] = out_scales
    zero_points[...] = out_zp


def _neural_compressor(weight: np.ndarray, lay: _Layout, scheme: QuantScheme, packed: np.ndarray,
                       scales: np.ndarray, zero_points: np.ndarray, pool: BlockPool) -> None:
    """rtn_quantize's per-weight step (quant_tensor / k-quant, then make_matmul_weight_only_node's packing) on a
    padded column slab [k_blocks * block_size, cols]. k-quant is `quant_tensor_k_quant_cpu` (what the reference's
    `quant_tensor_k_quant_cuda` runs without CUDA) on the pool's threads."""
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor

    cols = weight.shape[1]
    if scheme.method == "k_quant":
        # With one block per column the reference's reshape keeps the transpose's Fortran order (of the whole weight,
        # which it quantizes at once), and numpy sums such rows in order.
        sequential = lay.k_blocks == 1 and lay.n > 1
        q, scale, zp = k_quant_weight(weight, lay.block_size, scheme.bits, sequential, pool)
    else:
        q, scale, zp = quant_tensor(weight.T, scheme.bits, lay.block_size, "sym" if scheme.symmetric else "asym",
                                    "uint", 1)
    q = q.astype(np.uint8)  # [cols * k_blocks, block_size], one row per block of one column
    if scheme.bits == 4:
        q = q[:, ::2] | q[:, 1::2] << 4
    packed[...] = q.reshape(cols, lay.k_blocks, lay.blob_size)
    scales[...] = scale.astype(weight.dtype).reshape(cols, lay.k_blocks)
    if not scheme.has_zero_points:
        return
    zp = zp.astype(np.uint8).reshape(cols, lay.k_blocks)
    if scheme.bits == 4:
        # Two blocks per byte, low nibble first, each column starting on a new byte (MatMulNBits' layout; the
        # reference packs the flattened [cols * k_blocks] points, which is the same bytes when k_blocks is even and
        # fails to reshape when it is odd). A missing last block reads the reference's filler nibble 8.
        if lay.k_blocks % 2:
            zp = np.concatenate([zp, np.full((cols, 1), 8, np.uint8)], axis=1)
        zp = zp[:, ::2] | zp[:, 1::2] << 4
    zero_points[...] = zp


class QuantizedPiece(ir.LazyTensor):
    """One piece (packed, scales or zero points) of a QuantizedWeight, computed when first read."""

    def __init__(self, weight: QuantizedWeight, piece: str, name: str) -> None:
        super().__init__(lambda: ir.tensor(weight.piece(piece), dtype=weight.dtype(piece), name=name),
                         dtype=weight.dtype(piece), shape=ir.Shape(weight.shape(piece)), name=name)
        self.weight = weight
        self.piece_name = piece


def work_estimate(tensor: ir.TensorProtocol) -> float:
    """What writing `tensor` costs, in units of the time to write one byte: its bytes, plus the whole weight's
    quantization for the first piece of a QuantizedWeight (the one whose reading computes it; packed comes first)."""
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


def is_quantizable_matmul(node: ir.Node) -> bool:
    """A MatMul whose B is a 2-D float (fp32/fp16) initializer."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    weight = node.inputs[1]
    tensor = weight.const_value if weight is not None and weight.is_initializer() else None
    return tensor is not None and tensor.dtype in _QUANTIZABLE and len(tensor.shape) == 2


def wants_prepacking(model: ir.Model) -> bool | None:
    """Whether onnxruntime's CPU prepacking helps the graph: True when it has a MatMulNBits (in If bodies included),
    whose packed form is its fast path; False when its MatMul weights are all float, which prepacking copies into
    packed buffers for a few percent of speed; None when it has neither (e.g. the embedding's lookup)."""
    float_weights = False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "MatMulNBits":
            return True
        float_weights = float_weights or is_quantizable_matmul(node)
    return False if float_weights else None


SchemeChoice = QuantScheme | Callable[[ir.Node], QuantScheme | None]


def quantize_matmuls(model: ir.Model, schemes: SchemeChoice, accuracy_level: int, *,
                     cache: QuantizationCache | None = None) -> ir.Model:
    """Replace every MatMul with a constant 2-D float B [K, N] by MatMulNBits, in place; returns `model`.

    `schemes` is one QuantScheme for every MatMul, or a function of the node giving its scheme, None to keep it float
    (nodes_to_exclude). Node `X` becomes `X_Q4` / `X_Q8`; initializer `W` becomes the pieces `QuantScheme.names` lists
    (uint8 [N, ceil(K/bs), bs*bits/8], scales [N, ceil(K/bs)] in the float dtype of W, zero points) -- the names and
    layouts of onnxruntime's MatMulNBitsQuantizer for that method. A float weight left without users is dropped.
    """
    cache = cache or QuantizationCache()
    choose = schemes if callable(schemes) else (lambda node: schemes)
    targets = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        scheme = choose(node) if is_quantizable_matmul(node) else None
        if scheme is not None and (scheme.subgraphs or node.graph is model.graph):
            targets.append((node, scheme))
    for node, scheme in targets:
        _replace(node, scheme, accuracy_level, cache)
    if targets:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return model


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    existing = graph.initializers.get(name)
    if existing is not None:
        if existing.const_value is not tensor:
            raise ValueError(f"initializer {name} already exists with other content")
        return existing
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _replace(node: ir.Node, scheme: QuantScheme, accuracy_level: int, cache: QuantizationCache) -> None:
    activation, weight = node.inputs
    source = weight.const_value
    owner = weight.graph  # the graph that holds the initializer (may enclose the node's subgraph)
    graph = node.graph
    k, n = (int(d) for d in source.shape)
    names = scheme.names(weight.name)
    tensors = cache.tensors(source, scheme, names)
    inputs = [activation] + [_initializer(owner, names[p], tensors[p]) for p in QuantizedWeight.PIECES if p in names]
    attributes: dict[str, int] = {"K": k, "N": n, "bits": scheme.bits, "block_size": scheme.block_size}
    if accuracy_level:  # omitted when 0, as onnxruntime's quantizer does
        attributes["accuracy_level"] = accuracy_level
    attributes = dict(sorted(attributes.items()))  # onnx.helper.make_node's order, as the reference quantizer emits
    new_node = ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN,
                       name=f"{node.name}_Q{scheme.bits}" if node.name else None, num_outputs=1)
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new_node], list(node.outputs),
                                            list(new_node.outputs))
    if not weight.uses() and not weight.is_graph_output():
        owner.initializers.pop(weight.name)
