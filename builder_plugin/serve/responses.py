"""/v1/responses, the OpenAI Responses API, for what this model can do: text, image and audio input, instructions,
function tools with their calls and outputs, ``text.format`` (JSON schema or object), ``max_output_tokens``,
sampling, streaming with the API's event types, and ``previous_response_id`` while the conversation is kept.

A request is read into the chat messages and the ChatRequest the chat endpoint makes (the same worker answers both):
instructions become the system message, message items messages (input_text / input_image / input_audio parts as
text / image_url / input_audio), function_call items an assistant message's tool_calls, function_call_output items
tool messages; errors name the request's own fields (``input[2].content[0]``). What the model cannot do (built-in
tools, files, reasoning) is refused by name.

Responses with ``store`` (the API's default) are kept in memory, the last ``stored_responses`` of them: the
conversation each ended with (its input and output; instructions are not carried over, as in the OpenAI API) and its
body (GET /v1/responses/{id}). A request naming an unknown or forgotten previous_response_id gets a 404 naming it.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.events import Collected, Finished, Piece, ToolCalls, sse
from builder_plugin.serve.fields import RESPONSES
from builder_plugin.serve.media import check_detail
from builder_plugin.serve.protocol import ChatRequest, RequestFields, Writer, read_request, refuse_unknown_keys
from builder_plugin.serve.structured import response_guidance
from builder_plugin.serve.tools import parse_tools

PARTS = {"input_text": "text", "output_text": "text", "input_image": "image_url", "input_audio": "input_audio"}
# What each input item and part may carry; any other key is refused by name. An output item sent back (the openai
# client's objects) carries its id and status, its text parts their annotations and logprobs: accepted, not read; a
# function_call_output may name its function, as the call it answers does. The client's models also carry the
# ECHOED_KEYS, accepted when null or empty.
ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status"),
    "function_call": ("type", "call_id", "name", "arguments", "id", "status"),
    "function_call_output": ("type", "call_id", "output", "id", "status", "name"),
}
ECHOED_KEYS = ("phase", "caller", "namespace", "async", "async_")
PART_KEYS = {
    "input_text": ("type", "text"),
    "output_text": ("type", "text", "annotations", "logprobs"),
    "input_image": ("type", "image_url", "file_id", "detail"),
    "input_audio": ("type", "input_audio"),
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequestFields(RequestFields):
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None


@dataclass(frozen=True)
class Stored:
    """A kept response: the conversation it ended with (chat messages, without instructions) and its body."""

    messages: tuple[dict[str, Any], ...]
    body: dict[str, Any]


class ResponseStore:
    """The last `size` responses asked to be stored (0: none), by id. Used on the event loop only."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        if self.size < 1:
            return
        self._kept[response_id] = stored
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


@dataclass(frozen=True)
class ResponsesRequest:
    request: ChatRequest  # what the worker reads; its messages: the stored conversation, instructions and input
    where: tuple[str, ...]  # the request field each message came from, for errors
    continued: tuple[dict[str, Any], ...]  # the stored conversation continued, then the input's messages
    fields: ResponsesRequestFields


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(f"{param + ': ' if param else ''}no response {response_id!r} is kept here (responses are kept "
                    "in memory while the server runs, the last ones stored; send the whole conversation in input "
                    "instead)", 404, param=param, code="response_not_found")


def parse_responses(body: bytes, store: ResponseStore) -> ResponsesRequest:
    """The request in `body`; raises ApiError (400, or 404 for an unknown previous_response_id)."""
    fields = read_request(body, RESPONSES, ResponsesRequestFields)
    previous: tuple[dict[str, Any], ...] = ()
    if fields.previous_response_id is not None:
        stored = store.get(fields.previous_response_id)
        if stored is None:
            raise not_found(fields.previous_response_id, "previous_response_id")
        previous = stored.messages
    own, own_where = _input_messages(fields.input)
    continued = (*previous, *own)
    system = ({"role": "system", "content": fields.instructions},) if fields.instructions else ()
    where = ("instructions",) * len(system) + ("previous_response_id",) * len(previous) + own_where
    try:
        tools = parse_tools(_chat_tools(fields.tools), _chat_tool_choice(fields.tool_choice),
                            fields.parallel_tool_calls)
    except ApiError as exc:  # the chat form's tools[i].function.name is this form's tools[i].name
        raise ApiError(exc.message.replace(".function.", ".", 1), exc.status, code=exc.code,
                       param=exc.param.replace(".function", "", 1) if exc.param else None) from None
    guidance = response_guidance(_text_format(fields.text), "text.format", flat=True)
    if tools is not None and tools.constrained and guidance is not None:
        raise ApiError("text.format: cannot be combined with a required tool call (tool_choice)", param="text.format")
    request = ChatRequest(
        model=fields.model, messages=(*system, *continued), stream=fields.stream, include_usage=False,
        max_new_tokens=fields.max_output_tokens,
        sampling=fields.sampling, stops=(),
        tools=tools if tools is not None and tools.offered else None, guidance=guidance, logprobs=None,
        prompt_field="input", format_field="text.format")
    return ResponsesRequest(request, where, continued, fields)


