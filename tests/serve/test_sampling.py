"""temperature, top_p and seed through the server, with the OpenAI API's meaning (runtime.Sampling): every answer is
compared with a Chat of its own sampling the same way, and a seed gives one answer whether the server kept the
conversation or not."""

from __future__ import annotations

import pytest

from builder_plugin.runtime import Sampling
from tests.support.serving import ask_chat, ask_server, running_server, user

QUESTION = "Tell me a story about a lighthouse."
TOKENS = 10


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_seeds_and_temperature(server, chat, stream):
    client = server.client()
    answers = {}
    for seed in (1, 2, 1):
        got = ask_server(client, [user(QUESTION)], stream=stream, max_tokens=TOKENS, temperature=0.8, seed=seed)
        assert got == ask_chat(chat, [(QUESTION, (), ())], max_new_tokens=TOKENS,
                               sampling=Sampling(temperature=0.8, seed=seed))[0]
        assert answers.setdefault(seed, got.text) == got.text  # the same seed, the same answer
    assert answers[1] != answers[2]
    greedy = ask_chat(chat, [(QUESTION, (), ())], max_new_tokens=TOKENS)[0]
    assert greedy.text not in answers.values()
    for params in ({"temperature": 0}, {"temperature": 0, "top_p": 0.5, "seed": 4}, {}):
        assert ask_server(client, [user(QUESTION)], stream=stream, max_tokens=TOKENS, **params) == greedy
    got = ask_server(client, [user(QUESTION)], stream=stream, max_tokens=TOKENS, top_p=0.4, seed=3)
    assert got == ask_chat(chat, [(QUESTION, (), ())], max_new_tokens=TOKENS, sampling=Sampling(top_p=0.4, seed=3))[0]


def test_a_seed_gives_one_answer_whether_the_conversation_was_kept_or_not(served, chat):
    """The follow-up is answered in the conversation the server kept, then again after another conversation took its
    place (max_conversations 1): the same answer both times, and the one a Chat asked the same questions gives."""
    served.gate.set()
    first, follow_up = QUESTION, "What happened next?"
    params = {"max_tokens": TOKENS, "temperature": 1.0, "top_p": 0.9, "seed": 21}
    chat.clear()
    chat.system = chat.tools = None
    answer = "".join(chat.ask(first, max_new_tokens=6))
    expected = "".join(chat.ask(follow_up, max_new_tokens=TOKENS, sampling=Sampling(1.0, 0.9, None, 21)))
    with running_server(served, max_conversations=1) as running:
        client = running.client()
        assert ask_server(client, [user(first)], max_tokens=6).text == answer
        messages = [user(first), {"role": "assistant", "content": answer}, user(follow_up)]
        kept = ask_server(client, messages, **params)
        ask_server(client, [user("Something else entirely.")])  # the kept conversation is released
        again = ask_server(client, messages, **params)
    assert kept.text == again.text == expected
    assert kept.prompt_tokens == again.prompt_tokens == chat.last_stats.prompt_tokens
