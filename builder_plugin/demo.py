"""The offline demo: a tiny random checkpoint in the original format -> four-model package -> one chat turn.

    python -m builder_plugin.demo [DIR]

The weights are random, so the answer is noise; what the demo shows is the whole path working offline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m builder_plugin.demo", description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="demo", help="working folder (default: %(default)s)")
    parser.add_argument("--question", default="Describe the image and the audio clip.")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    from builder_plugin.build import build  # after parsing: --help does not wait for torch
    from builder_plugin.errors import BuildError
    from builder_plugin.options import BuildOptions
    from builder_plugin.runtime import Chat, ChatError
    from builder_plugin.testing.make_checkpoint import make_checkpoint

    root = Path(args.folder)
    checkpoint = root / "checkpoint"
    if not (checkpoint / "config.json").is_file():
        print(f"writing a tiny random Phi-4-multimodal checkpoint to {checkpoint} ...")
        make_checkpoint(checkpoint, preset="tiny", seed=0)
    image, clip = write_media(root)

    package = root / "package"
    print(f"building {package} (fp32, cpu) ...")
    try:
        result = build(BuildOptions(model_dir=checkpoint, output_dir=package, precision="fp32",
                                    execution_provider="cpu", overwrite=True), progress=False)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"built {len(result.files)} files, {result.total_bytes / 1e6:.1f} MB in {result.seconds:.1f} s")

    try:
        chat = Chat(package)
        print(f"\nuser: <image> <audio> {args.question}\nassistant: ", end="", flush=True)
        for piece in chat.ask(args.question, images=[image], audios=[clip], max_new_tokens=args.max_new_tokens):
            print(piece, end="", flush=True)
    except ChatError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    stats = chat.last_stats
    print(f"\n\n[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, first token after "
          f"{stats.time_to_first_token_s:.2f} s, decoder {stats.variant}] (random weights: the text is noise)")
    return 0


def write_media(root: Path) -> tuple[Path, Path]:
    """The demo's picture and clip (the README's examples send them): ROOT/media/picture.jpg and clip.wav."""
    from builder_plugin.testing.media import make_image, make_wav

    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    return (make_image(media / "picture.jpg", 640, 360, seed=1),
            make_wav(media / "clip.wav", 2.0, sample_rate=16000, seed=2))


if __name__ == "__main__":
    sys.exit(main())
