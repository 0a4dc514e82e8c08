"""int4/int8 weight quantization, as the stock onnxruntime-genai builder chooses and onnxruntime computes it.

- `choices`: the methods, algo_config aliases, block sizes and mixed-precision selectors (standard library only);
- `extra_options`: the --extra_options table, parsed once before any work (standard library only);
- `plan`: which scheme each MatMul node gets (`QuantPlan`);
- `kernels`: onnxruntime's block routines per method; `k_quant`: its k-quant search on many cores;
- `weights`: quantized weights as lazy tensors, shared between graphs (`QuantizationCache`);
- `matmul`: the graph rewrite MatMul -> MatMulNBits, and whether a graph wants CPU prepacking.

This module imports nothing, so the command line reads `choices` and `extra_options` without numpy or onnx.
"""
