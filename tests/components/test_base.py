"""ComponentBuilder.quantize, the encoders' step: -p int4 / int8 quantize the vision and speech encoders' MatMuls
(MatMulNBits): the graphs run and stay close to fp32, and each quantization choice gives the bytes onnxruntime's
MatMulNBitsQuantizer makes of the fp32 graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from builder_plugin.build import build, builder_class
from builder_plugin.layout import GRAPH_FILES
from builder_plugin.options import BuildOptions
from builder_plugin.spec import Component
from tests.support.processor import processor_inputs

# Random tiny weights are a harsh case for 4-bit RTN (the decoder's int4 logits reach cosine ~0.8 on them); the real
# checkpoint's trained weights quantize far better. These bounds only catch a broken quantized graph.
MIN_COSINE = {Component.VISION: 0.9, Component.SPEECH: 0.9}


def _build(checkpoint: Path, out: Path, component: Component, precision: str, float_encoders: bool = False,
           extra: dict[str, str] | None = None) -> Path:
    build(BuildOptions(model_dir=checkpoint, output_dir=out, precision=precision, execution_provider="cpu",
                       components=frozenset({component}), quantize_encoders=not float_encoders,
                       extra_options=extra or {}), progress=False)
    return out / GRAPH_FILES[component]


def _run(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in inputs.items() if k in names})[0]


@pytest.mark.parametrize("component", [Component.VISION, Component.SPEECH], ids=lambda c: c.value)
def test_int4_encoder_runs_close_to_fp32(component, tiny_checkpoint, media_dir, tmp_path, record_property):
    if component is Component.VISION:
        inputs = processor_inputs(tiny_checkpoint, "<|user|><|image_1|>?<|end|><|assistant|>",
                                  images=[media_dir / "wide.jpg"])
    else:
        inputs = processor_inputs(tiny_checkpoint, "<|user|><|audio_1|>?<|end|><|assistant|>",
                                  audios=[media_dir / "clip_2s.wav"])
        inputs["audio_projection_mode"] = np.array([2], dtype=np.int64)
    fp32 = _run(_build(tiny_checkpoint, tmp_path / "fp32", component, "fp32"), inputs)
    int4_path = _build(tiny_checkpoint, tmp_path / "int4", component, "int4")
    ops = {n.op_type for n in onnx.load(str(int4_path), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
    int4 = _run(int4_path, inputs)
    assert int4.shape == fp32.shape and np.isfinite(int4).all()
    cosine = float((int4 * fp32).sum() / np.linalg.norm(int4) / np.linalg.norm(fp32))
    record_property("cosine", cosine)
    print(f"{component.value} int4 vs fp32 cosine {cosine:.4f}")
    assert cosine >= MIN_COSINE[component]
    kept = _build(tiny_checkpoint, tmp_path / "float", component, "int4", float_encoders=True)
    assert "MatMulNBits" not in {n.op_type for n in onnx.load(str(kept), load_external_data=False).graph.node}


# The selectors of the mixed-precision choices name decoder nodes, so an encoder gets the body's method and bits.
# Tiny speech has K = 96 matrices (3 blocks): with zero points (k_quant) the reference cannot pack them
# (tests/quant/test_matmul.py), so k_quant is compared on vision.
ENCODER_CHOICES = [
    (Component.VISION, "int4", {}, "k_quant", 4),  # the default, k_quant_mixed
    (Component.SPEECH, "int4", {"algo_config": "rtn"}, "rtn", 4),
    (Component.SPEECH, "int8", {}, "default", 8),
]


@pytest.mark.parametrize(("component", "precision", "extra", "method", "bits"), ENCODER_CHOICES,
                         ids=lambda v: getattr(v, "value", None) or str(v))
def test_encoder_quantization_equals_onnxruntime_quantizer(component, precision, extra, method, bits,
                                                           tiny_checkpoint, tiny_config, tiny_weights,
                                                           tmp_path) -> None:
    """Compared on the graph as built, before `finish` (which moves the vision's SigLIP into a Scan body that
    onnxruntime's quantizer leaves float for k_quant and rtn); the package's file holds the same nodes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        KQuantWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
        RTNWeightOnlyQuantConfig,
    )

    def built(precision: str, extra: dict[str, str]) -> onnx.ModelProto:
        options = BuildOptions(model_dir=tiny_checkpoint, output_dir=tmp_path, precision=precision,
                               execution_provider="cpu", components=frozenset({component}), extra_options=extra)
        builder = builder_class(component)(tiny_config, options)
        (model,) = builder.build(tiny_weights[component]).values()
        return ir.serde.serialize_model(builder.quantize(model))

    float_model = built("fp32", {})
    algo_config = None
    if method != "default":
        config = {n.name: {"bits": bits} for n in float_model.graph.node if n.op_type == "MatMul"}
        algo_config = {"rtn": RTNWeightOnlyQuantConfig, "k_quant": KQuantWeightOnlyQuantConfig}[method](
            customized_weight_config=config)
    quantizer = MatMulNBitsQuantizer(float_model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4,
                                     algo_config=algo_config)
    quantizer.process()
    theirs = quantizer.model.model
    ours = built(precision, extra)
    a = {t.name: onnx.numpy_helper.to_array(t) for t in ours.graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t) for t in theirs.graph.initializer}
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    nodes = [sorted(n.SerializeToString() for n in m.graph.node if n.op_type == "MatMulNBits") for m in (ours, theirs)]
    assert nodes[0] == nodes[1] and nodes[0]

    # the package's file holds every one of these products (weights and attributes), wherever `finish` put them
    written = onnx.load(str(_build(tiny_checkpoint, tmp_path / "q", component, precision, extra=extra)))
    assert _products(ours.graph.node) <= _products(_all_nodes(written.graph))


def _products(nodes) -> set[tuple]:
    return {(tuple(n.input[1:]), tuple(a.SerializeToString() for a in n.attribute))
            for n in nodes if n.op_type == "MatMulNBits"}


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of `graph` and of its subgraphs (the vision's Scan body)."""
    found = []
    for node in graph.node:
        found.append(node)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found.extend(_all_nodes(attribute.g))
    return found
