"""builder_plugin.runtime.media: image and audio files checked before the runtime sees them."""

from __future__ import annotations

import shutil

import pytest

from builder_plugin.runtime import MediaNotFoundError, UnsupportedMediaError, check_audio, check_image

IMAGE = "square.png"
AUDIO = "clip_2s.wav"


def test_media_checks(media_dir, tmp_path):
    assert check_image(media_dir / IMAGE) == media_dir / IMAGE
    assert check_image(media_dir / "wide.jpg") == media_dir / "wide.jpg"
    assert check_audio(media_dir / AUDIO) == media_dir / AUDIO

    with pytest.raises(MediaNotFoundError, match="image file not found: .*missing.png"):
        check_image(tmp_path / "missing.png")
    with pytest.raises(MediaNotFoundError, match="audio path is not a file"):
        check_audio(tmp_path)
    bmp = tmp_path / "picture.bmp"
    bmp.write_bytes(b"BM" + bytes(100))
    with pytest.raises(UnsupportedMediaError, match=r"unsupported image format '.bmp'"):
        check_image(bmp)
    # A wav renamed .png would end the process inside the runtime's JPEG fallback: it must be caught first.
    disguised = tmp_path / "sound.png"
    shutil.copy(media_dir / AUDIO, disguised)
    with pytest.raises(UnsupportedMediaError, match="not a PNG or JPEG image"):
        check_image(disguised)
    with pytest.raises(UnsupportedMediaError, match=r"unsupported audio format '.png'"):
        check_audio(media_dir / IMAGE)
