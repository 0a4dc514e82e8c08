"""The embedding graph against the PyTorch reference (transformers' native token embedding + placeholder scatter)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from builder_plugin.components.embedding import (
    EMBEDDING_FILENAME,
    TABLE_LAYOUTS,
    TOKEN_TABLE,
    TRANSPOSED_TOKEN_TABLE,
    EmbeddingBuilder,
)
from builder_plugin.layout import AUDIO_FEATURES, DATA_FILES, IMAGE_FEATURES, INPUT_IDS, MAIN_DECODER
from builder_plugin.options import BuildOptions
from builder_plugin.package import PackageWriter
from builder_plugin.quant.plan import LM_HEAD_NODE, LM_HEAD_WEIGHT
from builder_plugin.spec import Component, check_io

DATA_FILE = DATA_FILES[Component.DECODER]


def _options(checkpoint: Path, precision: str = "fp32") -> BuildOptions:
    provider = "cuda" if precision == "fp16" else "cpu"
    return BuildOptions(model_dir=checkpoint, output_dir=checkpoint / "unused", precision=precision,
                        execution_provider=provider)


def _save(builder: EmbeddingBuilder, weights, folder: Path) -> Path:
    models = builder.build(weights)
    assert list(models) == [EMBEDDING_FILENAME]
    check_io(models[EMBEDDING_FILENAME], builder.io_spec(builder.config, builder.options.io_dtype), EMBEDDING_FILENAME)
    return PackageWriter(folder, progress=False).save(models[EMBEDDING_FILENAME], EMBEDDING_FILENAME, DATA_FILE)


FLOAT_LAYOUTS = tuple(layout for layout in TABLE_LAYOUTS if layout != "quantized")


@pytest.fixture(scope="module", params=FLOAT_LAYOUTS)
def session(request, tiny_checkpoint, tiny_config, tiny_weights, tmp_path_factory) -> ort.InferenceSession:
    builder = EmbeddingBuilder(tiny_config, _options(tiny_checkpoint), table_layout=request.param)
    path = _save(builder, tiny_weights[Component.EMBEDDING], tmp_path_factory.mktemp(f"embedding-{request.param}"))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _case(config, rng: np.random.Generator, batch: int, seq: int, image_rows: int, audio_rows: int):
    """Random text ids with the placeholders at random positions, and random feature rows of the right counts."""
    hidden = config.text.hidden_size
    ids = rng.integers(0, config.text.vocab_size, size=(batch, seq), dtype=np.int64)
    ids[np.isin(ids, (config.image_token_id, config.audio_token_id))] = 0
    slots = rng.permutation(batch * seq)[: image_rows + audio_rows]
    flat = ids.reshape(-1)
    flat[slots[:image_rows]] = config.image_token_id
    flat[slots[image_rows:]] = config.audio_token_id
    image = rng.standard_normal((image_rows, hidden)).astype(np.float32)
    audio = rng.standard_normal((audio_rows, hidden)).astype(np.float32)
    return ids, image, audio


CASES = {
    "text": (1, 37, 0, 0),
    "image": (1, 60, 23, 0),
    "audio": (1, 50, 0, 17),
    "image+audio": (1, 90, 31, 19),
    "image+audio, batch 2": (2, 40, 21, 13),
    "decode step": (1, 1, 0, 0),
    "all placeholders": (1, 12, 7, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_exactly(session, tiny_config, reference, case):
    rng = np.random.default_rng(sum(map(ord, case)))
    ids, image, audio = _case(tiny_config, rng, *CASES[case])
    (got,) = session.run(None, {INPUT_IDS: ids, IMAGE_FEATURES: image, AUDIO_FEATURES: audio})
    expected = reference.embeddings(
        torch.from_numpy(ids),
        torch.from_numpy(image) if len(image) else None,
        torch.from_numpy(audio) if len(audio) else None,
    ).numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(got - expected).max() == 0


def test_feature_rows_go_in_order(session, tiny_config):
    """Row k of the features lands on the k-th placeholder (row-major over batch, then sequence)."""
    ids, image, audio = _case(tiny_config, np.random.default_rng(3), 2, 30, 11, 9)
    (got,) = session.run(None, {INPUT_IDS: ids, IMAGE_FEATURES: image, AUDIO_FEATURES: audio})
    np.testing.assert_array_equal(got[ids == tiny_config.image_token_id], image)
    np.testing.assert_array_equal(got[ids == tiny_config.audio_token_id], audio)


def test_count_mismatch_is_an_error(session, tiny_config):
    ids, image, audio = _case(tiny_config, np.random.default_rng(4), 1, 20, 5, 0)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="ScatterND"):
        session.run(None, {INPUT_IDS: ids, IMAGE_FEATURES: image[:4], AUDIO_FEATURES: audio})


def test_io_spec(tiny_config):
    spec = EmbeddingBuilder.io_spec(tiny_config, "float16")
    hidden = tiny_config.text.hidden_size
    assert [(t.name, t.dtype, t.shape) for t in spec.inputs] == [
        ("input_ids", "int64", ("batch_size", "sequence_length")),
        ("image_features", "float16", ("num_image_tokens", hidden)),
        ("audio_features", "float16", ("num_audio_tokens", hidden)),
    ]
    assert [(t.name, t.dtype, t.shape) for t in spec.outputs] == [
        ("inputs_embeds", "float16", ("batch_size", "sequence_length", hidden)),
    ]


def test_default_layout_follows_precision(tiny_checkpoint, tiny_config):
    assert EmbeddingBuilder(tiny_config, _options(tiny_checkpoint, "fp32")).table_layout == "transposed"
    assert EmbeddingBuilder(tiny_config, _options(tiny_checkpoint, "fp16")).table_layout == "transposed"
    assert EmbeddingBuilder(tiny_config, _options(tiny_checkpoint, "int4")).table_layout == "quantized"


def test_transposed_table_is_the_lm_head_weight(tiny_checkpoint, tiny_config, tiny_weights, reference):
    """The stored table is embed_tokens.weight^T, the bytes of the tied lm_head MatMul weight [hidden, vocab]."""
    builder = EmbeddingBuilder(tiny_config, _options(tiny_checkpoint), table_layout="transposed")
    model = builder.build(tiny_weights[Component.EMBEDDING])[EMBEDDING_FILENAME]
    table = model.graph.initializers[TRANSPOSED_TOKEN_TABLE].const_value.numpy()
    lm_head = reference.model.lm_head.weight.detach().numpy().T
    assert table.shape == lm_head.shape and table.flags.c_contiguous
    assert table.tobytes() == np.ascontiguousarray(lm_head).tobytes()
    assert TOKEN_TABLE not in model.graph.initializers


def test_fp16_graph_is_valid_and_exact(tiny_checkpoint, tiny_config, tiny_weights, reference, tmp_path):
    builder = EmbeddingBuilder(tiny_config, _options(tiny_checkpoint, "fp16"))
    path = _save(builder, tiny_weights[Component.EMBEDDING], tmp_path)
    onnx.checker.check_model(str(path), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path)), check_type=True, strict_mode=True,
                                                 data_prop=True)
    output = inferred.graph.output[0]
    assert output.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    # Every float value in the graph is fp16: the dtypes chain without a Cast.
    assert "Cast" not in {node.op_type for node in inferred.graph.node}
    float_types = {v.type.tensor_type.elem_type for v in inferred.graph.value_info
                   if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    assert float_types == {onnx.TensorProto.FLOAT16}

    ids, image, audio = _case(tiny_config, np.random.default_rng(5), 1, 40, 9, 6)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {INPUT_IDS: ids, IMAGE_FEATURES: image.astype(np.float16),
                                AUDIO_FEATURES: audio.astype(np.float16)})
    expected = reference.embeddings(torch.from_numpy(ids), torch.from_numpy(image), torch.from_numpy(audio))
    assert got.dtype == np.float16
    assert np.abs(got.astype(np.float32) - expected.numpy().astype(np.float16).astype(np.float32)).max() == 0


def _external_location(path: Path, shape: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """(file, offset, length) of every external initializer of `shape` in the graph at `path`."""
    model = onnx.load(str(path), load_external_data=False)
    found = []
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL and tuple(tensor.dims) == shape:
            info = {entry.key: entry.value for entry in tensor.external_data}
            found.append((info["location"], int(info.get("offset", 0)), int(info["length"])))
    return found


@pytest.mark.parametrize("layout", ["routed", "split"])
def test_package_stores_the_table_once(layout, request, tiny_config):
    """In a built fp32 package the embedding table and every decoder's tied lm_head are the same bytes on disk."""
    package = request.getfixturevalue({"routed": "tiny_package", "split": "tiny_split_package"}[layout])
    shape = (tiny_config.text.hidden_size, tiny_config.text.vocab_size)
    table = _external_location(package / EMBEDDING_FILENAME, shape)
    assert len(table) == 1 and table[0][0] == DATA_FILE
    decoders = sorted(package.glob("phi-4-mm-text*.onnx"))
    assert len(decoders) == {"routed": 1, "split": 3}[layout]
    for decoder in decoders:
        assert _external_location(decoder, shape) == table


