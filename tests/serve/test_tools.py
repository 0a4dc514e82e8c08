"""builder_plugin.serve.tools: tool calls through the server, in the model's format and the OpenAI one."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.serving import (
    AUDIO,
    CALLS,
    IMAGE,
    SHORT,
    TOOLS,
    create,
    running_server,
    user,
)


def _check_calls(calls, names: set[str]) -> None:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_tool_calls(server):
    client = server.client()
    question = [user("What is the weather in Paris, and the time in Tokyo?")]
    required = create(client, question, tools=TOOLS, tool_choice="required", max_tokens=CALLS).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    _check_calls(required.message.tool_calls, {"get_weather", "get_time"})
    named = create(client, question, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_calls(calls, {"get_time"})
    single = create(client, question, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(single.message.tool_calls) == 1
    _check_calls(single.message.tool_calls, {"get_weather", "get_time"})
    # streamed: the client reassembles the tool_calls deltas into the same calls
    with client.chat.completions.stream(model=client.models.list().data[0].id, messages=question, tools=TOOLS,
                                        tool_choice="required", max_tokens=CALLS) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in required.message.tool_calls]
    # auto: random weights answer noise, so only the shape can be checked: text, or calls of the offered tools
    auto = create(client, question, tools=TOOLS, max_tokens=SHORT).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    if auto.message.tool_calls:
        _check_calls(auto.message.tool_calls, {"get_weather", "get_time"})
    else:
        assert isinstance(auto.message.content, str)
    # none: the tools are left out of the prompt, so the answer is the plain one
    none = create(client, question, tools=TOOLS, tool_choice="none", max_tokens=SHORT).choices[0]
    plain = create(client, question, max_tokens=SHORT).choices[0]
    assert none.message.content == plain.message.content and none.message.tool_calls is None


def test_a_call_cut_by_max_tokens_ends_with_length(server):
    """A call block cut by the token limit is neither content nor a call: finish_reason "length", no markup, and the
    client raises its own length error."""
    client = server.client()
    question = [user("What is the weather in Paris?")]
    for tokens in (1, 5):
        cut = create(client, question, tools=TOOLS, tool_choice="required", max_tokens=tokens).choices[0]
        assert (cut.finish_reason, cut.message.content, cut.message.tool_calls) == ("length", "", None)
        chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=question,
                                                     tools=TOOLS, tool_choice="required", max_tokens=tokens,
                                                     stream=True))
        assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert all(not c.choices[0].delta.content and not c.choices[0].delta.tool_calls for c in chunks)
    with pytest.raises(openai.LengthFinishReasonError), \
            client.chat.completions.stream(model=client.models.list().data[0].id, messages=question, tools=TOOLS,
                                           tool_choice="required", max_tokens=5) as stream:
        stream.get_final_completion()


def test_tool_loop_with_an_image_and_audio(server, served, chat, media_dir):
    """Question with media -> a call -> its result -> the answer, each request re-sending the conversation. The
    assistant's tool_calls are fed back as the call block the model wrote: the server's Chat finds the
    conversation it holds."""
    from builder_plugin.runtime import tool_results
    from builder_plugin.serve.tools import parse_tools

    client = server.client()
    image, audio = media_dir / IMAGE, media_dir / AUDIO
    messages = [{"role": "system", "content": "You help."}, user("What is the weather there?", (image,), (audio,))]
    first = create(client, messages, tools=TOOLS, tool_choice="required", max_tokens=CALLS).choices[0]
    assert first.finish_reason == "tool_calls"
    _check_calls(first.message.tool_calls, {"get_weather", "get_time"})
    messages.append(first.message.model_dump(exclude_none=True))
    results = [json.dumps({"result": 21 + i}) for i in range(len(first.message.tool_calls))]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": result}
                 for call, result in zip(first.message.tool_calls, results)]
    second = create(client, messages, tools=TOOLS, max_tokens=SHORT).choices[0]
    assert served.restores_unchanged[-1]  # the rebuilt history is the conversation the server holds
    # the same conversation in a Chat of its own
    chat.clear()
    chat.system, chat.tools = "You help.", parse_tools(TOOLS, "required", None).text
    functions = [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    call = "".join(chat.ask("What is the weather there?", (image,), (audio,), max_new_tokens=CALLS,
                            guidance=chat.tool_guidance(functions, single=False)))
    listed = json.loads(call[call.index("["):call.rindex("]") + 1])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == \
        [(item["name"], item["arguments"]) for item in listed]
    answer = "".join(chat.ask(tool_results(results), max_new_tokens=SHORT, role="tool"))
    if second.message.tool_calls:  # random weights: a call or text, whichever the model made
        assert second.finish_reason == "tool_calls" and answer.startswith("<|tool_call|>")
    else:
        assert second.message.content == answer


def test_tools_on_a_package_without_tool_tokens(package, tmp_path):
    folder = tmp_path / "no-tools"
    folder.mkdir()
    for path in package.iterdir():
        if path.name not in ("tokenizer.json", "tokenizer_config.json"):
            (folder / path.name).symlink_to(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (package / name).read_text(encoding="utf-8")
        (folder / name).write_text(text.replace("<|tool_call|>", "<|no_call|>").replace("<|/tool_call|>",
                                                                                        "<|/no_call|>"))
    with running_server(folder) as no_tools:
        with pytest.raises(openai.BadRequestError) as caught:
            create(no_tools.client(), [user("Hi")], tools=TOOLS)
        assert caught.value.code == "tools_not_supported" and caught.value.param == "tools"
        assert "no tool-call tokens" in caught.value.message and "\n" not in caught.value.message
