"""/v1/completions on the tiny package, called with the official openai client: every answer is compared with
Chat.generate (the same prompt as written, no chat template) run independently on the same package."""

from __future__ import annotations

import openai
import pytest

from builder_plugin.runtime import Chat, Sampling
from tests.support.serving import ask_chat, ask_server, user

PROMPT = "Once upon a time, in a lighthouse by the sea,"


def _complete(client: openai.OpenAI, stream: bool, **params):
    """(text, finish_reason, prompt_tokens, completion_tokens, logprobs) of a completion."""
    model = client.models.list().data[0].id
    params.setdefault("prompt", PROMPT)
    if not stream:
        response = client.completions.create(model=model, **params)
        choice = response.choices[0]
        assert response.object == "text_completion" and response.id.startswith("cmpl-")
        return (choice.text, choice.finish_reason, response.usage.prompt_tokens, response.usage.completion_tokens,
                choice.logprobs)
    chunks = list(client.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                            **params))
    *pieces, final, usage = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in pieces) and final.choices[0].finish_reason
    assert usage.choices == []
    text = "".join(c.choices[0].text for c in pieces)
    logprobs = None
    if params.get("logprobs") is not None:
        logprobs = {key: [v for c in pieces for v in getattr(c.choices[0].logprobs, key)]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    return text, final.choices[0].finish_reason, usage.usage.prompt_tokens, usage.usage.completion_tokens, logprobs


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_completion_equals_generate(server, chat, stream):
    client = server.client()
    for params, tokens in (({"max_tokens": 8}, 8), ({}, 16)):  # 16: the API's default max_tokens
        expected = chat.generate(PROMPT, max_new_tokens=tokens)
        stats = expected.stats
        got = _complete(client, stream, **params)
        assert got[:4] == (expected.text, stats.finish_reason, stats.prompt_tokens, stats.new_tokens)
    sampled = chat.generate(PROMPT, max_new_tokens=8, sampling=Sampling(temperature=0.9, seed=4))
    assert _complete(client, stream, max_tokens=8, temperature=0.9, seed=4)[0] == sampled.text
    echoed = _complete(client, stream, max_tokens=8, echo=True)
    assert echoed[0] == PROMPT + chat.generate(PROMPT, max_new_tokens=8).text
    assert _complete(client, stream, prompt=[PROMPT], max_tokens=8)[0] == chat.generate(PROMPT, max_new_tokens=8).text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_logprobs_and_stop(server, chat, stream):
    client = server.client()
    answer = chat.prepare_prompt(PROMPT, max_new_tokens=8, logprobs=3)
    steps = list(answer)
    expected = [step.logprob for step in steps if step.logprob is not None]
    got = _complete(client, stream, max_tokens=8, logprobs=3)
    logprobs = got[4] if stream else got[4].model_dump()
    assert logprobs["tokens"] == [e.chosen.token for e in expected]
    assert logprobs["token_logprobs"] == [e.chosen.logprob for e in expected]
    assert logprobs["top_logprobs"] == [{a.token: a.logprob for a in e.top} for e in expected]
    offsets = [sum(len(e.chosen.token) for e in expected[:i]) for i in range(len(expected))]
    assert logprobs["text_offset"] == offsets
    text = "".join(step.text for step in steps)
    stop = text[3:6]
    cut = _complete(client, stream, max_tokens=8, stop=[stop])
    assert (cut[0], cut[1]) == (text[:text.index(stop)], "stop")


def test_refused_fields(server):
    client = server.client()
    model = client.models.list().data[0].id
    for params, named in (({"prompt": [PROMPT, PROMPT]}, "prompt"), ({"prompt": [[1, 2, 3]]}, "prompt"),
                          ({"prompt": ""}, "prompt"), ({"echo": True, "logprobs": 1}, "logprobs"),
                          ({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"), ({"n": 2}, "n"),
                          ({"presence_penalty": 0.5}, "presence_penalty"), ({"logprobs": 21}, "logprobs"),
                          ({"max_tokens": 0}, "max_tokens")):
        params.setdefault("prompt", PROMPT)
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=model, **params)
        assert error.value.body["param"] == named and error.value.body["message"].startswith(named), params
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="x" * 40000, max_tokens=2)
    assert error.value.body["code"] == "context_length_exceeded" and error.value.body["param"] == "prompt"


def test_a_completion_between_chat_turns(server, tiny_package):
    """A completion takes turns with chat requests through the worker; a conversation asked around it is answered
    as a fresh Chat answers it."""
    client = server.client()
    reference = Chat(tiny_package)
    first = ask_server(client, [user("Hello!")])
    _complete(client, False, max_tokens=4)
    expected = ask_chat(reference, [("Hello!", (), ()), ("And then?", (), ())])
    assert first == expected[0]
    follow_up = [user("Hello!"), {"role": "assistant", "content": first.text}, user("And then?")]
    assert ask_server(client, follow_up) == expected[1]