def test_int4_lookup_reads_the_decoders_quantized_lm_head(tmp_path, tiny_checkpoint, tiny_config, reference):
    """-p int4: the embedding dequantizes rows of the decoder's own int4 lm_head (stored once), within the 4-bit
    rounding bound of each block, and places the features exactly."""
    from builder_plugin.build import build
    from builder_plugin.spec import Component as C

    options = BuildOptions(model_dir=tiny_checkpoint, output_dir=tmp_path / "pkg", precision="int4",
                           execution_provider="cpu", lora="none", components=frozenset({C.EMBEDDING, C.DECODER}),
                           extra_options={"algo_config": "default"})
    build(options, progress=False)
    folder = tmp_path / "pkg"
    embedding = onnx.load(str(folder / EMBEDDING_FILENAME), load_external_data=False)
    decoder = onnx.load(str(folder / MAIN_DECODER), load_external_data=False)

    def locations(model):
        return {tuple((e.key, e.value) for e in t.external_data) for t in model.graph.initializer if t.external_data}

    table = locations(embedding)
    assert table and table <= locations(decoder)
    assert {n.op_type for n in embedding.graph.node} >= {"GatherBlockQuantized"}

    ids, image, audio = _case(tiny_config, np.random.default_rng(7), 1, 64, 9, 5)
    session = ort.InferenceSession(str(folder / EMBEDDING_FILENAME), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {INPUT_IDS: ids, IMAGE_FEATURES: image, AUDIO_FEATURES: audio})
    expected = reference.embeddings(torch.from_numpy(ids), torch.from_numpy(image), torch.from_numpy(audio)).numpy()
    np.testing.assert_array_equal(got[ids == tiny_config.image_token_id], image)
    np.testing.assert_array_equal(got[ids == tiny_config.audio_token_id], audio)
    text = ~np.isin(ids, (tiny_config.image_token_id, tiny_config.audio_token_id))
    block = options.block_size
    exp_blocks = expected[text].reshape(-1, tiny_config.text.hidden_size // block, block)
    err_blocks = np.abs(got[text] - expected[text]).reshape(exp_blocks.shape)
    # Symmetric 4-bit: step = absmax / 8; rounding costs half a step, clipping at +7 on the side opposite the absmax
    # value at most one step.
    bound = np.abs(exp_blocks).max(-1, keepdims=True) / 8 * 1.01
    assert (err_blocks <= bound + 1e-7).all()
    assert np.abs(got[text] - expected[text]).max() > 0  # it really is the quantized table


def _dequantized_rows(node: onnx.NodeProto, tensors: dict[str, np.ndarray], hidden: int) -> np.ndarray:
    """The float rows a MatMulNBits node multiplies by (its weight transposed, [N, K]), from its initializers."""
    attrs = {a.name: a.i for a in node.attribute}
    bits, block = attrs["bits"], attrs["block_size"]
    packed = tensors[node.input[1]].astype(np.int32)  # [N, blocks, blob]
    scales = tensors[node.input[2]].astype(np.float32)
    n, blocks, _ = packed.shape
    if bits == 4:
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, block)
    else:
        q = packed.reshape(n, blocks, block)
    if len(node.input) > 3:
        zp = tensors[node.input[3]].astype(np.int32)
        zp = np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks] if bits == 4 else zp
    else:
        zp = np.full((n, blocks), 1 << (bits - 1))
    return ((q - zp[..., None]) * scales[..., None]).reshape(n, -1)[:, :hidden]


