"""Request media: data: URLs, base64 audio and (with --allow-local-files) file:// URLs, decoded safely into Media
(builder_plugin.media: Pillow and libsndfile in separate processes, with limits and a time bound) before anything
else sees them. Nothing a client sends is written to disk; the decoded media are kept in memory, under a byte bound,
by the sha256 of the bytes sent, so a conversation sent again with every request is decoded once."""

from __future__ import annotations

import base64
import binascii
import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import unquote, urlparse

from builder_plugin.media import Media, MediaDecoder, MediaError, MediaNotFoundError
from builder_plugin.serve import defaults
from builder_plugin.serve.errors import ApiError, shutting_down

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")  # input_audio.format: the content decides how it is decoded
# image_url.detail: "low" fits the image to one crop of the model's (a photo's answer starts several times sooner);
# "high" gives it whole, as the model's processor tiles it (up to 36 crops and the global view); "auto" (or none) is
# what the server's --image-detail says (defaults.IMAGE_DETAIL)
IMAGE_DETAILS = ("auto", "low", "high")
_CODES = {"image": "invalid_image_format", "audio": "invalid_audio_format"}


class MediaCache:
    """Decoded media by (kind, fit, sha256 of the bytes sent), least recently used dropped past `max_bytes` of canonical
    bytes (a kept conversation still holds its own). ``close`` (the server's shutdown) stops the decoder processes
    and forgets everything; later requests are refused."""

    def __init__(self, decoder: MediaDecoder, max_bytes: int) -> None:
        self.decoder = decoder
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], Media] = OrderedDict()
        self._bytes = 0
        self._closed = False
        self._lock = threading.Lock()

    def decode(self, kind: str, data: bytes, source: str, fit: int | None = None) -> Media:
        """`data` decoded (or found decoded), an image with `fit` as MediaDecoder.decode says, named `source`; raises
        MediaError."""
        key = (kind, fit, hashlib.sha256(data).hexdigest())
        with self._lock:
            if self._closed:
                raise shutting_down()
            media = self._entries.get(key)
            if media is not None:
                self._entries.move_to_end(key)
                return media.named(source)
        media = self.decoder.decode(kind, data, source, fit)
        with self._lock:
            if key not in self._entries and len(media.data) <= self.max_bytes:
                self._entries[key] = media
                self._bytes += len(media.data)
                while self._bytes > self.max_bytes:
                    _, dropped = self._entries.popitem(last=False)
                    self._bytes -= len(dropped.data)
        return media

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._bytes = 0
        self.decoder.close()


class MediaReader:
    """Turns the media parts of one request into Media named by their place in the request (for error messages)."""

    def __init__(self, cache: MediaCache, allow_local_files: bool = False, crop_side: int | None = None,
                 auto_detail: str = defaults.IMAGE_DETAIL) -> None:
        if auto_detail not in defaults.IMAGE_DETAILS_FOR_AUTO:
            raise ValueError(f"auto_detail must be one of {', '.join(defaults.IMAGE_DETAILS_FOR_AUTO)}, "
                             f"not {auto_detail!r}")
        self.cache = cache
        self.allow_local_files = allow_local_files
        self.crop_side = crop_side  # what detail "low" fits an image to: one crop of the package's vision processor
        self.auto_detail = auto_detail  # what "auto", or no detail, means

    def image(self, url: object, param: str, detail: object = None) -> Media:
        """The image of an image_url part (`param`), as its `detail` asks."""
        check_detail(detail, f"{param}.detail")
        low = (self.auto_detail if detail in (None, "auto") else detail) == "low"
        if low and self.crop_side is None:
            raise ApiError(f"{param}.detail: low detail is not available (this package's vision processor does not "
                           "give its crop size)", param=f"{param}.detail", code="unsupported_parameter")
        fit = self.crop_side if low else None
        if not isinstance(url, str):
            raise ApiError(f"{param}: the image URL must be a string", param=param)
        if url.startswith("file:"):
            return self._local_file(url, param, fit)
        if not url.startswith("data:"):
            scheme = urlparse(url).scheme or url[:16]
            raise ApiError(f"{param}: image URLs must be data: URLs ({scheme!r} is not fetched by this server)",
                           param=param, code="invalid_image_url")
        return self._decode("image", decode_base64(_data_url_payload(url, param), param), param, fit)

    def audio(self, data: object, audio_format: object, param: str) -> Media:
        if audio_format not in AUDIO_FORMATS:
            raise ApiError(f"{param}.format: audio format must be one of {', '.join(AUDIO_FORMATS)}, "
                           f"not {audio_format!r}", param=f"{param}.format", code="invalid_audio_format")
        if not isinstance(data, str):
            raise ApiError(f"{param}.data: base64 audio data (a string) is required", param=f"{param}.data")
        return self._decode("audio", decode_base64(data, f"{param}.data"), param)

    def _decode(self, kind: str, data: bytes, param: str, fit: int | None = None) -> Media:
        try:
            return self.cache.decode(kind, data, param, fit)
        except MediaError as exc:
            raise ApiError(f"{param}: {exc.reason}", param=param, code=_CODES[kind]) from None

    def _local_file(self, url: str, param: str, fit: int | None) -> Media:
        if not self.allow_local_files:
            raise ApiError(f"{param}: file:// URLs are refused (start the server with --allow-local-files)",
                           param=param, code="local_files_not_allowed")
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(f"{param}: file:// URLs must name a local path", param=param, code="invalid_image_url")
        try:
            return self.cache.decoder.open("image", Path(unquote(parsed.path)), fit).named(param)
        except MediaNotFoundError as exc:
            raise ApiError(f"{param}: {exc.reason}: {exc.source}", param=param, code="invalid_image_url") from None
        except MediaError as exc:
            raise ApiError(f"{param}: {exc.reason}", param=param, code=_CODES["image"]) from None


def check_detail(detail: object, param: str) -> None:
    """Raises ApiError (naming `param`) unless `detail` is an image detail the server knows, or left out."""
    if detail is not None and detail not in IMAGE_DETAILS:
        raise ApiError(f"{param}: must be one of {', '.join(IMAGE_DETAILS)}, not {detail!r}", param=param)


def decode_base64(text: str, param: str) -> bytes:
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"{param}: not valid base64 data", param=param, code="invalid_base64") from None
    if not data:
        raise ApiError(f"{param}: the data is empty", param=param, code="invalid_base64")
    return data


def _data_url_payload(url: str, param: str) -> str:
    """The base64 text of ``data:[<media type>];base64,<data>`` (the bytes decide the format, not the media type)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ApiError(f"{param}: a data: URL must be data:<media type>;base64,<data>", param=param,
                       code="invalid_image_url")
    return payload
