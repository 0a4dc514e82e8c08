"""builder_plugin.serve: the OpenAI chat-completions server on the tiny package, called with the official openai
client. Every answer is compared with a Chat run independently on the same package (greedy search)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from PIL import Image

from builder_plugin.media import MediaDecoder
from builder_plugin.runtime import Chat, ChatError, Sampling
from builder_plugin.serve.app import MB, Server
from builder_plugin.serve.errors import ApiError
from builder_plugin.serve.media import MediaCache, MediaReader
from builder_plugin.serve.protocol import parse_conversation
from builder_plugin.serve.stop import StopScanner
from builder_plugin.testing.media import make_wav
from tests.support.temp import our_files

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


class ProbeChat(Chat):
    """The server's Chat, with a gate that holds the worker inside ask (for the queue tests) and a record of
    whether each restore was handed the conversation already held (the condition for reusing it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.restores_unchanged: list[bool] = []

    def restore(self, turns):
        self.restores_unchanged.append(list(turns) == self.turns)
        super().restore(turns)

    def ask(self, *args, **kwargs):
        self.gate.wait(timeout=60)
        return super().ask(*args, **kwargs)


@pytest.fixture(scope="module")
def package(tiny_package) -> Path:
    return tiny_package


@pytest.fixture(scope="module")
def served_chat(package) -> ProbeChat:
    """The Chat behind the servers (shared by the tests so its models load once)."""
    return ProbeChat(package)


@pytest.fixture(scope="module")
def chat(package) -> Chat:
    """The yardstick: a Chat of its own on the same package."""
    return Chat(package)


@dataclass
class Running:
    url: str
    routes: Server

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **options)


@contextlib.contextmanager
def running_server(chat: Chat, folder: Path, **options) -> Iterator[Running]:
    """A uvicorn server for `chat` on a free 127.0.0.1 port, in a thread; stopped on exit."""
    routes = Server(chat, MediaCache(MediaDecoder(), 64 * MB), **options)
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


def last_stats(routes: Server):
    """The Stats of the answer the server gave last (in whichever of its kept conversations)."""
    return max(routes.pool.slots, key=lambda slot: slot.used).chat.last_stats


@pytest.fixture
def server(served_chat, tmp_path) -> Iterator[Running]:
    served_chat.gate.set()
    with running_server(served_chat, tmp_path) as running:
        yield running


# ---- requests and the yardstick -----------------------------------------------------------------------------------


def image_part(path: Path) -> dict:
    mime = "image/png" if path.suffix == ".png" else "image/jpeg"
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{_b64(path.read_bytes())}"}}


def audio_part(path: Path, audio_format: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": _b64(path.read_bytes()), "format": audio_format}}


def user(text: str, images: tuple[Path, ...] = (), audios: tuple[Path, ...] = ()) -> dict:
    """A user message with its media first (where Chat puts their tags when the text writes none)."""
    if not images and not audios:
        return {"role": "user", "content": text}
    parts = [image_part(p) for p in images] + [audio_part(p) for p in audios] + [{"type": "text", "text": text}]
    return {"role": "user", "content": parts}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


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


# ---- answers equal Chat's -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("images", "audios"), [((), ()), ((IMAGE,), ()), ((), (AUDIO,)), ((IMAGE,), (AUDIO,))],
                         ids=["text", "image", "audio", "image+audio"])
def test_answer_equals_chat(server, chat, media_dir, stream, images, audios):
    images = tuple(media_dir / name for name in images)
    audios = tuple(media_dir / name for name in audios)
    messages = [{"role": "system", "content": "You are a tester."}, user("Describe what you get.", images, audios)]
    got = ask_server(server.client(), messages, stream=stream)
    expected, = ask_chat(chat, [("Describe what you get.", images, audios)], system="You are a tester.")
    assert got == expected
    assert got.finish_reason == "length" and got.completion_tokens == SHORT


