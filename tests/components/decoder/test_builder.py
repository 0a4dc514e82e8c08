"""The text decoder against the PyTorch reference (transformers' native Phi-4-multimodal with per-mode LoRA merged).

Graphs run in plain onnxruntime the way onnxruntime-genai runs them: `inputs_embeds`, an all-ones `attention_mask` of
the total length, and GroupQueryAttention's shared KV buffer (past = a preallocated [B, kv_heads, max_length, head]
buffer, present fed back as the next past).
"""

from __future__ import annotations

import contextlib
import filecmp
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from builder_plugin.build import build_component, validate_options
from builder_plugin.components.decoder import DecoderBuilder, DecoderPlan
from builder_plugin.errors import InputError
from builder_plugin.layout import (
    AUDIO_TOKEN_ID,
    DATA_FILES,
    IMAGE_TOKEN_ID,
    INPUT_IDS,
    INPUT_MODES,
    INPUTS_EMBEDS,
    MAIN_DECODER,
    MODE_DECODERS,
    MODE_LORA,
    SPLIT_DECODERS,
)
from builder_plugin.options import LORA_ADAPTERS, BuildOptions
from builder_plugin.package import PackageWriter, initializers
from builder_plugin.quant.plan import LM_HEAD_WEIGHT
from builder_plugin.spec import Component
from tests.support.stock_quantizer import stock_to_nbits

DECODE_STEPS = 8
TOLERANCE = 5e-4
MAX_LENGTH = 256  # the shared KV buffer, as GenAI preallocates it from search.max_length
DATA_FILE = DATA_FILES[Component.DECODER]


def _options(checkpoint: Path, precision: str = "fp32", lora: str = "routed", merge: bool = False,
             provider: str = "cpu", extra: dict[str, str] | None = None) -> BuildOptions:
    return BuildOptions(model_dir=checkpoint, output_dir=checkpoint / "unused", precision=precision,
                        execution_provider=provider, lora=lora, merge_lora=merge, extra_options=extra or {})


def _build_and_save(config, weights, options: BuildOptions, folder: Path) -> tuple[PackageWriter, dict[str, Path]]:
    """The decoder files as the build makes them (quantized and finished, checked against the spec), written."""
    folder.mkdir(parents=True, exist_ok=True)
    output = build_component(DecoderBuilder(config, options), weights[Component.DECODER])
    writer = PackageWriter(folder, progress=False)
    paths = {filename: writer.save(model, filename, DATA_FILE) for filename, model in output.graphs.items()}
    return writer, paths


# name -> (build options, decoder file, reference LoRA, placeholder ids in the prompt of a self-routing decoder)
VARIANTS = {
    "base": ({"lora": "split"}, SPLIT_DECODERS["text"], "none", ()),
    "vision": ({"lora": "split"}, SPLIT_DECODERS["vision"], "vision", ()),
    "speech": ({"lora": "split"}, SPLIT_DECODERS["speech"], "speech", ()),
    "vision+speech": ({"lora": "vision+speech"}, MAIN_DECODER, "vision+speech", ()),
    "merged-vision": ({"lora": "vision", "merge": True}, MAIN_DECODER, "vision", ()),
    # one self-routing decoder: the prompt's placeholder ids choose the adapter (image wins over audio)
    "routed-text": ({"lora": "routed"}, MAIN_DECODER, "none", ()),
    "routed-image": ({"lora": "routed"}, MAIN_DECODER, "vision", (IMAGE_TOKEN_ID,)),
    "routed-audio": ({"lora": "routed"}, MAIN_DECODER, "speech", (AUDIO_TOKEN_ID,)),
    "routed-image+audio": ({"lora": "routed"}, MAIN_DECODER, "vision", (AUDIO_TOKEN_ID, IMAGE_TOKEN_ID)),
}


@pytest.fixture(scope="module")
def fp32_builds(tiny_checkpoint, tiny_config, tiny_weights, tmp_path_factory) -> dict[tuple, tuple]:
    """Each distinct fp32 build of VARIANTS written once as its own package: build key -> (writer, {file: path})."""
    root = tmp_path_factory.mktemp("decoder-fp32")
    builds = {}
    for kwargs, *_ in VARIANTS.values():
        key = tuple(sorted(kwargs.items()))
        if key not in builds:
            folder = root / f"build{len(builds)}"
            builds[key] = _build_and_save(tiny_config, tiny_weights, _options(tiny_checkpoint, **kwargs), folder)
    return builds


