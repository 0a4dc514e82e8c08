"""Tool calls in Phi-4-multimodal's own format, for the chat-completions API.

- The tools go into the system message the way the package's chat template renders them (``Chat.tools``: the JSON
  list of ``{"name", "description", "parameters"}``); the model answers a call with
  ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>``, parsed here into OpenAI ``tool_calls``.
- ``tool_choice``: ``"none"`` leaves the tools out of the prompt (a plain answer); ``"auto"`` lets the model answer or
  call; ``"required"`` and a named function constrain the answer with a grammar (runtime.guidance) so it is a call
  block whose arguments validate against the function's ``parameters``.
- An assistant message with ``tool_calls`` is fed back as the call block the model would have written, and ``tool``
  messages as the template renders them (``<|tool|>result<|end|>``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from builder_plugin.runtime import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from builder_plugin.serve.errors import ApiError

CHOICES = ("none", "auto", "required")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the OpenAI API's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Tools:
    """The tools of one request and how the model may use them."""

    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required" or "function" (the one named by `named`)
    named: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> bool:
        """The model sees the tools (and its answer is read for calls)."""
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    @cached_property
    def text(self) -> str:
        """The tools as the chat template puts them in the system message."""
        listed = []
        for f in self.functions:
            entry: dict[str, Any] = {"name": f.name}
            if f.description:
                entry["description"] = f.description
            entry["parameters"] = f.parameters
            listed.append(entry)
        return json.dumps(listed, ensure_ascii=False)

    def grammar_functions(self) -> list[tuple[str, dict[str, Any]]]:
        chosen = [f for f in self.functions if self.choice != "function" or f.name == self.named]
        return [(f.name, f.parameters) for f in chosen]

    @property
    def single_call(self) -> bool:
        return self.choice == "function" or not self.parallel

    def names(self) -> set[str]:
        return {f.name for f in self.functions}


def parse_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> Tools | None:
    """The request's tools; raises ApiError (400) naming the first problem."""
    if not tools:  # none, or an empty list (agent frameworks send one for an agent without tools)
        if tool_choice not in (None, "none", "auto"):
            raise ApiError("tool_choice: needs tools", param="tool_choice")
        return None
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(f"{where}: only {{'type': 'function', 'function': {{...}}}} tools are supported",
                           param=where)
        function = tool["function"]
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ApiError(f"{where}.function: unknown field {sorted(unknown)[0]!r}", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ApiError(f"{where}.function.name: 1-64 letters, digits, '_' or '-'", param=f"{where}.function.name")
        if name in (f.name for f in functions):
            raise ApiError(f"{where}.function.name: {name!r} is listed twice", param=f"{where}.function.name")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ApiError(f"{where}.function.parameters: must be a JSON schema object",
                           param=f"{where}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ApiError(f"{where}.function.description: must be a string", param=f"{where}.function.description")
        functions.append(Function(name, description, parameters))
    named = None
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in CHOICES:
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        choice, named = "function", tool_choice["function"].get("name")
        if named not in (f.name for f in functions):
            raise ApiError(f"tool_choice: no tool is named {named!r}", param="tool_choice")
    else:
        raise ApiError("tool_choice: use 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice")
    return Tools(tuple(functions), choice, named, True if parallel is None else bool(parallel))


# ---- the model's answer -------------------------------------------------------------------------------------------


def parse_calls(text: str, names: set[str], single: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and the OpenAI tool_calls of an answer. A call block that does not parse, or names a function
    that was not offered, leaves the whole answer as content (no calls)."""
    start = text.find(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, start + 1)
    if start < 0 or end < 0:
        return (text or None), []
    try:
        listed = json.loads(text[start + len(TOOL_CALL_OPEN):end])
    except json.JSONDecodeError:
        return text, []
    listed = [listed] if isinstance(listed, dict) else listed
    calls = []
    for item in listed if isinstance(listed, list) else [None]:
        if not isinstance(item, dict) or item.get("name") not in names:
            return text, []
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):  # some answers carry the arguments as JSON text already
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": item["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = (text[:start] + text[end + len(TOOL_CALL_CLOSE):]).strip()
    return (content or None), calls[:1] if single else calls


class CallScanner:
    """Streamed answers: text before a call block is let through as soon as it cannot be the start of the opening
    marker; from the marker on, the answer is held until it ends (`finish` then parses it)."""

    def __init__(self) -> None:
        self._held = ""
        self._block: str | None = None

    def feed(self, piece: str) -> str:
        if self._block is not None:
            self._block += piece
            return ""
        text = self._held + piece
        at = text.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._held, self._block = "", text[at:]
            return text[:at]
        keep = max((k for k in range(1, min(len(TOOL_CALL_OPEN), len(text) + 1))
                    if text.endswith(TOOL_CALL_OPEN[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self, names: set[str], single: bool = False, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The text still to send as content, and the calls. A call block still open when the answer was `cut` by
        its token limit is dropped: neither content nor a call (the answer then ends with finish_reason "length")."""
        if self._block is None:
            held, self._held = self._held, ""
            return held, []
        block, self._block = self._block, None
        if cut and TOOL_CALL_CLOSE not in block:
            return "", []
        content, calls = parse_calls(block, names, single)
        return content or "", calls


# ---- the conversation fed back ------------------------------------------------------------------------------------


def call_block(tool_calls: Any, param: str) -> str:
    """An assistant message's tool_calls as the call block the model writes."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise ApiError(f"{param}: must be a non-empty list of calls", param=param)
    listed = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(f"{param}[{j}]: a call needs function.name and function.arguments", param=f"{param}[{j}]")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            raise ApiError(f"{param}[{j}].function.arguments: must be JSON text",
                           param=f"{param}[{j}].function.arguments") from None
        listed.append({"name": function["name"], "arguments": arguments})
    return f"{TOOL_CALL_OPEN}{json.dumps(listed, ensure_ascii=False)}{TOOL_CALL_CLOSE}"


def stream_deltas(calls: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool_calls deltas of a stream: per call, its id, type and name, then its arguments."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas
