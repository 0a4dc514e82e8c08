"""The chat page: static files shipped in the package (ui/ beside this module), served at / and /ui/<name>. They hold
no secret, so they are served without an API key (the API calls the page makes carry the key its user types); their
Content-Security-Policy lets them load and call nothing but this server, with data: and blob: for pictures and
sound."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

FOLDER = Path(__file__).with_name("ui")
INDEX = "index.html"
ASSETS = "/ui/"  # the page's other files are under this path
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data: blob:; media-src 'self' data: blob:; manifest-src 'self'; "
                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Permissions-Policy": "microphone=(self), camera=(), geolocation=()",
           "Cache-Control": "no-cache"}  # revalidated (ETag) on every load, so an upgraded server's page is seen


@dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str
    etag: str

    @classmethod
    def read(cls, path: Path) -> _File:
        body = path.read_bytes()
        return cls(body, MEDIA_TYPES[path.suffix], f'"{hashlib.sha256(body).hexdigest()[:32]}"')


class ChatPage:
    """The page's files, read once from `folder`."""

    def __init__(self, folder: Path = FOLDER) -> None:
        self.files = {path.name: _File.read(path) for path in sorted(folder.iterdir()) if path.suffix in MEDIA_TYPES}
        if INDEX not in self.files:
            raise FileNotFoundError(f"the chat page is missing from {folder} (a broken install?)")

    @property
    def open_paths(self) -> frozenset[tuple[str, str]]:
        """(method, path) of every request for the page: served without an API key."""
        paths = ["/", *(ASSETS + name for name in self.files if name != INDEX)]
        return frozenset((method, path) for path in paths for method in ("GET", "HEAD"))

    def routes(self) -> list[Route]:
        return [Route("/", self.index, methods=["GET"]), Route(ASSETS + "{name}", self.asset, methods=["GET"])]

    async def index(self, request: Request) -> Response:
        return self._serve(INDEX, request)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name == INDEX or name not in self.files:
            raise HTTPException(404, f"no such file of the chat page: {name}")
        return self._serve(name, request)

    def _serve(self, name: str, request: Request) -> Response:
        file = self.files[name]
        headers = {**HEADERS, "ETag": file.etag}
        if file.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        return Response(file.body, media_type=file.media_type, headers=headers)
