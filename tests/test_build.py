"""Build pipeline options that shape the package: component subsets and LoRA choices."""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime_genai as og

from builder_plugin import cli
from builder_plugin.layout import GENAI_CONFIG_FILE, GRAPH_FILES, SPEECH_PROCESSOR_FILE, Component


def test_package_without_speech_loads_and_answers(tmp_path: Path, tiny_checkpoint: Path, media_dir: Path) -> None:
    out = tmp_path / "no-speech"
    assert cli.main(["-i", str(tiny_checkpoint), "-o", str(out), "-p", "fp32", "--components", "vision,text",
                     "--lora", "none", "--no-progress", "--max-length", "2048"]) == 0
    files = {p.name for p in out.iterdir()}
    assert GRAPH_FILES[Component.SPEECH] not in files and SPEECH_PROCESSOR_FILE not in files
    config = json.loads((out / GENAI_CONFIG_FILE).read_text())
    assert config["model"]["speech"] == {"config_filename": ""} and config["search"]["max_length"] == 2048
    model = og.Model(str(out))
    processor = model.create_multimodal_processor()
    inputs = processor("<|user|><|image_1|>What is this?<|end|><|assistant|>",
                       images=og.Images.open(str(media_dir / "square.png")))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=2048)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    for _ in range(3):
        generator.generate_next_token()
    assert len(generator.get_sequence(0)) > 545  # the 448x448 image alone expands to 545 tokens


def test_graph_subset_writes_no_runtime_config(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    out = tmp_path / "speech-only"
    assert cli.main(["-i", str(tiny_checkpoint), "-o", str(out), "-p", "fp32", "--components", "speech",
                     "--no-progress"]) == 0
    assert (out / GRAPH_FILES[Component.SPEECH]).is_file() and not (out / GENAI_CONFIG_FILE).exists()
    assert "graphs only" in capsys.readouterr().out
