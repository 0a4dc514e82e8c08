"""The block quantization routines of onnxruntime's MatMulNBitsQuantizer, one per method, on a weight's column slab.

Each produces the very bytes onnxruntime's `onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`
gives for its algorithm (`QuantScheme.method`), with the same padding, layouts and names:

- "default" (`algo_config=None` there, DefaultWeightOnlyQuantConfig): the MLAS kernels `quantize_matmul_4bits` /
  `quantize_matmul_8bits`; names `W_Q4` / `W_Q8`, `W_scales`, `W_zero_points` (asymmetric only).
- "rtn" (RTNWeightOnlyQuantConfig) and "k_quant" (KQuantWeightOnlyQuantConfig): neural_compressor's `quant_tensor` /
  `quant_tensor_k_quant_cuda` (which runs its CPU version without CUDA) and the packing of
  `make_matmul_weight_only_node`; names `W_Q4G32`, `W_scale`, `W_zp` (k_quant always has zero points). Like
  `rtn_quantize`, these two quantize main-graph MatMuls only.

k_quant's search runs in `builder_plugin.quant.k_quant`, a few thousand blocks at a time on `jobs` threads, with the
reference's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from builder_plugin.quant.k_quant import BlockPool, k_quant_weight
from builder_plugin.quant_choices import METHODS, QUANT_TYPE_BITS

BITS_CHOICES = tuple(QUANT_TYPE_BITS.values())


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


@dataclass(frozen=True)
class BlockLayout:
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


def mlas_blocks(weight: np.ndarray, rows: int, lay: BlockLayout, symmetric: bool, packed: np.ndarray,
                scales: np.ndarray, zero_points: np.ndarray) -> None:
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


def neural_compressor_blocks(weight: np.ndarray, lay: BlockLayout, scheme: QuantScheme, packed: np.ndarray,
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
