"""Real media in every format the runtime accepts, and seeded broken versions of them, for the media fuzz tests.

Images: photographs shipped with scikit-image (RGB, grayscale, RGBA) saved as JPEG, PNG, WebP, GIF, BMP and TIFF by
Pillow. Audio: a sentence spoken by espeak-ng, converted by sox (44.1 kHz stereo, 8 kHz) and written as WAV, FLAC,
Ogg/Vorbis and MP3 by libsndfile. Broken versions: each file truncated at several offsets, with bytes flipped in its
header and in its body, and with header fields that lie (huge, zero and 2^31 sizes, rates and frame counts)."""

from __future__ import annotations

import io
import random
import struct
import subprocess
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import soundfile
from PIL import Image

PHOTOS = ("astronaut", "coffee", "camera", "logo")  # RGB, RGB, grayscale, RGBA
IMAGE_FORMATS = {"jpg": ("JPEG", {"quality": 90}), "png": ("PNG", {}), "webp": ("WEBP", {"quality": 80}),
                 "gif": ("GIF", {}), "bmp": ("BMP", {}), "tiff": ("TIFF", {"compression": "tiff_lzw"})}
SPEECH = "The quick brown fox jumps over the lazy dog, twice."
AUDIO_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS"),
                 "mp3": ("MP3", "MPEG_LAYER_III")}
HEADER_BYTES = 64


@dataclass(frozen=True)
class Sample:
    name: str  # e.g. "astronaut.jpg", "astronaut.jpg cut at 1234", "speech.wav lies: data size 2^32-1"
    kind: str  # "image" or "audio"
    data: bytes


def images() -> list[Sample]:
    from skimage import data as photographs

    samples = []
    for photo in PHOTOS:
        pixels = getattr(photographs, photo)()
        image = Image.fromarray(pixels)
        for suffix, (fmt, options) in IMAGE_FORMATS.items():
            converted = image.convert("RGB") if fmt == "JPEG" and image.mode == "RGBA" else image
            out = io.BytesIO()
            converted.save(out, format=fmt, **options)
            samples.append(Sample(f"{photo}.{suffix}", "image", out.getvalue()))
    return samples


def clips(folder: Path) -> list[Sample]:
    """The sentence as spoken by espeak-ng (22.05 kHz mono), and sox's 44.1 kHz stereo and 8 kHz versions, in every
    audio format."""
    spoken = folder / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(spoken), SPEECH], check=True, capture_output=True)
    stereo, narrow = folder / "speech-44k-stereo.wav", folder / "speech-8k.wav"
    subprocess.run(["sox", str(spoken), "-r", "44100", "-c", "2", str(stereo)], check=True, capture_output=True)
    subprocess.run(["sox", str(spoken), "-r", "8000", str(narrow)], check=True, capture_output=True)
    samples = []
    for source in (spoken, stereo, narrow):
        audio, rate = soundfile.read(source, dtype="float32")
        for suffix, (fmt, subtype) in AUDIO_FORMATS.items():
            if fmt == "MP3" and rate == 8000:
                continue  # MPEG-2.5 layer III at 8 kHz: not every MP3 decoder reads it
            out = io.BytesIO()
            soundfile.write(out, audio, rate, format=fmt, subtype=subtype)
            samples.append(Sample(f"{source.stem}.{suffix}", "audio", out.getvalue()))
    return samples


def broken(samples: list[Sample], rng: random.Random, truncations: int = 4, flips: int = 2) -> Iterator[Sample]:
    """For each sample: `truncations` cuts (one inside the header, the others anywhere), `flips` single-byte flips
    in the header and as many in the body, and the header lies its format has."""
    for sample in samples:
        data = sample.data
        cuts = {rng.randrange(1, min(HEADER_BYTES, len(data)))} | {rng.randrange(1, len(data))
                                                                   for _ in range(truncations - 1)}
        for cut in sorted(cuts):
            yield Sample(f"{sample.name} cut at {cut}", sample.kind, data[:cut])
        for region, (low, high) in (("header", (0, HEADER_BYTES)), ("body", (HEADER_BYTES, len(data)))):
            for _ in range(flips):
                at = rng.randrange(low, min(high, len(data)))
                flipped = bytearray(data)
                flipped[at] ^= rng.randrange(1, 256)
                yield Sample(f"{sample.name} {region} byte {at} flipped", sample.kind, bytes(flipped))
        for lie, rewrite in LIES.get(sample.name.rsplit(".", 1)[1], {}).items():
            lied = rewrite(data)
            if lied is not None:
                yield Sample(f"{sample.name} lies: {lie}", sample.kind, lied)


