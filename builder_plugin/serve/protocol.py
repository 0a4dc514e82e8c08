"""The chat-completions protocol: a request parsed once into a frozen ChatRequest, its messages into an Exchange of
runtime Turns (their media decoded), and the response and stream-chunk bodies."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from builder_plugin import runtime
from builder_plugin.media import Media
from builder_plugin.runtime import (
    MAX_TOP_LOGPROBS,
    TOOL,
    Guidance,
    Sampling,
    TagMismatchError,
    TokenLogprob,
    Turn,
    tool_results,
)
from builder_plugin.runtime.prompt import tagged
from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.events import Collected, Finished, Piece, ToolCalls, sse
from builder_plugin.serve.fields import CHAT, Fields
from builder_plugin.serve.media import MediaReader
from builder_plugin.serve.structured import response_guidance
from builder_plugin.serve.tools import Tools, call_block, parse_tools, stream_deltas

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: the newer name of system
# What a message of each role may carry; any other key is refused by name. A tool message's `name` (the function's,
# which its tool_call_id already names) is accepted as some clients send it; participant names on the other roles are
# refused (the model's chat format has none).
MESSAGE_KEYS = {
    "system": ("role", "content"),
    "developer": ("role", "content"),
    "user": ("role", "content"),
    "assistant": ("role", "content", "tool_calls"),
    "tool": ("role", "content", "tool_call_id", "name"),
}
# An answer's fields that clients send back with it (the openai client's message objects): accepted on an assistant
# message when null or empty, refused with a value.
ECHOED_KEYS = ("refusal", "annotations", "audio", "function_call")
# What each content part may carry, and its object's keys.
PART_KEYS = {"text": ("type", "text"), "image_url": ("type", "image_url"), "input_audio": ("type", "input_audio")}
PART_OBJECT_KEYS = {"image_url": ("url", "detail"), "input_audio": ("data", "format")}
MAX_STOP_STRINGS = 4
Model = TypeVar("Model", bound=BaseModel)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = False  # padding against side channels; a local server sends none


class RequestFields(BaseModel):
    """The fields every endpoint reads alike, as sent (the endpoint's field table has refused the ones it cannot
    honour; the informational ones are left out of its request model)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = None

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.seed)