def test_multi_turn_conversation_reuses_the_held_one(server, served_chat, chat, media_dir):
    """Each request re-sends the conversation; the server restores it and asks the last question. After the first
    request, the restored history is exactly what the server's Chat holds (same answers, same media paths)."""
    questions = [("What is in this picture?", (media_dir / IMAGE,), ()), ("Tell me more.", (), ()),
                 ("And now?", (), ())]
    expected = ask_chat(chat, questions)
    client = server.client()
    messages: list[dict] = []
    served_chat.restores_unchanged.clear()
    for (text, images, audios), want in zip(questions, expected):
        messages.append(user(text, images, audios))
        got = ask_server(client, messages, stream=len(messages) == 3)
        assert got == want
        messages.append({"role": "assistant", "content": got.text})
    assert served_chat.restores_unchanged[1:] == [True, True]


def test_stop_strings(server, chat):
    full, = ask_chat(chat, [("Count to ten.", (), ())], max_new_tokens=16)
    middle = len(full.text) // 2
    stop = full.text[middle:middle + 3]
    cut = full.text[:full.text.find(stop)]
    client = server.client()
    for stream in (False, True):
        got = ask_server(client, [user("Count to ten.")], stream=stream, max_tokens=16, stop=[stop, "never seen"])
        assert (got.text, got.finish_reason) == (cut, "stop")
    got = ask_server(client, [user("Count to ten.")], max_tokens=16, stop="never seen")
    assert (got.text, got.finish_reason) == (full.text, full.finish_reason)


