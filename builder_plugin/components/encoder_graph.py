"""What the vision and speech graphs are built with: the component's routed weights by local name, constants, and
torch's Linear and LayerNorm as the nodes the int4 pass and onnxruntime's fusions expect."""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from builder_plugin.checkpoint.reader import TensorRef
from builder_plugin.graph import GraphBuilder, transposed


class EncoderGraph:
    """One build of an encoder graph on `g`, from `weights` (local name -> checkpoint tensor). `layer_norm_eps` is the
    model's; `fused` LayerNorms are one LayerNormalization node, else the arithmetic."""

    def __init__(self, g: GraphBuilder, weights: Mapping[str, TensorRef], layer_norm_eps: float,
                 fused: bool = True) -> None:
        self.g = g
        self.weights = weights
        self.layer_norm_eps = layer_norm_eps
        self.fused = fused
        self.dtype = g.weight_dtype  # compute dtype of the float path: the weights' float type

    def ref(self, name: str) -> TensorRef:
        return self.weights[name]

    def i64(self, values: object, name: str | None = None) -> ir.Value:
        return self.g.const(values, "int64", name=name)

    def f32(self, value: object) -> ir.Value:
        return self.g.const(value, "float32")

    def fconst(self, value: object) -> ir.Value:
        """A float constant in the compute dtype."""
        return self.g.const(value, "float16" if self.dtype == ir.DataType.FLOAT16 else "float32")

    def cast(self, x: ir.Value, to: ir.DataType) -> ir.Value:
        return self.g.op("Cast", x, to=to)

    def linear(self, x: ir.Value, prefix: str, scale: float | None = None) -> ir.Value:
        """torch Linear as MatMul with a constant [in, out] weight plus an Add of the bias (the int4 pass pattern).
        `scale` is folded into weight and bias (0.5 for the conformer's half-step feed-forwards: exact, a power of
        two)."""
        if scale is None:
            weight = self.g.weight(f"{prefix}.weight", self.ref(f"{prefix}.weight"), transform=transposed)
            bias = self.g.weight(f"{prefix}.bias", self.ref(f"{prefix}.bias"))
        else:
            weight = self.g.weight(f"{prefix}.weight", self.ref(f"{prefix}.weight"), transform=lambda t: t.t() * scale)
            bias = self.g.weight(f"{prefix}.bias", self.ref(f"{prefix}.bias"), transform=lambda t: t * scale)
        return self.g.op("Add", self.g.op("MatMul", x, weight), bias)

    def layer_norm(self, x: ir.Value, prefix: str) -> ir.Value:
        gamma = self.g.weight(f"{prefix}.weight", self.ref(f"{prefix}.weight"))
        beta = self.g.weight(f"{prefix}.bias", self.ref(f"{prefix}.bias"))
        eps = self.layer_norm_eps
        if self.fused:
            return self.g.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=eps)
        axes = self.i64([-1])
        mean = self.g.op("ReduceMean", x, axes, keepdims=1)
        centred = self.g.op("Sub", x, mean)
        var = self.g.op("ReduceMean", self.g.op("Mul", centred, centred), axes, keepdims=1)
        denom = self.g.op("Sqrt", self.g.op("Add", var, self.fconst(eps)))
        return self.g.op("Add", self.g.op("Mul", self.g.op("Div", centred, denom), gamma), beta)