class ChatCompletionRequest(RequestFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = 1
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


@dataclass(frozen=True)
class ChatRequest:
    """One chat-completions request, parsed once: what every later step reads (the messages become a Conversation
    when their media are decoded, off the event loop)."""

    model: str | None
    messages: tuple[dict[str, Any], ...]
    stream: bool
    include_usage: bool
    max_new_tokens: int | None
    sampling: Sampling
    stops: tuple[str, ...]
    tools: Tools | None  # None: no tools, or tool_choice "none" (the model does not see them)
    guidance: Guidance | None  # response_format
    logprobs: int | None  # alternatives per token when log-probabilities are asked for (None: none)
    prompt_field: str = "messages"  # the request's field an error about the conversation names
    format_field: str = "response_format"  # and the one an error about its guidance names

    @property
    def tools_text(self) -> str | None:
        """The tools as the chat template puts them in the system message (None: the model sees none)."""
        return self.tools.text if self.tools is not None else None


def parse_request(body: bytes) -> ChatRequest:
    """The request in `body`; raises ApiError (400) naming the first problem."""
    fields = read_request(body, CHAT, ChatCompletionRequest)
    if fields.top_logprobs is not None and not fields.logprobs:
        raise ApiError("top_logprobs: needs logprobs: true", param="top_logprobs")
    tools = parse_tools(fields.tools, fields.tool_choice, fields.parallel_tool_calls)
    guidance = response_guidance(fields.response_format)
    if tools is not None and tools.constrained and guidance is not None:
        raise ApiError("response_format: cannot be combined with a required tool call (tool_choice)",
                       param="response_format")
    return ChatRequest(
        model=fields.model, messages=tuple(fields.messages), stream=fields.stream,
        include_usage=fields.stream_options is not None and fields.stream_options.include_usage,
        max_new_tokens=fields.max_completion_tokens or fields.max_tokens,
        sampling=fields.sampling, stops=stop_strings(fields.stop),
        tools=tools if tools is not None and tools.offered else None, guidance=guidance,
        logprobs=(fields.top_logprobs or 0) if fields.logprobs else None)


def read_request(body: bytes, table: Fields, model: type[Model]) -> Model:
    """The fields of the request in `body`, read by `model` once `table` has refused the ones that cannot be
    honoured; raises ApiError (400) naming the first problem (a request model with `n` must ask for one choice)."""
    data = json_object(body)
    table.check(data)
    fields = validated(model, data)
    if getattr(fields, "n", 1) != 1:
        raise ApiError("n: only one choice per request is supported (n=1)", param="n")
    return fields


def json_object(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body; raises ApiError (400)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    return data


def validated(model: type[Model], data: dict[str, Any]) -> Model:
    """`data` read by a request model; raises ApiError (400) naming the first field in error."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
        raise ApiError(f"{param}: {error['msg']}" if param else error["msg"], param=param or None) from None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(f"stop: up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    return stops


# ---- messages -> conversation -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """What one request's messages ask: the system prompt, the answered turns so far and the question to answer."""

    system: str | None
    history: tuple[Turn, ...]
    question: Turn

    @property
    def has_audio(self) -> bool:
        return any(turn.audios for turn in (*self.history, self.question))


@dataclass(frozen=True)
class Prompt:
    """A raw prompt (/v1/completions): given to the model as written, with no chat template and no history."""

    text: str
    system = None
    history: tuple[Turn, ...] = ()
    question = None  # none of a kept conversation is reused

    @property
    def has_audio(self) -> bool:
        return False


def parse_messages(messages: Sequence[dict[str, Any]], media: MediaReader, where: Sequence[str] | None = None,
                   field: str = "messages") -> Exchange:
    """Messages in OpenAI form as a conversation: leading system messages are the system prompt, each user message
    (consecutive ones merged) is a question, each assistant message the answer to the question before it (its
    tool_calls written as the model's call block); the tool messages after an answer with calls are the next
    question, in the tool role. The last message must be a user or tool message. Media parts are decoded by `media`.
    Errors name `where[i]` for message i (default ``messages[i]``) and `field` for the whole."""
    system: list[str] = []
    turns: list[Turn] = []
    parts: list[str | Media] = []  # the open question: its texts and media in order
    results: list[str] = []  # or the open tool results
    question_at = field
    called = False  # the last answer made tool calls
    for i, message in enumerate(messages):
        param = where[i] if where is not None else f"{field}[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{param}: must be an object", param=param)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"{param}.role: unsupported role {role!r} (use system, user, assistant or tool)",
                           param=f"{param}.role")
        _message_keys(message, role, param)
        content = message.get("content")
        if role in ("system", "developer"):
            if turns or parts or results:
                raise ApiError(f"{param}: system messages must come before the conversation", param=param)
            system.append(_text_only(content, param))
        elif role == "user":
            if results:
                raise ApiError(f"{param}: the tool results before it need an assistant answer first", param=param)
            if not parts:
                question_at = param
            parts.extend(_user_parts(content, param, media))
        elif role == "tool":
            if parts or not (called or results):
                raise ApiError(f"{param}: a tool message must follow an assistant message with tool_calls",
                               param=param)
            if not isinstance(message.get("tool_call_id"), str):
                raise ApiError(f"{param}.tool_call_id: required", param=f"{param}.tool_call_id")
            if not results:
                question_at = param
            results.append(_text_only(content, param))
        else:
            if not parts and not results:
                raise ApiError(f"{param}: an assistant message must answer a user or tool message", param=param)
            answer = "" if content is None and message.get("tool_calls") else _text_only(content, param)
            called = bool(message.get("tool_calls"))
            if called:
                answer += call_block(message["tool_calls"], f"{param}.tool_calls")
            turns.append(_question(parts, results, question_at, answer))
            parts, results = [], []
    if not parts and not results:
        raise ApiError(f"{field}: the last message must be a user or tool message (the question to answer)",
                       param=field)
    question = _question(parts, results, question_at, None)
    return Exchange("\n".join(system) if system else None, tuple(turns), question)


def _question(parts: list[str | Media], results: list[str], param: str, answer: str | None) -> Turn:
    """One question: the tool results, or the user's parts, media tagged where they stand (runtime.tagged)."""
    if results:
        return Turn(tool_results(results), assistant=answer, role=TOOL)
    images = tuple(p for p in parts if isinstance(p, Media) and p.kind == "image")
    audios = tuple(p for p in parts if isinstance(p, Media) and p.kind == "audio")
    try:
        return Turn(tagged(parts), images, audios, answer)
    except TagMismatchError as exc:
        raise ApiError(f"{param}: {exc}", param=param, code="invalid_media_tags") from None


def refuse_unknown_keys(value: dict[str, Any], keys: Sequence[str], param: str, what: str,
                        echoed: Sequence[str] = ()) -> None:
    """Raises ApiError naming the first key of `value` (an object of the request at `param`) that is not in `keys`;
    one in `echoed` passes when null or empty."""
    for key, field in value.items():
        if key not in keys and not (key in echoed and not field):
            raise ApiError(f"{param}.{key}: unknown field of {what}", param=f"{param}.{key}",
                           code="unsupported_parameter")