# ---- the request, as chat messages --------------------------------------------------------------------------------


def _input_messages(items: str | list[Any]) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
    """The chat messages of `input` and the field each came from."""
    if isinstance(items, str):
        return ({"role": "user", "content": items},), ("input",)
    if not items:
        raise ApiError("input: must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    where: list[str] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ITEM_KEYS:
            refuse_unknown_keys(item, ITEM_KEYS[kind], param, f"a {kind} item", ECHOED_KEYS)
        if kind == "message":
            messages.append(_message(item, param))
            where.append(param)
        elif kind == "function_call":
            call = _function_call(item, param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the answer's text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                where.append(param)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(f"{param}.call_id: required", param=f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _output_text(item.get("output"), f"{param}.output")})
            where.append(param)
        else:
            raise ApiError(f"{param}.type: {kind!r} items are not supported (use message, function_call or "
                           "function_call_output)", param=f"{param}.type", code="unsupported_content_type")
    return tuple(messages), tuple(where)


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise ApiError(f"{param}.role: unsupported role {role!r} (use {', '.join(MESSAGE_ROLES)})",
                       param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ApiError(f"{param}.content: must be a string or a list of parts", param=f"{param}.content")
    return {"role": role, "content": [_part(part, f"{param}.content[{j}]") for j, part in enumerate(content)]}


def _part(part: Any, param: str) -> dict[str, Any]:
    """A content part as the chat endpoint's (the same index, so its errors name the same place)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in PARTS:
        raise ApiError(f"{param}.type: unsupported part type {kind!r} (use input_text, input_image or input_audio)",
                       param=f"{param}.type", code="unsupported_content_type")
    refuse_unknown_keys(part, PART_KEYS[kind], param, f"an {kind} part", ECHOED_KEYS)
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise ApiError(f"{param}.file_id: files are not supported; send the image in image_url (a data: URL)",
                           param=f"{param}.file_id", code="unsupported_parameter")
        if not isinstance(part.get("image_url"), str):
            raise ApiError(f"{param}.image_url: required", param=f"{param}.image_url")
        check_detail(part.get("detail"), f"{param}.detail")
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail")}}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    return {"type": "text", "text": part.get("text")}


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise ApiError(f"{param}.{name}: required (a string)", param=f"{param}.{name}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _output_text(output: Any, param: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text" and
                                        isinstance(p.get("text"), str) for p in output):
        return "\n".join(p["text"] for p in output)
    raise ApiError(f"{param}: must be a string or a list of input_text parts", param=param)


def _chat_tools(tools: list[Any] | None) -> list[Any] | None:
    """Function tools in the chat endpoint's form; built-in tools refused by name."""
    if tools is None:
        return None
    listed = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(f"tools[{i}].type: {kind!r} tools are not supported (only function tools)",
                           param=f"tools[{i}].type", code="unsupported_parameter")
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise ApiError(f"tools[{i}]: unknown field {sorted(unknown)[0]!r}", param=f"tools[{i}]")
        listed.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return listed


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise ApiError("tool_choice: use 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                           param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_format(text: dict[str, Any] | None) -> Any:
    if text is None:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise ApiError(f"text.{sorted(unknown)[0]}: unknown field", param="text")
    if text.get("verbosity") is not None:
        raise ApiError("text.verbosity: not supported (this model has no verbosity setting)", param="text.verbosity",
                       code="unsupported_parameter")
    return text.get("format")


# ---- the response -------------------------------------------------------------------------------------------------


class ResponsesWriter(Writer):
    """A response object, or the stream's events: response.created and response.in_progress; the message item
    (output_item.added, content_part.added, output_text.delta per piece, output_text.done, content_part.done,
    output_item.done); a function_call item per call (its arguments in one delta); then response.completed, or
    response.incomplete when max_output_tokens cut the answer; an error event and response.failed when the answer
    fails midway. Each event has its sequence_number. The response is stored, when asked, as it finishes."""

    def __init__(self, model: str, parsed: ResponsesRequest, store: ResponseStore) -> None:
        self.model = model
        self.parsed = parsed
        self.store = store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._sequence = 0
        self._text: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._opened = False  # the message item has been announced

    def body(self, answer: Collected) -> dict[str, Any]:
        self._text, self._calls = [answer.text], answer.calls
        return self._finish(answer.finished)

    def opening(self) -> list[str]:
        head = self.response("in_progress", [], None)
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def piece(self, piece: Piece) -> list[str]:
        if not piece.text:
            return []
        events = self._open()
        self._text.append(piece.text)
        events.append(self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                  content_index=0, delta=piece.text, logprobs=[]))
        return events

    def calls(self, calls: ToolCalls) -> list[str]:
        self._calls.extend(calls.calls)
        return []  # announced when the answer finishes, after the message

    def finished(self, finished: Finished) -> list[str]:
        events = []
        if self._opened or not self._calls:
            events += self._open()
            text, item = "".join(self._text), self._message(finished)
            events += [self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                   content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                   content_index=0, part=item["content"][0]),
                       self._event("response.output_item.done", output_index=0, item=item)]
        for index, call in enumerate(self._function_calls(), start=1 if events else 0):
            events += [self._event("response.output_item.added", output_index=index,
                                   item={**call, "arguments": "", "status": "in_progress"}),
                       self._event("response.function_call_arguments.delta", item_id=call["id"],
                                   output_index=index, delta=call["arguments"]),
                       self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                                   name=call["name"], arguments=call["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=call)]
        response = self._finish(finished)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def failed(self, error: ApiError) -> list[str]:
        """An error event, then response.failed with what was said so far (nothing of it is stored)."""
        output = [self._message(None)] if self._opened else []
        failed = {**self.response("failed", output, None),
                  "error": {"code": error.code or error.type, "message": error.message}}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]

    def closing(self) -> list[str]:
        return []

    # ---- bodies --------------------------------------------------------------------------------------------------

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        fields = self.parsed.fields
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": fields.instructions, "max_output_tokens": fields.max_output_tokens,
                "model": self.model, "output": output,
                "parallel_tool_calls": fields.parallel_tool_calls is not False,
                "previous_response_id": fields.previous_response_id, "reasoning": None, "store": fields.store,
                "temperature": fields.temperature, "top_p": fields.top_p,
                "text": fields.text or {"format": {"type": "text"}}, "tool_choice": fields.tool_choice or "auto",
                "tools": fields.tools or [], "truncation": "disabled", "usage": usage, "metadata": {}}

    def _finish(self, finished: Finished) -> dict[str, Any]:
        """The final response, stored when asked."""
        output = [self._message(finished)] if "".join(self._text) or not self._calls else []
        output += self._function_calls()
        status = "incomplete" if finished.finish_reason == "length" else "completed"
        usage = {"input_tokens": finished.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": finished.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": finished.prompt_tokens + finished.completion_tokens}
        response = self.response(status, output, usage)
        if self.parsed.fields.store:
            answer: dict[str, Any] = {"role": "assistant", "content": "".join(self._text) or
                                      (None if self._calls else "")}
            if self._calls:
                answer["tool_calls"] = self._calls
            self.store.put(self.id, Stored((*self.parsed.continued, answer), response))
        return response

    def _message(self, finished: Finished | None) -> dict[str, Any]:
        """The message item (`finished` None: the answer failed midway)."""
        return {"type": "message", "id": self.message_id, "role": "assistant",
                "status": "incomplete" if finished is None or finished.finish_reason == "length" else "completed",
                "content": [{"type": "output_text", "text": "".join(self._text), "annotations": [], "logprobs": []}]}

    def _function_calls(self) -> list[dict[str, Any]]:
        return [{"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                 "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                 "status": "completed"} for call in self._calls]

    def _open(self) -> list[str]:
        """The message item's announcement, the first time."""
        if self._opened:
            return []
        self._opened = True
        item = {"type": "message", "id": self.message_id, "role": "assistant", "status": "in_progress",
                "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                            part=part)]

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(event, kind)
