"""The decoder process's messages: a JSON header and a byte payload, each length-prefixed, on a pipe."""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any, BinaryIO

_PREFIX = struct.Struct(">IQ")  # header length, payload length
MAX_HEADER = 1 << 16


class FrameTimeout(Exception):
    """The other side sent nothing complete before the deadline."""


class FrameEOF(Exception):
    """The other side closed the pipe (it exited, or crashed)."""


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return _PREFIX.pack(len(text), len(payload)) + text + payload


def read(stream: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    """The next message from a blocking stream; None at end of stream (the child's side)."""
    prefix = stream.read(_PREFIX.size)
    if not prefix:
        return None
    if len(prefix) < _PREFIX.size:
        raise FrameEOF()
    header_size, payload_size = _PREFIX.unpack(prefix)
    header, payload = stream.read(header_size), stream.read(payload_size)
    if len(header) < header_size or len(payload) < payload_size:
        raise FrameEOF()
    return json.loads(header), payload


def read_until(fd: int, deadline: float) -> tuple[dict[str, Any], bytes]:
    """The next message from file descriptor `fd`, waiting until `deadline` (time.monotonic) at most (the parent's
    side: a child that hangs is not waited for)."""
    prefix = _read_exactly(fd, _PREFIX.size, deadline)
    header_size, payload_size = _PREFIX.unpack(prefix)
    if header_size > MAX_HEADER:
        raise FrameEOF()
    header = _read_exactly(fd, header_size, deadline)
    return json.loads(header), _read_exactly(fd, payload_size, deadline)


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise FrameTimeout()
        count = os.readv(fd, [view[done:]])
        if count == 0:
            raise FrameEOF()
        done += count
    return bytes(buffer)
