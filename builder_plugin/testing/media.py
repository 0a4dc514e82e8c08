"""Synthetic test media: structured RGB images and 16-bit PCM wav files, generated from a seed (no downloads).

Images have gradients, filled shapes and noise, so every crop and patch differs; audio has tones with a pitch sweep,
noise and an amplitude envelope, so the log-mel features vary over time and frequency.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

_IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG"}


def make_image(path: str | Path, width: int, height: int, seed: int = 0) -> Path:
    """Write an RGB image; PNG or JPEG chosen by the suffix of `path`."""
    path = Path(path)
    image_format = _IMAGE_FORMATS.get(path.suffix.lower())
    if image_format is None:
        raise ValueError(f"unsupported image suffix {path.suffix!r}; use one of {sorted(_IMAGE_FORMATS)}")
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    rng = np.random.default_rng(seed)

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    pixels = np.stack(
        [
            200 * u + 40 * np.sin(6 * v + phase[0]),
            200 * v + 40 * np.sin(5 * u + phase[1]),
            120 + 100 * np.sin(4 * (u + v) + phase[2]),
        ],
        axis=-1,
    )
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")

    draw = ImageDraw.Draw(image)
    scale = min(width, height)
    for _ in range(6):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        radius = rng.uniform(0.05, 0.25) * scale
        box = [cx - radius, cy - radius, cx + radius, cy + radius]
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.ellipse(box, fill=color)
        else:
            draw.rectangle(box, fill=color, outline=(0, 0, 0), width=max(1, scale // 100))

    noisy = np.asarray(image, dtype=np.float32) + 8 * rng.standard_normal((height, width, 3), dtype=np.float32)
    image = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=image_format, **({"quality": 92} if image_format == "JPEG" else {}))
    return path


def make_wav(path: str | Path, seconds: float, sample_rate: int = 16000, seed: int = 0, channels: int = 1) -> Path:
    """Write a 16-bit PCM wav: a few tones with a pitch sweep, noise and an amplitude envelope."""
    path = Path(path)
    num_samples = round(seconds * sample_rate)
    if num_samples < 1 or channels < 1:
        raise ValueError(f"need at least one sample and one channel, got {seconds} s x {channels} channels")
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / sample_rate
    nyquist = sample_rate / 2

    data = np.empty((num_samples, channels), dtype=np.float64)
    for channel in range(channels):
        signal = np.zeros(num_samples)
        for _ in range(3):
            start, end = rng.uniform(0.02, 0.3) * nyquist, rng.uniform(0.02, 0.3) * nyquist
            # Linear chirp: the instantaneous frequency moves from start to end over the clip.
            frequency_integral = start * t + (end - start) * t**2 / (2 * max(seconds, 1e-9))
            signal += rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * frequency_integral + rng.uniform(0, 2 * np.pi))
        envelope = 0.55 + 0.45 * np.sin(2 * np.pi * rng.uniform(0.5, 3.0) * t + rng.uniform(0, 2 * np.pi))
        signal = signal * envelope + rng.normal(0, 0.02, size=num_samples)
        data[:, channel] = signal
    data *= 0.8 / max(np.abs(data).max(), 1e-9)

    pcm = np.round(data * 32767).astype("<i2")
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm.tobytes())
    return path


def default_media(directory: str | Path) -> dict[str, Path]:
    """A small standard set: a 640x360 JPEG, a 448x448 PNG and a 2 s 16 kHz mono wav."""
    directory = Path(directory)
    return {
        "image_jpeg": make_image(directory / "landscape_640x360.jpg", 640, 360, seed=1),
        "image_png": make_image(directory / "square_448x448.png", 448, 448, seed=2),
        "audio_wav": make_wav(directory / "tones_2s_16k.wav", 2.0, 16000, seed=3),
    }