@pytest.fixture(scope="module")
def fp32_packages(fp32_builds) -> dict[str, Path]:
    """Variant name -> its decoder file."""
    return {name: fp32_builds[tuple(sorted(kwargs.items()))][1][filename]
            for name, (kwargs, filename, *_) in VARIANTS.items()}


@contextlib.contextmanager
def _reference_lora(reference, lora: str):
    """The reference with `lora` active. "vision+speech" (both adapters always on) is not a mode of the original
    model, so it is merged here from the reference's own adapters: W + s_v·B_v@A_v + s_s·B_s@A_s in float64."""
    if lora != "vision+speech":
        yield lora
        return
    reference.set_lora("none")
    adapters = [reference.adapters["vision"], reference.adapters["speech"]]
    with torch.no_grad():
        for name, param in reference.model.named_parameters():
            pairs = [(ad.scaling, ad.weights[name.removesuffix(".weight")]) for ad in adapters
                     if name.removesuffix(".weight") in ad.weights]
            if pairs:
                merged = param.double() + sum(s * (b.double() @ a.double()) for s, (a, b) in pairs)
                param.copy_(merged.to(torch.float32))
    reference.set_lora = lambda _lora: None  # keep the merged weights through logits() / decode_logits()
    try:
        yield "none"
    finally:
        del reference.set_lora
        reference.set_lora("vision")  # both rebuild every adapted weight from the pristine copy
        reference.set_lora("none")


class SharedBufferDecoder:
    """Prefill + KV-cached decode with GQA's shared buffer, as onnxruntime-genai drives the decoder: the KV layers
    are the graph's own past inputs (a self-routing decoder has one more), and `input_ids` is fed when the graph
    declares it."""

    def __init__(self, path: Path, config) -> None:
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        inputs = [i.name for i in self.session.get_inputs()]
        text = config.text
        self.layers = sum(name.startswith("past_key_values.") and name.endswith(".key") for name in inputs)
        self.kv_heads, self.head = text.num_key_value_heads, text.head_dim
        self.takes_ids = INPUT_IDS in inputs

    def run(self, prefix: np.ndarray, steps: list[np.ndarray], placeholders: tuple[int, ...] = ()
            ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(prefill logits [1, vocab]: the graph emits the last position only; last-position logits after the
        prefill and after each step). `placeholders` are written at the start of the prompt's ids (the embeddings
        are given, so the ids only tell a self-routing decoder the input mode); step ids are plain tokens."""
        past = {f"past_key_values.{i}.{kind}": np.zeros((1, self.kv_heads, MAX_LENGTH, self.head), np.float32)
                for i in range(self.layers) for kind in ("key", "value")}
        total = prefix.shape[1]
        ids = np.ones((1, total), np.int64)
        ids[0, :len(placeholders)] = placeholders
        out = self._run(prefix, ids, total, past)
        prefill = out["logits"][0]
        last = [prefill[-1]]
        for embeds in steps:
            total += 1
            past = {f"past_key_values.{i}.{kind}": out[f"present.{i}.{kind}"]
                    for i in range(self.layers) for kind in ("key", "value")}
            out = self._run(embeds, np.ones((1, 1), np.int64), total, past)
            last.append(out["logits"][0, -1])
        return prefill, last

    def _run(self, embeds: np.ndarray, ids: np.ndarray, total: int,
             past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {INPUTS_EMBEDS: embeds.astype(np.float32), "attention_mask": np.ones((1, total), np.int64), **past}
        if self.takes_ids:
            feeds[INPUT_IDS] = ids
        result = dict(zip(self.outputs, self.session.run(None, feeds)))
        assert result["present.0.key"].shape[2] == MAX_LENGTH  # GQA kept the shared buffer
        return result


def _prompt(reference, length: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    rng = np.random.default_rng(seed)
    vocab = reference.config.vocab_size
    ids = torch.from_numpy(rng.integers(0, vocab, size=(1, length)))
    media_ids = (reference.config.vision_config.image_token_id, reference.config.audio_config.audio_token_id)
    ids[(ids == media_ids[0]) | (ids == media_ids[1])] = 1
    new_tokens = [int(t) for t in rng.integers(0, vocab, size=DECODE_STEPS)]
    return reference.embeddings(ids), new_tokens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_cached_decode_match_the_reference(variant, fp32_packages, tiny_config, reference) -> None:
    original = tiny_config.text.original_max_position_embeddings
    decoder = SharedBufferDecoder(fp32_packages[variant], tiny_config)
    _, _, lora, placeholders = VARIANTS[variant]
    for length in (40, original + 72):  # short factors only / long factors from the start (LongRoPE switch)
        assert length + DECODE_STEPS <= MAX_LENGTH
        embeds, new_tokens = _prompt(reference, length, seed=length)
        step_embeds = [reference.embeddings(torch.tensor([[t]])).numpy() for t in new_tokens]
        prefill, steps = decoder.run(embeds.numpy(), step_embeds, placeholders)
        with _reference_lora(reference, lora) as ref_lora:
            want_prefill = reference.logits(embeds, ref_lora)[0, -1:].numpy()
            want_steps = reference.decode_logits(embeds, new_tokens, ref_lora)
        assert len(steps) == len(want_steps) == DECODE_STEPS + 1
        assert prefill.shape == want_prefill.shape
        assert np.abs(prefill - want_prefill).max() <= TOLERANCE, (variant, length)
        worst = max(float(np.abs(got - want.numpy()).max()) for got, want in zip(steps, want_steps))
        assert worst <= TOLERANCE, (variant, length, worst)


def test_decode_crossing_the_longrope_switch_keeps_cached_keys(fp32_packages, tiny_config, reference) -> None:
    """A prompt just below original_max_position_embeddings, decoded past it: the graph switches caches on the mask
    length and keeps the already-cached keys, as the reference's incremental forward does."""
    original = tiny_config.text.original_max_position_embeddings
    embeds, new_tokens = _prompt(reference, original - 3, seed=7)
    step_embeds = [reference.embeddings(torch.tensor([[t]])).numpy() for t in new_tokens]
    _, steps = SharedBufferDecoder(fp32_packages["speech"], tiny_config).run(embeds.numpy(), step_embeds)
    want = reference.decode_logits(embeds, new_tokens, "speech")
    assert max(float(np.abs(g - w.numpy()).max()) for g, w in zip(steps, want)) <= TOLERANCE


