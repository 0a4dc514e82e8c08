"""Run onnxruntime-genai's real phi4mm MultiModalProcessor without a built package.

The processor only needs a loadable phi4mm folder (for the graph input dtypes), the processor JSONs and the tokenizer.
`processor_inputs` writes a stub folder once per (checkpoint, dtype), with placeholder graphs of the real builders' I/O
specs, and returns the tensors the runtime would feed the vision, speech and embedding graphs, as numpy arrays.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from builder_plugin.components.decoder import DecoderBuilder
from builder_plugin.components.embedding import EmbeddingBuilder
from builder_plugin.components.speech import SpeechBuilder
from builder_plugin.components.vision import VisionBuilder
from builder_plugin.config import Phi4MMConfig
from builder_plugin.graph import GraphBuilder
from builder_plugin.layout import GENAI_CONFIG_FILE, SPEECH_PROCESSOR_FILE, TOKENIZER_FILES, VISION_PROCESSOR_FILE
from builder_plugin.spec import Component, IOSpec
from genai_config import make_genai_config, speech_processor_config, vision_processor_config, write_json

# Removed by remove_stubs() or when the process exits: the stubs are rebuilt in a second.
_STUB_DIRS: dict[tuple[str, str], tempfile.TemporaryDirectory] = {}


def remove_stubs() -> None:
    """Delete the stub folders `processor_inputs` wrote (a test session does at its end)."""
    while _STUB_DIRS:
        _STUB_DIRS.popitem()[1].cleanup()


def stub_specs(config: Phi4MMConfig, io_dtype: str) -> dict[Component, IOSpec]:
    """The real builders' I/O specs (the decoder's as a cpu build without self-routing declares it), so a renamed
    tensor reaches the stub package and the runtime reading it (the processor reads only the input dtypes)."""
    return {builder.component: builder.io_spec(config, io_dtype)
            for builder in (VisionBuilder, SpeechBuilder, EmbeddingBuilder, DecoderBuilder)}


def _stub_graph(name: str, spec: IOSpec) -> ir.Model:
    g = GraphBuilder(name, spec)
    for out in spec.outputs:
        dims = [d if isinstance(d, int) else 1 for d in out.shape]
        zeros = g.op("ConstantOfShape", g.const(dims), value=ir.tensor(np.zeros(1, dtype=np.float32)))
        if out.dtype != "float32":
            zeros = g.op("Cast", zeros, to=out.onnx_dtype)
        g.output(out.name, zeros)
    return g.model()


def stub_package(config: Phi4MMConfig, tokenizer_dir: Path, out_dir: Path, io_dtype: str = "float32") -> Path:
    specs = stub_specs(config, io_dtype)
    filenames = {c: f"stub-{c.value}.onnx" for c in specs}
    out_dir.mkdir(parents=True, exist_ok=True)
    for component, spec in specs.items():
        ir.save(_stub_graph(component.value, spec), out_dir / filenames[component])
    genai = make_genai_config(config, specs, filenames, share_kv_buffer=False, max_length=4096)
    write_json(out_dir / GENAI_CONFIG_FILE, genai)
    write_json(out_dir / VISION_PROCESSOR_FILE, vision_processor_config(config.vision.crop_size))
    write_json(out_dir / SPEECH_PROCESSOR_FILE, speech_processor_config(config.audio.compression_rate))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def processor_inputs(
    checkpoint_dir: str | Path,
    prompt: str,
    images: Sequence[str | Path] = (),
    audios: Sequence[str | Path] = (),
    io_dtype: str = "float32",
) -> dict[str, np.ndarray]:
    """The tensors onnxruntime-genai's phi4mm processor makes for this prompt and media, as numpy arrays
    (int64 where the runtime uses int64; input_ids as the processor emits them)."""
    import onnxruntime_genai as og

    checkpoint_dir = Path(checkpoint_dir)
    key = (str(checkpoint_dir.resolve()), io_dtype)
    if key not in _STUB_DIRS:
        folder = tempfile.TemporaryDirectory(prefix="phi4mm-stub-")
        stub_package(Phi4MMConfig.from_dir(checkpoint_dir), checkpoint_dir, Path(folder.name), io_dtype)
        _STUB_DIRS[key] = folder
    model = og.Model(_STUB_DIRS[key].name)
    processor = model.create_multimodal_processor()
    og_images = og.Images.open(*[str(p) for p in images]) if images else None
    og_audios = og.Audios.open(*[str(p) for p in audios]) if audios else None
    named = processor(prompt, images=og_images, audios=og_audios)
    out = {}
    for name in named.keys():
        array = named[name].as_numpy()
        out[name] = array.astype(np.int64) if array.dtype.kind == "i" and array.dtype.itemsize == 8 else array
    return out