def test_token_limits_and_sampling(server, chat):
    client = server.client()
    got = ask_server(client, [user("Hello!")], max_tokens=None, max_completion_tokens=3)
    assert got == ask_chat(chat, [("Hello!", (), ())], max_new_tokens=3)[0]
    sampling = Sampling(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    got = ask_server(client, [user("Hello!")], max_tokens=8, temperature=0.8, top_p=0.9, seed=7,
                     extra_body={"top_k": 20})
    assert got == ask_chat(chat, [("Hello!", (), ())], max_new_tokens=8, sampling=sampling)[0]


def test_default_answer_cap(served_chat, chat, tmp_path):
    """A request without max_tokens gets the server's cap; one may ask for less, or more up to the maximum length."""
    served_chat.gate.set()
    with running_server(served_chat, tmp_path, max_tokens=4) as running:
        client = running.client()
        card = httpx.get(f"{running.url}/v1/models").json()["data"][0]
        assert (card["max_tokens"], card["max_length"]) == (4, chat.max_length)
        for asked in (None, 2, 9):
            got = ask_server(client, [user("Tell me about lighthouses.")], max_tokens=asked)
            assert got == ask_chat(chat, [("Tell me about lighthouses.", (), ())], max_new_tokens=asked or 4)[0]
            assert got.completion_tokens <= (asked or 4)


def test_models_and_health(server, package):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [package.name]
    assert client.models.retrieve(package.name).id == package.name
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == package.name and not health["busy"]


def test_local_files_only_when_allowed(served_chat, chat, media_dir, tmp_path):
    url = (media_dir / IMAGE).as_uri()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What?"}]}]
    with running_server(served_chat, tmp_path) as refusing:
        with pytest.raises(openai.BadRequestError) as refused:
            ask_server(refusing.client(), messages)
        assert refused.value.code == "local_files_not_allowed"
    with running_server(served_chat, tmp_path, allow_local_files=True) as allowing:
        assert ask_server(allowing.client(), messages) == ask_chat(chat, [("What?", (media_dir / IMAGE,), ())])[0]


# ---- bad input ----------------------------------------------------------------------------------------------------


def _bad_requests(media_dir: Path, tmp_path: Path) -> dict[str, tuple[dict, int, str | None, str]]:
    """name -> (request fields, status, error code, a piece of the message)."""
    png = (media_dir / IMAGE).read_bytes()
    gif = b"GIF89a" + bytes(64)  # a GIF's first bytes, then nothing of one
    low_rate = make_wav(tmp_path / "low.wav", 1.0, sample_rate=6000)
    image_msg = lambda data, mime="image/png": {"role": "user", "content": [  # noqa: E731
        {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}, {"type": "text", "text": "?"}]}
    audio_msg = lambda data, fmt="wav": {"role": "user", "content": [  # noqa: E731
        {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}, {"type": "text", "text": "?"}]}
    return {
        "unknown role": ({"messages": [{"role": "function", "content": "x"}]}, 400, None,
                         "unsupported role 'function'"),
        "tool first": ({"messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]}, 400, None,
                       "must follow an assistant message with tool_calls"),
        "part type": ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
                      400, "unsupported_content_type", "unsupported part type 'video_url'"),
        "image base64": ({"messages": [image_msg("not base64!")]}, 400, "invalid_base64", "not valid base64"),
        "audio base64": ({"messages": [audio_msg("%%%")]}, 400, "invalid_base64", "not valid base64"),
        "broken gif": ({"messages": [image_msg(_b64(gif), "image/gif")]}, 400, "invalid_image_format",
                       "messages[0].content[0].image_url: not a readable image (truncated GIF)"),
        "wav as image": ({"messages": [image_msg(_b64((media_dir / AUDIO).read_bytes()))]}, 400,
                         "invalid_image_format", "not a readable image (not a JPEG, PNG, WebP, GIF, BMP or TIFF file)"),
        "http image": ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "invalid_image_url",
            "must be data: URLs"),
        "png as audio": ({"messages": [audio_msg(_b64(png))]}, 400, "invalid_audio_format",
                         "messages[0].content[0].input_audio: not a readable audio clip (not a WAV, FLAC, Ogg or MP3"),
        "6 kHz audio": ({"messages": [audio_msg(_b64(low_rate.read_bytes()))]}, 400, "invalid_audio_format",
                        "unsupported sample rate 6000 Hz (use 8000 to 192000)"),
        "audio format": ({"messages": [audio_msg(_b64(png), "aac")]}, 400, "invalid_audio_format",
                         "wav, mp3, flac, ogg"),
        "image tags": ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(png)}"}},
            {"type": "text", "text": "<|image_1|> and <|image_2|>?"}]}]}, 400, "invalid_media_tags",
            "2 image tags (<|image_1|> <|image_2|>) but 1 image is attached"),
        "context": ({"messages": [user("word " * 5000)]}, 400, "context_length_exceeded", "the prompt is"),
        "last not user": ({"messages": [user("Hi"), {"role": "assistant", "content": "Hello"}]}, 400, None,
                          "the last message must be a user or tool message"),
        "assistant first": ({"messages": [{"role": "assistant", "content": "Hello"}, user("Hi")]}, 400, None,
                            "must answer a user or tool message"),
        "temperature": ({"messages": [user("Hi")], "temperature": 3}, 400, None, "temperature"),
        "n": ({"messages": [user("Hi")], "n": 2}, 400, None, "only one choice"),
        "format type": ({"messages": [user("Hi")], "response_format": {"type": "xml"}}, 400, None,
                        "response_format.type: 'xml' is not supported"),
        "schema refused": ({"messages": [user("Hi")], "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}}, 400, "invalid_schema", "Invalid type: objectx"),
        "penalty": ({"messages": [user("Hi")], "frequency_penalty": 0.5}, 400, "unsupported_parameter",
                    "frequency_penalty: not supported"),
        "unknown field": ({"messages": [user("Hi")], "extra_body": {"best_of": 2}}, 400, "unsupported_parameter",
                          "best_of: unknown field"),
        "top_logprobs alone": ({"messages": [user("Hi")], "top_logprobs": 2}, 400, None, "needs logprobs: true"),
        "top_logprobs 21": ({"messages": [user("Hi")], "logprobs": True, "top_logprobs": 21}, 400, None,
                            "top_logprobs"),
        "tool_choice alone": ({"messages": [user("Hi")], "tool_choice": "required"}, 400, None, "needs tools"),
        "unknown tool": ({"messages": [user("Hi")], "tools": TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "nope"}}}, 400, None, "no tool is named 'nope'"),
        "bad parameters": ({"messages": [user("Hi")], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "objectx"}}}], "tool_choice": "required"}, 400, "invalid_schema",
            "tools: "),
        "model": ({"messages": [user("Hi")], "model": "gpt-5"}, 404, "model_not_found", "'gpt-5' is not served"),
    }


