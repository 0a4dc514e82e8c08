"""Untrusted image and audio bytes -> the canonical PNG / WAV bytes onnxruntime-genai reads, decoded by Pillow and
libsndfile (fuzzed, maintained decoders) under MediaLimits; the PNG is the simplest there is (stored deflate, no
filters: png()), the WAV libsndfile's. Runs in the decoder process only (media/child.py): a
decoder that crashes or hangs takes that process down, not the caller."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import soundfile
from PIL import Image, ImageOps, UnidentifiedImageError

from builder_plugin.media.limits import AUDIO_FORMATS, IMAGE_FORMATS, MIN_SAMPLE_RATE, MediaLimits

SIGNATURES = ((b"\xff\xd8\xff", "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
              (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
AUDIO_BLOCK_FRAMES = 1 << 16


class Unreadable(Exception):
    """The bytes are refused; the message is the reason, for people (e.g. "not a readable image (truncated JPEG)")."""


def canonical_image(data: bytes, limits: MediaLimits, fit: int | None = None) -> tuple[bytes, dict[str, Any]]:
    """(PNG bytes of the first frame in 8-bit RGB, upright per its EXIF orientation, and with `fit` scaled down to
    fit a square of that side, its shape kept (never up); what it was)."""
    Image.MAX_IMAGE_PIXELS = None  # the size is checked here, from the header, before any pixel is decoded
    names = _one_of(IMAGE_FORMATS.values())
    try:
        image = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except Exception as exc:  # a parser that fails on the header fails on the file
        kind = _sniff(data)
        if kind is None:
            raise Unreadable(f"not a readable image (not {names} file)") from None
        cut = isinstance(exc, UnidentifiedImageError) or "truncated" in str(exc).lower()
        raise Unreadable(f"not a readable image ({'truncated' if cut else 'broken'} {kind}"
                         f"{'' if cut else ' data'})") from None
    kind = IMAGE_FORMATS[image.format]
    width, height = image.size
    if width < 1 or height < 1:
        raise Unreadable(f"not a readable image (its {kind} header says {width} x {height} pixels)")
    if max(width, height) > limits.max_image_side or width * height > limits.max_image_pixels:
        raise Unreadable(f"the image is too large ({width} x {height} pixels; the limit is "
                         f"{_megapixels(limits.max_image_pixels)}, {limits.max_image_side} pixels a side)")
    try:
        image.load()
    except MemoryError:
        raise Unreadable(f"the image is too large to decode ({width} x {height} pixels)") from None
    except Exception as exc:
        raise Unreadable(f"not a readable image ({_broken(exc, kind)})") from None
    image = _upright(image)
    info = {"format": kind, "width": image.width, "height": image.height}
    image = _rgb(image, kind)
    if fit is not None and max(image.size) > fit:
        scale = fit / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        info["fitted"] = list(image.size)
    return png(np.asarray(image)), info


def canonical_audio(data: bytes, limits: MediaLimits) -> tuple[bytes, dict[str, Any]]:
    """(16-bit PCM mono WAV bytes at the clip's own sample rate, the channels averaged as the runtime does; what it
    was). The length is counted while decoding: a header that lies about it changes nothing."""
    names = _one_of(AUDIO_FORMATS.values())
    try:
        clip = soundfile.SoundFile(io.BytesIO(data))
    except Exception:
        raise Unreadable(f"not a readable audio clip (not {names} file, or a broken one)") from None
    with clip:
        kind = AUDIO_FORMATS.get(clip.format)
        if kind is None:
            raise Unreadable(f"unsupported audio format {clip.format_info} (not {names} file)")
        rate, channels = clip.samplerate, clip.channels
        if not MIN_SAMPLE_RATE <= rate <= limits.max_sample_rate:
            raise Unreadable(f"unsupported sample rate {rate} Hz (use {MIN_SAMPLE_RATE} to {limits.max_sample_rate})")
        if not 1 <= channels <= limits.max_channels:
            raise Unreadable(f"unsupported channel count {channels} (at most {limits.max_channels})")
        most = int(limits.max_audio_seconds * rate)
        blocks, frames = [], 0
        try:
            while True:
                block = clip.read(AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True)
                if not len(block):
                    break
                frames += len(block)
                if frames > most:
                    raise Unreadable(f"the clip is longer than the limit of {_duration(limits.max_audio_seconds)}")
                mono = block.mean(axis=1) if channels > 1 else block[:, 0]
                blocks.append(pcm16(mono))
        except Unreadable:
            raise
        except MemoryError:
            raise Unreadable("the clip is too large to decode") from None
        except Exception as exc:
            raise Unreadable(f"not a readable audio clip ({_broken(exc, kind)})") from None
    if frames == 0:
        raise Unreadable(f"not a readable audio clip (the {kind} file holds no samples)")
    if frames < int(limits.min_audio_seconds * rate):
        raise Unreadable(f"the clip is too short ({_duration(frames / rate)}; at least "
                         f"{_duration(limits.min_audio_seconds)})")
    out = io.BytesIO()
    soundfile.write(out, np.concatenate(blocks), rate, format="WAV", subtype="PCM_16")
    return out.getvalue(), {"format": kind, "seconds": frames / rate, "sample_rate": rate, "channels": channels}


def png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of `pixels` ([height, width, 3] uint8): one IDAT of stored (uncompressed) deflate blocks, no
    row filters. It is read once, in memory: a 12 MP photo takes ~0.1 s where Pillow's encoder took 0.5 s (its
    per-row filter choice runs at every compression level)."""
    height, width, _ = pixels.shape
    rows = np.empty((height, width * 3 + 1), np.uint8)
    rows[:, 0] = 0  # filter type None
    rows[:, 1:] = pixels.reshape(height, -1)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, no interlace
    parts = [PNG_SIGNATURE]
    for kind, data in ((b"IHDR", header), (b"IDAT", zlib.compress(rows.data, 0)), (b"IEND", b"")):
        parts += [struct.pack(">I", len(data)), kind, data, struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))]
    return b"".join(parts)  # one copy of the pixels, not one per chunk


def pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples (libsndfile's scale: a 16-bit value v reads as v / 32768) as 16-bit values, rounded and clipped:
    16-bit sources keep their very samples."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")


def _upright(image: Image.Image) -> Image.Image:
    """Rotated as its EXIF orientation says (phone photos); as stored when that tag cannot be read."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:
        return image


def _rgb(image: Image.Image, kind: str) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I") or image.mode == "F":  # 16/32-bit integer or float samples: scaled to 8 bits
        samples = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode != "F" and samples.max(initial=0) > 255 else 1.0 if image.mode == "F" else 255.0
        image = Image.fromarray(np.round(np.clip(samples / top, 0, 1) * 255).astype(np.uint8), "L")
    try:
        return image.convert("RGB")
    except ValueError:
        raise Unreadable(f"unsupported colour mode {image.mode} in the {kind} image") from None


def _broken(exc: Exception, kind: str) -> str:
    return f"truncated {kind}" if "truncated" in str(exc).lower() else f"broken {kind} data"


def _sniff(data: bytes) -> str | None:
    """The image format its first bytes announce, if any."""
    return next((kind for signature, kind in SIGNATURES if data.startswith(signature)), None) or \
        ("WebP" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None)


def _megapixels(pixels: int) -> str:
    return f"{pixels / 1e6:,.0f} megapixels" if pixels >= 10_000_000 else f"{pixels / 1e6:.3g} megapixels"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:.3g} s"


def _one_of(names: Iterable[str]) -> str:
    """'a JPEG, PNG or GIF' (each name once)."""
    *most, last = dict.fromkeys(names)
    return f"a {', '.join(most)} or {last}" if most else f"a {last}"