def _message_keys(message: dict[str, Any], role: str, param: str) -> None:
    if "name" in message and "name" not in MESSAGE_KEYS[role]:
        raise ApiError(f"{param}.name: participant names are not supported (the model's chat format has none)",
                       param=f"{param}.name", code="unsupported_parameter")
    echoed = ECHOED_KEYS if role == "assistant" else ()
    for key in echoed:
        if message.get(key):
            raise ApiError(f"{param}.{key}: an answer's {key} cannot be sent back to this model (send it null or "
                           "leave it out)", param=f"{param}.{key}", code="unsupported_parameter")
    refuse_unknown_keys(message, MESSAGE_KEYS[role], param, f"a {role} message", echoed)


def _part_keys(part: dict[str, Any], kind: str, param: str) -> None:
    refuse_unknown_keys(part, PART_KEYS[kind], param, f"a {kind} part")
    if kind in PART_OBJECT_KEYS:
        refuse_unknown_keys(part[kind], PART_OBJECT_KEYS[kind], f"{param}.{kind}", kind)


def _text_only(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"{param}.content[{j}]: only text parts are supported here", param=f"{param}.content")
            _part_keys(part, "text", f"{param}.content[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(f"{param}.content: must be a string or a list of parts", param=f"{param}.content")


def _user_parts(content: Any, param: str, media: MediaReader) -> list[str | Media]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list) or not content:
        raise ApiError(f"{param}.content: must be a string or a non-empty list of parts", param=f"{param}.content")
    parts: list[str | Media] = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in PART_KEYS and isinstance(part.get(kind), dict if kind in PART_OBJECT_KEYS else str):
            _part_keys(part, kind, where)
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "image_url" and isinstance(part.get("image_url"), dict):
            image = part["image_url"]
            parts.append(media.image(image.get("url"), f"{where}.image_url", image.get("detail")))
        elif kind == "input_audio" and isinstance(part.get("input_audio"), dict):
            audio = part["input_audio"]
            parts.append(media.audio(audio.get("data"), audio.get("format"), f"{where}.input_audio"))
        elif kind in ("text", "image_url", "input_audio"):
            raise ApiError(f"{where}: a {kind} part needs its {kind!r} field", param=where)
        else:
            raise ApiError(f"{where}.type: unsupported part type {kind!r} (use text, image_url or input_audio)",
                           param=f"{where}.type", code="unsupported_content_type")
    return parts


# ---- answers ------------------------------------------------------------------------------------------------------


class Writer:
    """The bodies of one answer in an endpoint's form: the JSON response (``body``), or the stream's server-sent
    events, opened, then one call per event, then closed."""

    def body(self, answer: Collected) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> list[str]:
        return []

    def piece(self, piece: Piece) -> list[str]:
        raise NotImplementedError

    def calls(self, calls: ToolCalls) -> list[str]:
        return []

    def finished(self, finished: Finished) -> list[str]:
        raise NotImplementedError

    def failed(self, error: ApiError) -> list[str]:
        return [sse(error.body())]

    def closing(self) -> list[str]:
        return [DONE]


DONE = "data: [DONE]\n\n"


class ChatWriter(Writer):
    """A chat completion, or its chunks: a role chunk, content chunks, the tool_calls deltas, a finish chunk, a usage
    chunk when asked, then [DONE]."""

    def __init__(self, model: str, request: ChatRequest) -> None:
        self.model = model
        self.request = request
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def body(self, answer: Collected) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": answer.text or (None if answer.calls else "")}
        if answer.calls:
            message["tool_calls"] = answer.calls
        finished = answer.finished
        logprobs = answer.logprobs if self.request.logprobs is not None else None
        return {**self._head("chat.completion"),
                "choices": [{"index": 0, "message": message, "logprobs": logprobs_body(logprobs),
                             "finish_reason": finished.finish_reason}],
                "usage": usage(finished.prompt_tokens, finished.completion_tokens)}

    def opening(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def piece(self, piece: Piece) -> list[str]:
        logprobs = list(piece.logprobs) if self.request.logprobs is not None else None
        return [self._chunk({"content": piece.text}, logprobs=logprobs)]

    def calls(self, calls: ToolCalls) -> list[str]:
        return [self._chunk(delta) for delta in stream_deltas(calls.calls)]

    def finished(self, finished: Finished) -> list[str]:
        chunks = [self._chunk({}, finished.finish_reason)]
        if self.request.include_usage:
            chunks.append(sse({**self._head("chat.completion.chunk"), "choices": [],
                               "usage": usage(finished.prompt_tokens, finished.completion_tokens)}))
        return chunks

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> str:
        return sse({**self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs_body(logprobs),
                                 "finish_reason": finish_reason}]})


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_body(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """The OpenAI ``logprobs`` object of a choice (None when they were not asked for)."""
    if logprobs is None:
        return None

    def entry(alt: runtime.Alternative) -> dict[str, Any]:
        return {"token": alt.token, "logprob": alt.logprob, "bytes": list(alt.bytes)}

    return {"content": [{**entry(t.chosen), "top_logprobs": [entry(a) for a in t.top]} for t in logprobs],
            "refusal": None}
