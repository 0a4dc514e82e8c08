"""Synthetic media: the files are what they claim to be, carry structure, and onnxruntime-genai opens them."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
from PIL import Image

from builder_plugin.testing.media import default_media, make_image, make_wav


@pytest.mark.parametrize(("name", "size", "fmt"), [("a.png", (448, 448), "PNG"), ("b.jpg", (640, 360), "JPEG"),
                                                   ("c.jpeg", (37, 501), "JPEG")])  # fmt: skip
def test_make_image_writes_structured_rgb(tmp_path, name, size, fmt):
    path = make_image(tmp_path / name, *size, seed=3)
    with Image.open(path) as image:
        assert (image.format, image.mode, image.size) == (fmt, "RGB", size)
        pixels = np.asarray(image, dtype=np.float32)
    assert pixels.std() > 20  # not flat
    assert all(pixels[..., c].std() > 10 for c in range(3))  # every channel varies
    left, right = pixels[:, : size[0] // 2], pixels[:, size[0] // 2 :]
    assert abs(left.mean() - right.mean()) > 1 or abs(pixels[: size[1] // 2].mean() - pixels[size[1] // 2 :].mean()) > 1


def test_make_image_is_deterministic_per_seed(tmp_path):
    first = make_image(tmp_path / "1.png", 64, 48, seed=5).read_bytes()
    assert make_image(tmp_path / "2.png", 64, 48, seed=5).read_bytes() == first
    assert make_image(tmp_path / "3.png", 64, 48, seed=6).read_bytes() != first


def test_make_image_rejects_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match="suffix"):
        make_image(tmp_path / "x.bmp", 10, 10)


@pytest.mark.parametrize(("seconds", "rate", "channels"), [(2.0, 16000, 1), (0.5, 8000, 2), (1.25, 48000, 1)])
def test_make_wav_writes_16_bit_pcm(tmp_path, seconds, rate, channels):
    path = make_wav(tmp_path / "clip.wav", seconds, sample_rate=rate, seed=1, channels=channels)
    info = soundfile.info(str(path))
    assert (info.samplerate, info.channels, info.subtype, info.format) == (rate, channels, "PCM_16", "WAV")
    assert info.frames == round(seconds * rate)
    data, _ = soundfile.read(str(path), always_2d=True)
    assert 0.1 < np.abs(data).max() < 1.0
    if channels == 2:
        assert not np.allclose(data[:, 0], data[:, 1])


def test_wav_log_mel_varies_over_time_and_frequency(tmp_path):
    from transformers import Phi4MultimodalFeatureExtractor

    path = make_wav(tmp_path / "clip.wav", 2.0, seed=4)
    audio, rate = soundfile.read(str(path))
    extracted = Phi4MultimodalFeatureExtractor()(audio, sampling_rate=rate, return_tensors="np")
    features = extracted["audio_input_features"][0]
    assert features.shape[1] == 80
    assert features.std(axis=0).mean() > 0.5  # changes over time (envelope, sweep)
    assert features.std(axis=1).mean() > 0.5  # changes over frequency (tones)


def test_make_wav_is_deterministic_per_seed(tmp_path):
    first = make_wav(tmp_path / "1.wav", 0.3, seed=2).read_bytes()
    assert make_wav(tmp_path / "2.wav", 0.3, seed=2).read_bytes() == first
    assert make_wav(tmp_path / "3.wav", 0.3, seed=3).read_bytes() != first


def test_default_media_opens_in_onnxruntime_genai(tmp_path):
    import onnxruntime_genai as og

    media = default_media(tmp_path)
    with Image.open(media["image_jpeg"]) as image:
        assert (image.format, image.size) == ("JPEG", (640, 360))
    with Image.open(media["image_png"]) as image:
        assert (image.format, image.size) == ("PNG", (448, 448))
    info = soundfile.info(str(media["audio_wav"]))
    assert (info.samplerate, info.channels, info.frames) == (16000, 1, 32000)
    og.Images.open(str(media["image_jpeg"]), str(media["image_png"]))
    og.Audios.open(str(media["audio_wav"]))
