"""builder_plugin.serve.media: request media decoded once, kept in memory under a bound."""

from __future__ import annotations

import io
import shutil

import pytest
from PIL import Image

from builder_plugin.media import MediaDecoder
from builder_plugin.serve.app import MB
from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.media import MediaCache, MediaReader
from tests.support.serving import (
    AUDIO,
    IMAGE,
    b64,
)


class CountingDecoder(MediaDecoder):
    """A MediaDecoder that counts its decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded: list[str] = []

    def decode(self, kind, data, source, fit=None):
        self.decoded.append(source)
        return super().decode(kind, data, source, fit)


def _png(value: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (value, value, value)).save(out, format="PNG")
    return out.getvalue()


def test_media_cache_decodes_the_same_bytes_once_and_stays_bounded():
    decoder = CountingDecoder()
    one = MediaDecoder().image(_png(1), "size")
    cache = MediaCache(decoder, max_bytes=2 * len(one.data) + 10)  # room for two decoded images
    first = cache.decode("image", _png(1), "first")
    again = cache.decode("image", _png(1), "again")
    assert again == first and again.source == "again" and decoder.decoded == ["first"]
    cache.decode("image", _png(2), "second")
    cache.decode("image", _png(3), "third")  # the least recently used one is dropped
    assert cache.held_bytes <= cache.max_bytes
    cache.decode("image", _png(1), "first again")
    assert decoder.decoded == ["first", "second", "third", "first again"]
    cache.decode("image", _png(1), "fitted", fit=4)  # another fit, another picture
    assert decoder.decoded[-1] == "fitted"
    with pytest.raises(ApiError, match="not valid base64"):
        MediaReader(cache).audio("***", "wav", "x")
    cache.close()
    assert cache.held_bytes == 0
    with pytest.raises(ApiError, match="shutting down"):
        cache.decode("image", _png(1), "late")


def test_refused_media_are_not_kept(media_dir):
    cache = MediaCache(MediaDecoder(), MB)
    reader = MediaReader(cache)
    for data in ((media_dir / IMAGE).read_bytes(), b"RIFF" + bytes(64), b"plain text, not a clip"):
        with pytest.raises(ApiError, match=r"x: not a readable audio clip \(not a WAV, FLAC, Ogg or MP3 file"):
            reader.audio(b64(data), "wav", "x")
    assert cache.held_bytes == 0
    assert reader.audio(b64((media_dir / AUDIO).read_bytes()), "wav", "x").kind == "audio"
    cache.close()


def test_local_files_are_decoded_like_sent_ones(media_dir, tmp_path):
    disguised = tmp_path / "sound.png"
    shutil.copy(media_dir / AUDIO, disguised)
    reader = MediaReader(MediaCache(MediaDecoder(), MB), allow_local_files=True)
    with pytest.raises(ApiError, match=r"url: not a readable image \(not a JPEG"):
        reader.image(disguised.as_uri(), "url")
    with pytest.raises(ApiError, match="url: image file not found: "):
        reader.image((tmp_path / "nothing.png").as_uri(), "url")
    assert reader.image((media_dir / IMAGE).as_uri(), "url").source == "url"
    reader.cache.close()


def test_low_detail_needs_the_packages_crop_size(media_dir):
    """A package whose vision processor gives no crop size (another builder's) cannot fit an image: detail "low" is
    refused naming the field, whether the request or the server's --image-detail asked for it."""
    url = "data:image/png;base64," + b64((media_dir / IMAGE).read_bytes())
    cache = MediaCache(MediaDecoder(), MB)
    for reader, detail in ((MediaReader(cache), "low"), (MediaReader(cache, auto_detail="low"), None)):
        with pytest.raises(ApiError, match=r"^part.detail: low detail is not available") as refused:
            reader.image(url, "part", detail)
        assert refused.value.param == "part.detail"
    assert MediaReader(cache).image(url, "part", "high").kind == "image"
    with pytest.raises(ValueError, match="auto_detail must be one of high, low"):
        MediaReader(cache, auto_detail="auto")
    cache.close()
