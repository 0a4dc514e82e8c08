"""Image and audio files, checked before the runtime sees them.

The image decoder of onnxruntime-extensions reads PNG and JPEG only, and any other image content ends the process from
inside its JPEG fallback, so image files are recognised by their signature first.
"""

from __future__ import annotations

import re
from pathlib import Path

from builder_plugin.runtime.errors import MediaNotFoundError, UnsupportedMediaError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac")
IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")

# Clearer wording for decoder messages of onnxruntime-extensions.
DECODER_HINTS = {
    "only down-sampling supported": "sample rates below 8000 Hz are not supported",
    "Cannot detect audio stream format": "not a WAV, MP3 or FLAC file",
}


def check_image(path: str | Path) -> Path:
    """`path` as a Path if it is an existing PNG or JPEG file; raises MediaNotFoundError / UnsupportedMediaError."""
    path = _existing(path, "image")
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise UnsupportedMediaError(f"unsupported image format {path.suffix or '(no extension)'!r}: {path} "
                                    f"(use {', '.join(IMAGE_SUFFIXES)})")
    with open(path, "rb") as f:
        head = f.read(8)
    if not any(head.startswith(signature) for signature in IMAGE_SIGNATURES):
        raise UnsupportedMediaError(f"not a PNG or JPEG image: {path}")
    return path


def check_audio(path: str | Path) -> Path:
    """`path` as a Path if it is an existing file with an audio extension the runtime decodes (its content is checked
    when the question is processed)."""
    path = _existing(path, "audio")
    if path.suffix.lower() not in AUDIO_SUFFIXES:
        raise UnsupportedMediaError(f"unsupported audio format {path.suffix or '(no extension)'!r}: {path} "
                                    f"(use {', '.join(AUDIO_SUFFIXES)})")
    return path


def decoder_reason(message: str) -> str:
    """'[AudioDecoder]: only down-sampling supported.' -> 'sample rates below 8000 Hz are not supported'"""
    reason = re.sub(r"^\[\w+\]:\s*", "", message).rstrip(".")
    return DECODER_HINTS.get(reason, reason)


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise MediaNotFoundError(f"{what} file not found: {path}")
    if not path.is_file():
        raise MediaNotFoundError(f"{what} path is not a file: {path}")
    return path