BAD_REQUESTS = ["unknown role", "tool first", "part type", "image base64", "audio base64", "broken gif",
                "wav as image", "http image", "png as audio", "6 kHz audio", "audio format", "image tags", "context",
                "last not user", "assistant first", "temperature", "n", "model", "format type", "schema refused",
                "penalty", "unknown field", "top_logprobs alone", "top_logprobs 21", "tool_choice alone",
                "unknown tool", "bad parameters"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, chat, media_dir, tmp_path):
    cases = _bad_requests(media_dir, tmp_path)
    assert sorted(cases) == sorted(BAD_REQUESTS)
    client = server.client()
    for name, (fields, status, code, message) in cases.items():
        fields.setdefault("model", server.routes.model_id)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(**fields, max_tokens=SHORT)
        error = caught.value
        assert (error.status_code, error.code) == (status, code), name
        assert message in error.message and "\n" not in error.body["message"], name
    with pytest.raises(openai.BadRequestError, match="start the server with a larger --max-length") as caught:
        client.chat.completions.create(model=server.routes.model_id, messages=[user("word " * 5000)])
    assert "max_length" not in caught.value.message  # the Python API's name is not the server's option
    # Streaming requests fail the same way, before any chunk.
    with pytest.raises(openai.BadRequestError, match="the prompt is"):
        client.chat.completions.create(model=server.routes.model_id, messages=[user("word " * 5000)], stream=True)
    assert ask_server(client, [user("Hello!")]) == ask_chat(chat, [("Hello!", (), ())])[0]


