"""The server with several users: answers taking turns, kept conversations (reused, rewound, released under the KV
budget) and the drain at a stop signal. Every answer is compared with a Chat run independently on the same package."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from builder_plugin.runtime import FOLLOW_UP_ROOM
from tests.support.serving import IMAGE, ask_chat, ask_server, running_server, user

LONG = 400  # tokens of the long answer: ~2 s on the tiny package, against a few ms for a short one


def _slot_of(routes, messages: list[dict]):
    """The kept conversation holding `messages` plus the answer to the last one."""
    questions = sum(m["role"] == "user" for m in messages)
    slots = [s for s in routes.pool.slots if len(s.chat.turns) == questions and s.holds_generator]
    return max(slots, key=lambda s: s.used)


def test_a_short_request_is_answered_while_a_long_answer_streams(served, chat, tmp_path):
    with running_server(served, tmp_path) as running:
        client = running.client()
        model = client.models.list().data[0].id
        long_pieces: list[str] = []
        done = threading.Event()

        def stream_long() -> None:
            stream = client.chat.completions.create(model=model, messages=[user("Talk for a long time.")],
                                                    max_tokens=LONG, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    long_pieces.append(chunk.choices[0].delta.content)
                if chunk.choices and chunk.choices[0].finish_reason:
                    long_pieces.append(f"<finish {chunk.choices[0].finish_reason}>")
            done.set()

        thread = threading.Thread(target=stream_long)
        thread.start()
        deadline = time.monotonic() + 20
        while len(long_pieces) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        short = ask_server(client, [user("Hello!")])
        assert not done.is_set(), "the short request waited for the whole long answer"
        thread.join(timeout=60)
    assert short == ask_chat(chat, [("Hello!", (), ())])[0]
    want = ask_chat(chat, [("Talk for a long time.", (), ())], max_new_tokens=LONG)[0]
    assert want.finish_reason == "length"  # the long answer was long
    assert "".join(long_pieces) == want.text + "<finish length>"


def test_conversations_taking_turns_keep_their_caches(served, chat, media_dir, tmp_path):
    """Three users ask in turns (one with an image); each follow-up prefills only its own question."""
    scripts = {"a": [("What is in this picture?", (media_dir / IMAGE,), ()), ("Tell me more.", (), ()),
                     ("And now?", (), ())],
               "b": [("Hello!", (), ()), ("How are you?", (), ()), ("Bye.", (), ())],
               "c": [("Count.", (), ()), ("Go on.", (), ()), ("Stop.", (), ())]}
    expected = {name: ask_chat(chat, questions) for name, questions in scripts.items()}
    messages: dict[str, list[dict]] = {name: [] for name in scripts}
    with running_server(served, tmp_path, max_conversations=3) as running:
        client = running.client()
        for turn in range(3):
            for name, questions in scripts.items():
                text, images, audios = questions[turn]
                messages[name].append(user(text, images, audios))
                got = ask_server(client, messages[name])
                assert got == expected[name][turn], (name, turn)
                stats = _slot_of(running.routes, messages[name]).chat.last_stats
                if turn:
                    assert stats.reused_tokens > 0 and stats.prefill_tokens < 20, (name, turn, stats)
                messages[name].append({"role": "assistant", "content": got.text})
        assert running.routes.pool.live_conversations == 3


def test_the_least_recently_used_conversation_is_released_under_the_budget(served, chat, tmp_path):
    per_generator = served.package.kv_bytes_per_token * (FOLLOW_UP_ROOM + 64)  # a short conversation's generator
    budget = int(2.5 * per_generator)
    scripts = {name: [(f"Hello from {name}.", (), ()), ("And then?", (), ())] for name in "abc"}
    expected = {name: ask_chat(chat, questions) for name, questions in scripts.items()}
    with running_server(served, tmp_path, max_conversations=3, kv_budget_bytes=budget) as running:
        client, pool = running.client(), running.routes.pool
        messages = {name: [user(questions[0][0])] for name, questions in scripts.items()}
        for name in "abc":
            answer = ask_server(client, messages[name])
            assert answer == expected[name][0]
            messages[name] += [{"role": "assistant", "content": answer.text}, user("And then?")]
            assert pool.kv_bytes <= budget
        assert pool.live_conversations == 2  # a's was released when c's generator was made
        for name in "cab":
            assert ask_server(client, messages[name]) == expected[name][1]
            stats = _slot_of(running.routes, messages[name]).chat.last_stats
            assert (stats.reused_tokens > 0) == (name == "c"), name  # b's went when a's came back
            assert pool.kv_bytes <= budget


def test_an_edited_question_and_a_regenerated_answer_rewind_the_kept_conversation(served, chat, media_dir, tmp_path):
    image = (media_dir / IMAGE,)
    first = [user("What is in this picture?", image)]
    with running_server(served, tmp_path) as running:
        client = running.client()
        answer = ask_server(client, first)
        assert answer == ask_chat(chat, [("What is in this picture?", image, ())])[0]
        asked_again = ask_server(client, first)  # "regenerate": the same request again
        assert asked_again == answer
        stats = _slot_of(running.routes, first).chat.last_stats
        assert stats.prefill_tokens == 1 and stats.reused_tokens == stats.prompt_tokens - 1

        history = [*first, {"role": "assistant", "content": answer.text}]
        ask_server(client, [*history, user("Tell me more.")])
        edited = ask_server(client, [*history, user("Name a colour.")])
        expected = ask_chat(chat, [("What is in this picture?", image, ()), ("Name a colour.", (), ())])[1]
        assert edited == expected
        stats = _slot_of(running.routes, [*history, user("Name a colour.")]).chat.last_stats
        assert stats.reused_tokens > 0 and stats.prefill_tokens < 20


def test_a_stop_signal_drains_the_answers_in_progress(tiny_package, tmp_path):
    """SIGTERM: new requests are refused, the stream in flight ends with a final chunk (finish_reason "length")
    and [DONE] once --drain-seconds are over, and the process exits with status 0."""
    process = subprocess.Popen([sys.executable, "-m", "builder_plugin.serve", str(tiny_package), "--port", "0",
                                "--drain-seconds", "1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        url = process.stdout.readline().split(" at ")[1].strip()
        body = {"messages": [user("Talk for a long time.")], "max_tokens": 100_000, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 5:
                    process.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
            ended = time.monotonic() - signalled
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2], lines[-3:]
        assert 0.5 < ended < 10, ended
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{url}/chat/completions", json={"messages": [user("Hi")]}, timeout=5).raise_for_status()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_pool_gauges_answer_the_health_route(served, tmp_path):
    with running_server(served, tmp_path, max_conversations=2) as running:
        ask_server(running.client(), [user("Hello!")])
        health = httpx.get(f"{running.url}/health").json()
        held = sum(slot.chat.kv_tokens for slot in running.routes.pool.slots)
    assert health["conversations"] == 1 and health["max_conversations"] == 2 and health["answering"] == 0
    assert health["kv_bytes"] == held * served.package.kv_bytes_per_token > 0
    assert all(slot.chat.kv_tokens == 0 for slot in running.routes.pool.slots)  # freed when the server stopped