SPLIT = (("lora", "split"),)
ROUTED = (("lora", "routed"),)


def test_split_variants_share_identical_base_weights_stored_once(tiny_checkpoint, tiny_config, tiny_weights,
                                                                 fp32_builds) -> None:
    models = build_component(DecoderBuilder(tiny_config, _options(tiny_checkpoint, lora="split")),
                             tiny_weights[Component.DECODER]).graphs
    assert list(models) == [SPLIT_DECODERS[m] for m in ("vision", "speech", "text")]
    base = models[SPLIT_DECODERS["text"]].graph.initializers
    assert not any("lora" in name for name in base)
    for filename in (SPLIT_DECODERS["vision"], SPLIT_DECODERS["speech"]):
        variant = models[filename].graph.initializers
        assert set(base) <= set(variant)
        for name, value in base.items():  # same names, same tensor objects (so the same bytes)
            assert variant[name].const_value is value.const_value, name
    stored_large = {}  # what a deduplicating writer must store: every distinct large tensor once
    for model in models.values():
        for value in initializers(model.graph):  # the LongRoPE caches are If-branch initializers
            if value.const_value.nbytes > 1024:
                stored_large[id(value.const_value)] = value.const_value.nbytes
    base_bytes = sum(v.const_value.nbytes for v in base.values() if v.const_value.nbytes > 1024)

    writer, paths = fp32_builds[SPLIT]  # the same build, written by the PackageWriter
    size = (paths[MAIN_DECODER].parent / DATA_FILE).stat().st_size
    assert sum(stored_large.values()) <= size < sum(stored_large.values()) + 64 * len(stored_large)
    assert size < 1.2 * base_bytes + 2 * 64 * 1024  # the base weights are stored once, not three times
    assert writer.stores[DATA_FILE].reused_bytes >= 2 * base_bytes


