"""A local Hugging Face hub for tests: the HTTP API `huggingface_hub` speaks, on 127.0.0.1, serving folders on disk.

    with LocalHub() as hub:                      # uvicorn in a thread; hub.endpoint goes into HF_ENDPOINT
        sha = hub.add_commit("org/name", folder, tags=("v1",))
        ...                                      # hub.log: every request (method, path, Range, status, bytes sent)

What it answers, as the hub does:
- ``GET /api/models/{repo}[/revision/{rev}]``: model info with ``sha`` and ``siblings`` (sizes, blob ids and LFS
  info with ``?blobs=true``); ``GET /api/models/{repo}/tree/{rev}``: the file listing.
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: a regular file is served with ``ETag`` (its git blob id),
  ``X-Repo-Commit`` and ``Content-Length``; an LFS file (weights, ONNX, media, anything over 10 MB) answers ``302`` to
  a storage URL on a second port (another origin, like the hub's CDN) with ``X-Linked-Etag`` (its sha256),
  ``X-Linked-Size`` and ``X-Repo-Commit``. Both honour ``Range`` (``206`` with ``Content-Range``).
- Errors with the hub's ``X-Error-Code``: ``RepoNotFound`` (401, as the hub answers an anonymous client),
  ``RevisionNotFound`` / ``EntryNotFound`` (404), ``GatedRepo`` (401 without a token, 403 with one).

Faults for tests: `cut` drops the connection when a file's transfer reaches a byte offset; `corrupt` changes the byte
at an offset in the transfers that carry it (the size stays right, as when a proxy or a link garbles data); `fail`
answers a status (e.g. 500) to a repository's requests; each for a number of requests or until `clear_faults`.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote

LFS_SUFFIXES = (".safetensors", ".onnx", ".data", ".bin", ".png", ".jpg", ".jpeg", ".wav", ".mp3", ".flac", ".pt")
LFS_MIN_BYTES = 10 * 1024 * 1024
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class HubFile:
    path: str  # inside the repository, "/"-separated
    source: Path  # where its bytes are on disk
    size: int
    blob_id: str  # git blob sha1 (of the LFS pointer for an LFS file)
    sha256: str | None  # LFS files only

    @classmethod
    def of(cls, path: str, source: Path) -> HubFile:
        data = source.read_bytes()
        size = len(data)
        if path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES:
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
            return cls(path, source, size, _git_blob_id(pointer), sha256)
        return cls(path, source, size, _git_blob_id(data), None)

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    repo_id: str
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    gated: bool = False

    def commit_of(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str  # unquoted, without the query
    range: str | None
    status: int
    sent: int  # body bytes sent (before any cut)
    authorized: bool


@dataclass
class _Fault:
    kind: str  # "cut", "corrupt" or "status"
    repo_id: str
    path: str | None  # cut, corrupt: the file; status: None = every request of the repository
    value: int  # cut, corrupt: byte offset of the file; status: the HTTP status
    remaining: int | None  # requests left to hit; None = until cleared


class LocalHub:
    """The hub app (ASGI) and, as a context manager, a uvicorn server for it on two loopback ports."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self._log: list[LoggedRequest] = []
        self._answering = 0  # requests whose answer is being sent, not logged yet
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server = None
        self._thread: threading.Thread | None = None
        self._by_sha256: dict[str, HubFile] = {}

    # --- repositories -------------------------------------------------------------------------------------------
    def add_commit(self, repo_id: str, folder: Path, branch: str = "main", tags: Iterable[str] = ()) -> str:
        """Publish every file under `folder` as a new commit on `branch` (the repository is created if needed)."""
        folder = Path(folder)
        files = {}
        for item in sorted(folder.rglob("*")):
            if item.is_file():
                rel = item.relative_to(folder).as_posix()
                files[rel] = HubFile.of(rel, item)
        repo = self.repos.setdefault(repo_id, HubRepo(repo_id))
        parent = repo.refs.get(branch, "")
        sha = hashlib.sha1(("\n".join([parent, *(f"{p} {f.blob_id}" for p, f in files.items())])).encode()).hexdigest()
        with self._lock:
            repo.commits[sha] = files
            repo.refs[branch] = sha
            for tag in tags:
                repo.refs[tag] = sha
            self._by_sha256.update({f.sha256: f for f in files.values() if f.sha256})
        return sha

    def set_gated(self, repo_id: str, gated: bool = True) -> None:
        self.repos[repo_id].gated = gated

    # --- faults and the log -------------------------------------------------------------------------------------
    def cut(self, repo_id: str, path: str, at_byte: int, times: int | None = 1) -> None:
        """Drop the connection when a transfer of `path` reaches byte `at_byte` of the file (a request that starts
        there or later is dropped before any byte), for `times` requests (None: until `clear_faults`)."""
        with self._lock:
            self._faults.append(_Fault("cut", repo_id, path, at_byte, times))

    def corrupt(self, repo_id: str, path: str, at_byte: int, times: int | None = 1) -> None:
        """Send byte `at_byte` of `path` inverted (every bit flipped) in the next `times` transfers that carry that
        byte (None: until `clear_faults`); a transfer that stops or starts elsewhere does not count."""
        with self._lock:
            self._faults.append(_Fault("corrupt", repo_id, path, at_byte, times))

    def fail(self, repo_id: str, status: int = 500, times: int | None = None) -> None:
        """Answer `status` to every request about `repo_id` (API and files) for `times` requests."""
        with self._lock:
            self._faults.append(_Fault("status", repo_id, None, status, times))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    @property
    def log(self) -> list[LoggedRequest]:
        """Every request so far. A client can read its whole answer before the server thread has logged it, so this
        waits (up to 10 s) until no answer is still being sent."""
        deadline = time.monotonic() + 10
        while True:
            with self._lock:
                if self._answering == 0 or time.monotonic() > deadline:
                    return list(self._log)
            time.sleep(0.01)

    def downloads(self) -> list[str]:
        """Repository paths of the files whose bytes a GET sent (through a resolve URL or a storage redirect), in
        the order the transfers ended."""
        paths = []
        for r in list(self.log):
            if r.method != "GET" or r.sent == 0 or r.path.startswith("/api/"):
                continue
            parts = r.path.strip("/").split("/")
            if parts[-1] in self._by_sha256:
                paths.append(self._by_sha256[parts[-1]].path)
            elif len(parts) >= 5 and parts[2] == "resolve":
                paths.append("/".join(parts[4:]))
        return paths

    def _take_fault(self, kind: str, repo_id: str, path: str | None,
                    applies: Callable[[int], bool] = lambda value: True) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.kind == kind and fault.repo_id == repo_id and fault.path in (None, path) and applies(
                        fault.value):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining <= 0:
                            self._faults.remove(fault)
                    return fault
        return None

    # --- server -------------------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._sockets[0].getsockname()[1]}"

    @property
    def storage(self) -> str:
        return f"http://127.0.0.1:{self._sockets[1].getsockname()[1]}"

    def __enter__(self) -> LocalHub:
        import uvicorn

        for _ in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            self._sockets.append(s)
        config = uvicorn.Config(self, log_level="critical", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": self._sockets}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the local hub did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        for s in self._sockets:
            s.close()

    # --- the ASGI app -------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        request = _Request(scope["method"], unquote(scope["path"]), parse_qs(scope.get("query_string", b"").decode()),
                           headers, self._sockets[1].getsockname()[1] == scope["server"][1])
        sent = 0
        status = 500
        with self._lock:
            self._answering += 1
        try:
            response = self._route(request)
            status = response.status
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k.lower().encode(), str(v).encode()) for k, v in response.headers.items()]})
            if request.method == "HEAD" or response.body is None:
                await send({"type": "http.response.body", "body": b""})
                return
            if isinstance(response.body, bytes):
                sent = len(response.body)
                await send({"type": "http.response.body", "body": response.body})
                return
            hub_file, start, stop, cut_at, flip_at = response.body
            with open(hub_file.source, "rb") as f:
                f.seek(start)
                position = start
                while position < stop:
                    end = min(stop, position + CHUNK_BYTES)
                    if cut_at is not None and cut_at < end:
                        end = cut_at
                    chunk = f.read(end - position)
                    if flip_at is not None and position <= flip_at < end:
                        chunk = bytearray(chunk)
                        chunk[flip_at - position] ^= 0xFF
                        chunk = bytes(chunk)
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    sent += len(chunk)
                    position = end
                    if cut_at is not None and position == cut_at:
                        raise ConnectionAbortedError("cut by the test")  # uvicorn closes the connection mid-body
                await send({"type": "http.response.body", "body": b""})
        finally:
            with self._lock:
                self._log.append(LoggedRequest(request.method, request.path, headers.get("range"), status, sent,
                                               "authorization" in headers))
                self._answering -= 1

    def _route(self, request: _Request) -> _Response:
        parts = request.path.strip("/").split("/")
        if request.storage:  # /{sha256}?repo=...: the storage host that LFS redirects point at
            repo_id = request.query.get("repo", [""])[0]
            hub_file = self._lfs_file(repo_id, parts[-1])
            if hub_file is None:
                return _Response.error(404, "EntryNotFound", "not found")
            return self._file_response(request, hub_file, repo_id, {})
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            rest = parts[4:]
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id = "/".join(parts[:2])
            rest = parts[2:]
        else:
            return _Response.error(404, None, "Sorry, we can't find the page you are looking for.")
        fault = self._take_fault("status", repo_id, None)
        if fault is not None:
            return _Response.error(fault.value, None, "Internal Error - we're working hard to fix this")
        repo = self.repos.get(repo_id)
        if repo is None:
            return _Response.error(401, "RepoNotFound", "Repository not found")
        if parts[0] == "api":
            return self._api(request, repo, rest)
        revision, path = unquote(rest[1]), "/".join(rest[2:])
        return self._resolve(request, repo, revision, path)

    def _lfs_file(self, repo_id: str, sha256: str) -> HubFile | None:
        """The repository's file with these bytes (another repository's copy may be gone from disk: a test's folder)."""
        repo = self.repos.get(repo_id)
        for files in repo.commits.values() if repo else ():
            for hub_file in files.values():
                if hub_file.sha256 == sha256:
                    return hub_file
        return None

    def _api(self, request: _Request, repo: HubRepo, rest: list[str]) -> _Response:
        revision = "main"
        if rest[:1] in (["revision"], ["tree"]) and len(rest) >= 2:
            revision = unquote(rest[1])
        sha = repo.commit_of(revision)
        if sha is None:
            return _Response.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[sha]
        if rest[:1] == ["tree"]:
            prefix = "/".join(rest[2:])
            listing = [_tree_entry(f) for p, f in files.items() if not prefix or p.startswith(prefix + "/")]
            return _Response.json(listing)
        blobs = request.query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for p, f in files.items():
            sibling = {"rfilename": p}
            if blobs:
                sibling.update(size=f.size, blobId=f.blob_id)
                if f.sha256:
                    sibling["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(sibling)
        info = {"_id": sha[:24], "id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0],
                "sha": sha, "lastModified": "2025-01-01T00:00:00.000Z", "private": False,
                "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": [], "library_name": "transformers", "siblings": siblings,
                "createdAt": "2025-01-01T00:00:00.000Z"}
        return _Response.json(info)

    def _resolve(self, request: _Request, repo: HubRepo, revision: str, path: str) -> _Response:
        sha = repo.commit_of(revision)
        if sha is None:
            return _Response.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if repo.gated:
            if "authorization" not in request.headers:
                return _Response.error(401, "GatedRepo", f"Access to model {repo.repo_id} is restricted. You must "
                                       "have access to it and be authenticated to access it. Please log in.")
            return _Response.error(403, "GatedRepo", f"Access to model {repo.repo_id} is restricted and you are not "
                                   "in the authorized list. Visit the model page to ask for access.")
        hub_file = repo.commits[sha].get(path)
        if hub_file is None:
            return _Response.error(404, "EntryNotFound", f"{path} does not exist on {revision}", commit=sha)
        common = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if hub_file.sha256:
            location = f"{self.storage}/{hub_file.sha256}?repo={quote(repo.repo_id)}"
            return _Response(302, {**common, "Location": location, "ETag": f'"{hub_file.blob_id}"',
                                   "X-Linked-Etag": f'"{hub_file.sha256}"', "X-Linked-Size": hub_file.size,
                                   "Content-Length": 0}, None)
        return self._file_response(request, hub_file, repo.repo_id, common)

    def _file_response(self, request: _Request, hub_file: HubFile, repo_id: str, headers: dict) -> _Response:
        start, stop, status = 0, hub_file.size, 200
        wanted = request.headers.get("range")
        headers = {**headers, "ETag": f'"{hub_file.etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if wanted and wanted.startswith("bytes="):
            first, _, last = wanted[len("bytes="):].partition("-")
            start = int(first) if first else max(hub_file.size - int(last), 0)
            stop = int(last) + 1 if first and last else hub_file.size
            stop = min(stop, hub_file.size)
            if start >= hub_file.size:
                return _Response(416, {"Content-Range": f"bytes */{hub_file.size}"}, b"")
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{hub_file.size}"
        headers["Content-Length"] = stop - start
        cut_at = flip_at = None
        if request.method == "GET":
            fault = self._take_fault("cut", repo_id, hub_file.path)
            if fault is not None:
                cut_at = max(fault.value, start)
            sent_end = stop if cut_at is None else cut_at
            fault = self._take_fault("corrupt", repo_id, hub_file.path, lambda at: start <= at < sent_end)
            if fault is not None:
                flip_at = fault.value
        return _Response(status, headers, (hub_file, start, stop, cut_at, flip_at))


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    storage: bool  # sent to the storage port


@dataclass(frozen=True)
class _Response:
    status: int
    headers: dict
    body: object  # bytes, None, or (HubFile, start, stop, cut_at, flip_at)

    @classmethod
    def json(cls, data: object) -> _Response:
        body = json.dumps(data).encode()
        return cls(200, {"Content-Type": "application/json", "Content-Length": len(body)}, body)

    @classmethod
    def error(cls, status: int, code: str | None, message: str, commit: str | None = None) -> _Response:
        body = json.dumps({"error": message}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": len(body), "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        return cls(status, headers, body)


def _tree_entry(f: HubFile) -> dict:
    entry = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
    if f.sha256:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
    return entry
