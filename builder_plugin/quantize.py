"""Weight-only int4 quantization of MatMul weights (MatMulNBits), computed lazily at save time.

`quantize_matmuls` rewrites the graph only: every MatMul whose B input is a 2-D float initializer [K, N] becomes a
com.microsoft MatMulNBits whose packed weights and scales are lazy initializers. The numbers are produced when the model
is saved, one weight at a time, by `onnxruntime`'s own `quantize_matmul_4bits` kernel, the routine
`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` runs on its default (RTN, QOperator) path, with
the same padding, layouts and names; the result is byte-identical to that quantizer's.

Nothing here holds the float graph in memory. A weight that is a `ColumnChunkedTensor` is additionally quantized a slab
of output columns at a time (each column is quantized independently, so the bytes are the same), which bounds the float
working set to one slab instead of one whole [K, N] matrix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

MS_DOMAIN = "com.microsoft"
BITS = 4
# Float bytes quantized per slab when a weight can be produced column range by column range.
SLAB_BYTES = 64 << 20

_QUANTIZABLE = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16}


class ColumnChunkedTensor(ir.LazyTensor):
    """A lazily computed 2-D weight [K, N] that can also produce any column range [K, c1 - c0] on its own.

    `columns(c0, c1)` must return a C-contiguous array of the tensor's dtype; the whole tensor is `columns(0, N)`.
    """

    def __init__(self, columns: Callable[[int, int], np.ndarray], dtype: ir.DataType, shape: tuple[int, int],
                 name: str) -> None:
        k, n = shape
        super().__init__(lambda: ir.tensor(columns(0, n), dtype=dtype, name=name), dtype=dtype,
                         shape=ir.Shape((k, n)), name=name)
        self.columns = columns


@dataclass(frozen=True)
class _Layout:
    k: int
    n: int
    block_size: int

    @property
    def k_blocks(self) -> int:
        return (self.k + self.block_size - 1) // self.block_size

    @property
    def blob_size(self) -> int:
        return self.block_size * BITS // 8

    @property
    def zero_point_cols(self) -> int:
        return (self.k_blocks + 1) // 2


class QuantizedWeight:
    """The int4 form of one float weight, computed on first use and handed out piece by piece.

    The kernel produces packed weights, scales and zero points together; the pieces are kept only until each has been
    read once, so saving holds at most one quantized weight besides the one being written.
    """

    PIECES = ("packed", "scales", "zero_points")

    def __init__(self, source: ir.TensorProtocol, block_size: int, symmetric: bool) -> None:
        if source.dtype not in _QUANTIZABLE:
            raise ValueError(f"cannot quantize a {source.dtype} weight")
        k, n = (int(d) for d in source.shape)
        self.source = source
        self.symmetric = symmetric
        self.layout = _Layout(k, n, block_size)
        self._pending: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

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
                self._pending = self._compute()
            array = self._pending.pop(piece)
            if set(self._pending) <= ({"zero_points"} if self.symmetric else set()):
                self._pending = {}
            return array

    def lazy(self, piece: str, name: str) -> ir.LazyTensor:
        return ir.LazyTensor(lambda: ir.tensor(self.piece(piece), dtype=self.dtype(piece), name=name),
                             dtype=self.dtype(piece), shape=ir.Shape(self.shape(piece)), name=name)

    def _compute(self) -> dict[str, np.ndarray]:
        lay = self.layout
        packed = np.zeros(self.shape("packed"), dtype=np.uint8)
        scales = np.zeros(self.shape("scales"), dtype=self.float_dtype)
        zero_points = np.zeros(self.shape("zero_points"), dtype=np.uint8)
        if isinstance(self.source, ColumnChunkedTensor):
            slab = max(1, SLAB_BYTES // max(1, lay.k * self.float_dtype.itemsize))
            for c0 in range(0, lay.n, slab):
                c1 = min(lay.n, c0 + slab)
                self._quantize(self.source.columns(c0, c1), packed[c0:c1], scales[c0:c1], zero_points[c0:c1])
        else:
            self._quantize(self.source.numpy(), packed, scales, zero_points)
        return {"packed": packed, "scales": scales, "zero_points": zero_points}

    def _quantize(self, weight: np.ndarray, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> None:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits

        lay = self.layout
        weight = np.ascontiguousarray(weight, dtype=self.float_dtype)
        rows, cols = weight.shape
        if rows != lay.k:
            raise ValueError(f"weight slab has {rows} rows, expected {lay.k}")
        pad = lay.k_blocks * lay.block_size - rows
        if pad:  # as MatMulNBitsQuantizer: zero rows up to whole blocks; the kernel is still told the true K
            weight = np.pad(weight, ((0, pad), (0, 0)), "constant")
        out_packed = np.zeros((cols, lay.k_blocks, lay.blob_size), dtype=np.uint8)
        out_scales = np.zeros((cols, lay.k_blocks), dtype=self.float_dtype)
        out_zp = np.zeros((cols, lay.zero_point_cols), dtype=np.uint8)
        quantize_matmul_4bits(out_packed, weight, out_scales, out_zp, lay.block_size, cols, rows, self.symmetric)
        packed[...] = out_packed
        scales[...] = out_scales
        zero_points[...] = out_zp


class QuantizationCache:
    """Shares the quantized form of a float weight between graphs that reference the same weight object (the decoder
    variants), so each weight is quantized once per save and written once by a writer that deduplicates by object."""

    def __init__(self) -> None:
        self._by_source: dict[tuple[int, int, bool], tuple[ir.TensorProtocol, dict[str, ir.LazyTensor]]] = {}

    def tensors(self, source: ir.TensorProtocol, block_size: int, symmetric: bool,
                names: dict[str, str]) -> dict[str, ir.LazyTensor]:
        key = (id(source), block_size, symmetric)
        entry = self._by_source.get(key)
        if entry is None or any(entry[1][p].name != names[p] for p in names):
            weight = QuantizedWeight(source, block_size, symmetric)
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


def quantize_matmuls(
    model: ir.Model,
    block_size: int,
    accuracy_level: int,
    exclude: Callable[[ir.Node], bool] | None = None,
    symmetric: bool = True,
    *,
    cache: QuantizationCache | None = None,
) -> ir.Model:
    """Replace every MatMul with a constant 2-D float B [K, N] by MatMulNBits (4 bits), in place; returns `model`.

    Node `X` becomes `X_Q4`; initializer `W` becomes `W_Q4` (uint8 [N, ceil(K/bs), bs/2]) and `W_scales` ([N,
    ceil(K/bs)], the float dtype of W), plus `W_zero_points` when asymmetric — the names and layouts of onnxruntime's
    MatMulNBitsQuantizer. MatMuls for which `exclude(node)` is true stay float. A float weight left without users is
    dropped. Subgraphs (If/Loop bodies) are included.
    """
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    cache = cache or QuantizationCache()
    targets = [
        node for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if is_quantizable_matmul(node) and not (exclude is not None and exclude(node))
    ]
    for node in targets:
        _replace(node, block_size, accuracy_level, symmetric, cache)
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


def _replace(node: ir.Node, block_size: int, accuracy_level: int, symmetric: bool, cache: QuantizationCache) -> None:
    activation, weight = node.inputs
    source = weight.const_value
    owner = weight.graph  # the graph that holds the initializer (may enclose the node's subgraph)
    graph = node.graph
    k, n = (int(d) for d in source.shape)
    names = {"packed": f"{weight.name}_Q{BITS}", "scales": f"{weight.name}_scales"}
    if not symmetric:
        names["zero_points"] = f"{weight.name}_zero_points"
    tensors = cache.tensors(source, block_size, symmetric, names)
    inputs = [activation] + [_initializer(owner, names[p], tensors[p]) for p in QuantizedWeight.PIECES if p in names]
    attributes: dict[str, int] = {"K": k, "N": n, "bits": BITS, "block_size": block_size}
    if accuracy_level:  # omitted when 0, as onnxruntime's quantizer does
        attributes["accuracy_level"] = accuracy_level
    attributes = dict(sorted(attributes.items()))  # onnx.helper.make_node's order, as the reference quantizer emits
    new_node = ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN,
                       name=f"{node.name}_Q{BITS}" if node.name else None, num_outputs=1)
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new_node], list(node.outputs),
                                            list(new_node.outputs))
    if not weight.uses() and not weight.is_graph_output():
        owner.initializers.pop(weight.name)
