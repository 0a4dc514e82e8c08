"""A small graph-construction helper on top of onnx-ir, shared by the encoder and embedding builders.

Weights are added as lazy initializers: nothing is read from the checkpoint until the graph is saved, and each tensor
is read, converted and released on its own, so building a component never holds all of its weights in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.dtypes import BY_ONNX, DTYPES, GRAPH_FLOATS, onnx_dtype
from builder_plugin.spec import IOSpec, TensorSpec

OPSET = 21
MS_DOMAIN = "com.microsoft"

WeightSource = TensorRef | torch.Tensor | np.ndarray


def transposed(tensor: torch.Tensor) -> torch.Tensor:
    """A weight `transform`: torch's Linear weight [out, in] as the [in, out] right operand of a MatMul."""
    return tensor.t()


class GraphBuilder:
    """Records nodes and initializers, then assembles an ``ir.Model`` whose I/O follows an IOSpec."""

    def __init__(self, name: str, spec: IOSpec, weight_dtype: str = "float32") -> None:
        self.name = name
        self.spec = spec
        self.weight_dtype = onnx_dtype(weight_dtype)
        self.inputs: dict[str, ir.Value] = {s.name: s.value() for s in spec.inputs}
        self._outputs: dict[str, ir.Value] = {}
        self._nodes: list[ir.Node] = []
        self._initializers: dict[str, ir.Value] = {}
        self._counter = 0

    # ---- nodes -------------------------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "", name: str | None = None,
           **attributes: Any) -> ir.Value:
        return self.op_multi(op_type, *inputs, num_outputs=1, domain=domain, name=name, **attributes)[0]

    def op_multi(self, op_type: str, *inputs: ir.Value | None, num_outputs: int, domain: str = "",
                 name: str | None = None, **attributes: Any) -> Sequence[ir.Value]:
        self._counter += 1
        node_name = name or f"{op_type}_{self._counter}"
        attrs = {k: v for k, v in attributes.items() if v is not None}
        node = ir.node(op_type, list(inputs), attributes=attrs, domain=domain, name=node_name,
                       num_outputs=num_outputs)
        for i, out in enumerate(node.outputs):
            out.name = f"{node_name}/out{i}" if num_outputs > 1 else f"{node_name}/out"
        self._nodes.append(node)
        return node.outputs

    # ---- constants and weights ---------------------------------------------------------------------------------
    def const(self, value: Any, dtype: str = "int64", name: str | None = None) -> ir.Value:
        """A small constant (shape vectors, scalars, masks) stored in the graph itself."""
        array = np.asarray(value, dtype=DTYPES[dtype].numpy)
        self._counter += 1
        return self._add_initializer(name or f"const_{self._counter}", ir.tensor(array))

    def weight(self, name: str, source: WeightSource, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
               dtype: str | None = None, shape: Sequence[int] | None = None) -> ir.Value:
        """A lazily loaded initializer: `source` (a checkpoint tensor or an array) is read, passed through
        `transform` (e.g. a transpose) and cast to `dtype` (default: the graph's weight dtype) only when saved.
        `shape` must be given when `transform` changes the shape."""
        ir_dtype = onnx_dtype(dtype) if dtype else self.weight_dtype
        if shape is None:
            shape = tuple(source.shape)
            if transform is not None:
                shape = tuple(transform(torch.empty(shape, device="meta")).shape)

        row = BY_ONNX.get(ir_dtype)
        target = row.torch if row is not None and row.name in GRAPH_FLOATS else None

        def materialize() -> ir.TensorProtocol:
            # Converting straight to the target dtype (bf16 -> fp16 rounds exactly as via fp32) keeps a big fp16
            # tensor from passing through an fp32 copy twice its size.
            tensor = source.load(target or torch.float32) if isinstance(source, TensorRef) else torch.as_tensor(source)
            if transform is not None:
                tensor = transform(tensor)
            tensor = tensor.to(target or tensor.dtype).contiguous()
            return ir.tensor(tensor.numpy(), name=name)

        lazy = ir.LazyTensor(materialize, dtype=ir_dtype, shape=ir.Shape(shape), name=name)
        return self._add_initializer(name, lazy)

    def initializer(self, tensor: ir.TensorProtocol) -> ir.Value:
        """An initializer from a ready (possibly lazy) tensor, named by the tensor."""
        return self._add_initializer(tensor.name, tensor)

    def _add_initializer(self, name: str, tensor: ir.TensorProtocol) -> ir.Value:
        if name in self._initializers:
            raise ValueError(f"duplicate initializer {name}")
        value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
        self._initializers[name] = value
        return value

    # ---- outputs and assembly ----------------------------------------------------------------------------------
    def output(self, spec_name: str, value: ir.Value) -> None:
        spec: TensorSpec = self.spec.output(spec_name)
        if value.name in self.inputs or value.name in self._initializers:
            value = self.op("Identity", value)
        value.name = spec.name
        value.dtype = spec.onnx_dtype
        value.shape = ir.Shape(spec.shape)
        self._outputs[spec.name] = value

    def model(self) -> ir.Model:
        missing = [s.name for s in self.spec.outputs if s.name not in self._outputs]
        if missing:
            raise ValueError(f"{self.name}: outputs not set: {missing}")
        graph = ir.Graph(
            inputs=[self.inputs[s.name] for s in self.spec.inputs],
            outputs=[self._outputs[s.name] for s in self.spec.outputs],
            nodes=self._nodes,
            initializers=list(self._initializers.values()),
            opset_imports={"": OPSET, MS_DOMAIN: 1},
            name=self.name,
        )
        return ir.Model(graph, ir_version=10, producer_name="builder_plugin")
