"""The vision graph against transformers' native image embedding (eager, fp32), fed the tensors that
onnxruntime-genai's real phi4mm processor makes from image files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from builder_plugin.components.vision import VISION_FILENAME, VisionBuilder
from builder_plugin.config import Phi4MMConfig
from builder_plugin.options import BuildOptions
from builder_plugin.spec import Component, check_io
from tests.support.processor import processor_inputs

ATOL = 1e-4
FUSED_VS_UNFUSED_ATOL = 1e-5
GRAPH_INPUTS = ("pixel_values", "image_attention_mask", "image_sizes")


def _options(checkpoint: Path, out: Path, precision: str) -> BuildOptions:
    return BuildOptions(model_dir=checkpoint, output_dir=out, precision=precision)


def _build_and_save(config: Phi4MMConfig, weights: Mapping, options: BuildOptions, folder: Path,
                    fused_ops: bool = True) -> Path:
    builder = VisionBuilder(config, options, fused_ops=fused_ops)
    models = builder.build(weights)
    assert list(models) == [VISION_FILENAME]
    model = builder.finish(models[VISION_FILENAME], VISION_FILENAME)
    check_io(model, VisionBuilder.io_spec(config, options.io_dtype), VISION_FILENAME)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / VISION_FILENAME
    ir.save(model, path, external_data=VISION_FILENAME + ".data")
    return path


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def vision_weights(tiny_weights):
    return tiny_weights[Component.VISION]


@pytest.fixture(scope="module")
def fp32_session(tiny_checkpoint, tiny_config, vision_weights, tmp_path_factory) -> ort.InferenceSession:
    out = tmp_path_factory.mktemp("vision-fp32")
    return _session(_build_and_save(tiny_config, vision_weights, _options(tiny_checkpoint, out, "fp32"), out))


def _processed(checkpoint: Path, images: Sequence[Path]) -> dict[str, np.ndarray]:
    tags = "".join(f"<|image_{i + 1}|>" for i in range(len(images)))
    return processor_inputs(checkpoint, f"<|user|>{tags}Describe.<|end|><|assistant|>", images=list(images))


@pytest.mark.parametrize(
    "names",
    [
        ["square.png"],  # 448x448: 1 sub-crop, no padding
        ["wide.jpg"],  # 640x360 JPEG: padded rows
        ["tall.png"],  # 300x900: 3x1 grid, padded columns
        ["tiny.png"],  # 50x50: upscaled
        ["strip.jpg"],  # 2000x200: extreme aspect, a 1x5 grid
        ["photo.jpg"],  # 4000x3000: the aspect-ratio fallback grid, many crops
        ["tall.png", "square.png"],  # two images with different crop counts: batch-padding crops
    ],
    ids=lambda names: "+".join(n.split(".")[0] for n in names),
)
def test_matches_native_image_embedding(names, tiny_checkpoint, media_dir, reference, fp32_session):
    inputs = _processed(tiny_checkpoint, [media_dir / n for n in names])
    feeds = {name: inputs[name] for name in GRAPH_INPUTS}
    (features,) = fp32_session.run(None, feeds)

    expected_rows = int(inputs["num_image_tokens"].sum())
    assert features.shape[0] == expected_rows
    expected = reference.image_features(**feeds).numpy()
    assert features.shape == expected.shape
    np.testing.assert_allclose(features, expected, rtol=0, atol=ATOL)


def test_fused_ops_match_primitive_ops(tiny_checkpoint, tiny_config, vision_weights, media_dir, fp32_session,
                                       tmp_path):
    """LayerNormalization / Gelu / MultiHeadAttention give the same numbers as the ops spelled out."""
    path = _build_and_save(tiny_config, vision_weights, _options(tiny_checkpoint, tmp_path, "fp32"), tmp_path,
                           fused_ops=False)
    inputs = _processed(tiny_checkpoint, [media_dir / "wide.jpg", media_dir / "tall.png"])
    feeds = {name: inputs[name] for name in GRAPH_INPUTS}
    (unfused,) = _session(path).run(None, feeds)
    (fused,) = fp32_session.run(None, feeds)
    np.testing.assert_allclose(fused, unfused, rtol=0, atol=FUSED_VS_UNFUSED_ATOL)

    fused_ops = {node.op_type for node in onnx.load(path, load_external_data=False).graph.node}
    assert not fused_ops & {"MultiHeadAttention", "LayerNormalization", "Gelu"}


def test_fused_graph_uses_ort_kernels(tiny_checkpoint, tiny_config, vision_weights, tmp_path):
    model = VisionBuilder(tiny_config, _options(tiny_checkpoint, tmp_path, "fp32")).build(vision_weights)[
        VISION_FILENAME]
    counts: dict[str, int] = {}
    for node in model.graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    layers = tiny_config.vision.num_layers_used
    assert counts.get("MultiHeadAttention") == layers
    assert counts.get("LayerNormalization") == 2 * layers
    assert counts.get("Gelu") == layers + 1  # SigLIP MLPs (tanh) + the projection (erf)


def test_linears_are_matmul_plus_bias(tiny_checkpoint, tiny_config, vision_weights, tmp_path):
    """The int4 pass rewrites MatMul(x, W[in, out] constant); every Linear must look like that."""
    model = VisionBuilder(tiny_config, _options(tiny_checkpoint, tmp_path, "fp32")).build(vision_weights)[
        VISION_FILENAME]
    weight_matmuls = [n for n in model.graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None]
    layers, c, h = tiny_config.vision.num_layers_used, tiny_config.vision.hidden_size, tiny_config.text.hidden_size
    assert len(weight_matmuls) == 6 * layers + 2
    shapes = set()
    for node in weight_matmuls:
        weight = node.inputs[1]
        shapes.add(tuple(weight.shape))
        (consumer,) = list(node.outputs[0].uses())
        bias = consumer.node.inputs[1 - consumer.idx]
        assert consumer.node.op_type == "Add" and bias.const_value is not None
        assert tuple(bias.shape) == (weight.shape[1],)
    assert (c, tiny_config.vision.intermediate_size) in shapes and (c, h) in shapes and (h, h) in shapes


def test_fp16_build_is_valid_onnx(tiny_checkpoint, tiny_config, vision_weights, tmp_path):
    options = _options(tiny_checkpoint, tmp_path, "fp16")
    path = _build_and_save(tiny_config, vision_weights, options, tmp_path)
    onnx.checker.check_model(str(path), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path)), check_type=True, strict_mode=True)
    (output,) = inferred.graph.output
    assert output.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    initializers = {i.name: i.data_type for i in onnx.load(str(path), load_external_data=False).graph.initializer}
    checkpoint_weights = {name: initializers[name] for name in vision_weights if name in initializers}
    assert len(checkpoint_weights) > 10
    assert set(checkpoint_weights.values()) == {onnx.TensorProto.FLOAT16}


def test_io_spec_follows_config(tiny_config):
    spec = VisionBuilder.io_spec(tiny_config, "float16")
    v = tiny_config.vision
    assert spec.input_names == GRAPH_INPUTS
    assert spec.output_names == ("image_features",)
    assert spec.input("pixel_values").shape[2:] == (3, v.image_size, v.image_size)
    assert spec.input("image_attention_mask").shape[2:] == (v.patches_per_side, v.patches_per_side)
    assert spec.input("image_sizes").dtype == "int64"
    assert spec.output("image_features").shape[1] == tiny_config.text.hidden_size
    assert {s.dtype for s in (spec.input("pixel_values"), spec.input("image_attention_mask"),
                              spec.output("image_features"))} == {"float16"}


# ---- a SigLIP of other sizes: odd patch grid (reflection-padded pooling), image_size != crop_size, 3 heads ----------

ODD_VISION = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=3, image_size=434,
                  patch_size=14, crop_size=448, feature_layer=-2, hidden_act="gelu_pytorch_tanh")


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory) -> Path:
    """A native-format checkpoint (transformers' own save) with a 31x31 patch grid and 3 attention heads."""
    import torch
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    config = Phi4MultimodalConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, original_max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=[2], pad_token_id=0, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0] * 12, long_factor=[1.0] * 12, original_max_position_embeddings=1024),
        vision_config=dict(ODD_VISION, image_token_id=3),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32,
                          bias_max_distance=500, audio_token_id=4),
    )
    torch.manual_seed(1)
    model = Phi4MultimodalForCausalLM(config).eval()
    with torch.no_grad():  # transformers' SigLIP init (unit-std q/k/v) saturates attention; keep activations O(1)
        for name, param in model.named_parameters():
            if "image_embed" in name:
                fan_in = param[0].numel() if param.dim() > 1 else 1
                param.normal_(0.0, fan_in**-0.5 if param.dim() > 1 else 0.1)
    folder = tmp_path_factory.mktemp("vision-odd") / "ckpt"
    model.save_pretrained(folder)
    return folder


