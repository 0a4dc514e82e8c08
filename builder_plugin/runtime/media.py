"""Media for a conversation: the files an app names, decoded safely (builder_plugin.media) into the canonical bytes
handed to onnxruntime-genai, whose own image decoder can hang or end the process on a broken JPEG.

    image = open_image("photo.jpg")  # Pillow, in a separate process, with limits
    inputs = processor(prompt, images=og.Images.open_bytes(image.data))
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterable
from pathlib import Path

import onnxruntime_genai as og

from builder_plugin.media import Media, MediaDecoder, MediaError, MediaNotFoundError
from builder_plugin.runtime.errors import MediaNotFoundError as MissingMediaError
from builder_plugin.runtime.errors import UnsupportedMediaError

MediaSource = str | Path | Media  # a file, or media already decoded

_A = {"image": "an image", "audio": "an audio clip"}
_default: MediaDecoder | None = None
_default_lock = threading.Lock()


def default_decoder() -> MediaDecoder:
    """The process's decoder with the default limits (its process starts on first use, stops at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MediaDecoder()
            atexit.register(_default.close)
        return _default


def open_image(source: MediaSource, decoder: MediaDecoder | None = None, fit: int | None = None) -> Media:
    """An image file decoded (Media pass through); raises MediaNotFoundError or UnsupportedMediaError. With `fit`
    (e.g. a Package's ``crop_side``), scaled down to fit a square of that side, its shape kept: the model then reads
    it as one crop and the global view, a fraction of the prompt tokens and time of a large photo's full detail."""
    return _open("image", source, decoder, fit)


def open_audio(source: MediaSource, decoder: MediaDecoder | None = None) -> Media:
    """An audio file decoded (Media pass through); raises MediaNotFoundError or UnsupportedMediaError."""
    return _open("audio", source, decoder)


def og_images(images: Iterable[Media]) -> og.Images | None:
    """onnxruntime-genai Images of decoded images (None for none)."""
    data = [image.data for image in images]
    return og.Images.open_bytes(*data) if data else None


def og_audios(audios: Iterable[Media]) -> og.Audios | None:
    """onnxruntime-genai Audios of decoded clips (None for none)."""
    data = [audio.data for audio in audios]
    return og.Audios.open_bytes(*data) if data else None


def _open(kind: str, source: MediaSource, decoder: MediaDecoder | None, fit: int | None = None) -> Media:
    """`source` decoded (`fit`: images only), or a decoded Media passed through, fitted from its canonical bytes."""
    if isinstance(source, Media):
        if source.kind != kind:
            raise UnsupportedMediaError(f"{source.source}: {_A[kind]} was expected, not {_A[source.kind]}",
                                        source.source)
        if fit is None:
            return source
    try:
        if isinstance(source, Media):
            return (decoder or default_decoder()).decode(kind, source.data, source.source, fit)
        return (decoder or default_decoder()).open(kind, source, fit)
    except MediaNotFoundError as exc:
        raise MissingMediaError(exc.reason + f": {exc.source}") from None
    except MediaError as exc:
        raise UnsupportedMediaError(str(exc), exc.source) from None
