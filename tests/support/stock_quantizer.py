"""The stock GenAI builder's own quantization code run on our graphs: a bare `builders.base.Model` whose quantization
state is set up as `Model.__init__` sets it (base.py quant_attrs, make_quant_init), so `to_nbits` -- the builder's
whole-graph MatMulNBitsQuantizer pass -- can quantize a float graph this project built."""

from __future__ import annotations

from typing import Any

import onnx
import onnx_ir as ir


def stock_builder(extra_options: dict[str, str], precision: str, num_layers: int,
                  execution_provider: str = "cpu") -> Any:
    import onnxruntime_genai.models.builder  # noqa: F401  - sets up the builder's top-level modules first
    from builders.base import Model
    from quantization.quant_config import QuantConfig

    options: dict[str, Any] = dict(extra_options)
    if "nodes_to_exclude" in options:  # as check_extra_options splits it
        options["nodes_to_exclude"] = options["nodes_to_exclude"].split(",")
    if "op_types_to_quantize" in options:
        options["op_types_to_quantize"] = tuple(options["op_types_to_quantize"].split("/"))
    model = object.__new__(Model)
    model.ep = execution_provider
    model.num_layers = num_layers
    model.layer_types = ["full_attention"] * num_layers
    model.mlp_attrs = {"fuse_gate_up": False}
    model.quant_type = None
    model.quant_config = QuantConfig.from_extra_options(options, precision=precision,
                                                        execution_provider=execution_provider)
    model.matmul_attrs = {"weights_prepacked": model.quant_config.runtime.matmulnbits_weights_prepacked}
    weights = model.quant_config.weights
    model.quant_attrs = {
        "accuracy_level": weights.accuracy_level,
        "matmul_block_size": int(weights.block_size),
        "bits": 8 if precision == "int8" else 4,
        "is_symmetric": weights.symmetric,
        "op_types_to_quantize": weights.op_types,
        "nodes_to_exclude": [o.match["name"] for o in weights.overrides if o.exclude],
        "use_qdq": model.quant_config.runtime.use_qdq,
    }
    model.make_quant_init(None)
    return model


def stock_to_nbits(float_model: ir.Model, extra_options: dict[str, str], precision: str, num_layers: int,
                   execution_provider: str = "cpu") -> onnx.ModelProto:
    model = stock_builder(extra_options, precision, num_layers, execution_provider)
    model.model = float_model
    return ir.to_proto(model.to_nbits())