@pytest.mark.parametrize(("precision", "extra"), [
    ("int8", {}),
    ("int4", {}),  # the default, k_quant_mixed: an int8 k_quant lm_head with zero points
    ("int4", {"algo_config": "rtn_last", "is_symmetric": "false"}),
    ("int4", {"algo_config": "default", "nodes_to_exclude": "/lm_head/MatMul"}),
])
def test_every_quantization_choice_reads_the_decoders_lm_head_stored_once(precision, extra, tmp_path,
                                                                          tiny_checkpoint, tiny_config, monkeypatch):
    """Whatever the lm_head becomes (int8, k_quant with zero points, asymmetric RTN, or float when excluded), the
    embedding reads exactly the decoder's lm_head weights, quantized once and stored once: its lookup equals the rows
    the decoder's MatMulNBits dequantizes (or multiplies by, when float)."""
    from builder_plugin.build import build
    from builder_plugin.quant import weights as quantize
    from builder_plugin.spec import Component as C

    computed = []
    compute = quantize.QuantizedWeight._compute

    def counting(self):
        computed.append(self.source.name)
        return compute(self)

    monkeypatch.setattr(quantize.QuantizedWeight, "_compute", counting)
    folder = tmp_path / "pkg"
    build(BuildOptions(model_dir=tiny_checkpoint, output_dir=folder, precision=precision, lora="none",
                       components=frozenset({C.EMBEDDING, C.DECODER}), extra_options=extra), progress=False)
    embedding = onnx.load(str(folder / EMBEDDING_FILENAME), load_external_data=False)
    decoder = onnx.load(str(folder / MAIN_DECODER))
    lm_head = next(n for n in decoder.graph.node if n.name.startswith(LM_HEAD_NODE))
    tensors = {t.name: onnx.numpy_helper.to_array(t) for t in decoder.graph.initializer}
    hidden = tiny_config.text.hidden_size
    if lm_head.op_type == "MatMulNBits":
        assert computed.count(LM_HEAD_WEIGHT) == 1
        rows = _dequantized_rows(lm_head, tensors, hidden)
        (lookup,) = [n for n in embedding.graph.node if n.op_type == "GatherBlockQuantized"]
        # the table as stored, no node over it: onnxruntime would fold one into a copy of the table of its own
        stored = {t.name for t in embedding.graph.initializer}
        assert lookup.input[0] in stored and set(lookup.input[2:]) <= stored
    else:
        assert LM_HEAD_NODE in extra.get("nodes_to_exclude", "")
        rows = tensors[lm_head.input[1]].T

    def locations(model):
        return {tuple((e.key, e.value) for e in t.external_data) for t in model.graph.initializer if t.external_data}

    decoder_locations = locations(onnx.load(str(folder / MAIN_DECODER), load_external_data=False))
    assert locations(embedding) and locations(embedding) <= decoder_locations  # no second copy of the table
    ids = np.random.default_rng(8).integers(0, tiny_config.text.vocab_size, size=(1, 50), dtype=np.int64)
    ids[np.isin(ids, (tiny_config.image_token_id, tiny_config.audio_token_id))] = 0
    session = ort.InferenceSession(str(folder / EMBEDDING_FILENAME), providers=["CPUExecutionProvider"])
    empty = np.zeros((0, hidden), np.float32)
    (got,) = session.run(None, {INPUT_IDS: ids, IMAGE_FEATURES: empty, AUDIO_FEATURES: empty})
    np.testing.assert_allclose(got[0], rows[ids[0]], rtol=1e-6, atol=1e-7)
