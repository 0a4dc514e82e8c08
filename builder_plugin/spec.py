"""I/O specs: the names, dtypes and symbolic shapes of every graph, declared once per component.

The exporter checks each built graph against its spec, the genai_config writer takes every tensor name from the specs,
and the tests feed graphs by them.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from builder_plugin.dtypes import onnx_dtype
from builder_plugin.errors import SpecMismatchError
from builder_plugin.layout import Component  # noqa: F401  - re-exported: specs are declared per component

Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # a key of builder_plugin.dtypes.DTYPES
    shape: tuple[Dim, ...]
    genai_key: str | None = None  # the genai_config.json key naming this tensor, when it differs from `name`

    @property
    def onnx_dtype(self) -> ir.DataType:
        return onnx_dtype(self.dtype)

    def value(self) -> ir.Value:
        """A fresh onnx-ir graph input/output value with this name, dtype and shape."""
        return ir.Value(name=self.name, type=ir.TensorType(self.onnx_dtype), shape=ir.Shape(self.shape))


@dataclass(frozen=True)
class IOSpec:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name)

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


def _by_name(specs: tuple[TensorSpec, ...], name: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    raise KeyError(name)


def check_io(model: ir.Model, spec: IOSpec, graph_name: str) -> None:
    """Raise SpecMismatchError unless the graph's inputs and outputs equal the spec (names, order, dtypes, ranks,
    and every fixed dimension)."""
    sides = (("input", model.graph.inputs, spec.inputs), ("output", model.graph.outputs, spec.outputs))
    for kind, values, specs in sides:
        names = [v.name for v in values]
        wanted = [s.name for s in specs]
        if names != wanted:
            raise SpecMismatchError(f"{graph_name}: {kind}s are {names}, spec says {wanted}")
        for value, s in zip(values, specs):
            if value.dtype != s.onnx_dtype:
                raise SpecMismatchError(f"{graph_name}: {kind} {s.name} is {value.dtype}, spec says {s.dtype}")
            dims = tuple(value.shape) if value.shape is not None else None
            if dims is None or len(dims) != len(s.shape):
                raise SpecMismatchError(f"{graph_name}: {kind} {s.name} has shape {dims}, spec says {s.shape}")
            for got, want in zip(dims, s.shape):
                got_v = got if isinstance(got, int) else str(got)
                if isinstance(want, int) and got_v != want:
                    raise SpecMismatchError(f"{graph_name}: {kind} {s.name} has shape {dims}, spec says {s.shape}")
