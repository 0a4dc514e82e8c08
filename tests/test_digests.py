"""Digests of hub files against independent tools (`git hash-object`, `sha256sum`), and a download's file that hashes
what is written to it, as huggingface_hub's `http_get` writes it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from builder_plugin.digests import GIT_BLOB, SHA256, Digest, HashingFile


def _git_blob_id(path: Path) -> str:
    return subprocess.run(["git", "hash-object", "--no-filters", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


def _sha256sum(path: Path) -> str:
    return subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]


@pytest.mark.parametrize("data", [b"", b'{"a": 1}\n', os.urandom((1 << 24) + 5)], ids=["empty", "json", "16MB+5"])
def test_file_digests_match_git_and_sha256sum(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "f"
    path.write_bytes(data)
    sha256, blob_id = _sha256sum(path), _git_blob_id(path)
    assert Digest(SHA256, "").of_file(path) == sha256
    assert Digest(GIT_BLOB, "").of_file(path) == blob_id
    assert Digest(SHA256, sha256).matches(path) and Digest(GIT_BLOB, blob_id).matches(path)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]) if data else b"x")
    assert not Digest(SHA256, sha256).matches(path) and not Digest(GIT_BLOB, blob_id).matches(path)


def test_a_cache_blob_name_states_its_digest() -> None:
    assert Digest.named("ab" * 32) == Digest(SHA256, "ab" * 32)
    assert Digest.named("cd" * 20) == Digest(GIT_BLOB, "cd" * 20)
    for name in ("config.json", "ab" * 32 + ".incomplete", "AB" * 32, "ab" * 31):
        assert Digest.named(name) is None


def test_hashing_file_hashes_kept_bytes_writes_and_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "blob.incomplete"
    kept, rest = os.urandom(3_000_000), os.urandom(5_000_001)
    path.write_bytes(kept)  # what an earlier run left
    reference = tmp_path / "reference"
    reference.write_bytes(kept + rest)
    digest = Digest(SHA256, _sha256sum(reference))
    with HashingFile(path, digest, len(kept + rest)) as out:
        assert out.tell() == len(kept)
        for i in range(0, len(rest), 1 << 20):
            out.write(rest[i:i + (1 << 20)])
        assert out.hexdigest() == digest.hex
    assert path.read_bytes() == kept + rest

    # a later attempt resumes with a range request the server ignores: http_get rewinds to where the download began
    # and truncates, then writes the whole file
    whole = os.urandom(4_000_000)
    reference.write_bytes(whole)
    blob_id = _git_blob_id(reference)
    path.write_bytes(whole[:1_000_000])
    with HashingFile(path, Digest(GIT_BLOB, blob_id), len(whole)) as out:
        out.seek(max(out.tell() - 1_000_000, 0))
        out.truncate()
        out.write(whole)
        assert out.hexdigest() == blob_id
    assert path.read_bytes() == whole
