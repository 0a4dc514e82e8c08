"""builder_plugin.serve.worker, without HTTP: jobs answered in the pool's conversations, a step each in turn, their
events equal to an independent Chat's answers; the queue bound, cancellation and the drain."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence

import pytest

from builder_plugin.media import MediaDecoder
from builder_plugin.runtime import Chat, Package
from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.events import Failed, Finished, Piece, Started
from builder_plugin.serve.media import MediaCache, MediaReader
from builder_plugin.serve.pool import ConversationPool
from builder_plugin.serve.protocol import parse_messages, parse_request
from builder_plugin.serve.worker import Job, Worker

BUDGET = 1 << 40


class Events:
    """What a job was told, in order, and when it ended."""

    def __init__(self) -> None:
        self.events: list = []
        self.ended = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.ended.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Piece))

    @property
    def last(self):
        return self.events[-1]


@pytest.fixture(scope="module")
def opened(tiny_package) -> Package:
    return Package(tiny_package)


@pytest.fixture(scope="module")
def chat(tiny_package) -> Chat:
    return Chat(tiny_package)


@pytest.fixture
def worker(opened):
    worker = Worker(ConversationPool(opened, 2, BUDGET), max_queue=2)
    worker.start()
    yield worker
    worker.stop()


def _job(messages: Sequence[dict], max_tokens: int, **fields) -> tuple[Job, Events]:
    request = parse_request(json.dumps({"messages": list(messages), "max_tokens": max_tokens, **fields}).encode())
    cache = MediaCache(MediaDecoder(), 1 << 20)
    exchange = parse_messages(request.messages, MediaReader(cache))
    cache.close()
    events = Events()
    return Job(request, exchange, events, max_new_tokens=request.max_new_tokens), events


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_an_answer_is_told_as_chat_gives_it(worker, chat):
    job, events = _job([_user("Hello!")], 5)
    worker.submit(job)
    assert events.ended.wait(60)
    chat.clear()
    expected = "".join(chat.ask("Hello!", max_new_tokens=5))
    assert isinstance(events.events[0], Started) and isinstance(events.last, Finished)
    assert events.text == expected
    assert (events.last.prompt_tokens, events.last.completion_tokens, events.last.finish_reason) == \
        (chat.last_stats.prompt_tokens, chat.last_stats.new_tokens, chat.last_stats.finish_reason)


def test_answers_take_turns_a_step_each(worker):
    long, long_events = _job([_user("Talk for a long time.")], 300)
    short, short_events = _job([_user("Hi.")], 3)
    worker.submit(long)
    while not any(isinstance(e, Piece) for e in long_events.events):
        time.sleep(0.005)
    worker.submit(short)
    assert short_events.ended.wait(60)
    assert not long_events.ended.is_set()  # the short one did not wait for the long one to end
    assert long_events.ended.wait(60) and isinstance(long_events.last, Finished)


def test_the_queue_is_bounded_and_a_cancelled_job_is_skipped(opened):
    worker = Worker(ConversationPool(opened, 1, BUDGET), max_queue=1)  # not started: jobs stay queued
    first, first_events = _job([_user("One.")], 2)
    worker.submit(first)
    with pytest.raises(ApiError) as caught:
        worker.submit(_job([_user("Two.")], 2)[0])
    assert caught.value.status == 429
    first.cancel()
    worker.start()
    second, second_events = _job([_user("Three.")], 2)
    worker.submit(second)
    assert second_events.ended.wait(60) and isinstance(second_events.last, Finished)
    assert first_events.events == []  # cancelled while it waited: never started
    worker.stop()


def test_the_drain_ends_answers_at_its_deadline_and_refuses_the_rest(opened):
    worker = Worker(ConversationPool(opened, 1, BUDGET), max_queue=4)
    worker.start()
    running, running_events = _job([_user("Count.")], 100_000)
    waiting, waiting_events = _job([_user("Wait.")], 2)
    worker.submit(running)
    while not any(isinstance(e, Piece) for e in running_events.events):
        time.sleep(0.005)
    worker.submit(waiting)
    worker.drain(0.2, wait=True)
    assert isinstance(running_events.last, Finished) and running_events.last.finish_reason == "length"
    assert isinstance(waiting_events.last, Failed) and waiting_events.last.error.status == 503
    with pytest.raises(ApiError) as caught:
        worker.submit(_job([_user("Late.")], 2)[0])
    assert caught.value.status == 503 and worker.stopping and worker.answering == 0
    worker.stop()
