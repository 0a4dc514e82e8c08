"""Request media as files: base64 data (data: URLs, input_audio) decoded into a content-addressed cache, so the same
bytes always map to the same path and the runtime sees the same conversation across stateless requests."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

from builder_plugin import runtime
from builder_plugin.serve.errors import ApiError, shutting_down

# The runtime's image decoder reads PNG and JPEG only; other content can end the process, so it is refused here.
IMAGE_SIGNATURES = {b"\x89PNG\r\n\x1a\n": ".png", b"\xff\xd8\xff": ".jpg"}
AUDIO_FORMATS = {"wav": ".wav", "mp3": ".mp3", "flac": ".flac"}
TEMPORARY_PREFIX = "phi4mm-serve-media-"


def is_audio(data: bytes) -> bool:
    """Whether `data` starts as a WAV (RIFF/RF64), FLAC or MP3 (ID3 tag or frame sync) file does; anything else is
    refused before it is stored (the runtime's decoder would refuse it later)."""
    return (data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE") or data.startswith((b"fLaC", b"ID3")) \
        or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)


class MediaCache:
    """A folder of media files named by the sha256 of their bytes, holding at most about `max_bytes`.

    Files a request still uses are pinned (``store`` pins, ``release`` unpins); the least recently stored unpinned
    files are deleted when the folder grows past its bound. `folder` None is a new temporary folder. ``close`` (the
    server's shutdown) removes the folder if this cache created it, else every file it stored there: nothing a
    client sent outlives the server."""

    def __init__(self, folder: str | Path | None, max_bytes: int) -> None:
        if folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX))
            self.created = True
        else:
            self.folder = Path(folder)
            self.created = not self.folder.exists()
            self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._pins: Counter[Path] = Counter()
        self._stored: set[Path] = set()
        self._closed = False
        self._lock = threading.Lock()

    def store(self, data: bytes, suffix: str) -> Path:
        path = self.folder / (hashlib.sha256(data).hexdigest() + suffix)
        with self._lock:
            if self._closed:
                raise shutting_down()
            if path.is_file():
                os.utime(path)  # recently used: evicted last
            else:
                partial = path.with_name(path.name + ".part")
                partial.write_bytes(data)
                os.replace(partial, path)
            self._stored.add(path)
            self._pins[path] += 1
            self._evict()
        return path

    def release(self, paths: Iterable[Path], discard: bool = False) -> None:
        """Unpin `paths`; with `discard` (a refused request) also delete those no other request uses."""
        with self._lock:
            for path in paths:
                self._pins[path] -= 1
                if self._pins[path] <= 0:
                    del self._pins[path]
                    if discard:
                        path.unlink(missing_ok=True)
                        self._stored.discard(path)

    def close(self) -> None:
        """Delete what this cache stored (the whole folder if it created it); later stores are refused."""
        with self._lock:
            self._closed = True
            if self.created:
                shutil.rmtree(self.folder, ignore_errors=True)
            else:
                for path in self._stored:
                    path.unlink(missing_ok=True)
                    path.with_name(path.name + ".part").unlink(missing_ok=True)
            self._stored.clear()
            self._pins.clear()

    def _evict(self) -> None:
        files = []
        for path in list(self._stored):  # only its own files: a --media-cache folder may hold the user's too
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            if path not in self._pins:
                path.unlink(missing_ok=True)
                self._stored.discard(path)
                total -= size


class MediaReader:
    """Turns the media parts of one request into files; `labels` names each file by its place in the request (for
    error messages), `paths` lists the cache files to release when the request is over."""

    def __init__(self, cache: MediaCache, allow_local_files: bool = False) -> None:
        self.cache = cache
        self.allow_local_files = allow_local_files
        self.labels: dict[Path, str] = {}
        self.stored: list[Path] = []

    def image(self, url: object, param: str) -> Path:
        if not isinstance(url, str):
            raise ApiError(f"{param}: the image URL must be a string", param=param)
        if url.startswith("file:"):
            path = self._local_file(url, param)
        elif url.startswith("data:"):
            data = decode_base64(_data_url_payload(url, param), param)
            signature = next((s for s in IMAGE_SIGNATURES if data.startswith(s)), None)
            if signature is None:
                raise ApiError(f"{param}: the image is not a PNG or JPEG file", param=param,
                               code="invalid_image_format")
            path = self._store(data, IMAGE_SIGNATURES[signature])
        else:
            scheme = urlparse(url).scheme or url[:16]
            raise ApiError(f"{param}: image URLs must be data: URLs ({scheme!r} is not fetched by this server)",
                           param=param, code="invalid_image_url")
        self.labels[path] = param
        return path

    def audio(self, data: object, audio_format: object, param: str) -> Path:
        if audio_format not in AUDIO_FORMATS:
            raise ApiError(f"{param}.format: audio format must be one of {', '.join(AUDIO_FORMATS)}, "
                           f"not {audio_format!r}", param=f"{param}.format", code="invalid_audio_format")
        if not isinstance(data, str):
            raise ApiError(f"{param}.data: base64 audio data (a string) is required", param=f"{param}.data")
        decoded = decode_base64(data, f"{param}.data")
        if not is_audio(decoded):
            raise ApiError(f"{param}: not a WAV, MP3 or FLAC file", param=param, code="invalid_media")
        path = self._store(decoded, AUDIO_FORMATS[audio_format])
        self.labels[path] = param
        return path

    def _store(self, data: bytes, suffix: str) -> Path:
        path = self.cache.store(data, suffix)
        self.stored.append(path)
        return path

    def _local_file(self, url: str, param: str) -> Path:
        if not self.allow_local_files:
            raise ApiError(f"{param}: file:// URLs are refused (start the server with --allow-local-files)",
                           param=param, code="local_files_not_allowed")
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(f"{param}: file:// URLs must name a local path", param=param, code="invalid_image_url")
        try:
            return runtime.check_image(unquote(parsed.path))
        except runtime.ChatError as exc:
            raise ApiError(f"{param}: {exc}", param=param, code="invalid_image_format") from None


def decode_base64(text: str, param: str) -> bytes:
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"{param}: not valid base64 data", param=param, code="invalid_base64") from None
    if not data:
        raise ApiError(f"{param}: the data is empty", param=param, code="invalid_base64")
    return data


def _data_url_payload(url: str, param: str) -> str:
    """The base64 text of ``data:[<media type>];base64,<data>``."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ApiError(f"{param}: a data: URL must be data:<media type>;base64,<data>", param=param,
                       code="invalid_image_url")
    return payload
