"""Speech graph: parity with the native conformer (each clip encoded alone) on the tensors ORT GenAI's processor
makes from synthetic wavs."""

from __future__ import annotations

import dataclasses
import json
import math
import wave
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file
from transformers import Phi4MultimodalConfig
from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalAudioEmbedding

from builder_plugin.checkpoint.reader import CheckpointReader, TensorRef
from builder_plugin.checkpoint.routing import route_weights
from builder_plugin.components.speech import SPEECH_FILENAME, SpeechBuilder, check_supported
from builder_plugin.config import Phi4MMConfig
from builder_plugin.errors import UnsupportedModelError
from builder_plugin.layout import AUDIO_FEATURES
from builder_plugin.options import BuildOptions
from builder_plugin.spec import Component, check_io
from builder_plugin.testing.media import make_wav
from tests.support.processor import processor_inputs

ATOL = 1e-4
PROJECTIONS = {2: "speech", 3: "vision"}  # audio_projection_mode -> the reference's projection pair

# name -> wav files (from the shared media_dir, or made here) fed to the processor in one call.
CASES = {
    "0.5s": ["clip_0_5s.wav"],
    "2s": ["clip_2s.wav"],
    "12s": ["clip_12s.wav"],
    "2s_8k": ["clip_2s_8k.wav"],
    "3s_48k": ["clip_3s_48k.wav"],
    "45s_chunked": ["clip_45s.wav"],
    "2s+12s": ["clip_2s.wav", "clip_12s.wav"],
    # Chunked layout with short clips, an odd frame count (99: the first conv reads past the last valid frame) and
    # a long clip that is not the longest (its chunk tail must be zeroed like the original's padding).
    "45s+1.01s+3s_48k+50s": ["clip_45s.wav", "clip_1_01s.wav", "clip_3s_48k.wav", "clip_50s.wav"],
}
EXTRA_WAVS = {"clip_1_01s.wav": (1.01, 16000), "clip_50s.wav": (50.0, 16000)}


def _build(config, weights, precision: str, folder: Path) -> tuple[ir.Model, Path]:
    options = BuildOptions(model_dir=folder, output_dir=folder, precision=precision)
    models = SpeechBuilder(config, options).build(weights[Component.SPEECH])
    assert list(models) == [SPEECH_FILENAME]
    model = models[SPEECH_FILENAME]
    path = folder / f"{precision}-{SPEECH_FILENAME}"
    ir.save(model, path, external_data=path.name + ".data")
    return model, path


@pytest.fixture(scope="module")
def fp32_build(tiny_config, tiny_weights, tmp_path_factory) -> tuple[ir.Model, ort.InferenceSession]:
    model, path = _build(tiny_config, tiny_weights, "fp32", tmp_path_factory.mktemp("speech32"))
    return model, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def fp32_session(fp32_build) -> ort.InferenceSession:
    return fp32_build[1]


