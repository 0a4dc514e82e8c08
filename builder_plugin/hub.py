"""Resolving -m/-i to a checkpoint folder; from the Hugging Face hub, only the files a build needs, resumably.

A hub model is opened in two steps so that nothing big moves before it is known to be wanted: `open_source` fetches
config.json (a checkpoint that is not Phi-4-multimodal is refused there) and the small metadata files, and lists the
weight files with their sizes from the hub; `ModelSource.fetch` then downloads the weights. Files go to the Hugging
Face cache (HF_HOME / HF_HUB_CACHE, or -c), in its usual layout, so other tools find them and a second run downloads
nothing. A weight file that stops half-way keeps its bytes (``blobs/<sha256>.incomplete``, as the hub's own tools name
it) and the next run resumes it with a range request. With HF_HUB_OFFLINE=1 everything comes from the cache.

Every file is checked against the hub's digest (`digests.Digest`) before a build reads it: downloaded (hashed as it is
written), resumed, or found in the cache. A cached file that does not match is removed and fetched again; a download
that does not match is tried once more, then refused.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from builder_plugin.checkpoint.files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    INDEX_FILE,
    SINGLE_WEIGHTS_FILE,
    weight_map,
)
from builder_plugin.config import CONFIG_FILE, NATIVE_ADAPTER_DIRS, PREPROCESSOR_CONFIG_FILE, Phi4MMConfig
from builder_plugin.digests import GIT_BLOB, SHA256, Digest, HashingFile
from builder_plugin.errors import InputError, UnsupportedModelError
from builder_plugin.layout import GENERATION_CONFIG_FILE, TOKENIZER_FILES
from builder_plugin.units import human

METADATA_FILES = (GENERATION_CONFIG_FILE, PREPROCESSOR_CONFIG_FILE, *TOKENIZER_FILES, INDEX_FILE)
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)  # each native adapter folder's two files
DEFAULT_REVISION = "main"
RETRY_DELAYS_S = (1.0, 2.0)  # a failed hub call is tried len + 1 times
DOWNLOADS_PER_FILE = 2  # a file whose fresh download does not match the hub's digest is downloaded once more
_TRUE = ("1", "ON", "YES", "TRUE")
_TRANSPORT_MODULES = ("httpx", "httpx2", "httpcore")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_T = TypeVar("_T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceFile:
    path: str  # inside the checkpoint, "/"-separated
    size: int | None  # None: not known (offline and not cached)
    cached: bool  # already complete on disk
    partial: int = 0  # bytes of an interrupted download kept for resuming

    @property
    def to_download(self) -> int:
        return 0 if self.cached else max((self.size or 0) - self.partial, 0)


@dataclass
class ModelSource:
    """Where a build reads its checkpoint from, and how that folder can be traced back (manifest.json)."""

    folder: Path
    provenance: dict[str, Any]
    weights: list[SourceFile]
    metadata: list[SourceFile] = field(default_factory=list)
    hub: _HubModel | None = None

    @property
    def weight_bytes(self) -> int:
        return sum(f.size or 0 for f in self.weights)

    @property
    def download_bytes(self) -> int:
        return sum(f.to_download for f in self.metadata + self.weights)

    @property
    def cache_dir(self) -> Path | None:
        return self.hub.cache_dir if self.hub else None

    def fetch(self) -> None:
        """Check the cached weights against the hub's digests and download the rest (nothing for a local folder)."""
        if self.hub is not None:
            for f in self.metadata:
                if not f.cached:
                    self.hub.download(f.path)
            self.hub.fetch(self.weights)


def open_source(model_name: str | None, input_dir: str | None, cache_dir: Path | None,
                revision: str | None = None, dry_run: bool = False) -> ModelSource:
    """The checkpoint to build from: -i wins over -m; -m may also name a local folder. A hub model has its config
    and metadata fetched (and checked) here, its weights only by `ModelSource.fetch`; for a dry run only the files
    that tell what a build would be (config.json, the weight index, a native layout's adapter configs)."""
    if input_dir or (model_name and Path(model_name).expanduser().is_dir()):
        path = Path(input_dir or model_name).expanduser()
        if not path.is_dir():
            raise InputError(f"input folder not found: {path}")
        if revision:
            raise InputError("--revision picks a version of a hub model; it does not apply to a local folder")
        metadata = [SourceFile(n, (path / n).stat().st_size, True) for n in (CONFIG_FILE, *METADATA_FILES)
                    if (path / n).is_file()]
        return ModelSource(path, {"local_folder": str(path.resolve())}, local_weights(path), metadata)
    if not model_name:
        raise InputError("give a model: -m <hugging face id> or -i <local folder>")
    return _HubModel(model_name, revision or DEFAULT_REVISION, cache_dir).open(light=dry_run)


