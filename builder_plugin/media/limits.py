"""What media the runtime accepts: the formats, the canonical forms handed to onnxruntime-genai, and the limits on
one file (stdlib only: the server's --help reads it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Pillow format name -> what a message calls it. Only these parsers are ever run on untrusted bytes.
IMAGE_FORMATS = {"JPEG": "JPEG", "PNG": "PNG", "WEBP": "WebP", "GIF": "GIF", "BMP": "BMP", "TIFF": "TIFF"}
# libsndfile major format -> what a message calls it.
AUDIO_FORMATS = {"WAV": "WAV", "WAVEX": "WAV", "RF64": "WAV", "FLAC": "FLAC", "OGG": "Ogg", "MP3": "MP3"}
# The forms onnxruntime-genai is handed, written by Pillow and libsndfile: its own decoders never see client bytes.
CANONICAL = {"image": "PNG (8-bit RGB)", "audio": "WAV (16-bit PCM, mono, the clip's sample rate)"}
MIN_SAMPLE_RATE = 8000  # the runtime's audio decoder only resamples down, to 8 or 16 kHz


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one image or clip; a file past any of them is refused before (or while) it is decoded."""

    max_file_bytes: int = 256 << 20
    max_image_pixels: int = 50_000_000  # width x height: decompression bombs stop at the header
    max_image_side: int = 16384
    min_audio_seconds: float = 0.1  # clips of 5-15 ms end the process inside onnxruntime-genai's feature extractor
    max_audio_seconds: float = 600.0  # 7,500 audio tokens: what fits the default maximum length with room to answer
    max_sample_rate: int = 192_000
    max_channels: int = 16
    decode_seconds: float = 10.0  # a decode that takes longer is stopped and the file refused

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"media limit {name} must be positive, not {value!r}")
        if self.max_sample_rate < MIN_SAMPLE_RATE:
            raise ValueError(f"max_sample_rate must be at least {MIN_SAMPLE_RATE}")
        if self.min_audio_seconds > self.max_audio_seconds:
            raise ValueError("min_audio_seconds must not be above max_audio_seconds")

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