@pytest.fixture(scope="module")
def wav_dir(media_dir: Path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("speech_media")
    for name in {n for files in CASES.values() for n in files}:
        if name in EXTRA_WAVS:
            seconds, rate = EXTRA_WAVS[name]
            make_wav(folder / name, seconds, sample_rate=rate, seed=len(name))
        else:
            (folder / name).symlink_to(media_dir / name)
    return folder


@pytest.fixture(scope="module")
def processed(tiny_checkpoint: Path, wav_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """Processor outputs per case, computed on first use."""

    class Cache(dict):
        def __missing__(self, case: str) -> dict[str, np.ndarray]:
            files = [wav_dir / name for name in CASES[case]]
            tags = "".join(f"<|audio_{i + 1}|>" for i in range(len(files)))
            self[case] = processor_inputs(tiny_checkpoint, f"<|user|>{tags}Transcribe.<|end|><|assistant|>",
                                          audios=files)
            return self[case]

    return Cache()


def _expected_frames(path: Path) -> int:
    """Log-mel frames of the whole wav (no truncation): 10 ms hop at 16 kHz (rates above are downsampled) or 8 kHz."""
    with wave.open(str(path)) as wav:
        samples, rate = wav.getnframes(), wav.getframerate()
    if rate == 8000:
        return (samples - 200) // 80 + 1
    samples_16k = samples * 16000 // rate
    return (samples_16k - 400) // 160 + 1


def _run(session: ort.InferenceSession, inputs: dict[str, np.ndarray], mode: int) -> np.ndarray:
    feed = {name: inputs[name] for name in ("audio_embeds", "audio_attention_mask", "audio_sizes")}
    feed["audio_projection_mode"] = np.array([mode], dtype=np.int64)
    return session.run([AUDIO_FEATURES], feed)[0]


@pytest.mark.parametrize("mode", sorted(PROJECTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_native_per_clip(case, mode, processed, fp32_session, reference, tiny_config, wav_dir):
    inputs = processed[case]
    frames = inputs["audio_attention_mask"].sum(axis=1)
    assert frames.tolist() == [_expected_frames(wav_dir / name) for name in CASES[case]], "frames truncated?"
    sizes = inputs["audio_sizes"]
    assert sizes.tolist() == [math.ceil(f / tiny_config.audio.compression_rate) for f in frames]
    if case.startswith("45s"):
        assert sizes.max() > 500, "the 45 s clip must take the chunked (>500 subsampled frames) path"

    got = _run(fp32_session, inputs, mode)
    want = reference.audio_features(inputs["audio_embeds"], inputs["audio_attention_mask"], sizes,
                                    projection=PROJECTIONS[mode]).numpy()
    assert got.shape == (int(sizes.sum()), tiny_config.text.hidden_size)
    assert got.shape == want.shape
    diff = np.abs(got - want)
    assert diff.max() <= ATOL, f"max abs diff {diff.max():.3g} (reference max {np.abs(want).max():.3g})"


def test_projection_modes_differ(processed, fp32_session):
    """Mode 3 must not silently reuse the speech pair (the parity test would pass with identical random pairs)."""
    inputs = processed["2s"]
    assert np.abs(_run(fp32_session, inputs, 2) - _run(fp32_session, inputs, 3)).max() > 1e-2


def test_fp16_build_is_valid_and_close(tiny_config, tiny_weights, tmp_path, processed, reference):
    model, path = _build(tiny_config, tiny_weights, "fp16", tmp_path)
    check_io(model, SpeechBuilder.io_spec(tiny_config, "float16"), "speech")
    onnx.checker.check_model(str(path), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True, check_type=True)
    assert inferred.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
    stray = [init.name for init in inferred.graph.initializer
             if init.data_type in float_types and init.data_type != onnx.TensorProto.FLOAT16]
    assert not stray, f"fp32 initializers in the fp16 build: {stray[:5]}"

    inputs = processed["2s+12s"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {name: inputs[name] for name in ("audio_attention_mask", "audio_sizes")}
    feed["audio_embeds"] = inputs["audio_embeds"].astype(np.float16)
    feed["audio_projection_mode"] = np.array([2], dtype=np.int64)
    got = session.run([AUDIO_FEATURES], feed)[0]
    want = reference.audio_features(inputs["audio_embeds"], inputs["audio_attention_mask"], inputs["audio_sizes"],
                                    projection="speech").numpy()
    assert got.dtype == np.float16 and got.shape == want.shape
    assert np.abs(got.astype(np.float32) - want).max() <= 2e-2 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("io_dtype", ["float32", "float16"])
def test_io_spec_names_and_sizes(io_dtype, tiny_config):
    spec = SpeechBuilder.io_spec(tiny_config, io_dtype)
    assert spec.input_names == ("audio_embeds", "audio_attention_mask", "audio_sizes", "audio_projection_mode")
    assert spec.output_names == ("audio_features",)
    assert spec.input("audio_embeds").shape[-1] == tiny_config.audio.input_size
    assert spec.output("audio_features").shape == ("num_audio_tokens", tiny_config.text.hidden_size)


def test_fp32_graph_io_matches_spec(fp32_build, tiny_config):
    model, session = fp32_build
    spec = SpeechBuilder.io_spec(tiny_config, "float32")
    check_io(model, spec, "speech")
    onnx_types = {"float32": "tensor(float)", "bool": "tensor(bool)", "int64": "tensor(int64)"}
    got_inputs = [(i.name, i.type) for i in session.get_inputs()]
    assert got_inputs == [(s.name, onnx_types[s.dtype]) for s in spec.inputs]
    assert [(o.name, o.type) for o in session.get_outputs()] == [("audio_features", "tensor(float)")]


@pytest.mark.parametrize("change", [{"chunk_size": 18}, {"causal": False}, {"batch_norm": True},
                                    {"input_layer": "conv2d"}, {"activation": "tanh"}, {"time_reduction": 6},
                                    {"bias_symmetric": True}])
def test_unsupported_encoder_variants_are_rejected(change, tiny_config):
    with pytest.raises(UnsupportedModelError):
        check_supported(dataclasses.replace(tiny_config.audio, **change))


def test_native_format_checkpoint_parity(tiny_native_checkpoint, native_reference, processed, tmp_path):
    """The same graph from a transformers-native checkpoint (routing renames) against the reference loaded from it."""
    config = Phi4MMConfig.from_dir(tiny_native_checkpoint)
    weights = route_weights(CheckpointReader(tiny_native_checkpoint, config.source_format), config)
    _, path = _build(config, weights, "fp32", tmp_path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = processed["2s+12s"]
    got = _run(session, inputs, 3)
    want = native_reference.audio_features(
        inputs["audio_embeds"], inputs["audio_attention_mask"], inputs["audio_sizes"], projection="vision").numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= ATOL


VARIANT_AUDIO_CONFIGS = {
    # Sizes unlike the release: ÷16 with a kernel-5 depthwise conv of multiplier 2, and ÷4 with kernel 1, 3 heads and
    # a 7-frame bias clamp; the lengths mix chunked and short clips.
    "div16_k5_mult2": dict(hidden_size=32, intermediate_size=48, num_blocks=2, num_attention_heads=4,
                           ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=16,
                           input_size=64, time_reduction=16, bias_max_distance=20, kernel_size=5,
                           depthwise_multiplier=2),
    "div4_k1_h3": dict(hidden_size=24, intermediate_size=40, num_blocks=1, num_attention_heads=3,
                       ext_pw_out_channel=24, depthwise_separable_out_channel=24, nemo_conv_channels=8, input_size=80,
                       time_reduction=4, bias_max_distance=7, kernel_size=1),
}


@pytest.mark.parametrize("variant", list(VARIANT_AUDIO_CONFIGS))
def test_other_encoder_sizes_match_native_module(variant, tmp_path):
    """Nothing is tied to the release sizes: a native-config encoder of other shapes, weights drawn at random, against
    transformers' Phi4MultimodalAudioEmbedding run clip by clip without a mask."""
    audio = VARIANT_AUDIO_CONFIGS[variant]
    native = Phi4MultimodalConfig(
        hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=200064, max_position_embeddings=8192, original_max_position_embeddings=4096,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0] * 9, long_factor=[2.0] * 9),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2),
        audio_config=audio,
    )
    torch.manual_seed(0)
    module = Phi4MultimodalAudioEmbedding(native).eval()
    with torch.no_grad():
        for param in module.parameters():  # b1/b2 start at zero and biases small: give every tensor an effect
            param.copy_(torch.randn_like(param) * (0.3 if param.dim() == 1 else param[0].numel() ** -0.5))
        norm = module.encoder.encoder_embedding
        norm.global_mean.copy_(torch.randn_like(norm.global_mean))
        norm.global_invstd.copy_(torch.rand_like(norm.global_invstd) + 0.5)
    (tmp_path / "config.json").write_text(json.dumps(native.to_dict()))
    state = {name: tensor.contiguous() for name, tensor in module.state_dict().items()}
    save_file(state, str(tmp_path / "audio.safetensors"))
    file = tmp_path / "audio.safetensors"
    weights = {name: TensorRef(name, file, tuple(t.shape), "F32") for name, t in state.items()}
    config = Phi4MMConfig.from_dir(tmp_path)

    options = BuildOptions(model_dir=tmp_path, output_dir=tmp_path, precision="fp32")
    model = SpeechBuilder(config, options).build(weights)[SPEECH_FILENAME]
    path = tmp_path / SPEECH_FILENAME
    ir.save(model, path, external_data=path.name + ".data")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    rng = np.random.default_rng(1)
    lengths = [8999, 333, 77]
    features = np.zeros((len(lengths), max(lengths), audio["input_size"]), dtype=np.float32)
    mask = np.zeros(features.shape[:2], dtype=bool)
    for clip, n in enumerate(lengths):
        features[clip, :n] = rng.standard_normal((n, audio["input_size"])) * 2
        mask[clip, :n] = True
    sizes = np.array([math.ceil(n / audio["time_reduction"]) for n in lengths], dtype=np.int64)
    got = _run(session, dict(audio_embeds=features, audio_attention_mask=mask, audio_sizes=sizes), 3)

    rows = []
    with torch.no_grad():
        for clip, (n, size) in enumerate(zip(lengths, sizes)):
            hidden = module.encoder(torch.from_numpy(features[clip : clip + 1, :n]), None)[0, :size]
            hidden = torch.nn.functional.gelu(module.up_proj_for_vision_speech(hidden))
            rows.append(module.down_proj_for_vision_speech(hidden))
    want = torch.cat(rows).numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= ATOL