def test_malformed_json_and_unknown_paths(server):
    for body in (b"{not json", b"[1, 2]", "\u00e9".encode("latin-1")):
        response = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.get(f"{server.url}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_body_over_the_limit(served_chat, chat, media_dir, tmp_path):
    with running_server(served_chat, tmp_path, max_body_bytes=MB // 8) as small:
        big = "x" * (MB // 4)
        with pytest.raises(openai.APIStatusError) as caught:
            ask_server(small.client(), [user(big)])
        assert caught.value.status_code == 413 and "--max-body-mb" in caught.value.message
        # a chunked body (no content-length) is cut off as well
        chunks = (json.dumps({"messages": [user(big)]})[i:i + 4096].encode() for i in range(0, MB // 4 + 100, 4096))
        response = httpx.post(f"{small.url}/v1/chat/completions", content=chunks)
        assert response.status_code == 413
        assert ask_server(small.client(), [user("Hi")]) == ask_chat(chat, [("Hi", (), ())])[0]


def test_audio_on_a_package_without_speech(package, media_dir, tmp_path):
    folder = tmp_path / "no-speech"
    folder.mkdir()
    for path in package.iterdir():
        if path.name != "genai_config.json":
            (folder / path.name).symlink_to(path)
    config = json.loads((package / "genai_config.json").read_text())
    config["model"]["speech"] = {"config_filename": ""}
    (folder / "genai_config.json").write_text(json.dumps(config))
    with running_server(Chat(folder), tmp_path) as no_speech:
        with pytest.raises(openai.BadRequestError) as caught:
            ask_server(no_speech.client(), [user("Listen.", audios=(media_dir / AUDIO,))])
        assert caught.value.code == "audio_not_supported"


class FailingChat(Chat):
    """A Chat whose answers fail after their first piece: with a ChatError ("model" failures) or a bug."""

    failure: type[Exception] = ChatError

    def ask(self, *args, **kwargs):
        pieces = super().ask(*args, **kwargs)

        def fail_after_one():
            with contextlib.closing(pieces):
                yield next(pieces)
                raise self.failure("the model failed on purpose")

        return fail_after_one()


def test_failures_while_answering(package, tmp_path):
    failing = FailingChat(package)
    with running_server(failing, tmp_path) as running:
        client = running.client()
        with pytest.raises(openai.APIError, match="the model failed on purpose"):
            list(client.chat.completions.create(model=running.routes.model_id, messages=[user("Hi")], stream=True,
                                                max_tokens=SHORT))
        failing.failure = KeyError  # a bug: 500, and the next request is served
        with pytest.raises(openai.InternalServerError, match="internal error: KeyError"):
            ask_server(client, [user("Hi")])
        failing.failure = ChatError
        with pytest.raises(openai.BadRequestError, match="the model failed on purpose"):
            ask_server(client, [user("Hi")])
        assert httpx.get(f"{running.url}/health").json()["status"] == "ok"


# ---- queue, concurrency, disconnects ------------------------------------------------------------------------------


def test_many_clients_at_once(served_chat, chat, media_dir, tmp_path):
    """8 clients, each a 10-question conversation (one with an image, some streamed): every answer equals Chat's for
    that client's conversation, in order; with room for every client in the queue, none is refused."""
    clients, rounds = 8, 10
    questions = {c: [(f"Client {c}, question {r}.", (media_dir / IMAGE,) if c == 0 and r == 0 else (), ())
                     for r in range(rounds)] for c in range(clients)}
    expected = {c: ask_chat(chat, questions[c], max_new_tokens=3) for c in range(clients)}
    got: dict[int, list[Answer]] = {c: [] for c in range(clients)}
    failures: list[BaseException] = []

    def converse(c: int, client: openai.OpenAI) -> None:
        messages: list[dict] = []
        try:
            for r, (text, images, audios) in enumerate(questions[c]):
                messages.append(user(text, images, audios))
                answer = ask_server(client, messages, stream=(c + r) % 3 == 0, max_tokens=3)
                got[c].append(answer)
                messages.append({"role": "assistant", "content": answer.text})
        except BaseException as exc:
            failures.append(exc)

    with running_server(served_chat, tmp_path, max_queue=clients) as running:
        threads = [threading.Thread(target=converse, args=(c, running.client())) for c in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not failures, failures[0]
    assert got == expected


def _wait_for(condition, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_full_queue_answers_429(served_chat, chat, tmp_path):
    """max_queue=1: one request being answered (held at the gate), one waiting; the third is refused with 429, and the
    first two are answered correctly once the gate opens."""
    results: dict[str, Answer | BaseException] = {}

    def send(name: str, client: openai.OpenAI) -> None:
        try:
            results[name] = ask_server(client, [user(f"Request {name}.")])
        except BaseException as exc:
            results[name] = exc

    served_chat.gate.clear()
    try:
        with running_server(served_chat, tmp_path, max_queue=1) as running:
            health = lambda: httpx.get(f"{running.url}/health").json()  # noqa: E731
            first = threading.Thread(target=send, args=("A", running.client()))
            first.start()
            _wait_for(lambda: health()["busy"], "the first request to be answered")
            second = threading.Thread(target=send, args=("B", running.client()))
            second.start()
            _wait_for(lambda: health()["waiting"] == 1, "the second request to wait")
            with pytest.raises(openai.RateLimitError) as refused:
                ask_server(running.client(), [user("Request C.")])
            assert refused.value.code == "queue_full"
            served_chat.gate.set()
            first.join(timeout=30)
            second.join(timeout=30)
            assert ask_server(running.client(), [user("Request C.")]) == ask_chat(chat, [("Request C.", (), ())])[0]
    finally:
        served_chat.gate.set()
    for name in ("A", "B"):
        assert results[name] == ask_chat(chat, [(f"Request {name}.", (), ())])[0]


def test_disconnect_stops_generation(server, served_chat, chat):
    long = 3000  # ~15 s of tokens: a disconnect must end it long before
    body = {"model": server.routes.model_id, "messages": [user("Talk for a long time.")], "max_tokens": long,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) > 2
    health = lambda: httpx.get(f"{server.url}/health").json()  # noqa: E731
    _wait_for(lambda: not health()["busy"], "the stream to stop", timeout=10)
    assert last_stats(server.routes).new_tokens < long / 2

    # A non-streamed request whose client gives up is stopped as well.
    with pytest.raises(openai.APITimeoutError):
        ask_server(server.client(timeout=0.5), [user("Talk for a long time.")], max_tokens=long)
    _wait_for(lambda: not health()["busy"], "the request to stop", timeout=10)
    assert last_stats(server.routes).new_tokens < long / 2
    assert ask_server(server.client(), [user("Hello!")]) == ask_chat(chat, [("Hello!", (), ())])[0]


# ---- command line -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_cli_serves_a_package_and_keeps_nothing_a_client_sent(package, chat, media_dir, tmp_path, stop):
    """A real server process, stopped by a signal: exit 0, and nothing a client sent is written to disk (its temporary
    folder stays empty while it serves and after)."""
    temp = tmp_path / "temp"  # the server's system temp folder
    temp.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "builder_plugin.serve", str(package), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "TMPDIR": str(temp)})
    try:
        line = process.stdout.readline()
        assert line.startswith(f"serving {package.name} at http://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["status"] == "ok"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        media = (media_dir / IMAGE,), (media_dir / AUDIO,)
        assert ask_server(client, [user("Hi", *media)]) == ask_chat(chat, [("Hi", *media)])[0]
        assert our_files(temp) == []
        process.send_signal(getattr(signal, stop))
        assert process.wait(timeout=30) == 0
        assert process.stdout.read().splitlines()[-1] == f"stopped by {stop}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert our_files(temp) == []


def test_a_draining_server_answers_503_until_its_answers_end(package, tmp_path):
    """After a stop signal the server keeps listening: readiness probes and new requests get 503 (not a refused
    connection) while the answer in progress goes on, then it ends with finish_reason "length" and the server
    exits."""
    process = subprocess.Popen([sys.executable, "-m", "builder_plugin.serve", str(package), "--port", "0",
                                "--drain-seconds", "3"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = process.stdout.readline().split(" at ")[1].strip()
        base = url.removesuffix("/v1")
        body = {"messages": [user("Count.")], "max_tokens": 100_000, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # answering
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{base}/health")).status_code == 200:
                assert time.monotonic() < deadline, "the server never reported draining"
                time.sleep(0.05)
            assert (health.status_code, health.json()["status"]) == (503, "draining")
            refused = httpx.post(f"{url}/chat/completions", json={"messages": [user("Hi")]})
            assert (refused.status_code, refused.json()["error"]["message"]) == (503, "the server is shutting down")
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_errors_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "builder_plugin.serve", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"error: package folder not found: {tmp_path / 'nowhere'}"]
    verbose = subprocess.run([sys.executable, "-m", "builder_plugin.serve", str(tmp_path / "nowhere"), "-v"],
                             capture_output=True, text=True, timeout=60)
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


# ---- parts without a model ----------------------------------------------------------------------------------------


def test_stop_scanner_holds_back_what_may_start_a_stop_string():
    scanner = StopScanner(["END", "xy"])
    fed = [scanner.feed(piece) for piece in ("ab", "cE", "N", "x", "zE", "ND more")]
    assert fed == [("ab", False), ("c", False), ("", False), ("EN", False), ("xz", False), ("", True)]
    scanner = StopScanner(["abc"])
    assert (scanner.feed("xxab"), scanner.feed("d"), scanner.flush()) == (("xx", False), ("abd", False), "")


def test_messages_become_turns(media_dir):
    media = MediaReader(MediaCache(MediaDecoder(), MB))
    png = image_part(media_dir / IMAGE)
    conversation = parse_conversation([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, png, {"type": "text", "text": "and"},
                                     png]},
        {"role": "assistant", "content": [{"type": "text", "text": "Same."}]},
        {"role": "user", "content": "Why?"},
        {"role": "user", "content": [{"type": "text", "text": "Where is <|audio_1|>?"}, audio_part(media_dir / AUDIO)]},
    ], media)
    media.cache.close()
    assert conversation.system == "Be brief."
    first, = conversation.history
    assert (first.user, first.assistant) == ("Compare<|image_1|>and<|image_2|>", "Same.")
    assert first.images[0] == first.images[1]  # the same bytes: the same image
    assert [m.source for m in first.images] == ["messages[1].content[1].image_url", "messages[1].content[3].image_url"]
    assert conversation.question.user == "Why?\nWhere is <|audio_1|>?"
    assert conversation.question.audios[0].info["format"] == "WAV"


class CountingDecoder(MediaDecoder):
    """A MediaDecoder that counts its decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded: list[str] = []

    def decode(self, kind, data, source):
        self.decoded.append(source)
        return super().decode(kind, data, source)


def _png(value: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (value, value, value)).save(out, format="PNG")
    return out.getvalue()


def test_media_cache_decodes_the_same_bytes_once_and_stays_bounded():
    decoder = CountingDecoder()
    one = MediaDecoder().image(_png(1), "size")
    cache = MediaCache(decoder, max_bytes=2 * len(one.data) + 10)  # room for two decoded images
    first = cache.decode("image", _png(1), "first")
    again = cache.decode("image", _png(1), "again")
    assert again == first and again.source == "again" and decoder.decoded == ["first"]
    cache.decode("image", _png(2), "second")
    cache.decode("image", _png(3), "third")  # the least recently used one is dropped
    assert cache.held_bytes <= cache.max_bytes
    cache.decode("image", _png(1), "first again")
    assert decoder.decoded == ["first", "second", "third", "first again"]
    with pytest.raises(ApiError, match="not valid base64"):
        MediaReader(cache).audio("***", "wav", "x")
    cache.close()
    assert cache.held_bytes == 0
    with pytest.raises(ApiError, match="shutting down"):
        cache.decode("image", _png(1), "late")


def test_refused_media_are_not_kept(media_dir):
    cache = MediaCache(MediaDecoder(), MB)
    reader = MediaReader(cache)
    for data in ((media_dir / IMAGE).read_bytes(), b"RIFF" + bytes(64), b"plain text, not a clip"):
        with pytest.raises(ApiError, match=r"x: not a readable audio clip \(not a WAV, FLAC, Ogg or MP3 file"):
            reader.audio(_b64(data), "wav", "x")
    assert cache.held_bytes == 0
    assert reader.audio(_b64((media_dir / AUDIO).read_bytes()), "wav", "x").kind == "audio"
    cache.close()


def test_local_files_are_decoded_like_sent_ones(media_dir, tmp_path):
    disguised = tmp_path / "sound.png"
    shutil.copy(media_dir / AUDIO, disguised)
    reader = MediaReader(MediaCache(MediaDecoder(), MB), allow_local_files=True)
    with pytest.raises(ApiError, match=r"url: not a readable image \(not a JPEG"):
        reader.image(disguised.as_uri(), "url")
    with pytest.raises(ApiError, match="url: image file not found: "):
        reader.image((tmp_path / "nothing.png").as_uri(), "url")
    assert reader.image((media_dir / IMAGE).as_uri(), "url").source == "url"
    reader.cache.close()


# ---- structured output, tool calls, log-probabilities --------------------------------------------------------------


def _create(client: openai.OpenAI, messages: list[dict], **params):
    params.setdefault("max_tokens", GUIDED)
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, **params)


def _guided_chat(chat: Chat, text: str, guidance, images=(), audios=(), max_new_tokens: int = GUIDED) -> str:
    chat.clear()
    chat.system = chat.tools = None
    return "".join(chat.ask(text, images, audios, max_new_tokens=max_new_tokens, guidance=guidance))


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
    assert got.text == _guided_chat(chat, "Which shapes are in the picture?", Guidance.json_schema(schema), (image,))
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
    required = _create(client, question, tools=TOOLS, tool_choice="required", max_tokens=CALLS).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    _check_calls(required.message.tool_calls, {"get_weather", "get_time"})
    named = _create(client, question, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_calls(calls, {"get_time"})
    single = _create(client, question, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
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
    auto = _create(client, question, tools=TOOLS, max_tokens=SHORT).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    if auto.message.tool_calls:
        _check_calls(auto.message.tool_calls, {"get_weather", "get_time"})
    else:
        assert isinstance(auto.message.content, str)
    # none: the tools are left out of the prompt, so the answer is the plain one
    none = _create(client, question, tools=TOOLS, tool_choice="none", max_tokens=SHORT).choices[0]
    plain = _create(client, question, max_tokens=SHORT).choices[0]
    assert none.message.content == plain.message.content and none.message.tool_calls is None


def test_tool_loop_with_an_image_and_audio(server, served_chat, chat, media_dir):
    """Question with media -> a call -> its result -> the answer, each request re-sending the conversation. The
    assistant's tool_calls are fed back as the call block the model wrote: the server's Chat finds the
    conversation it holds."""
    from builder_plugin.runtime import tool_results
    from builder_plugin.serve.tools import parse_tools

    client = server.client()
    image, audio = media_dir / IMAGE, media_dir / AUDIO
    messages = [{"role": "system", "content": "You help."}, user("What is the weather there?", (image,), (audio,))]
    first = _create(client, messages, tools=TOOLS, tool_choice="required", max_tokens=CALLS).choices[0]
    assert first.finish_reason == "tool_calls"
    _check_calls(first.message.tool_calls, {"get_weather", "get_time"})
    messages.append(first.message.model_dump(exclude_none=True))
    results = [json.dumps({"result": 21 + i}) for i in range(len(first.message.tool_calls))]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": result}
                 for call, result in zip(first.message.tool_calls, results)]
    second = _create(client, messages, tools=TOOLS, max_tokens=SHORT).choices[0]
    assert served_chat.restores_unchanged[-1]  # the rebuilt history is the conversation the server holds
    # the same conversation in a Chat of its own
    chat.clear()
    chat.system, chat.tools = "You help.", parse_tools(TOOLS, "required", None).template_text()
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
    with running_server(Chat(folder), tmp_path) as no_tools:
        with pytest.raises(openai.BadRequestError) as caught:
            _create(no_tools.client(), [user("Hi")], tools=TOOLS)
        assert caught.value.code == "tools_not_supported" and caught.value.param == "tools"
        assert "no tool-call tokens" in caught.value.message and "\n" not in caught.value.message


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
        chunks = list(_create(client, [user("Hello!")], max_tokens=SHORT, logprobs=True, top_logprobs=top,
                              stream=True, **params))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = _create(client, [user("Hello!")], max_tokens=SHORT, logprobs=True, top_logprobs=top,
                          **params).choices[0].logprobs.content
    chat.keep_logits = True
    try:
        _guided_chat(chat, "Hello!", Guidance.json_object() if guided else None, max_new_tokens=SHORT)
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


def test_every_openai_request_field_is_handled():
    """Each field of the official client's chat-completions request is honoured, informational or refused unless
    neutral, and the README lists it."""
    from openai.types.chat import completion_create_params

    from builder_plugin.serve import fields

    names = set(completion_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    handled = set(fields.HONOURED) | set(fields.INFORMATIONAL) | set(fields.NEUTRAL)
    assert names - handled == set()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert [name for name in sorted(handled) if f"| `{name}` |" not in readme] == []
