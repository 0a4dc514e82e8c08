"""/v1/responses on the tiny package, called with the official openai client (client.responses.create / .stream /
.parse): every answer is compared with a Chat run independently on the same package."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from builder_plugin.runtime import tool_results
from builder_plugin.serve.tools import parse_tools
from tests.support.serving import (
    AUDIO,
    CALLS,
    GUIDED,
    IMAGE,
    SHORT,
    TOOLS,
    ask_chat,
    b64,
    guided_chat,
    running_server,
    user,
)

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat form
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _content(text: str, images: tuple[Path, ...] = (), audios: tuple[Path, ...] = ()) -> list[dict]:
    parts = [{"type": "input_image", "image_url": f"data:image/png;base64,{b64(p.read_bytes())}", "detail": "auto"}
             for p in images]
    parts += [{"type": "input_audio", "input_audio": {"data": b64(p.read_bytes()), "format": "wav"}} for p in audios]
    return [*parts, {"type": "input_text", "text": text}]


def _streamed(client: openai.OpenAI, **params):
    """The events of a streamed response, checked for order and numbering, and the final response they carry."""
    events = list(client.responses.create(model=_model(client), stream=True, **params))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == EVENTS[:2] and events[-1].type in ("response.completed",
                                                                                "response.incomplete")
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    return events, events[-1].response


@pytest.mark.parametrize(("images", "audios"), [((), ()), ((IMAGE,), (AUDIO,))], ids=["text", "image+audio"])
def test_answer_equals_chat(server, chat, media_dir, images, audios):
    client = server.client()
    images, audios = tuple(media_dir / n for n in images), tuple(media_dir / n for n in audios)
    question = "Describe what you get."
    expected = ask_chat(chat, [(question, images, audios)], system="You are a tester.")[0]
    user_input = [{"role": "user", "content": _content(question, images, audios)}]
    response = client.responses.create(model=_model(client), instructions="You are a tester.", input=user_input,
                                       max_output_tokens=SHORT)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == expected.text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (expected.prompt_tokens,
                                                                            expected.completion_tokens)
    assert response.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    events, final = _streamed(client, instructions="You are a tester.", input=user_input, max_output_tokens=SHORT)
    assert [e.type for e in events[:4]] == EVENTS
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected.text and final.output_text == expected.text
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.incomplete"]
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.input_tokens == expected.prompt_tokens


def test_low_detail_is_the_chat_endpoints(server, media_dir, tmp_path):
    """input_image.detail reaches the image as the chat endpoint's image_url.detail does."""
    from PIL import Image
    from skimage import data as photographs

    photo = tmp_path / "photo.png"
    Image.fromarray(photographs.astronaut()).resize((900, 600)).save(photo)
    client = server.client()
    url = f"data:image/png;base64,{b64(photo.read_bytes())}"
    model = _model(client)
    for detail in ("low", "high"):
        response = client.responses.create(model=model, max_output_tokens=SHORT, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url, "detail": detail}, {"type": "input_text", "text": "What?"}]}])
        chat = client.chat.completions.create(model=model, max_tokens=SHORT, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": detail}}, {"type": "text", "text": "What?"}]}])
        assert response.output_text == chat.choices[0].message.content, detail
        assert response.usage.input_tokens == chat.usage.prompt_tokens, detail


def test_output_items_sent_back_as_the_client_got_them(server):
    """A response's output items go back as the openai client holds them (its objects, or their model_dump with
    every field): the same answer as their text sent as an assistant message."""
    client = server.client()
    model = _model(client)
    first = client.responses.create(model=model, input="Hi", max_output_tokens=SHORT, store=False)
    plain = client.responses.create(model=model, max_output_tokens=SHORT, store=False, input=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Tell me more."}])
    for sent_back in (first.output, [item.model_dump() for item in first.output]):
        again = client.responses.create(model=model, max_output_tokens=SHORT, store=False, input=[
            {"role": "user", "content": "Hi"}, *sent_back, {"role": "user", "content": "Tell me more."}])
        assert again.output_text == plain.output_text


def test_a_plain_string_input_and_sampling(server, chat):
    from builder_plugin.runtime import Sampling

    client = server.client()
    got = client.responses.create(model=_model(client), input="Hello!", max_output_tokens=8, temperature=0.9,
                                  top_p=0.8, extra_body={"seed": 3})
    expected = ask_chat(chat, [("Hello!", (), ())], max_new_tokens=8, sampling=Sampling(0.9, 0.8, None, 3))[0]
    assert got.output_text == expected.text and got.temperature == 0.9


def test_an_empty_tool_list_is_no_tools(server, chat):
    """Agent frameworks (openai-agents) send `tools: []` for an agent without tools, as the API allows: on both
    endpoints it answers as a request without tools."""
    client = server.client()
    expected = ask_chat(chat, [("Hello!", (), ())], max_new_tokens=8)[0]
    got = client.responses.create(model=_model(client), input="Hello!", max_output_tokens=8, tools=[],
                                  tool_choice="auto")
    assert got.output_text == expected.text
    chat_answer = client.chat.completions.create(model=_model(client), messages=[user("Hello!")], max_tokens=8,
                                                 tools=[])
    assert chat_answer.choices[0].message.content == expected.text


def test_previous_response_id_continues_the_conversation(server, served, tiny_package):
    """A response continued by id: the kept conversation (its turns and answer ids) is reused, and the answer is
    the one a Chat asked the same questions gives; instructions are not carried over. Unknown ids get a 404."""
    from builder_plugin.runtime import Chat

    client = server.client()
    reference = Chat(tiny_package)
    expected = ask_chat(reference, [("Hello!", (), ()), ("And then?", (), ())], system="Be brief.")
    first = client.responses.create(model=_model(client), instructions="Be brief.", input="Hello!",
                                    max_output_tokens=SHORT)
    assert first.output_text == expected[0].text
    second = client.responses.create(model=_model(client), instructions="Be brief.", input="And then?",
                                     previous_response_id=first.id, max_output_tokens=SHORT)
    assert second.output_text == expected[1].text and second.previous_response_id == first.id
    assert served.restores_unchanged[-1]  # the server's Chat held this conversation
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=_model(client), input="Hi", previous_response_id="resp_unknown")
    assert error.value.body["param"] == "previous_response_id" and "resp_unknown" in error.value.body["message"]
    unstored = client.responses.create(model=_model(client), input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=_model(client), input="Hi", previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_forgotten_responses(served):
    served.gate.set()
    with running_server(served, stored_responses=1) as running:
        client = running.client()
        first = client.responses.create(model=_model(client), input="One", max_output_tokens=2)
        client.responses.create(model=_model(client), input="Two", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError) as error:
            client.responses.create(model=_model(client), input="Three", previous_response_id=first.id)
        assert "previous_response_id" in error.value.body["message"]


def test_function_calls_and_their_outputs(server, chat, media_dir):
    """A required call (arguments valid for its schema), streamed with its events, then its output sent back as a
    function_call_output item: the answer is the one a Chat given the same call block and results gives."""
    import jsonschema

    client = server.client()
    image = media_dir / IMAGE
    question = [{"role": "user", "content": _content("What is the weather there?", (image,))}]
    first = client.responses.create(model=_model(client), instructions="You help.", input=question,
                                    tools=FUNCTIONS, tool_choice="required", max_output_tokens=CALLS)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls and all(item.type == "function_call" for item in first.output)
    schemas = {t["name"]: t["parameters"] for t in FUNCTIONS}
    for call in calls:
        assert call.call_id.startswith("call_") and call.name in schemas
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    events, final = _streamed(client, instructions="You help.", input=question, tools=FUNCTIONS,
                              tool_choice="required", max_output_tokens=CALLS)
    streamed = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in streamed] == [(c.name, c.arguments) for c in calls]
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in calls]
    with client.responses.stream(model=_model(client), instructions="You help.", input=question, tools=FUNCTIONS,
                                 tool_choice="required", max_output_tokens=CALLS) as stream:
        assert [c.arguments for c in stream.get_final_response().output] == [c.arguments for c in calls]
    results = [json.dumps({"result": 21 + i}) for i in range(len(calls))]
    follow_up = [*question, *[c.model_dump(exclude_none=True) for c in calls],
                 *[{"type": "function_call_output", "call_id": c.call_id, "output": r} for c, r in zip(calls, results)]]
    second = client.responses.create(model=_model(client), instructions="You help.", input=follow_up,
                                     tools=FUNCTIONS, max_output_tokens=SHORT)
    chained = client.responses.create(model=_model(client), instructions="You help.", previous_response_id=first.id,
                                      input=follow_up[len(question) + len(calls):], tools=FUNCTIONS,
                                      max_output_tokens=SHORT)
    # the same conversation in a Chat of its own
    chat.clear()
    chat.system, chat.tools = "You help.", parse_tools(TOOLS, "required", None).text
    functions = [(t["name"], t["parameters"]) for t in FUNCTIONS]
    block = "".join(chat.ask("What is the weather there?", (image,), max_new_tokens=CALLS,
                             guidance=chat.tool_guidance(functions, single=False)))
    listed = json.loads(block[block.index("["):block.rindex("]") + 1])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(i["name"], i["arguments"]) for i in listed]
    answer = "".join(chat.ask(tool_results(results), max_new_tokens=SHORT, role="tool"))
    for got in (second, chained):
        if any(item.type == "function_call" for item in got.output):  # random weights: a call or text
            assert answer.startswith("<|tool_call|>")
        else:
            assert got.output_text == answer


