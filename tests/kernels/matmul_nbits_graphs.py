"""MatMulNBits test material: random quantized weights in onnxruntime's layout, one-node graphs, and the independent
numpy reference of the library's int8 path (A quantized per row and block, B dequantized)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class QuantizedB:
    k: int
    n: int
    bits: int
    block: int
    codes: np.ndarray  # [n, blocks * block] int64, the padding rows included
    scales: np.ndarray  # [n, blocks] float32
    zero_points: np.ndarray | None  # [n, blocks] int64 codes, or None (the default 2^(bits-1))

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block)

    def packed(self) -> np.ndarray:
        """uint8 [n, blocks, block * bits / 8]: codes from the lowest bits up (MatMulNBits' B)."""
        codes = self.codes.astype(np.uint8)
        if self.bits == 4:
            codes = codes[:, ::2] | codes[:, 1::2] << 4
        return codes.reshape(self.n, self.blocks, self.block * self.bits // 8)

    def packed_zero_points(self) -> np.ndarray | None:
        if self.zero_points is None:
            return None
        zp = self.zero_points.astype(np.uint8)
        if self.bits == 4:
            if self.blocks % 2:
                zp = np.concatenate([zp, np.zeros((self.n, 1), np.uint8)], axis=1)
            zp = zp[:, ::2] | zp[:, 1::2] << 4
        return zp

    def centred(self) -> np.ndarray:
        """[n, k] int64 codes minus zero points (the padding rows dropped)."""
        zp = self.zero_points if self.zero_points is not None else np.full((self.n, self.blocks), 1 << (self.bits - 1))
        return (self.codes - np.repeat(zp, self.block, axis=1))[:, :self.k]

    def dequantized(self) -> np.ndarray:
        """[n, k] float64."""
        return self.centred() * np.repeat(self.scales.astype(np.float64), self.block, axis=1)[:, :self.k]


def random_b(rng: np.random.Generator, k: int, n: int, bits: int, block: int, zero_points: bool,
             scales: np.ndarray | None = None) -> QuantizedB:
    blocks = -(-k // block)
    codes = rng.integers(0, 1 << bits, size=(n, blocks * block))
    if scales is None:
        scales = (rng.random((n, blocks)) * 0.02 + 0.001).astype(np.float32)
    zp = rng.integers(0, 1 << bits, size=(n, blocks)) if zero_points else None
    return QuantizedB(k, n, bits, block, codes, np.asarray(scales, np.float32), zp)


def write_graph(path: Path, b: QuantizedB, accuracy_level: int = 4, bias: np.ndarray | None = None,
                scales_2d: bool = False) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    initializers = [numpy_helper.from_array(b.packed(), "B"),
                    numpy_helper.from_array(b.scales if scales_2d else b.scales.reshape(-1), "scales")]
    inputs = ["A", "B", "scales"]
    zp = b.packed_zero_points()
    if zp is not None or bias is not None:
        inputs.append("zero_points" if zp is not None else "")
        if zp is not None:
            initializers.append(numpy_helper.from_array(zp, "zero_points"))
    if bias is not None:
        inputs += ["", "bias"]
        initializers.append(numpy_helper.from_array(bias.astype(np.float32), "bias"))
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", name="mnb", K=b.k, N=b.n,
                            bits=b.bits, block_size=b.block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "mnb", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, b.k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, b.n])],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return path


def quantize_a(a: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The library's activation quantization: per row and block of K, scale = max|a| / 127 (float32), codes =
    round-half-even(a * (127 / max|a|)) (float32 product). Returns (codes [m, k] int64, scales [m, blocks])."""
    m, k = a.shape
    blocks = -(-k // block)
    padded = np.zeros((m, blocks * block), np.float32)
    padded[:, :k] = a
    tops = np.abs(padded.reshape(m, blocks, block)).max(axis=2).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(tops > 0, np.float32(127) / tops, np.float32(0)).astype(np.float32)
    products = (padded.reshape(m, blocks, block) * inverse[:, :, None]).astype(np.float32)
    codes = np.rint(np.clip(products, -127, 127)).astype(np.int64).reshape(m, blocks * block)[:, :k]
    return codes, (tops / np.float32(127)).astype(np.float32)


def block_dots(b: QuantizedB, codes_a: np.ndarray) -> np.ndarray:
    """[m, n, blocks] exact integer sums of (code - zero point) x activation code per block."""
    m = codes_a.shape[0]
    padded_a = np.zeros((m, b.blocks * b.block), np.int64)
    padded_a[:, :b.k] = codes_a
    centred = np.zeros((b.n, b.blocks * b.block), np.int64)
    centred[:, :b.k] = b.centred()
    return np.einsum("mbi,nbi->mnb", padded_a.reshape(m, b.blocks, b.block), centred.reshape(b.n, b.blocks, b.block))


def int8_reference(b: QuantizedB, a: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """Y of the int8 path in float64: exact block sums, each times its two scales."""
    codes_a, scales_a = quantize_a(a, b.block)
    dots = block_dots(b, codes_a).astype(np.float64)
    y = np.einsum("mnb,mb,nb->mn", dots, scales_a.astype(np.float64), b.scales.astype(np.float64))
    return y + (bias if bias is not None else 0.0)


def quantization_bound(b: QuantizedB, a: np.ndarray) -> np.ndarray:
    """[m, n] bound of |int8 result - float result|: each activation moves by at most half its block's step."""
    _, scales_a = quantize_a(a, b.block)
    steps = np.repeat(scales_a.astype(np.float64), b.block, axis=1)[:, :b.k] / 2
    return steps @ np.abs(b.dequantized()).T
