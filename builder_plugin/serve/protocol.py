"""The chat-completions protocol: the request model, messages parsed into a conversation of runtime Turns, and the
response and stream-chunk bodies."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from builder_plugin import runtime
from builder_plugin.runtime import Sampling, Turn
from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.media import MediaReader

ROLES = ("system", "developer", "user", "assistant")  # developer: the newer name of system
MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields this server reads; other fields of the OpenAI request are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    tools: list[Any] | None = None
    logprobs: bool | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.seed)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def parse_request(body: bytes) -> ChatCompletionRequest:
    """The request in `body`; raises ApiError (400) naming the first problem."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    try:
        request = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
        raise ApiError(f"{param}: {error['msg']}" if param else error["msg"], param=param or None) from None
    _refuse_unsupported(request)
    return request


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    if request.n != 1:
        raise ApiError("n: only one choice per request is supported (n=1)", param="n")
    if request.tools:
        raise ApiError("tools: tool calls are not supported", param="tools")
    if request.logprobs:
        raise ApiError("logprobs: log probabilities are not supported", param="logprobs")
    stops = request.stop_strings
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(f"stop: up to {MAX_STOP_STRINGS} non-empty strings", param="stop")


# ---- messages -> conversation -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """What one request asks: the system prompt, the answered turns so far and the question to answer."""

    system: str | None
    history: tuple[Turn, ...]
    question: Turn

    @property
    def has_audio(self) -> bool:
        return any(turn.audios for turn in (*self.history, self.question))


def parse_conversation(messages: list[dict[str, Any]], media: MediaReader) -> Conversation:
    """Messages in OpenAI form as a conversation: leading system messages are the system prompt, each user message
    (consecutive ones merged) is a question, each assistant message the answer to the question before it; the last
    message must be a user message. Media parts become files through `media`."""
    system: list[str] = []
    turns: list[Turn] = []
    parts: list[tuple[str, Any]] = []  # the open question: ("text", str) / ("image", Path) / ("audio", Path)
    question_at = 0
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"{param}.role: unsupported role {role!r} (use system, user or assistant)",
                           param=f"{param}.role")
        content = message.get("content")
        if role in ("system", "developer"):
            if turns or parts:
                raise ApiError(f"{param}: system messages must come before the conversation", param=param)
            system.append(_text_only(content, param))
        elif role == "user":
            if not parts:
                question_at = i
            parts.extend(_user_parts(content, param, media))
        else:
            if not parts:
                raise ApiError(f"{param}: an assistant message must answer a user message", param=param)
            turns.append(_turn(parts, f"messages[{question_at}]", _text_only(content, param)))
            parts = []
    if not parts:
        raise ApiError("messages: the last message must be a user message (the question to answer)",
                       param="messages")
    question = _turn(parts, f"messages[{question_at}]", None)
    return Conversation("\n".join(system) if system else None, tuple(turns), question)


def _text_only(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"{param}.content[{j}]: only text parts are supported here", param=f"{param}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(f"{param}.content: must be a string or a list of parts", param=f"{param}.content")


def _user_parts(content: Any, param: str, media: MediaReader) -> list[tuple[str, Any]]:
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list) or not content:
        raise ApiError(f"{param}.content: must be a string or a non-empty list of parts", param=f"{param}.content")
    parts: list[tuple[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(("text", part["text"]))
        elif kind == "image_url" and isinstance(part.get("image_url"), dict):
            parts.append(("image", media.image(part["image_url"].get("url"), f"{where}.image_url.url")))
        elif kind == "input_audio" and isinstance(part.get("input_audio"), dict):
            audio = part["input_audio"]
            parts.append(("audio", media.audio(audio.get("data"), audio.get("format"), f"{where}.input_audio")))
        elif kind in ("text", "image_url", "input_audio"):
            raise ApiError(f"{where}: a {kind} part needs its {kind!r} field", param=where)
        else:
            raise ApiError(f"{where}.type: unsupported part type {kind!r} (use text, image_url or input_audio)",
                           param=f"{where}.type", code="unsupported_content_type")
    return parts


def _turn(parts: list[tuple[str, Any]], param: str, answer: str | None) -> Turn:
    """One question from its parts. Media tags go where the media parts are, unless the text writes its own tags of
    that kind (then it must write one per file, in order: runtime.check_tags)."""
    texts = "".join(value for kind, value in parts if kind == "text")
    written = {kind for kind in ("image", "audio") if re.search(rf"<\|{kind}_\d+\|>", texts)}
    pieces: list[str] = []
    counts = {"image": 0, "audio": 0}
    previous = None
    for kind, value in parts:
        if kind == "text":
            if previous == "text":
                pieces.append("\n")
            pieces.append(value)
        elif kind not in written:
            counts[kind] += 1
            pieces.append(f"<|{kind}_{counts[kind]}|>")
        previous = kind
    images = tuple(value for kind, value in parts if kind == "image")
    audios = tuple(value for kind, value in parts if kind == "audio")
    text = "".join(pieces)
    try:
        runtime.check_tags(text, len(images), len(audios))
    except runtime.TagMismatchError as exc:
        raise ApiError(f"{param}: {exc}", param=param, code="invalid_media_tags") from None
    return Turn(text, images, audios, answer)


# ---- responses ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Identity of one answer, shared by all its stream chunks."""

    model: str
    id: str
    created: int

    @classmethod
    def new(cls, model: str) -> Reply:
        return cls(model, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))

    def completion(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish_reason}],
                "usage": usage}

    def chunk(self, delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
