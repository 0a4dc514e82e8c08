"""python -m builder_plugin.serve: a real server process, its start, its stop signals and drain, its errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

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