def test_routed_decoder_runs_each_adapter_behind_an_if(fp32_builds, tiny_config) -> None:
    """The self-routing decoder: every base MatMul once in the main graph, each LoRA branch only inside the If of
    its adapter (one level deep, chained vision then speech), its weights main-graph initializers (prepacked once),
    and the mode KV layer."""
    _, paths = fp32_builds[ROUTED]
    assert list(paths) == [MAIN_DECODER]
    model = ir.load(str(paths[MAIN_DECODER]))
    text = tiny_config.text
    graph = model.graph
    assert [v.name for v in graph.inputs][-3:] == ["input_ids", f"past_key_values.{text.num_hidden_layers}.key",
                                                   f"past_key_values.{text.num_hidden_layers}.value"]
    assert not any("lora" in (n.name or "") for n in graph if n.op_type == "MatMul")
    for adapter, condition in (("vision", "/model/mode/is_vision"), ("speech", "/model/mode/is_speech")):
        routes = [n for n in graph if n.op_type == "If" and f"/lora.{adapter}/" in n.name]
        assert len(routes) == 4 * text.num_hidden_layers  # qkv, o, gate_up, down per layer
        for node in routes:
            assert node.inputs[0].name == condition
            then, skip = node.attributes["then_branch"].value, node.attributes["else_branch"].value
            matmuls = [n for n in then if n.op_type == "MatMul"]
            assert matmuls and all(f".{adapter}/" in n.name for n in matmuls)
            assert not any(n.op_type == "If" for n in then)  # one level deep
            assert not then.initializers  # the weights stay outer-scope initializers
            assert all(n.inputs[1].name in graph.initializers for n in matmuls)
            assert {n.op_type for n in skip} == {"Identity"}
        if adapter == "speech":  # chained after the vision If of the same projection
            assert all(n.attributes["else_branch"].value[0].inputs[0].producer().op_type == "If" for n in routes)
    base_users = Counter(n.inputs[1].name for n in graph if n.op_type == "MatMul")
    assert all(count == 1 for count in base_users.values())


def test_building_twice_gives_identical_files(tiny_checkpoint, tiny_config, tiny_weights, fp32_builds,
                                              tmp_path) -> None:
    _, first = fp32_builds[ROUTED]
    _, second = _build_and_save(tiny_config, tiny_weights, _options(tiny_checkpoint), tmp_path)
    assert sorted(first) == sorted(second)
    for filename in first:
        assert filecmp.cmp(first[filename], second[filename], shallow=False), filename
    assert filecmp.cmp(first[MAIN_DECODER].parent / DATA_FILE, tmp_path / DATA_FILE, shallow=False)


def test_native_checkpoint_gives_the_same_decoder(tiny_native_checkpoint, fp32_builds, tmp_path) -> None:
    """The transformers-native layout (LoRA in PEFT adapter folders) routes to the same tensors: identical files."""
    from builder_plugin.checkpoint.reader import CheckpointReader
    from builder_plugin.checkpoint.routing import route_weights
    from builder_plugin.config import Phi4MMConfig

    config = Phi4MMConfig.from_dir(tiny_native_checkpoint)
    assert config.source_format == "native"
    weights = route_weights(CheckpointReader(tiny_native_checkpoint, config.source_format), config)
    key = tuple(sorted(VARIANTS["vision+speech"][0].items()))
    _, original = fp32_builds[key]
    _, native = _build_and_save(config, weights, _options(tiny_native_checkpoint, lora="vision+speech"), tmp_path)
    assert filecmp.cmp(original[MAIN_DECODER], native[MAIN_DECODER], shallow=False)
    assert filecmp.cmp(original[MAIN_DECODER].parent / DATA_FILE, tmp_path / DATA_FILE, shallow=False)


def test_int4_runs_on_cpu_close_to_fp32(tiny_checkpoint, tiny_config, tiny_weights, fp32_packages, reference,
                                        tmp_path) -> None:
    options = _options(tiny_checkpoint, precision="int4", lora="vision", extra={"algo_config": "default"})
    _, paths = _build_and_save(tiny_config, tiny_weights, options, tmp_path)
    model = onnx.load(str(paths[MAIN_DECODER]), load_external_data=False)
    ops = Counter(node.op_type for node in model.graph.node)
    # per layer: 5 base projections (qkv, o, gate, up, down), 4 shared LoRA A and 5 LoRA B; plus the lm_head
    assert ops["MatMul"] == 0 and ops["MatMulNBits"] == tiny_config.text.num_hidden_layers * 14 + 1
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert {(a.name, a.i) for a in nbits[0].attribute if a.name in ("block_size", "accuracy_level", "bits")} == {
        ("block_size", options.block_size), ("accuracy_level", options.accuracy_level), ("bits", 4)}

    embeds, new_tokens = _prompt(reference, 40, seed=3)
    step_embeds = [reference.embeddings(torch.tensor([[t]])).numpy() for t in new_tokens]
    _, got_steps = SharedBufferDecoder(paths[MAIN_DECODER], tiny_config).run(embeds.numpy(), step_embeds)
    _, want_steps = SharedBufferDecoder(fp32_packages["vision"], tiny_config).run(embeds.numpy(), step_embeds)
    got, want = np.stack(got_steps), np.stack(want_steps)  # last-position logits of the prefill and each step
    cosine = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    print(f"int4 vs fp32 logits cosine: {cosine:.4f}")
    # Random Gaussian weights are a harsh case for 4-bit RTN (the 200064-row lm_head dominates): measured 0.68-0.93
    # depending on the checkpoint's seed, sizes and scales; a wiring error (wrong layout, scale or block) gives ~0.
    # The int4 weights themselves are checked byte for byte against onnxruntime's quantizer in
    # test_streaming_int4_equals_whole_graph_quantization.
    assert cosine > 0.5


