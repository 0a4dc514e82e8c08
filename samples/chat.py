"""Chat with a built Phi-4-multimodal package in the terminal: multi-turn, streamed, with images and audio.

    python samples/chat.py PACKAGE_DIR                                    # interactive
    python samples/chat.py PACKAGE_DIR --image photo.jpg --audio q.wav    # files go with the first question
    python samples/chat.py PACKAGE_DIR --prompt "Describe the image." --image photo.jpg   # one answer, for scripts

In the chat, /image PATH and /audio PATH attach files to the next question; /help lists the commands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

try:
    from builder_plugin import runtime
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from builder_plugin import runtime

Media = runtime.Media

EXECUTION_PROVIDERS = ("cpu", "cuda", "dml", "webgpu")

COMMANDS = """commands:
  /image PATH   attach an image (JPEG, PNG, WebP, GIF, BMP or TIFF) to the next question; repeat for more
  /audio PATH   attach an audio clip (WAV, FLAC, Ogg or MP3) to the next question; repeat for more
  /clear        forget the conversation and the attached files
  /help         show this help
  /quit         leave (Ctrl-D works too)
Attached files go before the question, or where it writes <|image_1|>, <|audio_1|>, ...
Ctrl-C stops an answer."""


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Chat with a Phi-4-multimodal ONNX Runtime GenAI package.")
    p.add_argument("package", help="folder of the built package (with genai_config.json)")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="image for the first question (repeatable)")
    p.add_argument("--low-detail", action="store_true",
                   help="read images at low detail: each scaled down to one crop of the model's (448 pixels a side), "
                        "answered many times sooner on a CPU than a large photo's every detail")
    p.add_argument("--audio", action="append", default=[], metavar="PATH",
                   help="audio clip for the first question (repeatable)")
    p.add_argument("--prompt", metavar="TEXT", help="ask this one question, print the answer and exit")
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer in tokens (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest conversation in tokens, prompt included (default: the package's search.max_length)")
    p.add_argument("-e", "--execution-provider", choices=EXECUTION_PROVIDERS, default=None,
                   help="run on this provider (default: the one the package was built for)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads of every session (default: one per physical core this process may use)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        return _error("--max-new-tokens must be at least 1")
    try:
        chat = runtime.Chat(args.package, max_length=args.max_length, execution_provider=args.execution_provider,
                            system=args.system, threads=args.threads)
        fit = chat.package.crop_side if args.low_detail else None
        images = [runtime.open_image(p, fit=fit) for p in args.image]
        audios = [runtime.open_audio(p) for p in args.audio]
        if args.prompt is not None:
            return ask_once(chat, args.prompt, images, audios, args.max_new_tokens)
    except runtime.ChatError as exc:
        return _error(describe(exc))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return interactive(chat, images, audios, args.max_new_tokens, fit)


def ask_once(chat: runtime.Chat, text: str, images: list[Media], audios: list[Media], max_new_tokens: int) -> int:
    """--prompt mode: the answer on stdout, loading notes and statistics on stderr."""
    runtime.check_tags(text, len(images), len(audios))
    _load_for(chat, images, audios, sys.stderr)
    answer(chat, text, images, audios, max_new_tokens, sys.stdout)
    print()
    print(format_stats(chat.last_stats), file=sys.stderr)
    return 0


def interactive(chat: runtime.Chat, images: list[Media], audios: list[Media], max_new_tokens: int,
                fit: int | None = None) -> int:
    print(f"Chatting with {chat.package_dir}. Type a question, or /help.")
    _show_attached(images, audios)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 130
        if not line:
            continue
        if line.startswith("/"):
            command, _, argument = line.partition(" ")
            argument = argument.strip()
            if command in ("/quit", "/exit"):
                return 0
            if command == "/help":
                print(COMMANDS)
            elif command == "/clear":
                chat.clear()
                images, audios = [], []
                print("(conversation cleared)")
            elif command in ("/image", "/audio"):
                if not argument:
                    _error(f"usage: {command} PATH")
                    continue
                try:
                    if command == "/image":
                        images.append(runtime.open_image(argument, fit=fit))
                    else:
                        audios.append(runtime.open_audio(argument))
                except runtime.ChatError as exc:
                    _error(str(exc))
                    continue
                _show_attached(images, audios)
            else:
                _error(f"unknown command {command} (try /help)")
            continue
        try:
            runtime.check_tags(line, len(images), len(audios))
            _load_for(chat, images, audios, sys.stdout)
            answer(chat, line, images, audios, max_new_tokens, sys.stdout)
        except (runtime.MediaNotFoundError, runtime.UnsupportedMediaError) as exc:
            _error(str(exc))
            if images or audios:
                images, audios = [], []
                print("(attachments dropped; attach them again with /image or /audio)")
            continue
        except runtime.ChatError as exc:
            _error(describe(exc))
            continue
        except KeyboardInterrupt:
            print(" [stopped]")
        else:
            print()
        images, audios = [], []
        if chat.last_stats is not None:
            print(format_stats(chat.last_stats))


def answer(chat: runtime.Chat, text: str, images: list[Media], audios: list[Media], max_new_tokens: int,
           out: TextIO) -> None:
    """Stream the answer to `out`; the pieces are printed as they are generated."""
    pieces = chat.ask(text, images, audios, max_new_tokens=max_new_tokens)
    try:
        for piece in pieces:
            out.write(piece)
            out.flush()
    finally:
        pieces.close()


def format_stats(stats: runtime.Stats | None) -> str:
    if stats is None:
        return ""
    reused = f" ({stats.reused_tokens} kept from the conversation)" if stats.reused_tokens else ""
    return (f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, first token after "
            f"{stats.time_to_first_token_s:.2f} s, prompt {stats.prompt_tokens} tokens{reused}, {stats.variant}]")


def _load_for(chat: runtime.Chat, images: list[Media], audios: list[Media], out: TextIO) -> None:
    variant = chat.next_variant(images, audios)
    if not chat.is_loaded(variant):
        print(f"(loading {variant} ...)", file=out, flush=True)
        chat.load(variant)


def _show_attached(images: list[Media], audios: list[Media]) -> None:
    if images or audios:
        names = [f"image {m.source}" for m in images] + [f"audio {m.source}" for m in audios]
        print(f"(attached to the next question: {', '.join(names)})")


def describe(exc: runtime.ChatError) -> str:
    """The error in this program's terms: its command and option, not the Python API's."""
    if isinstance(exc, runtime.PromptTooLongError):
        return f"{exc.summary}; start over with /clear, or run with a larger --max-length"
    return str(exc)


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
