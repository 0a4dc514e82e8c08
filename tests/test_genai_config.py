import json
from pathlib import Path

import onnxruntime_genai as og
import pytest

from builder_plugin.layout import GENAI_CONFIG_FILE
from builder_plugin.spec import Component
from genai_config import make_genai_config, speech_processor_config, vision_processor_config
from tests.support.processor import stub_package, stub_specs


def test_config_names_come_from_the_specs(tiny_config) -> None:
    specs = stub_specs(tiny_config, "float32")  # the builders' own io_spec of every graph
    files = {c: f"{c.value}.onnx" for c in specs}
    cfg = make_genai_config(tiny_config, specs, files, "cpu")
    model = cfg["model"]
    assert model["type"] == "phi4mm"
    assert model["vision"]["inputs"] == {"pixel_values": "pixel_values", "attention_mask": "image_attention_mask",
                                         "image_sizes": "image_sizes"}
    assert model["speech"]["inputs"]["attention_mask"] == "audio_attention_mask"
    assert model["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert model["decoder"]["outputs"]["present_value_names"] == "present.%d.value"
    assert model["eos_token_id"] == [200020, 199999]
    assert cfg["search"]["max_length"] == 16384 and cfg["search"]["max_length"] <= model["context_length"]
    cuda = make_genai_config(tiny_config, specs, files, "cuda", max_length=2048)
    assert cuda["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {"enable_cuda_graph": "0"}}]
    assert cuda["search"]["max_length"] == 2048
    with pytest.raises(ValueError, match="context length"):
        make_genai_config(tiny_config, specs, files, "cpu", max_length=10**7)


def test_runtime_loads_full_and_speechless_configs(tmp_path: Path, tiny_config, tiny_checkpoint: Path) -> None:
    folder = stub_package(tiny_config, tiny_checkpoint, tmp_path / "pkg")
    config = og.Config(str(folder))
    model = og.Model(config)
    assert model.type == "phi4mm"
    model.create_multimodal_processor()

    specs = stub_specs(tiny_config, "float32")
    specs.pop(Component.SPEECH)
    cfg = make_genai_config(tiny_config, specs, {c: f"stub-{c.value}.onnx" for c in specs}, "cpu",
                            share_kv_buffer=False)
    assert cfg["model"]["speech"] == {"config_filename": ""}
    (folder / GENAI_CONFIG_FILE).write_text(json.dumps(cfg))
    og.Model(str(folder)).create_multimodal_processor()


def test_processor_configs_have_aligners_and_no_30s_cap() -> None:
    vision = vision_processor_config(448)
    assert vision["processor"]["output_aligner"] == "phi4-vision-aligner"
    speech = speech_processor_config(8)
    assert speech["feature_extraction"]["output_aligner"] == "phi4-audio-aligner"
    assert speech["feature_extraction"]["sequence"][0]["operation"]["attrs"]["max_samples"] == 0


def test_float_weight_sessions_run_unpacked_on_cpu(tiny_config) -> None:
    specs = stub_specs(tiny_config, "float32")
    files = {c: f"{c.value}.onnx" for c in specs}
    unpacked = {"session.disable_prepacking": "1"}

    fp32 = {Component.VISION: False, Component.SPEECH: False, Component.DECODER: False}  # the embedding: no MatMul
    every = make_genai_config(tiny_config, specs, files, "cpu", prepacking=fp32)["model"]
    assert every["decoder"]["session_options"].items() >= unpacked.items()
    assert all("session_options" not in every[c] for c in ("vision", "speech", "embedding"))  # the decoder's fallback

    float_encoders = {**fp32, Component.DECODER: True}
    encoders = make_genai_config(tiny_config, specs, files, "cpu", prepacking=float_encoders)["model"]
    assert "session.disable_prepacking" not in encoders["decoder"]["session_options"]
    for section in ("vision", "speech"):
        assert encoders[section]["session_options"] == {**encoders["decoder"]["session_options"], **unpacked}
    assert "session_options" not in encoders["embedding"]

    inverse = {Component.VISION: True, Component.DECODER: False}
    mixed = make_genai_config(tiny_config, specs, files, "cpu", prepacking=inverse)["model"]
    assert mixed["vision"]["session_options"] == {"log_id": "onnxruntime-genai", "provider_options": []}
    assert "session_options" not in mixed["speech"] and "session_options" not in mixed["embedding"]

    cuda = make_genai_config(tiny_config, specs, files, "cuda", prepacking=fp32)["model"]
    assert all("session.disable_prepacking" not in cuda[c].get("session_options", {}) for c in cuda
               if isinstance(cuda[c], dict))


def test_built_packages_unpack_exactly_their_float_graphs(tmp_path_factory, tiny_package, tiny_checkpoint) -> None:
    from builder_plugin.build import build
    from builder_plugin.options import BuildOptions

    fp32 = json.loads((tiny_package / GENAI_CONFIG_FILE).read_text())["model"]
    assert fp32["decoder"]["session_options"]["session.disable_prepacking"] == "1"
    assert all("session_options" not in fp32[c] for c in ("vision", "speech", "embedding"))
    output = tmp_path_factory.mktemp("float-encoders") / "package"
    build(BuildOptions(model_dir=tiny_checkpoint, output_dir=output, precision="int4", lora="none",
                       quantize_encoders=False, max_length=256), progress=False)
    int4 = json.loads((output / GENAI_CONFIG_FILE).read_text())["model"]
    assert "session.disable_prepacking" not in int4["decoder"]["session_options"]  # MatMulNBits: packed is fast
    assert int4["vision"]["session_options"]["session.disable_prepacking"] == "1"
    assert int4["speech"]["session_options"]["session.disable_prepacking"] == "1"
    assert "session_options" not in int4["embedding"]
    og.Model(str(output)).create_multimodal_processor()  # the runtime takes the per-section options