def _canonical_nodes(graph: onnx.GraphProto) -> list[tuple]:
    """Nodes as comparable tuples, attributes sorted by name (the quantizer may reorder an If's branches)."""
    def attribute(attr: onnx.AttributeProto) -> tuple:
        if attr.type == onnx.AttributeProto.GRAPH:
            return attr.name, _canonical_nodes(attr.g), [o.SerializeToString() for o in attr.g.output]
        return attr.name, attr.SerializeToString()

    return [(n.op_type, n.domain, n.name, list(n.input), list(n.output),
             sorted((attribute(a) for a in n.attribute), key=lambda item: item[0])) for n in graph.node]


# precision, --extra_options, decoder files compared. The LoRA variants' B MatMuls have K = r = 8 / 12 (one block):
# with zero points (k_quant) the reference cannot pack them (tests/quant/test_matmul.py), so only the base decoder is
# compared.
QUANT_CHOICES = {
    "int4-default": ("int4", {"algo_config": "default"}, tuple(SPLIT_DECODERS.values())),
    "int4-default-mixed": ("int4", {"algo_config": "default",
                                    "matmul_mixed_precision": "last_matmul:int8,mixed_layers:int8"},
                           (SPLIT_DECODERS["vision"],)),
    "int4-rtn_last": ("int4", {"algo_config": "rtn_last"}, (SPLIT_DECODERS["speech"],)),
    "int4-k_quant_mixed (default)": ("int4", {}, (SPLIT_DECODERS["text"],)),
    "int8": ("int8", {}, (SPLIT_DECODERS["vision"],)),
}


@pytest.mark.parametrize("choice", QUANT_CHOICES)
def test_streaming_quantization_equals_the_stock_builders_whole_graph_pass(choice, tiny_checkpoint, tiny_config,
                                                                          tiny_weights, fp32_builds, tmp_path) -> None:
    """The streaming build of the split variants (weights quantized one at a time while writing, base weights shared
    by the three variants) gives the same tensors, nodes and outputs as the stock GenAI builder's own `to_nbits` (its
    MatMulNBitsQuantizer passes for that algo_config / matmul_mixed_precision) run on the fp32 variant."""
    precision, extra, compared = QUANT_CHOICES[choice]
    options = _options(tiny_checkpoint, precision=precision, lora="split", extra=extra)
    _, streamed = _build_and_save(tiny_config, tiny_weights, options, tmp_path / "streamed")
    _, float_paths = fp32_builds[SPLIT]
    hidden = tiny_config.text.hidden_size
    rng = np.random.default_rng(5)
    embeds = rng.standard_normal((1, 24, hidden)).astype(np.float32) * 0.5
    steps = [rng.standard_normal((1, 1, hidden)).astype(np.float32) * 0.5 for _ in range(3)]
    assert sorted(streamed) == sorted(float_paths)
    for filename in compared:
        float_model = ir.from_proto(onnx.load(str(float_paths[filename])))
        stock_options = {**extra, "algo_config": options.algo_config}  # our default spelled out for the stock builder
        whole = stock_to_nbits(float_model, stock_options, precision, tiny_config.text.num_hidden_layers)
        whole_tensors = {t.name: onnx.numpy_helper.to_array(t) for t in whole.graph.initializer}
        whole_path = tmp_path / "whole" / filename
        whole_path.parent.mkdir(exist_ok=True)
        onnx.save(whole, str(whole_path), save_as_external_data=True, location=filename + ".data")

        ours = onnx.load(str(streamed[filename]))
        ours_tensors = {t.name: onnx.numpy_helper.to_array(t) for t in ours.graph.initializer}
        assert sorted(ours_tensors) == sorted(whole_tensors), filename
        for name, array in ours_tensors.items():
            assert array.dtype == whole_tensors[name].dtype, name
            assert array.tobytes() == whole_tensors[name].tobytes(), name
        # rtn / k_quant re-sort the graph topologically; the node set is what must match
        assert sorted(_canonical_nodes(ours.graph), key=repr) == sorted(_canonical_nodes(whole.graph), key=repr)

        got = SharedBufferDecoder(streamed[filename], tiny_config).run(embeds, steps)[1]
        want = SharedBufferDecoder(whole_path, tiny_config).run(embeds, steps)[1]
        np.testing.assert_array_equal(np.stack(got), np.stack(want))


