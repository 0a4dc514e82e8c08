"""builder_plugin.media: untrusted images and clips decoded in a separate process into canonical PNG / WAV bytes that
keep their pixels and samples, under limits and a time bound; a decoder process that dies or hangs is replaced."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest
import soundfile
from PIL import Image

from builder_plugin.media import Media, MediaDecoder, MediaError, MediaLimits, MediaNotFoundError
from tests.support.media_corpus import AUDIO_FORMATS


@pytest.fixture(scope="module")
def decoder():
    with MediaDecoder(processes=2) as decoder:
        yield decoder


def _encoded(pixels: np.ndarray, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **options)
    return out.getvalue()


def _rgb(media: Media) -> np.ndarray:
    assert media.kind == "image" and media.data.startswith(b"\x89PNG")
    with Image.open(io.BytesIO(media.data)) as image:
        assert image.mode == "RGB" and image.format == "PNG"
        return np.asarray(image)


def _pcm(media: Media) -> tuple[np.ndarray, int]:
    assert media.kind == "audio"
    info = soundfile.info(io.BytesIO(media.data))
    assert (info.format, info.subtype, info.channels) == ("WAV", "PCM_16", 1)
    samples, rate = soundfile.read(io.BytesIO(media.data), dtype="int16")
    return samples, rate


def test_lossless_images_keep_their_pixels(decoder):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, (40, 30), dtype=np.uint8)
    rgba = rng.integers(0, 256, (20, 24, 4), dtype=np.uint8)
    for fmt in ("PNG", "BMP", "TIFF", "WEBP"):
        options = {"lossless": True} if fmt == "WEBP" else {}
        assert np.array_equal(_rgb(decoder.image(_encoded(rgb, fmt, **options), fmt)), rgb), fmt
        assert np.array_equal(_rgb(decoder.image(_encoded(gray, fmt, **options), fmt)), np.stack([gray] * 3, -1))
    # Transparency is dropped, as transformers' processor does (convert("RGB")).
    assert np.array_equal(_rgb(decoder.image(_encoded(rgba, "PNG"), "rgba")), rgba[..., :3])
    # A palette GIF: the palette's colours, first frame only.
    frames = [Image.fromarray(np.full((8, 8, 3), value, np.uint8)).convert("P") for value in (10, 200)]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    assert np.array_equal(_rgb(decoder.image(out.getvalue(), "gif")), np.asarray(frames[0].convert("RGB")))


def test_lossy_images_decode_as_pillow_does(decoder):
    from skimage import data as photographs

    pixels = photographs.astronaut()[::4, ::4]
    for fmt in ("JPEG", "WEBP"):
        data = _encoded(pixels, fmt, quality=85)
        expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        decoded = _rgb(decoder.image(data, fmt))
        assert np.array_equal(decoded, expected), fmt
        assert np.abs(decoded.astype(int) - pixels).mean() < 8  # and it is the photograph


def test_deep_images_are_scaled_to_8_bits_not_clipped(decoder):
    deep = (np.arange(64 * 32, dtype=np.uint16).reshape(64, 32) * 31).astype(np.uint16)
    out = io.BytesIO()
    Image.fromarray(deep).save(out, format="PNG")  # a 16-bit grayscale PNG
    decoded = _rgb(decoder.image(out.getvalue(), "deep"))
    assert np.array_equal(decoded[..., 0], np.round(deep / 65535 * 255).astype(np.uint8))  # nearest 8-bit level


def test_photos_are_turned_upright_by_their_exif_orientation(decoder):
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = 255  # left half white
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view"
    out = io.BytesIO()
    image.save(out, format="PNG", exif=exif)
    decoded = _rgb(decoder.image(out.getvalue(), "phone photo"))
    assert decoded.shape == (40, 20, 3)
    assert decoded[:20].min() == 255 and decoded[20:].max() == 0  # the white half is now on top


def test_a_fit_scales_images_down_to_a_square_keeping_their_shape(decoder):
    from skimage import data as photographs

    photo = photographs.astronaut()  # 512 x 512
    wide = np.ascontiguousarray(np.concatenate([photo, photo[:, ::-1]], axis=1)[:300])  # 1024 x 300
    for pixels, fit, size in ((photo, 448, (448, 448)), (wide, 448, (448, 131)), (wide[:, :200], 448, (200, 300)),
                              (wide, 1, (1, 1))):
        data = _encoded(pixels, "PNG")
        media = decoder.image(data, "photo", fit=fit)
        decoded = _rgb(media)
        assert decoded.shape == (size[1], size[0], 3), (fit, pixels.shape)
        assert (media.info["width"], media.info["height"]) == (pixels.shape[1], pixels.shape[0])  # what it was
        assert media.info.get("fitted", list(size)) == list(size)
        if size[0] < pixels.shape[1] and min(size) > 1:  # scaled: the photograph, as a plain Lanczos resize gives it
            expected = np.asarray(Image.fromarray(pixels).resize(size, Image.Resampling.LANCZOS), np.int16)
            assert np.abs(decoded.astype(np.int16) - expected).mean() < 2
        elif size[0] == pixels.shape[1]:  # never up
            assert np.array_equal(decoded, pixels) and "fitted" not in media.info
    assert decoder.image(_encoded(photo, "PNG"), "photo", fit=448) != decoder.image(_encoded(photo, "PNG"), "photo")
    for wrong in (0, -3, 2.5, True, "448"):
        with pytest.raises(ValueError, match="fit must be a positive number of pixels"):
            decoder.image(_encoded(photo, "PNG"), "photo", fit=wrong)
    with pytest.raises(ValueError, match="for an image only"):
        decoder.decode("audio", _wav(np.zeros(1600, np.int16), 16000), "clip", fit=448)


def test_clips_become_mono_16_bit_wav_at_their_rate(decoder):
    rng = np.random.default_rng(2)
    left, right = (0.4 * np.sin(np.linspace(0, f, 12000)) + 0.05 * rng.standard_normal(12000) for f in (300, 900))
    mono = pcm16(left)
    for fmt, subtype in (("WAV", "PCM_16"), ("FLAC", "PCM_16")):
        out = io.BytesIO()
        soundfile.write(out, mono, 22050, format=fmt, subtype=subtype)
        samples, rate = _pcm(decoder.audio(out.getvalue(), fmt))
        assert rate == 22050 and np.array_equal(samples, mono), fmt  # lossless: the very samples
    stereo = io.BytesIO()
    soundfile.write(stereo, np.stack([pcm16(left), pcm16(right)], 1), 44100, format="WAV", subtype="PCM_16")
    samples, rate = _pcm(decoder.audio(stereo.getvalue(), "stereo"))
    expected = (pcm16(left).astype(np.int32) + pcm16(right)) / 2  # the runtime averages the channels too
    assert rate == 44100 and np.abs(samples - expected).max() <= 1
    floats = io.BytesIO()
    loud = (1.5 * left).astype(np.float32)
    soundfile.write(floats, loud, 16000, format="WAV", subtype="FLOAT")  # out of range: clipped, not wrapped
    samples, _ = _pcm(decoder.audio(floats.getvalue(), "float"))
    assert np.array_equal(samples, pcm16(loud))
    for fmt, subtype in (AUDIO_FORMATS["ogg"], AUDIO_FORMATS["mp3"]):
        out = io.BytesIO()
        soundfile.write(out, left, 16000, format=fmt, subtype=subtype)
        media = decoder.audio(out.getvalue(), fmt)
        samples, rate = _pcm(media)
        assert rate == 16000 and abs(len(samples) - 12000) < 2000, fmt  # lossy codecs pad a little
        assert media.info["format"] == {"OGG": "Ogg"}.get(fmt, fmt)


def test_limits_refuse_with_one_line_each(decoder):
    limits = MediaLimits(max_image_pixels=10_000, max_image_side=200, max_audio_seconds=1.0, max_channels=2)
    small = MediaDecoder(limits)
    cases = {
        "too many pixels": ("image", _encoded(np.zeros((120, 120, 3), np.uint8), "PNG"),
                            "the image is too large (120 x 120 pixels; the limit is 0.01 megapixels, 200 pixels"),
        "too wide": ("image", _encoded(np.zeros((1, 300, 3), np.uint8), "PNG"), "(300 x 1 pixels"),
        "too long": ("audio", _wav(np.zeros(24000, np.int16), 16000), "longer than the limit of 1 s"),
        "too many channels": ("audio", _wav(np.zeros((100, 3), np.int16), 16000),
                              "unsupported channel count 3 (at most 2)"),
        "rate too low": ("audio", _wav(np.zeros(100, np.int16), 6000), "unsupported sample rate 6000 Hz"),
        "empty clip": ("audio", _wav(np.zeros(0, np.int16), 16000), "holds no samples"),
        "text": ("image", b"just some text", "not a readable image (not a JPEG, PNG, WebP, GIF, BMP or TIFF file)"),
        "an image as audio": ("audio", _encoded(np.zeros((4, 4, 3), np.uint8), "PNG"),
                              "not a readable audio clip (not a WAV, FLAC, Ogg or MP3 file"),
    }
    with small:
        for name, (kind, data, reason) in cases.items():
            with pytest.raises(MediaError) as caught:
                small.decode(kind, data, name)
            assert reason in caught.value.reason and "\n" not in str(caught.value), name
            assert str(caught.value).startswith(f"cannot read {kind} {name}: "), name
        with pytest.raises(MediaError, match="the file is empty"):
            small.decode("image", b"", "nothing")
    with pytest.raises(MediaError, match="larger than the limit of 0.000954 MB"):
        MediaDecoder(MediaLimits(max_file_bytes=1000)).image(bytes(2000), "big")
    with pytest.raises(ValueError, match="max_audio_seconds must be positive"):
        MediaLimits(max_audio_seconds=0)


def test_files_are_read_and_named_by_their_path(decoder, tmp_path):
    path = tmp_path / "picture.bmp"
    path.write_bytes(_encoded(np.full((4, 6, 3), 7, np.uint8), "BMP"))
    media = decoder.open("image", path)
    assert media.source == str(path) and media.info == {"format": "BMP", "width": 6, "height": 4}
    with pytest.raises(MediaNotFoundError, match="image file not found"):
        decoder.open("image", tmp_path / "missing.png")
    with pytest.raises(MediaNotFoundError, match="audio path is not a file"):
        decoder.open("audio", tmp_path)


def test_media_are_equal_by_their_canonical_bytes(decoder):
    pixels = np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    as_png, as_bmp = decoder.image(_encoded(pixels, "PNG"), "a"), decoder.image(_encoded(pixels, "BMP"), "b")
    assert as_png == as_bmp and hash(as_png) == hash(as_bmp) and as_png.named("c") == as_png
    assert as_png != decoder.image(_encoded(255 - pixels, "PNG"), "a")
    assert "data" not in repr(as_png)  # no megabytes in logs


def test_a_slow_decode_is_stopped_and_the_next_one_works(decoder):
    big = _encoded(np.random.default_rng(4).integers(0, 256, (3000, 3000, 3), dtype=np.uint8), "PNG")
    with MediaDecoder(MediaLimits(decode_seconds=0.05)) as hasty:
        started = time.monotonic()
        with pytest.raises(MediaError, match="decoding took longer than the limit of 0.05 s"):
            hasty.image(big, "big")
        assert time.monotonic() - started < 2  # not waited for
    assert _rgb(decoder.image(_encoded(np.zeros((2, 2, 3), np.uint8), "PNG"), "small")).shape == (2, 2, 3)


def test_a_decoder_process_that_dies_is_replaced():
    big = _encoded(np.random.default_rng(5).integers(0, 256, (2500, 2500, 3), dtype=np.uint8), "PNG")
    small = _encoded(np.zeros((3, 3, 3), np.uint8), "PNG")
    with MediaDecoder() as decoder:
        decoder.image(small, "warm")  # its process is started and idle
        child = decoder._idle[0]
        child.process.kill()  # dead while idle: not handed out
        child.process.wait()
        assert _rgb(decoder.image(small, "after")).shape == (3, 3, 3)
        running = decoder._idle[0]
        killer = threading.Timer(0.1, running.process.kill)
        killer.start()
        with pytest.raises(MediaError, match="the decoder failed on it"):
            decoder.image(big, "crashed")  # dies while decoding: this file is refused, nothing else
        killer.join()
        assert _rgb(decoder.image(small, "again")).shape == (3, 3, 3)


def test_decoders_serve_threads_at_once(decoder):
    images = [_encoded(np.full((8, 8, 3), value, np.uint8), "PNG") for value in range(12)]
    results: dict[int, int] = {}

    def decode(value: int) -> None:
        results[value] = int(_rgb(decoder.image(images[value], str(value)))[0, 0, 0])

    threads = [threading.Thread(target=decode, args=(value,)) for value in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {value: value for value in range(12)}
    assert decoder._started <= decoder.processes


def pcm16(samples: np.ndarray) -> np.ndarray:
    """What a canonical WAV holds for float samples: libsndfile reads a 16-bit value v as v / 32768."""
    return np.clip(np.round(samples * 32768), -32768, 32767).astype(np.int16)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()