def local_weights(folder: Path) -> list[SourceFile]:
    """The weight files a checkpoint folder's index (or layout) names, as they are on disk."""
    return [SourceFile(p, (folder / p).stat().st_size if (folder / p).is_file() else None, (folder / p).is_file())
            for p in weight_files(folder, lambda p: (folder / p).is_file())]


def weight_files(folder: Path, exists: Callable[[str], bool]) -> list[str]:
    """The weight files of the checkpoint whose metadata is in `folder`: the shards its index names (or the single
    file), and for the transformers-native layout each adapter folder's weights."""
    index = weight_map(folder)
    shards = sorted(set(index.values())) if index is not None else [SINGLE_WEIGHTS_FILE]
    if _layout(folder) == "native":  # the original layout has its LoRA inline; the native one in folders
        shards += [f"{d}/{ADAPTER_FILES[1]}" for d in NATIVE_ADAPTER_DIRS.values() if exists(f"{d}/{ADAPTER_FILES[0]}")]
    return shards


def _layout(folder: Path) -> str | None:
    """The checkpoint layout, None when config.json is missing or not Phi-4-multimodal (refused later, in one line)."""
    try:
        return Phi4MMConfig.layout_of(folder)
    except (InputError, UnsupportedModelError):
        return None


class _HubModel:
    def __init__(self, repo_id: str, revision: str, cache_dir: Path | None) -> None:
        from huggingface_hub import constants
        from huggingface_hub.utils import logging as hf_logging

        if not logging.getLogger().isEnabledFor(logging.DEBUG):  # its retry warnings would break the one-line errors
            hf_logging.set_verbosity_error()

        self.repo_id = repo_id
        self.revision = revision
        self.cache_dir = Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve()
        # read now, not when huggingface_hub was imported (it reads them then): a test sets them in-process
        self.endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        self.offline = constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE
        self.why_offline = "offline (HF_HUB_OFFLINE=1)"
        self.commit: str | None = revision if _COMMIT.match(revision) else None
        self.sizes: dict[str, int] = {}  # from the hub: every file's size
        self.lfs: dict[str, str] = {}  # from the hub: each LFS file's sha256, the name of its blob in the cache
        self.blob_ids: dict[str, str] = {}  # from the hub: each file's git blob id (of its pointer, for LFS files)
        from huggingface_hub.file_download import repo_folder_name

        self.storage = self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
        self._scratch: Any = None  # a dry run's own cache (tempfile.TemporaryDirectory)

    @property
    def label(self) -> str:
        return self.repo_id if self.revision == DEFAULT_REVISION else f"{self.repo_id} (revision {self.revision})"

    # --- opening: commit, config, metadata, weight list --------------------------------------------------------
    def open(self, light: bool = False) -> ModelSource:
        """The source; `light` (a dry run) fetches only what tells what a build would be, into a temporary cache
        that is dropped with this object, so the Hugging Face cache is left as it was."""
        if light and not self.offline:
            import tempfile

            self._scratch = tempfile.TemporaryDirectory(prefix="phi4mm-dry-run-")
        if not self.offline:
            try:
                self._resolve_online()
            except _Unreachable as exc:
                if not self._cached_commit():
                    raise InputError(f"{exc}; {self.label} is not in the cache {self.cache_dir} either") from exc
                print(f"warning: {exc}; building {self.label} from the cache (commit {self.commit[:12]})",
                      file=sys.stderr)
                self.offline = True
                self.why_offline = "the hub is unreachable"
        if self.offline and not self._cached_commit():
            raise InputError(f"{self.why_offline} and {self.label} is not in the cache {self.cache_dir}; "
                             "run once online to download it")
        config = Path(self.download(CONFIG_FILE))
        folder = config.parent
        cached = self.storage / "snapshots" / str(self.commit)  # = folder, but for a dry run
        try:
            layout = Phi4MMConfig.layout_of(folder, self.label)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{exc}; no weights were downloaded") from None
        wanted = list(METADATA_FILES)
        essential = {INDEX_FILE}  # what a dry run needs: the weight list and, native, the adapters' settings
        if layout == "native":
            essential |= {f"{d}/{ADAPTER_FILES[0]}" for d in NATIVE_ADAPTER_DIRS.values()}
            wanted += sorted(essential - {INDEX_FILE})
        metadata = [SourceFile(CONFIG_FILE, config.stat().st_size, (cached / CONFIG_FILE).is_file())]
        for name in wanted:
            if not self._exists(name, folder):
                continue
            if light and name not in essential and not (cached / name).is_file():
                metadata.append(SourceFile(name, self.sizes.get(name), False))
                continue
            path = Path(self.download(name))
            metadata.append(SourceFile(name, path.stat().st_size, (cached / name).is_file()))
        weights = [self._weight(p, cached) for p in weight_files(folder, lambda p: self._exists(p, folder))]
        missing = [w.path for w in weights if not w.cached]
        if self.offline and missing:
            raise InputError(f"{self.why_offline} and {self.label} is only partly in the cache "
                             f"{self.cache_dir}: {len(missing)} weight file(s) missing ({missing[0]}...); run once "
                             "online to finish the download")
        provenance = {"repository": self.repo_id, "revision": self.revision, "commit": self.commit,
                      "endpoint": self.endpoint}
        return ModelSource(folder, provenance, weights, metadata, self)

    def _resolve_online(self) -> None:
        from huggingface_hub import HfApi

        info = self._call(lambda: HfApi(endpoint=self.endpoint).model_info(
            self.repo_id, revision=self.revision, files_metadata=True), what="model info")
        self.commit = info.sha
        self.sizes = {s.rfilename: s.size for s in info.siblings or [] if s.size is not None}
        self.lfs = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if s.lfs is not None}
        self.blob_ids = {s.rfilename: s.blob_id for s in info.siblings or [] if s.blob_id}
        # the cache layout's refs/<branch or tag>, so offline runs find the commit (a dry run writes nothing)
        if self.revision != self.commit and self._scratch is None:
            ref = self.storage / "refs" / self.revision
            if not ref.is_file() or ref.read_text() != self.commit:
                ref.parent.mkdir(parents=True, exist_ok=True)
                ref.write_text(self.commit)

    def _cached_commit(self) -> bool:
        if self.commit is None:
            ref = self.storage / "refs" / self.revision
            self.commit = ref.read_text().strip() if ref.is_file() else None
        return self.commit is not None and (self.storage / "snapshots" / self.commit / CONFIG_FILE).is_file()

    def _exists(self, path: str, folder: Path) -> bool:
        return (folder / path).is_file() if self.offline else path in self.sizes

    def _weight(self, path: str, folder: Path) -> SourceFile:
        if (folder / path).is_file():
            return SourceFile(path, (folder / path).stat().st_size, True)
        if self.offline:
            return SourceFile(path, None, False)
        if path not in self.sizes:
            raise InputError(f"{self.label} lacks {path}, which its {INDEX_FILE} names")
        blob = self.lfs.get(path)
        partial = self.storage / "blobs" / f"{blob}.incomplete" if blob else None
        return SourceFile(path, self.sizes[path], False, partial.stat().st_size if partial and partial.is_file() else 0)

    # --- downloading, each file checked against the hub's digest before anything reads it ---------------------
    def download(self, path: str) -> str:
        """A small file through huggingface_hub's own download (into the cache, or from it offline), checked: a cached
        copy that does not match is removed and fetched again, a download that does not match is tried once more. A
        dry run reads what the cache has (linked into its own) and fetches the rest into its own."""
        kept = self._snapshot(path)
        if kept.is_file():
            failed = self._mismatch(path, kept)
            if failed is None:
                return str(kept if self._scratch is None else self._link_into_scratch(path, kept))
            self._set_aside(path, kept, failed)
        discarded: list[str] = []
        while len(discarded) < DOWNLOADS_PER_FILE:
            got = Path(self._hf_download(path))
            failed = self._mismatch(path, got)
            if failed is None:
                self._say_repaired(path, discarded, got)
                return str(got)
            _discard(got)
            discarded.append("fresh")
        raise self._refused(path, failed, len(discarded))

    def fetch(self, files: list[SourceFile]) -> None:
        """The weight files into the cache: the cached ones checked (one read each, on every core), the others and
        those that failed the check downloaded."""
        from concurrent.futures import ThreadPoolExecutor

        cached = [f.path for f in files if f.cached]
        with ThreadPoolExecutor(max(1, min(len(cached), os.cpu_count() or 1))) as pool:  # hashlib frees the GIL
            failed = list(pool.map(lambda p: self._mismatch(p, self._snapshot(p)), cached))
        for path, digest in zip(cached, failed):
            if digest is not None:
                self._set_aside(path, self._snapshot(path), digest)
        for f in files:
            if not self._snapshot(f.path).is_file():
                self._fetch_resumable(f)
                self._hf_download(f.path)  # links the snapshot entry to the blob, as huggingface_hub lays out its cache

    def _fetch_resumable(self, f: SourceFile) -> None:
        """One weight file into its cache blob, resuming what an earlier run kept, hashed as it is written. One that
        does not match the hub's digest is downloaded afresh (a resumed one, then a fresh one once more), then
        refused."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(self.repo_id, f.path, revision=self.commit, endpoint=self.endpoint)
        meta = self._call(lambda: get_hf_file_metadata(url, endpoint=self.endpoint), what=f.path)
        blob = self.storage / "blobs" / meta.etag
        if blob.is_file():  # another revision's, or left by a run that stopped before linking it
            failed = self._mismatch(f.path, blob)
            if failed is None:
                return
            self._set_aside(f.path, blob, failed)
        digest = self._digest(f.path, blob)
        if digest is None:
            raise InputError(f"the hub states no sha256 for {f.path} of {self.label}: it cannot be checked, so it is "
                             "not used")
        blob.parent.mkdir(parents=True, exist_ok=True)
        partial = blob.with_name(f"{meta.etag}.incomplete")
        headers = build_hf_headers()
        if _origin(meta.location) != _origin(self.endpoint):  # the token does not leave the hub (storage redirect)
            headers.pop("authorization", None)
        discarded: list[str] = []  # each download that did not match: "resumed" (bytes of an earlier run) or "fresh"
        while True:
            kind = "resumed" if partial.is_file() and partial.stat().st_size > 0 else "fresh"
            if self._transfer(f.path, meta, partial, digest, headers) == digest.hex:
                break
            partial.unlink()
            discarded.append(kind)
            if discarded.count("fresh") == DOWNLOADS_PER_FILE:
                raise self._refused(f.path, digest, len(discarded))
        os.replace(partial, blob)
        self._say_repaired(f.path, discarded, blob)

    def _transfer(self, path: str, meta: Any, partial: Path, digest: Digest, headers: dict[str, str]) -> str:
        """Download `partial` to its end from where it stops, hashing it; a dropped connection is resumed where it
        broke (by `http_get`). Its digest."""
        from huggingface_hub.file_download import http_get

        with HashingFile(partial, digest, meta.size or 0) as out:
            def attempt() -> None:
                have = out.tell()
                if meta.size is not None and have >= meta.size:
                    return
                if have:
                    log.info("resuming %s at byte %d", path, have)
                http_get(meta.location, out, resume_size=have, headers=headers, expected_size=meta.size,
                         displayed_filename=path)

            try:
                self._call(attempt, what=path, retry_network=False)  # http_get retries a dropped connection itself
            except _Unreachable as exc:
                have = out.tell()
                kept = f"; {human(have)} of {human(meta.size or 0)} are kept" if have else ""
                raise InputError(f"the download of {path} of {self.label} broke off "
                                 f"({_first_line(exc.__cause__ or exc)}){kept}: run the same command again to resume "
                                 "it") from exc
            return out.hexdigest()

    def _hf_download(self, path: str) -> str:
        from huggingface_hub import hf_hub_download

        cache_dir = Path(self._scratch.name) if self._scratch is not None else self.cache_dir
        return self._call(lambda: hf_hub_download(self.repo_id, path, revision=self.commit,
                                                  cache_dir=str(cache_dir), endpoint=self.endpoint,
                                                  local_files_only=self.offline), what=path)

    def _snapshot(self, path: str) -> Path:
        return self.storage / "snapshots" / str(self.commit) / path

    def _link_into_scratch(self, path: str, kept: Path) -> Path:
        """A dry run reads one folder, its own cache's snapshot: a file the Hugging Face cache has is linked there."""
        link = Path(self._scratch.name) / self.storage.name / "snapshots" / str(self.commit) / path
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(kept)
        return link

    def _digest(self, path: str, file: Path) -> Digest | None:
        """What `path` must hash to: what the hub's metadata says (an LFS file's sha256, else its git blob id), and
        without that (offline) what the name of the cache blob `file` is, or links to, says."""
        if path in self.lfs:
            return Digest(SHA256, self.lfs[path])
        if path in self.blob_ids:
            return Digest(GIT_BLOB, self.blob_ids[path])
        return Digest.named(file.resolve().name)

    def _mismatch(self, path: str, file: Path) -> Digest | None:
        """The digest `file` fails; None when it matches (or the hub states none: nothing to check it against)."""
        digest = self._digest(path, file)
        if digest is None:
            log.info("the hub states no digest of %s: not checked", path)
            return None
        return None if digest.matches(file) else digest

    def _set_aside(self, path: str, file: Path, digest: Digest) -> None:
        """A cached file that does not match its digest is removed, to be fetched again (a dry run only says so);
        offline that is an error."""
        where = f"{path} of {self.label} in the cache {self.cache_dir} does not match its {digest.short()}..."
        if self._scratch is not None:
            print(f"warning: {where}: a build would download it again", file=sys.stderr)
            return
        _discard(file)
        if self.offline:
            raise InputError(f"{where} (damaged on disk) and was removed; {self.why_offline}: run once online to "
                             "download it again")
        print(f"warning: {where} (damaged on disk): removed it, downloading it again", file=sys.stderr)

    def _say_repaired(self, path: str, discarded: list[str], file: Path) -> None:
        """One line when downloads of `path` were discarded before `file`, which matches, came."""
        if discarded:
            print(f"warning: the {' and '.join(discarded)} download{'s' * (len(discarded) > 1)} of {path} of "
                  f"{self.label} did not match the hub's {self._digest(path, file).short()}... and "
                  f"{'were' if len(discarded) > 1 else 'was'} discarded; downloaded again, it matches", file=sys.stderr)

    def _refused(self, path: str, digest: Digest, downloads: int) -> InputError:
        return InputError(f"{path} of {self.label} did not match the hub's {digest.short()}... in {downloads} "
                          "downloads: the hub, a proxy or the connection changes its bytes; nothing was built")

    # --- errors: each becomes one line, transient ones are retried first --------------------------------------
    def _call(self, fn: Callable[[], _T], what: str, retry_network: bool = True) -> _T:
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        for tries, delay in enumerate((*RETRY_DELAYS_S, None), 1):
            try:
                return fn()
            except GatedRepoError as exc:
                raise InputError(f"{self.repo_id} is gated: accept its terms on its hub page, then log in "
                                 "(`hf auth login`) or set HF_TOKEN to a token of that account") from exc
            except RepositoryNotFoundError as exc:
                raise InputError(f"no such model on the Hugging Face hub: {self.repo_id} (if it is private, log in "
                                 "with `hf auth login` or set HF_TOKEN)") from exc
            except RevisionNotFoundError as exc:
                raise InputError(f"{self.repo_id} has no revision {self.revision!r}") from exc
            except (OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:  # before EntryNotFoundError, its base
                cause = exc.__cause__ or exc.__context__
                if self.offline or isinstance(exc, OfflineModeIsEnabled) or cause is None:
                    raise InputError(f"{self.why_offline} and {what} of {self.label} is not in the cache "
                                     f"{self.cache_dir}") from exc
                error: BaseException = cause
            except EntryNotFoundError as exc:
                raise InputError(f"{self.label} has no file {what}") from exc
            except HfHubHTTPError as exc:
                status = exc.response.status_code if exc.response is not None else None
                if status is not None and status < 500 and status not in (408, 429):
                    if status in (401, 403):
                        raise InputError(f"the hub refused {what} of {self.label} ({status}): log in (`hf auth "
                                         "login`) or set HF_TOKEN") from exc
                    raise InputError(f"the hub refused {what} of {self.label}: {_first_line(exc)}") from exc
                error = exc
            except Exception as exc:  # connection refused or reset, timeouts, a short read
                if not isinstance(exc, OSError) and type(exc).__module__.split(".")[0] not in _TRANSPORT_MODULES:
                    raise
                error = exc
                if not retry_network:
                    delay = None
            if delay is None:
                raise _Unreachable(f"cannot get {what} of {self.label} from {self.endpoint} after {tries} tries: "
                                   f"{_first_line(error)}") from error
            log.info("retrying %s of %s in %.0f s: %s", what, self.repo_id, delay, _first_line(error))
            time.sleep(delay)
        raise AssertionError("unreachable")


class _Unreachable(InputError):
    """The hub could not be reached, or kept answering with a server error."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def _origin(url: str) -> tuple[str, str, int | None]:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return parsed.scheme, (parsed.hostname or "").lower(), parsed.port


def _discard(file: Path) -> None:
    """A cache entry removed: the snapshot link and the blob it links to (or the file itself, in a cache without
    links)."""
    blob = file.resolve()
    file.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