@pytest.mark.parametrize("extra", [{}, {"algo_config": "default"}, {"algo_config": "rtn"}])
def test_routed_quantized_weights_are_the_split_variants(extra, tiny_checkpoint, tiny_config, tiny_weights,
                                                          tmp_path) -> None:
    """The routed decoder is quantized before its adapters move into Ifs, so under every algorithm (also those
    onnxruntime applies to main-graph MatMuls only) no float MatMul is left, and every weight is byte for byte the
    split variants' (whose quantization is compared with the stock builder's above); it answers like them. Its
    decoder for each mode (a CPU int4 / int8 build's) has no If but the LongRoPE caches', the LoRA of that mode's
    adapter alone (text: none), the routed decoder's I/O, the same data file, and answers like the split build's
    decoder for that mode."""
    routed_paths = _build_and_save(tiny_config, tiny_weights, _options(tiny_checkpoint, "int4", "routed", extra=extra),
                                   tmp_path / "routed")[1]
    assert sorted(routed_paths) == sorted((MAIN_DECODER, *MODE_DECODERS.values()))
    routed = routed_paths[MAIN_DECODER]
    split = _build_and_save(tiny_config, tiny_weights, _options(tiny_checkpoint, "int4", "split", extra=extra),
                            tmp_path / "split")[1]
    model = onnx.load(str(routed))
    nodes = list(ir.traversal.RecursiveGraphIterator(ir.from_proto(model).graph))
    assert not [n.name for n in nodes if n.op_type == "MatMul"]
    assert sum("lora" in (n.name or "") and n.op_type == "MatMulNBits" for n in nodes) == \
        9 * 2 * tiny_config.text.num_hidden_layers  # per layer 4 A + 5 B MatMuls, per adapter
    split_tensors = {}
    for path in split.values():
        split_tensors.update({t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer})
    for tensor in model.graph.initializer:
        if tensor.name.startswith("model.layers.") or tensor.name.startswith("lm_head"):
            assert onnx.numpy_helper.to_array(tensor).tobytes() == split_tensors[tensor.name].tobytes(), tensor.name
    rng = np.random.default_rng(6)
    hidden = tiny_config.text.hidden_size
    embeds = rng.standard_normal((1, 20, hidden)).astype(np.float32) * 0.5
    steps = [rng.standard_normal((1, 1, hidden)).astype(np.float32) * 0.5 for _ in range(2)]
    for placeholders, mode in (((), "text"), ((IMAGE_TOKEN_ID,), "vision"), ((AUDIO_TOKEN_ID,), "speech")):
        got = SharedBufferDecoder(routed, tiny_config).run(embeds, steps, placeholders)[1]
        want = SharedBufferDecoder(split[SPLIT_DECODERS[mode]], tiny_config).run(embeds, steps)[1]
        np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-4, rtol=0)

    io = [[(v.name, v.type.SerializeToString()) for v in values] for values in (model.graph.input, model.graph.output)]
    for placeholders, mode in (((), "text"), ((IMAGE_TOKEN_ID,), "vision"), ((AUDIO_TOKEN_ID,), "speech")):
        path = routed_paths[MODE_DECODERS[mode]]
        own = onnx.load(str(path), load_external_data=False)
        nodes = list(ir.traversal.RecursiveGraphIterator(ir.from_proto(own).graph))
        assert [n.name for n in nodes if n.op_type == "If"] == ["/model/rope_caches_subgraph/If"], mode
        adapters = {adapter for n in nodes if "lora" in (n.name or "") and n.op_type == "MatMulNBits"
                    for adapter in ("vision", "speech") if adapter in n.name}
        assert adapters == set(LORA_ADAPTERS[MODE_LORA[mode]]), mode
        assert sum("lora" in (n.name or "") and n.op_type == "MatMulNBits" for n in nodes) == \
            9 * tiny_config.text.num_hidden_layers * len(adapters)
        assert [[(v.name, v.type.SerializeToString()) for v in values]
                for values in (own.graph.input, own.graph.output)] == io
        assert {e.value for t in own.graph.initializer for e in t.external_data if e.key == "location"} == {
            DATA_FILE}
        got = SharedBufferDecoder(path, tiny_config).run(embeds, steps, placeholders)[1]
        want = SharedBufferDecoder(split[SPLIT_DECODERS[mode]], tiny_config).run(embeds, steps)[1]
        np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-4, rtol=0)