def _synthetic_inputs(vision: Phi4MMConfig, grids: Sequence[tuple[int, int, int, int]], seed: int = 0):
    """Processor-shaped inputs for grids (h, w, padded patch rows, padded patch columns) of the HD canvas."""
    v = vision.vision
    rng = np.random.default_rng(seed)
    side, patches = v.image_size, v.patches_per_side
    max_crops = max(1 + h * w for h, w, *_ in grids)
    pixels = np.zeros((len(grids), max_crops, 3, side, side), np.float32)
    mask = np.ones((len(grids), max_crops, patches, patches), np.float32)
    sizes = np.zeros((len(grids), 2), np.int64)
    for b, (h, w, pad_rows, pad_cols) in enumerate(grids):
        pixels[b, : 1 + h * w] = rng.uniform(-1, 1, (1 + h * w, 3, side, side))
        canvas = np.ones((patches * h, patches * w), np.float32)
        canvas[canvas.shape[0] - pad_rows:, :] = 0
        canvas[:, canvas.shape[1] - pad_cols:] = 0
        for i in range(h):
            for j in range(w):
                mask[b, 1 + i * w + j] = canvas[i * patches:(i + 1) * patches, j * patches:(j + 1) * patches]
        sizes[b] = (v.crop_size * h, v.crop_size * w)
    return {"pixel_values": pixels, "image_attention_mask": mask, "image_sizes": sizes}


