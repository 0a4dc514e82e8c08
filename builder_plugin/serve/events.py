"""What the worker reports to a request as its answer goes (Started, Piece, ToolCalls, Finished or Failed), what
they add up to (Collected), and their server-sent form."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from builder_plugin.runtime import TokenLogprob
from builder_plugin.serve.errors import ApiError


@dataclass(frozen=True)
class Started:
    """The question was accepted by the runtime; pieces follow."""


@dataclass(frozen=True)
class Piece:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens generated since the last piece


@dataclass(frozen=True)
class ToolCalls:
    calls: list[dict]  # OpenAI tool_calls, complete


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (end of answer or a stop string), "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Started | Piece | ToolCalls | Finished | Failed


@dataclass
class Collected:
    """What the events of an answer add up to."""

    text: str
    finished: Finished
    calls: list[dict]
    logprobs: list[TokenLogprob]


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event (`event`: its type line, as the Responses API sends)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"
