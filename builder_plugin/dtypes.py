"""Every dtype the builder handles, one row each: its name in specs and options, and its ONNX, NumPy, PyTorch and
safetensors spellings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch


@dataclass(frozen=True)
class DType:
    name: str  # as specs, options and config files spell it
    onnx: ir.DataType
    numpy: type | None  # None: NumPy has no such type (bfloat16)
    torch: torch.dtype
    safetensors: str  # the dtype code in a safetensors header


_ROWS = (
    DType("float32", ir.DataType.FLOAT, np.float32, torch.float32, "F32"),
    DType("float16", ir.DataType.FLOAT16, np.float16, torch.float16, "F16"),
    DType("bfloat16", ir.DataType.BFLOAT16, None, torch.bfloat16, "BF16"),
    DType("float64", ir.DataType.DOUBLE, np.float64, torch.float64, "F64"),
    DType("int64", ir.DataType.INT64, np.int64, torch.int64, "I64"),
    DType("int32", ir.DataType.INT32, np.int32, torch.int32, "I32"),
    DType("bool", ir.DataType.BOOL, np.bool_, torch.bool, "BOOL"),
)

DTYPES: dict[str, DType] = {row.name: row for row in _ROWS}
BY_ONNX: dict[ir.DataType, DType] = {row.onnx: row for row in _ROWS}
BY_SAFETENSORS: dict[str, DType] = {row.safetensors: row for row in _ROWS}
# The float dtypes a graph's I/O and weights can have (the `io_dtype` / `weight_dtype` of a build).
GRAPH_FLOATS = ("float32", "float16")


def onnx_dtype(name: str) -> ir.DataType:
    return DTYPES[name].onnx
