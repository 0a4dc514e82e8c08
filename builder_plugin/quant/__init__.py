"""int4/int8 weight quantization, as the stock onnxruntime-genai builder chooses and onnxruntime computes it.

- `plan`: which scheme each MatMul node gets (`QuantPlan`, from the typed `BuildOptions`);
- `kernels`: onnxruntime's block routines per method; `k_quant`: its k-quant search on many cores (`k_quant_numba`:
  the same search compiled);
- `weights`: quantized weights as lazy tensors, shared between graphs (`QuantizationCache`);
- `matmul`: the graph rewrite MatMul -> MatMulNBits, and whether a graph wants CPU prepacking.

The options' vocabulary (methods, algo_config aliases, block sizes) is `builder_plugin.quant_choices`, and the
--extra_options table `builder_plugin.extra_options`: both sit below `options`, which this package reads.
"""
