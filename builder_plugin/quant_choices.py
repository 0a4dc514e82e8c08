"""The quantization choices: methods, algo_config aliases, block sizes, mixed-precision selectors, op types.

The words of the options (standard library only), below `options` and the quantizer that runs them
(`builder_plugin.quant`), so parsing the command line needs neither numpy nor onnx. Names and meanings are the stock
onnxruntime-genai 0.18 builder's (`quantization/quant_config.py`).
"""

from __future__ import annotations

from builder_plugin.precisions import PRECISION_BITS, QUANTIZED_PRECISIONS

# The base quantization methods (builder_plugin.quant.kernels runs them): onnxruntime's MLAS kernel, neural-compressor
# RTN and k-quant.
METHODS: tuple[str, ...] = ("default", "rtn", "k_quant")
# Quant type (also the -p precision of that name) -> bits.
QUANT_TYPE_BITS: dict[str, int] = {p: PRECISION_BITS[p] for p in QUANTIZED_PRECISIONS}

# algo_config value -> (base method, mixed-precision placement it implies): the base methods, and
# quant_config._LEGACY_ALGO_ALIASES.
ALGO_CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    **{method: (method, {}) for method in METHODS},
    "rtn_last": ("rtn", {"last_matmul": "int8"}),
    "k_quant_last": ("k_quant", {"last_matmul": "int8"}),
    "k_quant_mixed": ("k_quant", {"last_matmul": "int8", "mixed_layers": "int8"}),
    "k_quant_linear": ("k_quant", {"last_matmul": "int8", "linear_attn": "int8"}),
}
# What a build gets without algo_config, by precision (docs/build.md "Quantization choices" says why). int8 has nothing
# to mix in and the MLAS int8 kernel is both the fastest to build and, per the stock builder's notes, the more accurate.
DEFAULT_ALGO_CONFIG: dict[str, str] = {"int4": "k_quant_mixed", "int8": "default"}
MIXED_SELECTORS: tuple[str, ...] = ("last_matmul", "mixed_layers", "linear_attn")
BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
OP_TYPES: tuple[str, ...] = ("MatMul", "Gather")