def bombs() -> list[Sample]:
    """Small files that declare (or decompress to) far more pixels than the limits allow."""
    out = io.BytesIO()
    Image.new("1", (30000, 30000), 1).save(out, format="PNG")  # 112 MB of bits in a few hundred kB
    wide = io.BytesIO()
    Image.new("L", (20000, 1), 0).save(wide, format="GIF")
    return [Sample("30000x30000 1-bit PNG", "image", out.getvalue()),
            Sample("20000x1 GIF", "image", wide.getvalue())]


# ---- header lies --------------------------------------------------------------------------------------------------


def _png_size(width: int, height: int) -> Callable[[bytes], bytes]:
    def rewrite(data: bytes) -> bytes:
        chunk = bytearray(data[12:29])  # IHDR type and data
        chunk[4:12] = struct.pack(">II", width, height)
        return data[:12] + bytes(chunk) + struct.pack(">I", zlib.crc32(chunk)) + data[33:]

    return rewrite


def _jpeg_size(width: int, height: int) -> Callable[[bytes], bytes | None]:
    def rewrite(data: bytes) -> bytes | None:
        at = next((i for i in range(2, len(data) - 9) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC1, 0xC2)),
                  None)
        if at is None:
            return None
        return data[:at + 5] + struct.pack(">HH", height, width) + data[at + 9:]

    return rewrite


def _patch(offset: int, fmt: str, value: int) -> Callable[[bytes], bytes]:
    return lambda data: data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):]


def _wav_chunk(name: bytes, field_offset: int, fmt: str, value: int) -> Callable[[bytes], bytes | None]:
    def rewrite(data: bytes) -> bytes | None:
        at = data.find(name, 12)
        if at < 0:
            return None
        return _patch(at + field_offset, fmt, value)(data)

    return rewrite


def _flac_streaminfo(sample_rate: int, total_samples: int) -> Callable[[bytes], bytes]:
    def rewrite(data: bytes) -> bytes:
        info = bytearray(data[8:42])  # STREAMINFO after "fLaC" and its block header
        packed = int.from_bytes(info[10:18], "big")
        packed &= ~((0xFFFFF << 44) | 0xFFFFFFFFF)
        packed |= (sample_rate & 0xFFFFF) << 44 | (total_samples & 0xFFFFFFFFF)
        info[10:18] = packed.to_bytes(8, "big")
        return data[:8] + bytes(info) + data[42:]

    return rewrite


LIES: dict[str, dict[str, Callable[[bytes], bytes | None]]] = {
    "png": {"size 2^31-1 x 2^31-1": _png_size(2**31 - 1, 2**31 - 1), "size 0 x 0": _png_size(0, 0),
            "size 65535 x 65535": _png_size(65535, 65535)},
    "jpg": {"size 65500 x 65500": _jpeg_size(65500, 65500), "size 0 x 0": _jpeg_size(0, 0)},
    "gif": {"screen 65535 x 65535": _patch(6, "<I", 0xFFFFFFFF)},
    "bmp": {"size 2^31-1 x 2^31-1": lambda d: _patch(18, "<i", 2**31 - 1)(_patch(22, "<i", 2**31 - 1)(d)),
            "size 0 x 0": lambda d: _patch(18, "<i", 0)(_patch(22, "<i", 0)(d))},
    "wav": {"data size 2^32-1": _wav_chunk(b"data", 4, "<I", 2**32 - 1), "data size 0": _wav_chunk(b"data", 4, "<I", 0),
            "rate 0": _wav_chunk(b"fmt ", 12, "<I", 0), "rate 2^31-1": _wav_chunk(b"fmt ", 12, "<I", 2**31 - 1),
            "channels 0": _wav_chunk(b"fmt ", 10, "<H", 0), "channels 65535": _wav_chunk(b"fmt ", 10, "<H", 65535),
            "RIFF size 2^31": _patch(4, "<I", 2**31)},
    "flac": {"2^36-1 samples": _flac_streaminfo(44100, 2**36 - 1), "rate 0": _flac_streaminfo(0, 1000),
             "0 samples": _flac_streaminfo(44100, 0)},
}


def hostile_corpus(folder: Path, seed: int) -> list[Sample]:
    """Every broken version of every sample (with the seed's cuts and flips) and the bombs."""
    rng = random.Random(seed)
    samples = images() + clips(folder)
    return [*broken(samples, rng), *bombs()]


