"""Broken and hostile media, through a real server process and through Chat: real photographs and speech in every
accepted format, cut at random offsets, with bytes flipped in the header and the body, with header fields that lie,
and decompression bombs (tests/support/media_corpus). The server answers each request within seconds (400 naming the
part, or 200 where Pillow or libsndfile can still read the file, or context_length_exceeded where what they read is
too large for a conversation), stays up and answers /health, and writes nothing to disk; Chat raises its own error
for every file it refuses.

The cuts and flips change with every run; MEDIA_FUZZ_SEED=N repeats a run (each test prints its seed)."""

from __future__ import annotations

import base64
import os
import secrets
import time
from collections import Counter

import httpx
import pytest

from builder_plugin.runtime import Chat, PromptTooLongError, UnsupportedMediaError
from tests.support.media_corpus import Sample, hostile_corpus
from tests.support.server_process import server_process
from tests.support.temp import our_files

SEED = int(os.environ.get("MEDIA_FUZZ_SEED") or secrets.randbits(32))
ANSWER_WITHIN_S = 5.0
HEALTH_EVERY = 20  # requests between two /health checks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Sample]:
    return hostile_corpus(tmp_path_factory.mktemp("corpus"), SEED)


def _message(sample: Sample) -> dict:
    encoded = base64.b64encode(sample.data).decode()
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}} if sample.kind == "image" \
        else {"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}}
    return {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}


def test_the_server_answers_every_broken_file_and_keeps_serving(tiny_package, corpus, tmp_path):
    print(f"media fuzz seed {SEED} (MEDIA_FUZZ_SEED={SEED} repeats this run): {len(corpus)} files")
    statuses: Counter[str] = Counter()
    slowest = (0.0, "")
    with server_process(tiny_package, tmp_path) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        for i, sample in enumerate(corpus):
            started = time.monotonic()
            reply = client.post("/v1/chat/completions", json={"messages": [_message(sample)], "max_tokens": 1})
            took = time.monotonic() - started
            slowest = max(slowest, (took, sample.name))
            assert reply.status_code in (200, 400), (sample.name, reply.status_code, reply.text)
            assert took < ANSWER_WITHIN_S, (sample.name, took)
            if reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded":
                # read, and larger than the conversation may be (a flipped size field can make a big, valid image)
                error = reply.json()["error"]
                assert error["param"] == "messages" and "\n" not in error["message"], (sample.name, error)
                statuses["400 the prompt is too long"] += 1
            elif reply.status_code == 400:
                error = reply.json()["error"]
                part = "image_url" if sample.kind == "image" else "input_audio"
                assert error["param"] == f"messages[0].content[1].{part}", (sample.name, error)
                assert error["message"].startswith(f"{error['param']}: ") and "\n" not in error["message"]
                statuses[f"400 {error['message'].split(': ', 1)[1].split(' (')[0]}"] += 1
            else:
                statuses["200"] += 1
            if i % HEALTH_EVERY == 0:
                assert client.get("/health").json()["status"] == "ok", sample.name
            assert server.process.poll() is None, f"the server died on {sample.name}"
        assert client.get("/health").status_code == 200
        assert our_files(server.tmp) == []  # nothing a client sent is on disk, even while serving
        assert server.stop(30) == 0
    print(f"{len(corpus)} requests: {dict(statuses)}; slowest {slowest[0]:.2f} s ({slowest[1]})")
    assert statuses["200"] and sum(statuses.values()) - statuses["200"]  # both kinds of outcome were exercised
    assert our_files(server.tmp) == []


def test_chat_refuses_every_unreadable_file_with_its_own_error(tiny_package, corpus, tmp_path):
    print(f"media fuzz seed {SEED}")
    chat = Chat(tiny_package)
    outcomes: Counter[str] = Counter()
    for i, sample in enumerate(corpus):
        path = tmp_path / f"sample-{i}"
        path.write_bytes(sample.data)
        media = {"images": [path]} if sample.kind == "image" else {"audios": [path]}
        try:
            answer = chat.ask("What is this?", **media, max_new_tokens=1)  # decoded and preprocessed here
        except UnsupportedMediaError as exc:
            assert str(exc).startswith(f"cannot read {sample.kind} {path}: ") and "\n" not in str(exc), sample.name
            outcomes["refused"] += 1
        except PromptTooLongError:  # read, and larger than the conversation may be
            outcomes["too long"] += 1
        else:
            answer.close()  # the prompt was processed; nothing is generated
            outcomes["read"] += 1
        path.unlink()
    print(f"Chat: {dict(outcomes)}")
    assert outcomes["refused"] and outcomes["read"]
    assert chat.turns == [] and len(list(chat.ask("Still there?", max_new_tokens=2))) >= 1
