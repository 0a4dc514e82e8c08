"""MediaDecoder: untrusted image and audio bytes decoded in separate processes, each decode bounded in time, into
Media values holding the canonical bytes onnxruntime-genai is then given (never the caller's bytes).

A decoder process that crashes, exits, or runs past the time limit is killed and replaced: the caller gets a
MediaError, and its own thread never runs a decoder (nor waits for one longer than the limit)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from builder_plugin.media import frames
from builder_plugin.media.limits import MediaLimits

KINDS = ("image", "audio")
_NOUN = {"image": "image", "audio": "audio clip"}
_CHILD = [sys.executable, "-m", "builder_plugin.media.child"]


class MediaError(Exception):
    """An image or clip that cannot be used: `source` names it (a path, or a request's part), `reason` says why."""

    def __init__(self, kind: str, source: str, reason: str) -> None:
        super().__init__(f"cannot read {kind} {source}: {reason}")
        self.kind, self.source, self.reason = kind, source, reason


class MediaNotFoundError(MediaError):
    """The file does not exist or is not a file."""


@dataclass(frozen=True, eq=False)
class Media:
    """One decoded image or clip: its canonical bytes (PNG or 16-bit PCM WAV) and where it came from. Two are equal
    when their canonical bytes are, wherever they came from (a conversation sent again is the same conversation)."""

    kind: str  # "image" or "audio"
    data: bytes = field(repr=False)
    source: str  # a file's path or a request's part, for messages
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # format, size or duration of the original
    digest: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", hashlib.sha256(self.data).hexdigest())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Media) and (self.kind, self.digest) == (other.kind, other.digest)

    def __hash__(self) -> int:
        return hash((self.kind, self.digest))

    def named(self, source: str) -> Media:
        """The same media, named by another source."""
        return replace(self, source=source)


class MediaDecoder:
    """Decodes images and clips in up to `processes` child processes (started when first needed), under `limits`.
    Thread-safe: each decode takes an idle process, or waits for one."""

    def __init__(self, limits: MediaLimits | None = None, processes: int = 1) -> None:
        if processes < 1:
            raise ValueError("processes must be at least 1")
        self.limits = limits or MediaLimits()
        self.processes = processes
        self._idle: list[_Child] = []
        self._started = 0
        self._closed = False
        self._free = threading.Condition()

    def image(self, data: bytes, source: str, fit: int | None = None) -> Media:
        return self.decode("image", data, source, fit)

    def audio(self, data: bytes, source: str) -> Media:
        return self.decode("audio", data, source)

    def open(self, kind: str, path: str | Path, fit: int | None = None) -> Media:
        """The file at `path` decoded (an image with `fit` as decode() says); raises MediaNotFoundError or
        MediaError."""
        path = Path(path).expanduser()
        if not path.exists():
            raise MediaNotFoundError(kind, str(path), f"{kind} file not found")
        if not path.is_file():
            raise MediaNotFoundError(kind, str(path), f"{kind} path is not a file")
        if path.stat().st_size > self.limits.max_file_bytes:
            raise MediaError(kind, str(path), self._too_large())
        return self.decode(kind, path.read_bytes(), str(path), fit)

    def decode(self, kind: str, data: bytes, source: str, fit: int | None = None) -> Media:
        """`data` (a whole file's bytes) decoded into canonical bytes; raises MediaError naming `source`. An image
        with `fit` is scaled down to fit a square of that many pixels a side, its shape kept (one crop of the
        model's, not the crops of its full detail)."""
        if kind not in KINDS:
            raise ValueError(f"unknown media kind {kind!r}")
        if fit is not None and (kind != "image" or isinstance(fit, bool) or not isinstance(fit, int) or fit < 1):
            raise ValueError(f"fit must be a positive number of pixels, for an image only (not {fit!r} for {kind})")
        if len(data) > self.limits.max_file_bytes:
            raise MediaError(kind, source, self._too_large())
        if not data:
            raise MediaError(kind, source, "the file is empty")
        child = self._take()
        healthy = False
        try:
            request = {"kind": kind, "limits": self.limits.as_dict(), "fit": fit}
            header, payload = child.ask(frames.encode(request, data),
                                        time.monotonic() + self.limits.decode_seconds)
            healthy = True
        except frames.FrameTimeout:
            raise MediaError(kind, source, f"decoding took longer than the limit of "
                             f"{self.limits.decode_seconds:g} s") from None
        except (frames.FrameEOF, OSError, ValueError):
            raise MediaError(kind, source, f"not a readable {_NOUN[kind]} (the decoder failed on it)") from None
        finally:
            self._give_back(child, healthy)
        if not header.get("ok"):
            raise MediaError(kind, source, str(header.get("reason", "refused")))
        return Media(kind, payload, source, header.get("info", {}))

    def close(self) -> None:
        """Stop the decoder processes; later decodes are refused."""
        with self._free:
            self._closed = True
            idle, self._idle = self._idle, []
            self._free.notify_all()
        for child in idle:
            child.stop()

    def __enter__(self) -> MediaDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _too_large(self) -> str:
        return f"the file is larger than the limit of {self.limits.max_file_bytes / (1 << 20):.3g} MB"

    def _take(self) -> _Child:
        with self._free:
            while True:
                if self._closed:
                    raise RuntimeError("the media decoder is closed")
                while self._idle:
                    child = self._idle.pop()
                    if child.alive:
                        return child
                    self._started -= 1  # it died while idle
                    child.stop()
                if self._started < self.processes:
                    self._started += 1
                    break
                self._free.wait()
        try:
            return _Child()
        except BaseException:
            with self._free:
                self._started -= 1
                self._free.notify()
            raise

    def _give_back(self, child: _Child, healthy: bool) -> None:
        if not healthy:
            child.stop()  # it may be stuck in a decoder, or half-way through an answer
        with self._free:
            if healthy and not self._closed:
                self._idle.append(child)
            else:
                self._started -= 1
            self._free.notify()
        if healthy and self._closed:
            child.stop()


class _Child:
    """One decoder process, answering one request at a time."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(_CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, close_fds=True)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, request: bytes, deadline: float) -> tuple[dict[str, Any], bytes]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(request)
        self.process.stdin.flush()
        return frames.read_until(self.process.stdout.fileno(), deadline)

    def stop(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
