"""The graphs' contract with each other, from the real I/O specs: what one graph produces is what the next consumes,
by name, dtype and width; an input two graphs share has one dtype (the runtime merges their input tables and refuses
a mismatch); and the token table is shared between the embedding and the decoder by construction, by name."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from builder_plugin.components.decoder import DecoderBuilder
from builder_plugin.components.embedding import EmbeddingBuilder
from builder_plugin.components.speech import SpeechBuilder
from builder_plugin.components.vision import VisionBuilder
from builder_plugin.options import BuildOptions
from builder_plugin.package import FILENAMES
from builder_plugin.spec import Component

CASES = [("fp32", "cpu", "routed"), ("int4", "cpu", "routed"), ("fp32", "cpu", "split"), ("fp16", "cuda", "routed"),
         ("int4", "dml", "routed"), ("fp16", "webgpu", "vision")]


def _specs(config, precision: str, provider: str, lora: str):
    options = BuildOptions(model_dir=Path("unused"), output_dir=Path("unused"), precision=precision,
                           execution_provider=provider, lora=lora)
    return {c: builder.spec_for(config, options) for c, builder in (
        (Component.VISION, VisionBuilder), (Component.SPEECH, SpeechBuilder),
        (Component.EMBEDDING, EmbeddingBuilder), (Component.DECODER, DecoderBuilder))}


@pytest.mark.parametrize(("precision", "provider", "lora"), CASES)
def test_each_graph_consumes_what_the_previous_one_produces(tiny_config, precision, provider, lora):
    specs = _specs(tiny_config, precision, provider, lora)
    hidden = tiny_config.text.hidden_size
    embedding = {t.name: t for t in specs[Component.EMBEDDING].inputs}
    for producer, name in ((Component.VISION, "image_features"), (Component.SPEECH, "audio_features")):
        out = specs[producer].output(name)
        assert name in embedding, name
        assert (out.dtype, out.shape[-1]) == (embedding[name].dtype, embedding[name].shape[-1]) == (out.dtype, hidden)
        assert len(out.shape) == len(embedding[name].shape) == 2  # the runtime feeds rank-2 features
    embeds = specs[Component.EMBEDDING].output("inputs_embeds")
    decoder_inputs = {t.name: t for t in specs[Component.DECODER].inputs}
    assert (embeds.dtype, embeds.shape[-1]) == (decoder_inputs["inputs_embeds"].dtype, hidden)


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
    """The embedding reads the decoder's own lm_head initializer: same name, same bytes in the data file."""
    from builder_plugin.components.embedding import LM_HEAD_WEIGHT, TRANSPOSED_TOKEN_TABLE

    package = request.getfixturevalue({"routed": "tiny_package", "split": "tiny_split_package"}[layout])
    embedding = _initializer_locations(package / FILENAMES[Component.EMBEDDING])
    for decoder in sorted(package.glob("phi-4-mm-text*.onnx")):
        weights = _initializer_locations(decoder)
        assert LM_HEAD_WEIGHT in weights, decoder.name
        table = embedding.get(TRANSPOSED_TOKEN_TABLE, embedding.get(LM_HEAD_WEIGHT))
        assert table == weights[LM_HEAD_WEIGHT], decoder.name
