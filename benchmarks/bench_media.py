"""What decoding media safely costs (builder_plugin.media): every image and clip is decoded by Pillow / libsndfile in
a separate process and handed to onnxruntime-genai as canonical PNG / WAV bytes instead of the file itself.

    python -m benchmarks.bench_media [--package PKG] [--rounds 5]

Per medium (the 448x448 image of the first-token benchmarks, a 512x512 photograph as JPEG, a 12 MP phone-size JPEG,
a 30 s clip as 16 kHz WAV and as 44.1 kHz MP3): the decode in the decoder process (bytes in, canonical bytes back),
and the package's processor on the file's own bytes against the canonical ones, in turn, `--rounds` times. The cost
added to a request is decode + (processor on canonical - processor on the original).

With `--package` (a full-size package): the first token of a one-image question about the 448x448 image, from the
file's bytes through onnxruntime-genai's own decoder (as before) and through the safe decode, in turn.

Results: benchmarks/results/media.json and the "Safe media decoding" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import add_report_options, fmt, machine_markdown, markdown_table, measure_or_replay

HEADING = "## Safe media decoding"
QUESTION = "Describe the image."


def media(folder: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (kind, file bytes)."""
    import numpy as np
    import soundfile
    from PIL import Image
    from skimage import data

    from builder_plugin.testing.media import make_image, make_wav

    def jpeg(pixels) -> bytes:
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
        return out.getvalue()

    clip = make_wav(folder / "clip.wav", 30.0, sample_rate=16000, seed=1)
    samples, rate = soundfile.read(make_wav(folder / "clip44.wav", 30.0, sample_rate=44100, seed=2), dtype="float32")
    mp3 = io.BytesIO()
    soundfile.write(mp3, samples, rate, format="MP3", subtype="MPEG_LAYER_III")
    phone = np.asarray(Image.open(make_image(folder / "phone.jpg", 4032, 3024, seed=5)).convert("RGB"))
    return {
        "448x448 PNG": ("image", make_image(folder / "square.png", 448, 448, seed=2).read_bytes()),
        "512x512 photograph, JPEG": ("image", jpeg(data.astronaut())),
        "4032x3024 JPEG (12 MP)": ("image", jpeg(phone)),
        "30 s WAV, 16 kHz": ("audio", clip.read_bytes()),
        "30 s MP3, 44.1 kHz": ("audio", mp3.getvalue()),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime_genai as og

    from builder_plugin.media import MediaDecoder
    from builder_plugin.runtime import Package, og_audios, og_images

    package = Package(args.package or args.processor_package)
    processor = package.load(package.main_decoder).processor
    rows = []
    with tempfile.TemporaryDirectory() as folder, MediaDecoder() as decoder:
        files = media(Path(folder))
        decoder.decode("image", files["448x448 PNG"][1], "warm-up")  # the decoder process starts once
        for name, (kind, data) in files.items():
            prompt = f"<|user|><|{kind}_1|>?<|end|><|assistant|>"

            def process(images, audios, prompt: str = prompt) -> None:
                processor(prompt, images=images, audios=audios)

            original = (og.Images.open_bytes(data), None) if kind == "image" else (None, og.Audios.open_bytes(data))
            decode, direct, canonical = [], [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                decoded = decoder.decode(kind, data, name)
                decode.append(time.perf_counter() - started)
                started = time.perf_counter()
                process(*original)
                direct.append(time.perf_counter() - started)
                converted = (og_images([decoded]), None) if kind == "image" else (None, og_audios([decoded]))
                started = time.perf_counter()
                process(*converted)
                canonical.append(time.perf_counter() - started)
            median = statistics.median
            rows.append({"medium": name, "bytes": len(data), "canonical_bytes": len(decoded.data),
                         "decode_s": median(decode), "processor_original_s": median(direct),
                         "processor_canonical_s": median(canonical),
                         "added_s": median(decode) + median(canonical) - median(direct)})
        first_token = first_tokens(package, files["448x448 PNG"][1], decoder, args.rounds) if args.package else None
    return {"rounds": args.rounds, "media": rows, "first_token": first_token}


def first_tokens(package: Any, image: bytes, decoder: Any, rounds: int) -> dict[str, Any]:
    """The first token of a one-image question, the image handed to onnxruntime-genai as the file's bytes or decoded
    safely (the decode counted), in turn."""
    import onnxruntime_genai as og

    from builder_plugin.runtime import og_images

    loaded = package.load(package.main_decoder)
    prompt = f"<|user|><|image_1|>{QUESTION}<|end|><|assistant|>"

    def first_token(safe: bool) -> float:
        started = time.perf_counter()
        images = og_images([decoder.image(image, "image")]) if safe else og.Images.open_bytes(image)
        inputs = loaded.processor(prompt, images=images)
        params = og.GeneratorParams(loaded.model)
        params.set_search_options(max_length=int(inputs["input_ids"].shape()[-1]) + 2)
        generator = og.Generator(loaded.model, params)
        generator.set_inputs(inputs)
        generator.generate_next_token()
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"file": [], "safe": []}
    first_token(True)  # sessions warmed up
    for _ in range(rounds):
        for way in times:
            times[way].append(first_token(way == "safe"))
    return {way: {"best": min(t), "median": statistics.median(t), "runs": t} for way, t in times.items()}


def report(results: dict[str, Any]) -> str:
    lines = [f"`{results['command']}`; {results['rounds']} runs of each, in turn, medians. The decode runs in the "
             "decoder process (bytes in, canonical PNG / 16-bit WAV back); the processor is the package's "
             "(onnxruntime-genai's), on the file's own bytes and on the canonical ones. Added = decode + processor on "
             "canonical - processor on the original.", ""]
    lines.append(markdown_table(
        ["medium", "file MB", "canonical MB", "decode ms", "processor, original ms", "processor, canonical ms",
         "added ms"],
        [[r["medium"], fmt(r["bytes"] / 1e6), fmt(r["canonical_bytes"] / 1e6), fmt(r["decode_s"] * 1e3, 0),
          fmt(r["processor_original_s"] * 1e3, 0), fmt(r["processor_canonical_s"] * 1e3, 0),
          fmt(r["added_s"] * 1e3, 0)] for r in results["media"]]))
    first = results.get("first_token")
    if first:
        lines += ["", f"First token of a one-image question (448x448), full-size package: the file's bytes "
                  f"{fmt(first['file']['median'])} s (best {fmt(first['file']['best'])}), decoded safely "
                  f"{fmt(first['safe']['median'])} s (best {fmt(first['safe']['best'])}), medians of "
                  f"{len(first['safe']['runs'])} in turn."]
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join([*lines, "", machine_markdown(results["machine"])])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_media", description=__doc__.split("\n\n")[0])
    p.add_argument("--package", type=Path, help="a full-size package: also time the one-image first token")
    p.add_argument("--processor-package", type=Path, default=Path("demo/package"),
                   help="the package whose processor runs without --package (any size: default %(default)s)")
    p.add_argument("--rounds", type=int, default=5)
    add_report_options(p, "media.json")
    args = p.parse_args(argv)
    return measure_or_replay(args, argv, "bench_media", HEADING, measure, report)


if __name__ == "__main__":
    raise SystemExit(main())
