"""The server's test rig: a server in a thread on the tiny package (its Chats held by a Probe), the request helpers,
and the yardstick (a Chat of its own answering the same questions)."""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import uvicorn

from builder_plugin.media import MediaDecoder
from builder_plugin.runtime import Answering, Chat, Package, Sampling, Step, Turn
from builder_plugin.serve.app import MB, Server
from builder_plugin.serve.media import MediaCache

IMAGE = "square.png"
AUDIO = "clip_2s.wav"
SHORT = 6  # max_tokens of most requests: the tiny model makes ~200 tokens/s
GUIDED = 80  # max_tokens of guided answers: room for a bounded JSON answer or one call
CALLS = 240  # room for the most calls a constrained answer may make (runtime.guidance.MAX_CALLS)
# Tools whose arguments are bounded (random weights would otherwise fill any string to max_tokens).
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": CLOCK}}]


class Probe:
    """The Chats of a test server, on one opened package: they wait at `gate` before preparing an answer (the queue
    tests hold the worker there), record whether each restore was handed the conversation they held (the condition
    for reusing it), and, with `failure` set, fail after an answer's first step."""

    def __init__(self, package: str | Path | Package) -> None:
        self.package = package if isinstance(package, Package) else Package(package)
        self.gate = threading.Event()
        self.gate.set()
        self.restores_unchanged: list[bool] = []
        self.failure: type[Exception] | None = None

    def __call__(self, package: Package) -> Chat:
        return _ProbeChat(package, self)


class _ProbeChat(Chat):
    def __init__(self, package: Package, probe: Probe) -> None:
        super().__init__(package)
        self.probe = probe

    def restore(self, turns) -> None:
        self.probe.restores_unchanged.append(list(turns) == self.turns)
        super().restore(turns)

    def prepare(self, question: Turn, *args, **kwargs) -> Answering:
        self.probe.gate.wait(timeout=60)
        answer = super().prepare(question, *args, **kwargs)
        return answer if self.probe.failure is None else _Failing(answer, self.probe.failure)


class _Failing:
    """An answer that fails after its first step."""

    def __init__(self, answer: Answering, failure: type[Exception]) -> None:
        self.answer, self.failure = answer, failure
        self.kv_tokens = answer.kv_tokens
        self.steps = 0

    def __next__(self) -> Step:
        if self.steps:
            self.answer.close()
            raise self.failure("the model failed on purpose")
        self.steps += 1
        return next(self.answer)

    def close(self) -> None:
        self.answer.close()

    @property
    def stats(self):
        return self.answer.stats


@dataclass
class Running:
    url: str
    routes: Server

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **options)


@contextlib.contextmanager
def running_server(served: Probe | Package | Path, folder: Path | None = None, **options) -> Iterator[Running]:
    """A uvicorn server on a free 127.0.0.1 port, in a thread, for a Probe's Chats (or plain ones on a package);
    stopped on exit. `folder` is unused (the server writes nothing)."""
    probe = served if isinstance(served, Probe) else None
    package = probe.package if probe is not None else served if isinstance(served, Package) else Package(served)
    routes = Server(package, MediaCache(MediaDecoder(), 64 * MB), **options, **({"new_chat": probe} if probe else {}))
    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(routes.app(), log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{listener.getsockname()[1]}", routes)
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        listener.close()
        assert not thread.is_alive(), "the server did not stop"


def wait_for(condition, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def last_stats(routes: Server):
    """The Stats of the answer the server gave last (in whichever of its kept conversations)."""
    return max(routes.pool.slots, key=lambda slot: slot.used).chat.last_stats


# ---- requests and the yardstick -----------------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def image_part(path: Path) -> dict:
    mime = "image/png" if path.suffix == ".png" else "image/jpeg"
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(path.read_bytes())}"}}


def audio_part(path: Path, audio_format: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(path.read_bytes()), "format": audio_format}}


def user(text: str, images: tuple[Path, ...] = (), audios: tuple[Path, ...] = ()) -> dict:
    """A user message with its media first (where Chat puts their tags when the text writes none)."""
    if not images and not audios:
        return {"role": "user", "content": text}
    parts = [image_part(p) for p in images] + [audio_part(p) for p in audios] + [{"type": "text", "text": text}]
    return {"role": "user", "content": parts}


@dataclass
class Answer:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def ask_server(client: openai.OpenAI, messages: list[dict], stream: bool = False, **params) -> Answer:
    params.setdefault("max_tokens", SHORT)
    model = client.models.list().data[0].id
    if not stream:
        response = client.chat.completions.create(model=model, messages=messages, **params)
        choice = response.choices[0]
        assert response.object == "chat.completion" and choice.message.role == "assistant"
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
        return Answer(choice.message.content, choice.finish_reason, response.usage.prompt_tokens,
                      response.usage.completion_tokens)
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **params))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, final, usage_chunk = chunks
    assert all(c.choices[0].finish_reason is None for c in content)
    assert final.choices[0].finish_reason is not None and not final.choices[0].delta.content
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in content)
    return Answer(text, final.choices[0].finish_reason, usage_chunk.usage.prompt_tokens,
                  usage_chunk.usage.completion_tokens)


def create(client: openai.OpenAI, messages: list[dict], **params):
    """A chat completion (max_tokens: room for a guided answer)."""
    params.setdefault("max_tokens", GUIDED)
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, **params)


def guided_chat(chat: Chat, text: str, guidance, images=(), audios=(), max_new_tokens: int = GUIDED) -> str:
    """The answer of a fresh conversation with `chat` under `guidance`."""
    chat.clear()
    chat.system = chat.tools = None
    return "".join(chat.ask(text, images, audios, max_new_tokens=max_new_tokens, guidance=guidance))


def ask_chat(chat: Chat, questions: list[tuple[str, tuple[Path, ...], tuple[Path, ...]]], system: str | None = None,
             max_new_tokens: int = SHORT, sampling: Sampling | None = None) -> list[Answer]:
    """The answers of a fresh conversation with `chat`, one question after the other."""
    chat.clear()
    chat.system, chat.tools = system, None
    answers = []
    for text, images, audios in questions:
        answer = "".join(chat.ask(text, images, audios, max_new_tokens=max_new_tokens, sampling=sampling))
        stats = chat.last_stats
        answers.append(Answer(answer, stats.finish_reason, stats.prompt_tokens, stats.new_tokens))
    return answers


