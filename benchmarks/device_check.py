"""Device check for GPU packages (cuda, dml, webgpu): run on a machine with that GPU, in one command.

    python -m benchmarks.device_check --ep cuda [--precision fp16|int4] [--work DIR] [--checkpoint DIR]
    python -m benchmarks.device_check --ep cpu --precision fp32      # a dry run of the script itself, on the CPU

This machine class has no GPU, so the CPU test suite only builds and checks GPU graphs (onnx.checker, shape
inference). This script does what it cannot: it builds a routed package for the execution provider from a tiny
random checkpoint (or --checkpoint), and a float32 CPU split package of the same checkpoint (one decoder file per
LoRA choice) as the yardstick, then for each input mode (text, image, audio, image+audio):

- answers through builder_plugin.runtime.Chat on the device: one og.Model for every mode (the self-routing decoder
  picks the LoRA itself, so the base weights are in device memory once);
- compares the device's logits for the first new token of each turn with the CPU package's over the same token ids
  (cosine; fp16 and int4 are not bit-exact, so this is a closeness check with the thresholds below);
- checks that the route is real: the device's logits are closer to the CPU decoder of the mode's LoRA than to the
  CPU decoders of the other LoRA choices, over the same ids and media;
- asks a follow-up on the kept generator (it must reuse the cache) and checks it the same way.

With cuda it also prints the process' GPU memory after loading (nvidia-smi, when present). Exit status 0 when every
check passed; the report goes to stdout and, with --json, to a file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

MIN_COSINE = {"fp32": 0.99999, "fp16": 0.999, "int4": 0.95}  # device logits against the fp32 CPU package's
MODES = {"text": ((), ()), "image": (("photo.png",), ()), "audio": ((), ("clip.wav",)),
         "image+audio": (("photo.png",), ("clip.wav",))}
QUESTION, FOLLOW_UP, NEW_TOKENS = "Describe what you get.", "And what else?", 8


def build(checkpoint: Path, out: Path, precision: str, ep: str, lora: str = "routed") -> Path:
    from builder_plugin.build import build as build_package
    from builder_plugin.options import BuildOptions

    options = BuildOptions(model_dir=checkpoint, output_dir=out, precision=precision, execution_provider=ep,
                           max_length=4096, overwrite=True, lora=lora)
    return build_package(options, progress=False).output_dir


def device_conversation(package: Path, ep: str | None, media: Path, mode: str) -> list[dict]:
    """A first question and a follow-up on the device: per turn, the ids before it, its logits, reuse."""
    from builder_plugin.runtime import Chat

    chat = Chat(package, execution_provider=ep)
    chat.keep_logits = True
    images = [media / name for name in MODES[mode][0]]
    audios = [media / name for name in MODES[mode][1]]
    turns = []
    for question, files in ((QUESTION, (images, audios)), (FOLLOW_UP, ([], []))):
        list(chat.ask(question, *files, max_new_tokens=NEW_TOKENS))
        stats = chat.last_stats
        turns.append({"prefix": chat.token_ids[:stats.prompt_tokens], "logits": chat.last_logits[0],
                      "reused": stats.reused_tokens})
    return turns


def cpu_logits(chat, decoder: str, media: Path, mode: str, ids: list[int]) -> np.ndarray:
    """Last-position logits of one decoder file of the fp32 CPU split package over `ids`, with the first question's
    media."""
    import onnxruntime_genai as og

    from builder_plugin.runtime import Turn, build_prompt

    images = [media / name for name in MODES[mode][0]]
    audios = [media / name for name in MODES[mode][1]]
    model = chat.model(decoder)
    processor = model.create_multimodal_processor()
    inputs = processor(build_prompt([Turn(QUESTION, tuple(images), tuple(audios))]),
                       images=og.Images.open(*map(str, images)) if images else None,
                       audios=og.Audios.open(*map(str, audios)) if audios else None)
    inputs["input_ids"] = og.Tensor(np.array([ids], dtype=np.int32))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 1)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    return np.asarray(generator.get_output("logits"), np.float32).reshape(-1)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


def gpu_memory_mb() -> str:
    if shutil.which("nvidia-smi") is None:
        return "n/a (no nvidia-smi)"
    result = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"], capture_output=True,
                            text=True, check=False)
    return result.stdout.strip() or "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", choices=("cuda", "dml", "webgpu", "cpu"), required=True,
                        help="cpu: a dry run of this script (with --precision fp32)")
    parser.add_argument("--precision", choices=("fp16", "int4", "fp32"), default="fp16",
                        help="fp32 only with --ep cpu")
    parser.add_argument("--checkpoint", type=Path, help="default: a tiny random checkpoint")
    parser.add_argument("--work", type=Path, help="keep the packages here (default: a temporary folder)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from builder_plugin.testing.make_checkpoint import make_checkpoint
    from builder_plugin.testing.media import make_image, make_wav

    work = args.work or Path(tempfile.mkdtemp(prefix="device-check-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or make_checkpoint(work / "checkpoint", preset="tiny", seed=0)
    media = work / "media"
    media.mkdir(exist_ok=True)
    make_image(media / "photo.png", 451, 300, seed=3)
    make_wav(media / "clip.wav", 2.0, sample_rate=16000, seed=4)
    reference = build(checkpoint, work / "cpu-fp32-split", "fp32", "cpu", lora="split")
    device = build(checkpoint, work / f"{args.ep}-{args.precision}", args.precision, args.ep)

    from builder_plugin.runtime import Chat

    yardstick = Chat(reference)
    report, failed = {"ep": args.ep, "precision": args.precision, "modes": {}}, []
    for mode in MODES:
        turns = device_conversation(device, None if args.ep == "cpu" else args.ep, media, mode)
        own = yardstick.variant_for(bool(MODES[mode][0]), bool(MODES[mode][1]))
        entry = {}
        for name, turn in zip(("first", "follow-up"), turns):
            by_decoder = {d: cosine(turn["logits"], cpu_logits(yardstick, d, media, mode, turn["prefix"]))
                          for d in sorted(set(yardstick.manifest.decoders.values()))}
            routed = all(by_decoder[own] > c for d, c in by_decoder.items() if d != own)
            entry[name] = {"cosine": by_decoder[own], "other_decoders": {d: c for d, c in by_decoder.items()
                                                                          if d != own},
                           "route_ok": routed, "reused": turn["reused"]}
            if by_decoder[own] < MIN_COSINE[args.precision] or not routed:
                failed.append(f"{mode}/{name}")
        if entry["follow-up"]["reused"] == 0:
            failed.append(f"{mode}/follow-up not reused")
        report["modes"][mode] = entry
    report["gpu_memory_after"] = gpu_memory_mb() if args.ep == "cuda" else "n/a"
    report["failed"] = failed
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print("device check " + ("passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
