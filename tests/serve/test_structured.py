"""Structured output (response_format) and log-probabilities through the server, against Chat's."""

from __future__ import annotations

import json

import pytest

from tests.support.serving import (
    GUIDED,
    IMAGE,
    SHORT,
    ask_chat,
    ask_server,
    create,
    guided_chat,
    user,
)


def test_parse_with_a_pydantic_model(server):
    from typing import Literal

    import jsonschema
    import pydantic

    class Forecast(pydantic.BaseModel):
        sky: Literal["clear", "cloudy", "rain"]
        degrees: int = pydantic.Field(ge=-50, le=50)
        note: str = pydantic.Field(max_length=10)

    client = server.client()
    completion = client.chat.completions.parse(model=client.models.list().data[0].id, response_format=Forecast,
                                               messages=[user("The forecast for tomorrow, please.")],
                                               max_tokens=GUIDED)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Forecast)
    jsonschema.validate(json.loads(choice.message.content), Forecast.model_json_schema())
    # the layout is fixed (json.dumps's), not left to the model
    assert choice.message.content == json.dumps(json.loads(choice.message.content), ensure_ascii=False)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_json_schema_answer_with_an_image(server, chat, media_dir, stream):
    import jsonschema

    from builder_plugin.runtime import Guidance

    schema = {"type": "object", "properties": {"objects": {"type": "array", "maxItems": 3, "items": {
        "enum": ["circle", "square", "triangle"]}}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["objects", "count"], "additionalProperties": False}
    image = media_dir / IMAGE
    response_format = {"type": "json_schema", "json_schema": {"name": "shapes", "schema": schema, "strict": True}}
    got = ask_server(server.client(), [user("Which shapes are in the picture?", (image,))], stream=stream,
                     max_tokens=GUIDED, response_format=response_format)
    jsonschema.validate(json.loads(got.text), schema)
    assert got.finish_reason == "stop"
    assert got.text == guided_chat(chat, "Which shapes are in the picture?", Guidance.json_schema(schema), (image,))
    # an answer cut by max_tokens says so (and is then not whole JSON)
    cut = ask_server(server.client(), [user("Which shapes are in the picture?", (image,))], stream=stream,
                     max_tokens=3, response_format=response_format)
    assert cut.finish_reason == "length" and got.text.startswith(cut.text) and len(cut.text) < len(got.text)
    # json_object: any object
    whole = ask_server(server.client(), [user("JSON!")], stream=stream, response_format={"type": "json_object"},
                       max_tokens=GUIDED)
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.text), dict)
    text = ask_server(server.client(), [user("Hello!")], stream=stream, response_format={"type": "text"})
    assert text == ask_chat(chat, [("Hello!", (), ())])[0]


@pytest.fixture(scope="module")
def hf_tokenizer(package):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(package)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("guided", [False, True], ids=["free", "json_object"])
def test_logprobs_equal_chats(server, chat, hf_tokenizer, stream, guided):
    """The reported log-probabilities are the log-softmax of the logits Chat kept for each token (with guidance, of
    the logits the runtime masked), the alternatives the most likely of them."""
    import numpy as np

    from builder_plugin.runtime import Guidance

    top = 5
    params = {"response_format": {"type": "json_object"}} if guided else {}
    client = server.client()
    if stream:
        chunks = list(create(client, [user("Hello!")], max_tokens=SHORT, logprobs=True, top_logprobs=top,
                              stream=True, **params))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = create(client, [user("Hello!")], max_tokens=SHORT, logprobs=True, top_logprobs=top,
                          **params).choices[0].logprobs.content
    chat.keep_logits = True
    try:
        guided_chat(chat, "Hello!", Guidance.json_object() if guided else None, max_new_tokens=SHORT)
    finally:
        chat.keep_logits = False
    ids = chat.turns[-1].answer_ids  # the end of the answer (its last logits) gets no entry
    assert len(content) == len(ids) > 0
    for entry, token_id, logits in zip(content, ids, chat.last_logits):
        values = np.asarray(logits, np.float64)
        expected = values - values.max() - np.log(np.exp(values - values.max()).sum())
        assert entry.logprob == pytest.approx(max(expected[token_id], -9999.0), abs=1e-4)
        assert entry.token == hf_tokenizer.decode([token_id]) and entry.token == bytes(entry.bytes).decode(
            "utf-8", errors="replace")
        assert len(entry.top_logprobs) == top
        best = np.argsort(-expected, kind="stable")[:top]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(np.maximum(expected[best], -9999.0),
                                                                         abs=1e-4)
        assert [a.token for a in entry.top_logprobs][:1] == [hf_tokenizer.decode([int(best[0])])]
