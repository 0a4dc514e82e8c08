"""The OpenAI error object: every request that cannot be answered gets one, with an HTTP status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses or cannot answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def queue_full(max_queue: int) -> ApiError:
    return ApiError(f"the server is busy: {max_queue} requests are already waiting; retry later", 429,
                    code="queue_full", type="rate_limit_error")


def server_error(message: str) -> ApiError:
    return ApiError(message, 500, type="server_error")


def shutting_down() -> ApiError:
    return ApiError("the server is shutting down", 503, type="server_error")
