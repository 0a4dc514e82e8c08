"""Setup of the run-time benchmark, not timed: full-width checkpoints, the fp32 / int4 CPU packages built from them
(cached in the work folder by recipe and builder fingerprint), the media files and the prompts."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import GB, ROOT, peak_rss_bytes, write_json
from benchmarks.runtime_bench import MODULE, PRECISIONS

VISION_LAYERS = 4
AUDIO_BLOCKS = 4
TEXT_PROMPT_TOKENS = 100
FILLER = ("The quick brown fox jumps over the lazy dog while seven wizards quietly box with jumping frogs near "
          "the old river bank, and every morning the baker counts loaves of warm bread before the market opens. ")


@dataclass(frozen=True)
class Prompt:
    name: str
    mode: str  # text | vision | speech: which decoder variant (LoRA) answers
    text: str
    images: tuple[str, ...] = ()
    audios: tuple[str, ...] = ()


def _recipe_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.recipe.json"


def _cached(folder: Path, recipe: dict[str, Any]) -> bool:
    marker = _recipe_file(folder)
    return folder.is_dir() and marker.is_file() and json.loads(marker.read_text()) == recipe


def _mark(folder: Path, recipe: dict[str, Any]) -> None:
    _recipe_file(folder).write_text(json.dumps(recipe))


def prepare_checkpoint(work: Path, text_layers: int) -> Path:
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    folder = work / f"checkpoint-full-text{text_layers}"
    recipe = {"preset": "full", "seed": 0, "text_layers": text_layers, "vision_layers": VISION_LAYERS,
              "audio_blocks": AUDIO_BLOCKS}
    if not _cached(folder, recipe):
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        make_checkpoint(folder, preset="full", seed=0, text_layers=text_layers, vision_layers=VISION_LAYERS,
                        audio_blocks=AUDIO_BLOCKS)
        _mark(folder, recipe)
        print(f"checkpoint ({text_layers} text layers) written in {time.perf_counter() - start:.0f} s: {folder}",
              flush=True)
    return folder


def prepare_checkpoints(work: Path, text_layers: int, scaling_layers: int, checkpoint: Path | None,
                        scaling_checkpoint: Path | None) -> dict[int, Path]:
    """Checkpoints by decoder depth: the given ones, else generated ones of `text_layers` and `scaling_layers`
    (0: none) layers."""
    from builder_plugin.config import Phi4MMConfig

    checkpoints: dict[int, Path] = {}
    if checkpoint:
        checkpoints[Phi4MMConfig.from_dir(checkpoint).text.num_hidden_layers] = checkpoint.resolve()
        if scaling_checkpoint:
            layers = Phi4MMConfig.from_dir(scaling_checkpoint).text.num_hidden_layers
            checkpoints[layers] = scaling_checkpoint.resolve()
    else:
        checkpoints[text_layers] = prepare_checkpoint(work, text_layers)
        if scaling_layers and scaling_layers != text_layers:
            checkpoints[scaling_layers] = prepare_checkpoint(work, scaling_layers)
    return checkpoints


def builder_fingerprint() -> str:
    """Hash of the builder's sources (builder_plugin without testing/, genai_config): packages built by other code
    are rebuilt."""
    digest = hashlib.sha256()
    files = [p for p in (ROOT / "builder_plugin").rglob("*.py") if "testing" not in p.parts]
    files += list((ROOT / "genai_config").rglob("*.py"))
    for path in sorted(files):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def prepare_package(work: Path, checkpoint: Path, precision: str, fingerprint: str | None
                    ) -> tuple[Path, dict[str, Any]]:
    """Build (in a subprocess, so its memory is returned) or reuse the split CPU package of `checkpoint`; with a
    `fingerprint` of None an existing package is reused whatever code built it."""
    folder = work / f"package-{checkpoint.name}-{precision}"
    stat = (checkpoint / "config.json").stat()
    recipe = {"checkpoint": str(checkpoint.resolve()), "config_mtime": stat.st_mtime, "precision": precision,
              "lora": "split", "execution_provider": "cpu", "builder": fingerprint}
    marker = _recipe_file(folder)
    if fingerprint is None and folder.is_dir() and marker.is_file():
        recipe["builder"] = json.loads(marker.read_text()).get("builder")
    if _cached(folder, recipe):
        return folder, json.loads((folder.parent / f".{folder.name}.build.json").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    info_file = folder.parent / f".{folder.name}.build.json"
    command = [sys.executable, "-m", MODULE, "--build-worker", str(checkpoint), str(folder), precision, str(info_file)]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    _mark(folder, recipe)
    info = json.loads(info_file.read_text())
    print(f"{precision} package of {checkpoint.name} built in {time.perf_counter() - start:.0f} s "
          f"(peak RSS {info['peak_rss_bytes'] / GB:.1f} GB)", flush=True)
    return folder, info


def prepare_packages(work: Path, checkpoints: dict[int, Path], fingerprint: str | None
                     ) -> tuple[dict[tuple[int, str], Path], dict[str, Any]]:
    """Every checkpoint's package in every precision: ({(layers, precision): folder}, {"layers/precision": build})."""
    packages: dict[tuple[int, str], Path] = {}
    builds: dict[str, Any] = {}
    for layers, checkpoint in checkpoints.items():
        for precision in PRECISIONS:
            packages[layers, precision], builds[f"{layers}/{precision}"] = prepare_package(
                work, checkpoint, precision, fingerprint)
    return packages, builds


def build_worker(checkpoint: str, output: str, precision: str, info_file: str) -> int:
    """The --build-worker subprocess: one package build, its time and peak RSS written to `info_file`."""
    from builder_plugin.build import build
    from builder_plugin.options import BuildOptions

    result = build(BuildOptions(model_dir=Path(checkpoint), output_dir=Path(output), precision=precision,
                                lora="split", execution_provider="cpu", overwrite=True), progress=False)
    write_json(info_file, {"seconds": result.seconds, "peak_rss_bytes": peak_rss_bytes(),
                           "total_bytes": result.total_bytes, "files": dict(result.files)})
    return 0


def text_prompt(checkpoint: Path, tokens: int) -> str:
    """A chat prompt of about `tokens` tokens (counted with the checkpoint's tokenizer)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    words = (FILLER * 20).split()
    prompt = ""
    for count in range(1, len(words) + 1):
        prompt = f"<|user|>{' '.join(words[:count])}<|end|><|assistant|>"
        if len(tokenizer.encode(prompt, add_special_tokens=False).ids) >= tokens:
            break
    return prompt


def make_prompts(work: Path, checkpoint: Path, names: list[str]) -> list[Prompt]:
    from builder_plugin.testing.media import make_image, make_wav

    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    image_question = "<|user|><|image_1|>Describe this picture in detail.<|end|><|assistant|>"
    available = {
        "text": lambda: Prompt("text", "text", text_prompt(checkpoint, TEXT_PROMPT_TOKENS)),
        "image-1crop": lambda: Prompt("image-1crop", "vision", image_question,
                                      images=(str(make_image(media / "448x448.png", 448, 448, seed=1)),)),
        "image-4crops": lambda: Prompt("image-4crops", "vision", image_question,
                                       images=(str(make_image(media / "896x896.png", 896, 896, seed=2)),)),
        "audio-10s": lambda: Prompt("audio-10s", "speech",
                                    "<|user|><|audio_1|>Transcribe the audio clip.<|end|><|assistant|>",
                                    audios=(str(make_wav(media / "10s.wav", 10.0, seed=3)),)),
    }
    return [available[name]() for name in names]
