"""API keys: an ASGI middleware that lets through only requests carrying `Authorization: Bearer <key>` of a known key
(GET /health stays open, for load balancers and process managers, and so does the chat page, which holds no secret)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Collection, Sequence
from typing import Any

from builder_plugin.serve.errors import ApiError

OPEN = frozenset({("GET", "/health"), ("HEAD", "/health")})  # (method, path) served without a key


def check_keys(keys: Sequence[str], source: str = "--api-key") -> tuple[str, ...]:
    """`keys` as a tuple; raises ValueError (one line, not naming the key) for an empty one or one with whitespace or
    characters other than printable ASCII (which HTTP clients cannot all send in a header)."""
    for number, key in enumerate(keys, 1):
        if not key or not all("!" <= c <= "~" for c in key):
            problem = "is empty" if not key else "has whitespace or characters other than printable ASCII"
            raise ValueError(f"{source}: key {number} {problem}")
    return tuple(keys)


class BearerAuth:
    """Pure ASGI: a request without a valid bearer key gets 401 with an OpenAI error body and `WWW-Authenticate:
    Bearer`. Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every key, so the time taken
    says nothing of which key nearly matched, nor of a key's length."""

    def __init__(self, app: Any, keys: Sequence[str], open_paths: Collection[tuple[str, str]] = OPEN) -> None:
        """`open_paths`: the (method, path) pairs served without a key."""
        keys = check_keys(keys)
        if not keys:
            raise ValueError("BearerAuth needs at least one key")
        self.app = app
        self.open_paths = frozenset(open_paths)
        self._digests = tuple(_digest(key.encode("ascii")) for key in keys)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # lifespan passes, and so do websockets: no route takes one
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope["headers"])
        if token is None:
            error = ApiError("missing Authorization: Bearer header: this server requires an API key "
                             "(Authorization: Bearer KEY)", 401, code="invalid_api_key")
        elif not self._known(token):
            error = ApiError("Incorrect API key provided", 401, code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _known(self, token: bytes) -> bool:
        given = _digest(token)
        known = False
        for digest in self._digests:  # no early exit: every key is compared
            known |= hmac.compare_digest(digest, given)
        return known


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first Authorization header if its scheme is Bearer (any case), else None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None
