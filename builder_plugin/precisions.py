"""The precisions (-p) and execution providers (-e) a package is built for, and the graph I/O dtype they give.

Standard library only: the command lines (build, verify, serve) and the runtime read them.
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "fp16", "int4", "int8"]
ExecutionProvider = Literal["cpu", "cuda", "dml", "webgpu"]

# Bits per weight of each precision (int4/int8: MatMulNBits blocks, plus their scales).
PRECISION_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "int4": 4, "int8": 8}
PRECISIONS: tuple[str, ...] = tuple(PRECISION_BITS)
QUANTIZED_PRECISIONS: tuple[str, ...] = ("int4", "int8")
EXECUTION_PROVIDERS: tuple[str, ...] = ("cpu", "cuda", "dml", "webgpu")


def io_dtype(precision: str, execution_provider: str) -> str:
    """Graph I/O dtype (and the KV cache's), as the GenAI builder chooses it: fp32 for fp32 builds and CPU int4/int8,
    else fp16."""
    if precision == "fp32" or (precision in QUANTIZED_PRECISIONS and execution_provider == "cpu"):
        return "float32"
    return "float16"


# MatMulNBits' block_size when --extra_options does not set one, as the stock builder chooses it.
DEFAULT_BLOCK_SIZE = 32


def default_accuracy_level(execution_provider: str) -> int:
    """MatMulNBits' accuracy_level when --extra_options does not set one, as the stock builder chooses it: 4 (int8
    activations per block) on cpu and webgpu, else 0."""
    return 4 if execution_provider in ("cpu", "webgpu") else 0


def lowest(precisions: list[str] | tuple[str, ...]) -> str:
    """The precision with the fewest bits per weight."""
    return min(precisions, key=PRECISION_BITS.__getitem__)
