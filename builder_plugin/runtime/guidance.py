"""Constrained answers: a JSON schema, a regular expression or a Lark grammar the runtime's guidance (llguidance)
enforces on every generated token, and the grammar of Phi-4-multimodal's tool calls.

- JSON whitespace is fixed, not left to the model: a schema gets llguidance's ``x-guidance`` options with
  ``whitespace_flexible`` off and ``", "`` / ``": "`` separators (the layout of ``json.dumps``) unless it sets its own,
  so a schema whose strings and arrays are bounded bounds the answer.
- A guided generator cannot be reused for the next question: the grammar state lives in the generator and follows
  only the tokens it generated (appended tokens are not fed to it). ``Chat`` starts a new generator over the
  conversation's ids for a guided answer and for the answer after one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "regex", "lark_grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GUIDANCE_OPTIONS = "x-guidance"  # llguidance's key for its JSON options inside a schema
# The markers of the model's call block: <|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<|tool_call|>", "<|/tool_call|>"
MAX_CALLS = 4  # calls one constrained answer may make (a model that keeps calling cannot fill max_tokens with them)


@dataclass(frozen=True)
class Guidance:
    """What the answer must match: `kind` is one of KINDS, `data` its text (a schema as JSON, a pattern, a
    grammar)."""

    kind: str
    data: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"guidance kind must be one of {', '.join(KINDS)}, not {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> Guidance:
        """An answer that parses as JSON and validates against `schema` (a dict, True, or its JSON text)."""
        if isinstance(schema, str):
            schema = json.loads(schema)
        return cls("json_schema", json.dumps(with_json_layout(schema)))

    @classmethod
    def json_object(cls) -> Guidance:
        """Any JSON object."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Guidance:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Guidance:
        """A Lark grammar in llguidance's dialect (``start`` is the answer; ``%json {schema}`` embeds a schema)."""
        return cls("lark_grammar", grammar)


def with_json_layout(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """`schema` with the fixed JSON layout unless it sets llguidance options itself."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    if GUIDANCE_OPTIONS in schema:
        return schema
    return {**schema, GUIDANCE_OPTIONS: dict(JSON_LAYOUT)}


def tool_call_grammar(open_id: int, close_id: int, functions: Sequence[tuple[str, dict[str, Any]]],
                      single: bool) -> Guidance:
    """The grammar of a call block naming only `functions` ((name, parameters schema) pairs), whose arguments
    validate against the function's schema: ``<|tool_call|>[call, call...]<|/tool_call|>`` by token id (the markers are
    one token each), one call when `single`, else up to MAX_CALLS."""
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    rules = []
    for i, (name, parameters) in enumerate(functions):
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"call_{i}: %json {json.dumps(with_json_layout(schema))}")
    calls = '"[" call "]"' if single else f'"[" call (", " call){{0,{MAX_CALLS - 1}}} "]"'
    lines = [f"start: <[{open_id}]> {calls} <[{close_id}]>",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions))), *rules]
    return Guidance.lark("\n".join(lines))
