"""builder_plugin.serve.fields: every request field of each endpoint is honoured, informational or refused, and
docs/serving.md lists it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from builder_plugin.serve import fields

SERVING = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def _listed(heading: str) -> set[str]:
    """The names in the first cell of every table row of docs/serving.md's section `heading`."""
    text = SERVING.read_text(encoding="utf-8")
    section = text[text.index(f"\n## {heading}\n"):]
    section = section[:section.find("\n## ", 1)]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+)`", line.split(" | ")[0]))
    return names


@pytest.mark.parametrize(("table", "params", "heading"), [
    (fields.CHAT, "openai.types.chat.completion_create_params", "Chat-completions fields"),
    (fields.RESPONSES, "openai.types.responses.response_create_params", "Responses API"),
    (fields.COMPLETIONS, "openai.types.completion_create_params", "Completions"),
], ids=["chat", "responses", "completions"])
def test_every_openai_request_field_is_handled(table, params, heading):
    """Each field of the official client's request is honoured, informational or refused unless neutral, and the
    docs list it."""
    import importlib

    module = importlib.import_module(params)
    base = next(getattr(module, name) for name in dir(module) if name.endswith("CreateParamsBase"))
    names = set(base.__annotations__) | {"stream"}
    assert names - table.names == set()
    assert sorted(table.names - _listed(heading)) == []
