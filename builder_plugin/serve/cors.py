"""Cross-origin requests (CORS) for apps in a browser on other origins: off unless origins are given; a preflight
(OPTIONS) from an allowed origin is answered before the API-key check (browsers send it without credentials)."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

ANY = "*"
METHODS = ("GET", "POST")
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


def check_origins(origins: Sequence[str], source: str = "--allowed-origins") -> tuple[str, ...]:
    """`origins` as a tuple (commas split, blanks dropped); raises ValueError (one line) for one that is neither `*`
    nor scheme://host[:port] (a browser's Origin header: no path, no trailing slash)."""
    listed = tuple(origin.strip() for entry in origins for origin in entry.split(",") if origin.strip())
    for origin in listed:
        if origin != ANY and not _is_origin(origin):
            raise ValueError(f"{source}: {origin!r} is not an origin: write scheme://host[:port] in lower case, "
                             "without a path (e.g. https://app.example.com), or * for any")
    return listed


def _is_origin(text: str) -> bool:
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError when out of range
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0 and "@" not in parts.netloc
            and not (parts.path or parts.query or parts.fragment) and text == text.lower())


def cors_middleware(origins: Sequence[str]) -> Middleware:
    """Let `origins` (or any, with `*`) call every route, with any request header (Authorization, Content-Type and
    the headers client libraries add); no cookies are involved, so credentials stay off."""
    origins = check_origins(origins)
    if not origins:
        raise ValueError("cors_middleware needs at least one origin")
    return Middleware(CORSMiddleware, allow_origins=origins, allow_methods=METHODS, allow_headers=[ANY],
                      max_age=MAX_AGE_S)
