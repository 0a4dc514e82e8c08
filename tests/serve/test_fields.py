"""builder_plugin.serve.fields: every chat-completions request field is honoured, informational or refused."""

from __future__ import annotations

from pathlib import Path


def test_every_openai_request_field_is_handled():
    """Each field of the official client's chat-completions request is honoured, informational or refused unless
    neutral, and the README lists it."""
    from openai.types.chat import completion_create_params

    from builder_plugin.serve import fields

    names = set(completion_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    handled = set(fields.HONOURED) | set(fields.INFORMATIONAL) | set(fields.NEUTRAL)
    assert names - handled == set()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert [name for name in sorted(handled) if f"| `{name}` |" not in readme] == []
