"""One log line per request (the CLI's -v): method, path, status and, for an answer, its prompt tokens, generated
tokens, time to the first token and tokens per second. Never a body, a query string or a header (keys stay out)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("builder_plugin.serve.requests")

SCOPE_KEY = "builder_plugin.answer"  # where a route finds the AnswerRecord of its request


@dataclass
class AnswerRecord:
    """How an answer went, filled in by the route's events (on the worker thread) as it finishes."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_s: float | None = None  # from receiving the request to the first piece of answer
    tokens_per_s: float | None = None  # after the first token

    def describe(self) -> str:
        if self.prompt_tokens is None:
            return ""
        parts = [f"{self.prompt_tokens} prompt tokens", f"{self.completion_tokens} generated"]
        if self.first_token_s is not None:
            parts.append(f"first token {self.first_token_s:.3f} s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tokens/s")
        return ": " + ", ".join(parts)


def answer_record(scope: dict[str, Any]) -> AnswerRecord | None:
    """The record of this request's answer, when requests are logged."""
    return scope.get(SCOPE_KEY)


class RequestLog:
    """Pure ASGI: a line at INFO once a request's response has been sent (a stream: when it ends), with the status
    sent (499: the client left before a response started; 500: an exception escaped before one)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AnswerRecord()
        scope[SCOPE_KEY] = record
        status: int | None = None
        started = time.perf_counter()

        async def recording_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except BaseException as exc:
            if status is None:
                status = 499 if isinstance(exc, asyncio.CancelledError) else 500
            raise
        finally:
            log.info("%s %s %s in %.3f s%s", scope["method"], scope["path"], status,
                     time.perf_counter() - started, record.describe())