def test_other_sizes_odd_patch_grid(odd_checkpoint, tmp_path):
    from builder_plugin.checkpoint.reader import CheckpointReader
    from builder_plugin.checkpoint.routing import route_weights
    from builder_plugin.reference.model import Reference

    config = Phi4MMConfig.from_dir(odd_checkpoint)
    assert config.vision.patches_per_side % 2 == 1 and config.vision.image_size != config.vision.crop_size
    weights = route_weights(CheckpointReader(odd_checkpoint, config.source_format), config)[Component.VISION]
    session = _session(_build_and_save(config, weights, _options(odd_checkpoint, tmp_path, "fp32"), tmp_path))
    reference = Reference.load(odd_checkpoint)
    # padding of 3 rows, of 40 columns (a whole sub-crop column plus 9), none; batched with different crop counts
    feeds = _synthetic_inputs(config, [(2, 1, 3, 0), (1, 3, 0, 40), (1, 1, 0, 0)])
    (features,) = session.run(None, feeds)
    expected = reference.image_features(**feeds).numpy()
    assert features.shape == (sum(reference.num_image_tokens(feeds["image_attention_mask"], feeds["image_sizes"])),
                              config.text.hidden_size)
    np.testing.assert_allclose(features, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize(("provider", "scanned"), [("cpu", True), ("cuda", False)])
def test_siglip_runs_one_crop_at_a_time_on_cpu(provider, scanned, tiny_checkpoint, tiny_config, vision_weights,
                                               tmp_path):
    """A CPU package's encoder layers are the body of one Scan over the crops (vision_scan.py), its weights read
    from the main graph; other providers keep the batch."""
    options = BuildOptions(model_dir=tiny_checkpoint, output_dir=tmp_path, precision="fp32",
                           execution_provider=provider)
    builder = VisionBuilder(tiny_config, options)
    model = builder.finish(builder.build(vision_weights)[VISION_FILENAME], VISION_FILENAME)
    scans = [node for node in model.graph if node.op_type == "Scan"]
    outside = [node.op_type for node in model.graph]
    layers = tiny_config.vision.num_layers_used
    if not scanned:
        assert not scans and outside.count("MultiHeadAttention") == layers
        return
    (scan,) = scans
    body = scan.attributes["body"].value
    inside = [node.op_type for node in body]
    assert inside.count("MultiHeadAttention") == layers and "Conv" in inside
    assert "MultiHeadAttention" not in outside and "Conv" not in outside
    assert not body.initializers  # the weights stay in the main graph