def test_mixed_precision_puts_int8_on_the_stock_builders_nodes(tiny_checkpoint, tiny_config, tiny_weights,
                                                               tmp_path) -> None:
    """k_quant_mixed (the int4 default): lm_head, and qkv_proj / down_proj of the mixed layers (layer 0 of a 2-layer
    model: i < n/8 or i >= 7n/8 or (i - round(n/8)) % 3 == 2), are 8-bit; o_proj, gate_up_proj and the LoRA branches
    4-bit; all k_quant, zero points included."""
    options = _options(tiny_checkpoint, precision="int4", lora="speech")
    _, paths = _build_and_save(tiny_config, tiny_weights, options, tmp_path)
    model = onnx.load(str(paths[MAIN_DECODER]), load_external_data=False)
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node
            if n.op_type == "MatMulNBits"}
    eight = {"/lm_head/MatMul_Q8"} | {f"/model/layers.0/{p}/MatMul_Q8" for p in ("attn/qkv_proj", "mlp/down_proj")}
    assert {name for name, b in bits.items() if b == 8} == eight
    assert all(b == 4 for name, b in bits.items() if name not in eight) and len(bits) > len(eight)
    assert all(len(n.input) == 4 for n in model.graph.node if n.op_type == "MatMulNBits")  # k_quant zero points
    assert f"{LM_HEAD_WEIGHT}_Q8G32" in {t.name for t in model.graph.initializer}


def _register_ort_onnx_domain_schemas() -> None:
    """SimplifiedLayerNormalization is an onnxruntime contrib op registered in the ONNX domain (the GenAI builder's
    first norm); onnx's checker needs its schema to run full_check. Declared here as onnxruntime defines it."""
    from onnx import defs

    if defs.has("SimplifiedLayerNormalization"):
        return
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    param = defs.OpSchema.FormalParameter
    defs.register_schema(defs.OpSchema(
        "SimplifiedLayerNormalization", "", 1,
        inputs=[param("X", "T"), param("scale", "V")],
        outputs=[param("Y", "V"), param("inv_std_var", "U", param_option=defs.OpSchema.FormalParameterOption.Optional)],
        type_constraints=[("T", floats, ""), ("U", ["tensor(float)", "tensor(double)"], ""), ("V", floats, "")],
        attributes=[defs.OpSchema.Attribute(name, kind, "", required=False) for name, kind in (
            ("axis", defs.OpSchema.AttrType.INT), ("epsilon", defs.OpSchema.AttrType.FLOAT),
            ("stash_type", defs.OpSchema.AttrType.INT))],
    ))


@pytest.mark.parametrize(("precision", "lora", "provider"), [("fp16", "vision", "cuda"), ("int4", "vision", "cuda"),
                                                         ("fp16", "routed", "cuda"), ("int4", "routed", "dml")])
