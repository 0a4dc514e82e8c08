"""python -m builder_plugin.serve: a real server process, its start, its stop signals and drain, its errors."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from builder_plugin.serve.__main__ import API_KEYS_VARIABLE
from tests.support.server_process import server_process
from tests.support.serving import (
    AUDIO,
    IMAGE,
    ask_chat,
    ask_server,
    user,
)
from tests.support.temp import our_files


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_cli_serves_a_package_and_keeps_nothing_a_client_sent(package, chat, media_dir, tmp_path, stop):
    """A real server process, stopped by a signal: exit 0, and nothing a client sent is written to disk (its temporary
    folder stays empty while it serves and after)."""
    with server_process(package, tmp_path) as server:
        assert server.model_id == package.name
        assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        media = (media_dir / IMAGE,), (media_dir / AUDIO,)
        assert ask_server(client, [user("Hi", *media)]) == ask_chat(chat, [("Hi", *media)])[0]
        assert our_files(server.tmp) == []
        assert server.stop(30, getattr(signal, stop)) == 0
        assert server.stdout_lines()[-1] == f"stopped by {stop}"
    assert our_files(server.tmp) == []


def test_a_draining_server_answers_503_until_its_answers_end(package, tmp_path):
    """After a stop signal the server keeps listening: readiness probes and new requests get 503 (not a refused
    connection) while the answer in progress goes on, then it ends with finish_reason "length" and the server
    exits."""
    with server_process(package, tmp_path, "--drain-seconds", "3") as server:
        body = {"messages": [user("Count.")], "max_tokens": 100_000, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", f"{server.url}/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # answering
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{server.base_url}/health")).status_code == 200:
                assert time.monotonic() < deadline, "the server never reported draining"
                time.sleep(0.05)
            assert (health.status_code, health.json()["status"]) == (503, "draining")
            refused = httpx.post(f"{server.url}/chat/completions", json={"messages": [user("Hi")]})
            assert (refused.status_code, refused.json()["error"]["message"]) == (503, "the server is shutting down")
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert server.process.wait(timeout=30) == 0


def test_cli_errors_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "builder_plugin.serve", str(tmp_path / "nowhere")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"error: package folder not found: {tmp_path / 'nowhere'}"]
    chunk = subprocess.run([sys.executable, "-m", "builder_plugin.serve", str(tmp_path), "--prefill-chunk", "-1"],
                           capture_output=True, text=True, timeout=60)
    assert chunk.returncode == 1 and chunk.stderr.strip().splitlines() == [
        "error: --prefill-chunk must be a number of tokens, or 0 to prefill each prompt in one call"]
    verbose = subprocess.run([sys.executable, "-m", "builder_plugin.serve", str(tmp_path / "nowhere"), "-v"],
                             capture_output=True, text=True, timeout=60)
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


def test_served_model_name_and_the_request_log(package, chat, tmp_path):
    """--served-model-name sets the id clients use; -v logs one line per request (method, path, status, prompt
    tokens, time to the first token, tokens/s), with no body and no key."""
    key, question = "sk-test-4c1f9e", "Describe the sea in one line."
    with server_process(package, tmp_path, "--served-model-name", "phi4mm", "-v", "--no-ui",
                        env={API_KEYS_VARIABLE: key}) as server:
        assert server.model_id == "phi4mm"
        client = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["phi4mm"]
        got = ask_server(client, [user(question)], max_tokens=8)
        expected = ask_chat(chat, [(question, (), ())], max_new_tokens=8)[0]
        assert got == expected
        assert ask_server(client, [user(question)], stream=True, max_tokens=8) == expected
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=package.name, messages=[user(question)])
        assert server.stop(30) == 0
    logged = server.stderr_path.read_text()
    assert key not in logged and question not in logged
    lines = [line for line in logged.splitlines() if line.startswith("INFO: POST /v1/chat/completions")]
    assert len(lines) == 3, logged
    answered = re.compile(r"INFO: POST /v1/chat/completions 200 in [\d.]+ s: (\d+) prompt tokens, (\d+) generated, "
                          r"first token [\d.]+ s, [\d.]+ tokens/s$")
    for line in lines[:2]:
        match = answered.match(line)
        assert match and (int(match[1]), int(match[2])) == (expected.prompt_tokens, expected.completion_tokens), line
    assert lines[2].startswith("INFO: POST /v1/chat/completions 404 in ") and lines[2].endswith(" s")
    assert any(line.startswith("INFO: GET /v1/models 200 in ") for line in logged.splitlines())


def test_prefill_chunk_reaches_the_runtime(package, media_dir, tmp_path):
    """--prefill-chunk N: the server's answers are a Chat's on the package opened with prefill_chunk N (whose own
    stats say its prompts were chunked)."""
    from builder_plugin.runtime import Chat, Package

    chunked = Chat(Package(package, prefill_chunk=16))
    questions = [("Describe the sea, the ships and the storm in one line, then say it again. " * 2, (), ()),
                 ("What do you hear?", (), (media_dir / AUDIO,))]
    with server_process(package, tmp_path, "--prefill-chunk", "16", "--no-ui") as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        for text, images, audios in questions:
            expected = ask_chat(chunked, [(text, images, audios)])[0]
            assert chunked.last_stats.prefill_chunk == 16
            assert ask_server(client, [user(text, images, audios)]) == expected
        assert server.stop(30) == 0
