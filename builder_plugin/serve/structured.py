"""``response_format``: plain text, any JSON object, or JSON that validates against a schema, enforced by the
runtime's guidance on every token (runtime.guidance fixes the JSON layout, so the model cannot pad it with blanks)."""

from __future__ import annotations

from typing import Any

from builder_plugin.runtime import Guidance
from builder_plugin.serve.errors import ApiError

TYPES = ("text", "json_object", "json_schema")


def response_guidance(response_format: Any) -> Guidance | None:
    """The guidance of a request's response_format (None: plain text); raises ApiError (400) naming the problem."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ApiError("response_format: must be an object with a 'type'", param="response_format")
    kind = response_format.get("type")
    if kind not in TYPES:
        raise ApiError(f"response_format.type: {kind!r} is not supported (use {', '.join(TYPES)})",
                       param="response_format.type")
    unknown = set(response_format) - {"type", "json_schema"}
    if unknown or (kind != "json_schema" and "json_schema" in response_format):
        field = sorted(unknown)[0] if unknown else "json_schema"
        raise ApiError(f"response_format.{field}: not a field of a {kind!r} response format",
                       param=f"response_format.{field}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guidance.json_object()
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError("response_format.json_schema: must be an object with 'name' and 'schema'",
                       param="response_format.json_schema")
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise ApiError(f"response_format.json_schema.{sorted(unknown)[0]}: unknown field",
                       param="response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ApiError("response_format.json_schema.name: required", param="response_format.json_schema.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError("response_format.json_schema.schema: must be a JSON schema object",
                       param="response_format.json_schema.schema")
    return Guidance.json_schema(schema)  # strict or not, the schema is always enforced