def test_json_schema_format(server, chat):
    import jsonschema

    from builder_plugin.runtime import Guidance

    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "rain"]},
                                               "degrees": {"type": "integer", "minimum": -50, "maximum": 50}},
              "required": ["sky", "degrees"], "additionalProperties": False}
    client = server.client()
    text = {"format": {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}}
    response = client.responses.create(model=_model(client), input="The forecast, please.", text=text,
                                       max_output_tokens=GUIDED)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.output_text == guided_chat(chat, "The forecast, please.", Guidance.json_schema(schema))
    with client.responses.stream(model=_model(client), input="The forecast, please.", text=text,
                                 max_output_tokens=GUIDED) as stream:
        assert stream.get_final_response().output_text == response.output_text
    plain = client.responses.create(model=_model(client), input="Hi", text={"format": {"type": "json_object"}},
                                    max_output_tokens=GUIDED)
    assert plain.output_text == guided_chat(chat, "Hi", Guidance.json_object())


def test_refused_by_name(server):
    client = server.client()
    model = _model(client)
    image = {"type": "input_image", "file_id": "file-123", "detail": "auto"}
    for params, named in (
            ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
            ({"input": [{"role": "user", "content": [image]}]}, "input[0].content[0].file_id"),
            ({"input": [{"role": "user", "content": "Hi", "name": "ann"}]}, "input[0].name"),
            ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi", "cache": 1}]}]},
             "input[0].content[0].cache"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "caller": "me"}]},
             "input[0].caller"),
            ({"input": [{"role": "user", "content": [{**image, "file_id": None, "image_url": "data:,",
                                                      "detail": "x"}]}]}, "input[0].content[0].detail"),
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
             "input[0].content[0].type"),
            ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
            ({"reasoning": {"effort": "high"}}, "reasoning"), ({"background": True}, "background"),
            ({"truncation": "auto"}, "truncation"), ({"include": ["message.output_text.logprobs"]}, "include"),
            ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
            ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
            ({"conversation": "conv_1"}, "conversation"), ({"max_output_tokens": 0}, "max_output_tokens"),
            ({"input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}, "input")):
        params.setdefault("input", "Hi")
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=model, **params)
        assert error.value.body["param"] == named, (params, error.value.body)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input="x" * 40000, max_output_tokens=2)
    assert error.value.body["code"] == "context_length_exceeded" and error.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="another", input="Hi")
    response = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", "unheard_of": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "unheard_of"



def test_a_failure_after_the_answer_started(served):
    """An answer that fails midway ends its stream with an error event and response.failed; a JSON answer gets the
    error object."""
    from builder_plugin.runtime import ChatError

    served.failure = ChatError  # the answers fail after their first piece
    try:
        with running_server(served) as running:
            client = running.client()
            events = list(client.responses.create(model=_model(client), input="Hi", stream=True,
                                                  max_output_tokens=SHORT))
            assert [e.type for e in events[:2]] == EVENTS[:2]
            error, failed = events[-2:]
            assert error.type == "error" and error.message == "the model failed on purpose"
            assert failed.type == "response.failed" and failed.response.status == "failed"
            assert failed.response.error.message == "the model failed on purpose"
            with pytest.raises(openai.BadRequestError, match="the model failed on purpose"):
                client.responses.create(model=_model(client), input="Hi", max_output_tokens=SHORT)
    finally:
        served.failure = None
