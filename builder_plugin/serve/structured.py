"""``response_format``: plain text, any JSON object, or JSON that validates against a schema, enforced by the
runtime's guidance on every token (runtime.guidance fixes the JSON layout, so the model cannot pad it with blanks)."""

from __future__ import annotations

from typing import Any

from builder_plugin.runtime import Guidance
from builder_plugin.serve.errors import ApiError

TYPES = ("text", "json_object", "json_schema")


def response_guidance(response_format: Any, field: str = "response_format", flat: bool = False) -> Guidance | None:
    """The guidance of a request's response_format (None: plain text); raises ApiError (400) naming the problem.
    `flat`: the Responses API's ``text.format``, which holds the schema's name and schema itself (`field` names it)
    where chat's response_format holds them in ``json_schema``."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ApiError(f"{field}: must be an object with a 'type'", param=field)
    kind = response_format.get("type")
    if kind not in TYPES:
        raise ApiError(f"{field}.type: {kind!r} is not supported (use {', '.join(TYPES)})", param=f"{field}.type")
    if kind == "json_schema":
        spec, where = (response_format, field) if flat else (response_format.get("json_schema"), f"{field}.json_schema")
        unknown = sorted(set(response_format) - {"type", "json_schema"}) if not flat else []
        if unknown:
            raise ApiError(f"{field}.{unknown[0]}: not a field of a 'json_schema' response format",
                           param=f"{field}.{unknown[0]}")
        return _schema(spec, where, {"type"} if flat else set())
    if set(response_format) != {"type"}:
        other = sorted(set(response_format) - {"type"})[0]
        raise ApiError(f"{field}.{other}: not a field of a {kind!r} response format", param=f"{field}.{other}")
    return Guidance.json_object() if kind == "json_object" else None


def _schema(spec: Any, where: str, also: set[str]) -> Guidance:
    if not isinstance(spec, dict):
        raise ApiError(f"{where}: must be an object with 'name' and 'schema'", param=where)
    unknown = set(spec) - {"name", "description", "schema", "strict"} - also
    if unknown:
        raise ApiError(f"{where}.{sorted(unknown)[0]}: unknown field", param=where)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ApiError(f"{where}.name: required", param=f"{where}.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError(f"{where}.schema: must be a JSON schema object", param=f"{where}.schema")
    return Guidance.json_schema(schema)  # strict or not, the schema is always enforced
