"""Quantizing on several threads (--jobs): the same bytes as onnxruntime's own quantizer whatever the thread count.

The k-quant kernel (builder_plugin.quant.k_quant) is compared with onnxruntime's `quant_tensor_k_quant_cpu` block for
block, on blocks made to hit its edge cases; then every algo_config of a build is compared, at 1 and 2 jobs, with the
stock GenAI builder's own whole-graph quantization (`to_nbits`, i.e. MatMulNBitsQuantizer) of the tiny checkpoint's
decoder.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

import builder_plugin.quant.k_quant as k_quant
from builder_plugin.components.base import BuildOutput
from builder_plugin.components.decoder import DecoderBuilder
from builder_plugin.layout import SPLIT_DECODERS
from builder_plugin.options import BuildOptions
from builder_plugin.quant.matmul import quantize_matmuls
from builder_plugin.quant.plan import LM_HEAD_WEIGHT, QuantPlan
from builder_plugin.quant.weights import QuantizationCache
from builder_plugin.quant_choices import ALGO_CONFIGS
from builder_plugin.spec import Component
from tests.support.stock_quantizer import stock_to_nbits


def _hard_blocks(rng: np.random.Generator, group_size: int, dtype) -> np.ndarray:
    """Blocks [n, group_size] of every kind the search treats specially, among ordinary ones of many scales."""
    blocks = [rng.standard_normal((200, group_size)) * rng.uniform(1e-3, 1e3, size=(200, 1)),
              rng.uniform(0, 1, (20, group_size)),  # one-signed
              np.full((3, group_size), 0.25), np.zeros((3, group_size)),  # constant: rmin == rmax
              np.where(rng.uniform(size=(10, group_size)) < 0.8, 0.0, rng.standard_normal((10, group_size)))]
    negative_zeros = np.full((2, group_size), -0.0)
    negative_zeros[1, ::3] = 1.0
    blocks.append(negative_zeros)
    return np.concatenate(blocks).astype(dtype)


@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("bits", [4, 8])
def test_k_quant_chunk_equals_onnxruntime_routine(group_size, bits) -> None:
    blocks = _hard_blocks(np.random.default_rng(group_size + bits), group_size, np.float32)
    theirs = quant_tensor_k_quant_cpu(blocks, bits, group_size)
    ours = k_quant.k_quant_chunk(blocks, bits)
    for mine, reference in zip(ours, theirs, strict=True):
        assert np.array_equal(mine.astype(reference.dtype), reference)
    assert ours[1].tobytes() == theirs[1].tobytes() and ours[2].tobytes() == theirs[2].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_block_per_column_sums_as_the_reference_does(dtype) -> None:
    """K = block size: the reference's reshape keeps the transposed weight Fortran-ordered and numpy sums each block
    in order there, not pairwise; `sequential` follows it."""
    rng = np.random.default_rng(7)
    weight = (rng.standard_normal((32, 40)) * rng.uniform(0.1, 3, (1, 40))).astype(dtype)
    weight[8:] = 0  # zeros after eight values: the two summation orders round differently
    theirs = quant_tensor_k_quant_cpu(weight.T, 4, 32)
    ours = k_quant.k_quant_chunk(np.ascontiguousarray(weight.T), 4, sequential=True)
    for mine, reference in zip(ours, theirs, strict=True):
        assert np.array_equal(mine.astype(reference.dtype), reference)


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_block_pool_gives_the_same_results_at_any_thread_count(jobs, monkeypatch) -> None:
    monkeypatch.setattr(k_quant, "CHUNK_BLOCKS", 37)  # many chunks, an uneven last one
    blocks = _hard_blocks(np.random.default_rng(3), 32, np.float32)
    theirs = quant_tensor_k_quant_cpu(blocks, 4, 32)
    pool = k_quant.BlockPool(jobs)
    try:
        ours = pool.run(lambda chunk: k_quant.k_quant_chunk(chunk, 4), blocks, np.uint8, np.float64)
    finally:
        pool.close()
    for mine, reference in zip(ours, theirs, strict=True):
        assert np.array_equal(mine.astype(reference.dtype), reference)


def _float_text_decoder(tiny_checkpoint, tiny_config, tiny_weights) -> bytes:
    """The tiny checkpoint's float base decoder, its lm_head cut to 1000 columns (the full 200064-token head would
    cost each algo_config a minute of onnxruntime's k-quant; both quantizers see the same cut weight)."""
    options = BuildOptions(model_dir=tiny_checkpoint, output_dir=tiny_checkpoint / "unused", lora="split")
    output: BuildOutput = DecoderBuilder(tiny_config, options).build_output(tiny_weights[Component.DECODER])
    model = output.graphs[SPLIT_DECODERS["text"]]
    head = model.graph.initializers[LM_HEAD_WEIGHT]
    head.const_value = ir.tensor(np.ascontiguousarray(head.const_value.numpy()[:, :1000]), name=LM_HEAD_WEIGHT)
    head.shape = ir.Shape(head.const_value.shape)
    return ir.to_proto(model).SerializeToString()