def test_gpu_builds_pass_checker_and_shape_inference(precision, lora, provider, tiny_checkpoint, tiny_config,
                                                     tiny_weights, tmp_path) -> None:
    options = _options(tiny_checkpoint, precision=precision, lora=lora, provider=provider)
    assert options.io_dtype == "float16"
    _, paths = _build_and_save(tiny_config, tiny_weights, options, tmp_path)
    _register_ort_onnx_domain_schemas()
    path = str(paths[MAIN_DECODER])
    onnx.checker.check_model(path, full_check=True)
    onnx.shape_inference.infer_shapes_path(path, str(tmp_path / "inferred.onnx"), check_type=True, strict_mode=True)
    inferred = onnx.load(str(tmp_path / "inferred.onnx"), load_external_data=False)
    logits = inferred.graph.output[0]
    assert logits.name == "logits" and logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    model = onnx.load(path, load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention" and not n.name.startswith("/model/mode")]
    assert len(gqa) == tiny_config.text.num_hidden_layers
    rotary = 0 if provider == "dml" else 1  # dml rotates q/k with RotaryEmbedding on position_ids
    assert all({a.name: a.i for a in n.attribute if a.name == "do_rotary"} == {"do_rotary": rotary} for n in gqa)


def test_graph_structure_follows_the_genai_builder(fp32_packages, tiny_config) -> None:
    model = ir.load(str(fp32_packages["vision"]))
    text = tiny_config.text
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == text.num_hidden_layers
    for node in gqa:
        assert node.inputs[1] is None and node.inputs[2] is None  # packed QKV into GQA
        assert node.attributes["num_heads"].value == text.num_attention_heads
        assert node.attributes["kv_num_heads"].value == text.num_key_value_heads
        assert node.attributes["do_rotary"].value == 1
    assert "position_ids" not in [v.name for v in model.graph.inputs]
    if_nodes = [n for n in nodes if n.op_type == "If"]
    assert len(if_nodes) == 1  # LongRoPE cache switch; its caches live in external data, not in the .onnx
    assert fp32_packages["vision"].stat().st_size < 200_000
    names = {n.name for n in nodes}
    for layer in range(text.num_hidden_layers):
        # one A per source projection: packed qkv and gate_up share theirs
        assert f"/model/layers.{layer}/attn/qkv_proj/lora_A.vision/MatMul" in names
        assert f"/model/layers.{layer}/mlp/gate_up_proj/lora_A.vision/MatMul" in names
        assert f"/model/layers.{layer}/mlp/gate_proj/lora_B.vision/MatMul" in names
        assert f"/model/layers.{layer}/mlp/up_proj/lora_B.vision/MatMul" in names
    assert Counter(n.op_type for n in nodes)["MatMul"] == 1 + 14 * text.num_hidden_layers


def test_option_errors(tiny_checkpoint, tiny_config) -> None:
    """The decoder is built from options `validate_options` accepted: its refusals are the decoder's."""
    with pytest.raises(InputError, match="fp16"):
        validate_options(_options(tiny_checkpoint, precision="fp16"), tiny_config)
    for lora in ("routed", "split", "none", "vision+speech"):
        with pytest.raises(InputError, match="--merge-lora"):
            validate_options(_options(tiny_checkpoint, lora=lora, merge=True), tiny_config)
    assert [v.filename for v in DecoderPlan.for_options(_options(tiny_checkpoint, lora="speech")).variants] == [
        MAIN_DECODER]


def test_runtime_settings(tiny_checkpoint, tiny_config, tiny_weights) -> None:
    """What genai_config.json and manifest.json take from the decoder build, read from the GenAI builder that made
    the graphs."""
    def runtime(**kwargs):
        builder = DecoderBuilder(tiny_config, _options(tiny_checkpoint, **kwargs))
        return builder.build_output(tiny_weights[Component.DECODER]).runtime

    cpu = runtime()
    assert (cpu.routing, cpu.decoders) == ("self", dict.fromkeys(INPUT_MODES, MAIN_DECODER))
    int4 = runtime(precision="int4")  # with a decoder for each mode
    assert (int4.routing, int4.decoders) == ("self", MODE_DECODERS)
    no_speech = replace(_options(tiny_checkpoint, precision="int4"),
                        components=frozenset({Component.VISION, Component.EMBEDDING, Component.DECODER}))
    without_speech = DecoderBuilder(tiny_config, no_speech).build_output(tiny_weights[Component.DECODER])
    assert without_speech.runtime.decoders == {**MODE_DECODERS, "speech": MAIN_DECODER}  # no audio to answer
    assert cpu.past_present_share_buffer and cpu.provider_options == ()
    split = runtime(lora="split")
    assert (split.routing, list(split.decoders.items())) == ("split", [
        ("text", SPLIT_DECODERS["text"]), ("vision", MAIN_DECODER), ("speech", SPLIT_DECODERS["speech"])])
    merged = runtime(lora="speech", merge=True)
    assert (merged.routing, merged.decoders) == ("fixed", dict.fromkeys(INPUT_MODES, MAIN_DECODER))
    cuda = runtime(precision="fp16", provider="cuda")
    assert cuda.provider_options == ({"cuda": {"enable_cuda_graph": "0"}},) and cuda.past_present_share_buffer
