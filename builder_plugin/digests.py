"""What a file from the Hugging Face hub must hash to, and hashing it in one pass over its bytes.

The hub states two kinds of digest: an LFS file's sha256 (the metadata's ``lfs.sha256``, the ``X-Linked-Etag`` of its
download) and a file kept in git's blob id (sha1 of ``b"blob <size>\\0"`` and its bytes). The Hugging Face cache names
each blob by the one its download was given, so a cached file also says what it must hash to.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_BYTES = 1 << 24  # a read of a file on disk
SHA256 = "sha256"  # an LFS file's
GIT_BLOB = "git blob sha1"  # a file kept in git: its blob id
_KINDS = {SHA256: re.compile(r"[0-9a-f]{64}"), GIT_BLOB: re.compile(r"[0-9a-f]{40}")}


@dataclass(frozen=True)
class Digest:
    kind: str  # a key of _KINDS
    hex: str

    @classmethod
    def named(cls, name: str) -> Digest | None:
        """The digest a cache blob's file name states, if the name is one."""
        for kind, pattern in _KINDS.items():
            if pattern.fullmatch(name):
                return cls(kind, name)
        return None

    def start(self, size: int) -> Any:
        """A hash object of this kind for a file of `size` bytes, fed nothing yet."""
        if self.kind == SHA256:
            return hashlib.sha256()
        return hashlib.sha1(b"blob %d\0" % size)

    def of_file(self, path: Path) -> str:
        """The hex digest of this kind of the file at `path` (one read of it)."""
        hashed = self.start(path.stat().st_size)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(BLOCK_BYTES), b""):
                hashed.update(block)
        return hashed.hexdigest()

    def matches(self, path: Path) -> bool:
        return self.of_file(path) == self.hex

    def short(self) -> str:
        return f"{self.kind} {self.hex[:12]}"


class HashingFile:
    """A download's file, opened for appending, that hashes every byte written to it, so checking a download costs no
    second pass over it. The bytes it already holds (a download resumed by a later run) are hashed when it opens. It
    offers what huggingface_hub's `http_get` uses of a file: `write`, `tell`, and `seek` + `truncate` when a server
    ignores a range request and the download restarts from the beginning (the hash then restarts too)."""

    def __init__(self, path: Path, digest: Digest, size: int) -> None:
        self.path = path
        self.digest = digest
        self._size = size
        self._out = open(path, "ab")  # noqa: SIM115 -- closed by close() / the with block
        self._hash = digest.start(size)
        self._hashed = 0
        self._catch_up(self._out.tell())

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._out.close()

    def write(self, data: bytes) -> int:
        written = self._out.write(data)
        self._hash.update(data)
        self._hashed += len(data)
        return written

    def tell(self) -> int:
        return self._out.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        self._out.flush()
        position = self._out.seek(offset, whence)
        if position < self._hashed:
            self._hash = self.digest.start(self._size)
            self._hashed = 0
            self._catch_up(position)
        return position

    def truncate(self, size: int | None = None) -> int:
        return self._out.truncate(size)

    def hexdigest(self) -> str:
        """The digest of what the file holds: what was there when it opened, then everything written since."""
        return self._hash.hexdigest()

    def _catch_up(self, end: int) -> None:
        """Hash the file's bytes from where the hash is up to `end`, reading them from disk."""
        self._out.flush()
        with open(self.path, "rb") as f:
            f.seek(self._hashed)
            while self._hashed < end:
                block = f.read(min(BLOCK_BYTES, end - self._hashed))
                if not block:
                    break
                self._hash.update(block)
                self._hashed += len(block)