@pytest.fixture(scope="module")
def float_decoder(tiny_checkpoint, tiny_config, tiny_weights) -> bytes:
    return _float_text_decoder(tiny_checkpoint, tiny_config, tiny_weights)


@pytest.fixture(scope="module")
def stock_quantized(float_decoder, tiny_config) -> dict[str, onnx.ModelProto]:
    """algo_config -> the stock builder's quantization of the float decoder, computed once for both thread counts."""
    layers = tiny_config.text.num_hidden_layers
    return {algo: stock_to_nbits(ir.from_proto(onnx.load_from_string(float_decoder)), {"algo_config": algo}, "int4",
                                 layers) for algo in ALGO_CONFIGS}


def _canonical_nodes(graph: onnx.GraphProto) -> list[tuple]:
    """Nodes as comparable tuples, attributes sorted by name (the quantizer may reorder an If's branches)."""
    def attribute(attr: onnx.AttributeProto) -> tuple:
        if attr.type == onnx.AttributeProto.GRAPH:
            return attr.name, _canonical_nodes(attr.g), [o.SerializeToString() for o in attr.g.output]
        return attr.name, attr.SerializeToString()

    return sorted(((n.op_type, n.domain, n.name, list(n.input), list(n.output),
                    sorted((attribute(a) for a in n.attribute), key=lambda item: item[0])) for n in graph.node),
                  key=repr)


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("algo_config", list(ALGO_CONFIGS))
def test_every_algo_config_at_one_and_two_jobs_equals_the_stock_builders_quantization(
        algo_config, jobs, float_decoder, stock_quantized, tiny_checkpoint, tiny_config, monkeypatch) -> None:
    monkeypatch.setattr(k_quant, "CHUNK_BLOCKS", 97)  # a tiny weight still spans several chunks, so threads share it
    options = BuildOptions(model_dir=tiny_checkpoint, output_dir=tiny_checkpoint / "unused", precision="int4",
                           extra_options={"algo_config": algo_config}, jobs=jobs)
    plan = QuantPlan.for_decoder(options, tiny_config.text.num_hidden_layers)
    cache = QuantizationCache(options.jobs)
    ours = ir.to_proto(quantize_matmuls(ir.from_proto(onnx.load_from_string(float_decoder)), plan,
                                        options.accuracy_level, cache=cache))
    theirs = stock_quantized[algo_config]
    ours_tensors = {t.name: onnx.numpy_helper.to_array(t) for t in ours.graph.initializer}
    theirs_tensors = {t.name: onnx.numpy_helper.to_array(t) for t in theirs.graph.initializer}
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for name, array in ours_tensors.items():
        assert array.dtype == theirs_tensors[name].dtype and array.shape == theirs_tensors[name].shape, name
        assert array.tobytes() == theirs_tensors[name].tobytes(), name
    assert _canonical_nodes(ours.graph) == _canonical_nodes(theirs.graph)
    assert cache.stats.jobs == jobs and cache.stats.weights > 0 and cache.stats.seconds > 0
