"""The graphs' contract with each other, from the real I/O specs: what one graph produces is what the next consumes,
by name, dtype and width; an input two graphs share has one dtype (the runtime merges their input tables and refuses
a mismatch); and the token table is shared between the embedding and the decoder by construction, by name."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from builder_plugin.components.decoder import DecoderBuilder
from builder_plugin.components.embedding import TRANSPOSED_TOKEN_TABLE, EmbeddingBuilder
from builder_plugin.components.speech import SpeechBuilder
from builder_plugin.components.vision import VisionBuilder
from builder_plugin.layout import AUDIO_FEATURES, GRAPH_FILES, IMAGE_FEATURES, INPUTS_EMBEDS
from builder_plugin.options import BuildOptions
from builder_plugin.quant.plan import LM_HEAD_NODE, LM_HEAD_WEIGHT
from builder_plugin.spec import Component, TensorSpec

CASES = [("fp32", "cpu", "routed"), ("int4", "cpu", "routed"), ("fp32", "cpu", "split"), ("fp16", "cuda", "routed"),
         ("int4", "dml", "routed"), ("fp16", "webgpu", "vision")]


def _specs(config, precision: str, provider: str, lora: str):
    options = BuildOptions(model_dir=Path("unused"), output_dir=Path("unused"), precision=precision,
                           execution_provider=provider, lora=lora)
    return {c: builder.spec_for(config, options) for c, builder in (
        (Component.VISION, VisionBuilder), (Component.SPEECH, SpeechBuilder),
        (Component.EMBEDDING, EmbeddingBuilder), (Component.DECODER, DecoderBuilder))}


def _io(spec: TensorSpec) -> tuple[str, str, tuple]:
    return spec.name, spec.dtype, spec.shape


# (producer, its output) -> (consumer, its input): every tensor one graph hands the next, through the runtime
HANDOVERS = (((Component.VISION, IMAGE_FEATURES), (Component.EMBEDDING, IMAGE_FEATURES)),
             ((Component.SPEECH, AUDIO_FEATURES), (Component.EMBEDDING, AUDIO_FEATURES)),
             ((Component.EMBEDDING, INPUTS_EMBEDS), (Component.DECODER, INPUTS_EMBEDS)))


@pytest.mark.parametrize(("precision", "provider", "lora"), CASES)
def test_each_graph_consumes_what_the_previous_one_produces(tiny_config, precision, provider, lora):
    specs = _specs(tiny_config, precision, provider, lora)
    hidden = tiny_config.text.hidden_size
    for (producer, output), (consumer, input_name) in HANDOVERS:
        out = specs[producer].output(output)
        assert input_name in specs[consumer].input_names, (consumer, input_name)
        assert _io(out) == _io(specs[consumer].input(input_name)), (producer, consumer)
        assert out.shape[-1] == hidden
    for name in (IMAGE_FEATURES, AUDIO_FEATURES):  # the runtime feeds rank-2 features
        assert len(specs[Component.EMBEDDING].input(name).shape) == 2


def _graph_io(path: Path) -> dict[tuple[str, str], tuple[int, tuple]]:
    """(input/output, name) -> (ONNX element type, dims as ints or symbols) of a written graph."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return {(kind, v.name): (v.type.tensor_type.elem_type,
                             tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                                   for d in v.type.tensor_type.shape.dim))
            for kind, values in (("input", graph.input), ("output", graph.output)) for v in values}


def test_written_graphs_hand_over_what_the_next_one_reads(tiny_package):
    """The same handovers in the package's .onnx files: each name, element type and shape as the consumer declares
    it (every decoder file of the package)."""
    graphs = {c: [_graph_io(tiny_package / GRAPH_FILES[c])] for c in (Component.VISION, Component.SPEECH,
                                                                      Component.EMBEDDING)}
    graphs[Component.DECODER] = [_graph_io(p) for p in sorted(tiny_package.glob("phi-4-mm-text*.onnx"))]
    assert graphs[Component.DECODER]
    for (producer, output), (consumer, input_name) in HANDOVERS:
        (produced,) = graphs[producer]
        for consumed in graphs[consumer]:
            assert produced[("output", output)] == consumed[("input", input_name)], (producer, consumer)


@pytest.mark.parametrize(("precision", "provider", "lora"), CASES)
def test_inputs_shared_by_name_have_one_dtype(tiny_config, precision, provider, lora):
    seen: dict[str, tuple[str, Component]] = {}
    for component, spec in _specs(tiny_config, precision, provider, lora).items():
        for tensor in spec.inputs:
            if tensor.name in seen:
                assert seen[tensor.name][0] == tensor.dtype, (tensor.name, seen[tensor.name][1], component)
            seen[tensor.name] = (tensor.dtype, component)
    # the runtime feeds the embedding under the decoder's input_ids name, and a routed decoder declares it too
    assert "input_ids" in {t.name for t in _specs(tiny_config, precision, provider, lora)[Component.EMBEDDING].inputs}


def _initializer_locations(path) -> dict[str, tuple[str, str, str]]:
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: tuple(sorted((e.key, e.value) for e in t.external_data if e.key in ("location", "offset",
                                                                                         "length")))
            for t in model.graph.initializer if t.external_data}


@pytest.mark.parametrize("layout", ["routed", "split"])
def test_token_table_is_shared_by_name(layout, request):
    """The embedding reads the decoder's own lm_head initializer: same name, same bytes in the data file; the name is
    the weight the decoder's lm_head MatMul multiplies by."""
    package = request.getfixturevalue({"routed": "tiny_package", "split": "tiny_split_package"}[layout])
    embedding = _initializer_locations(package / GRAPH_FILES[Component.EMBEDDING])
    for decoder in sorted(package.glob("phi-4-mm-text*.onnx")):
        weights = _initializer_locations(decoder)
        assert LM_HEAD_WEIGHT in weights, decoder.name
        table = embedding.get(TRANSPOSED_TOKEN_TABLE, embedding.get(LM_HEAD_WEIGHT))
        assert table == weights[LM_HEAD_WEIGHT], decoder.name
        nodes = onnx.load(str(decoder), load_external_data=False).graph.node
        lm_head = next(n for n in nodes if n.name == LM_HEAD_NODE)
        assert lm_head.op_type == "MatMul" and lm_head.input[1] == LM_HEAD_WEIGHT, decoder.name
