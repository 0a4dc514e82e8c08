"""CORS (builder_plugin/serve/cors.py): off by default; with --allowed-origins, a preflight from an allowed origin is
answered (without a key, and not counted as a chat response) and every answer carries the origin, a 401 included;
another origin gets nothing. And in a real browser: a page on an allowed origin calls the API, one on another
origin cannot."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from builder_plugin.serve.cors import MAX_AGE_S, check_origins
from tests.support.serving import running_server

KEY = "cors-test-key"
APP = "https://app.example.com"
OTHER = "https://elsewhere.example.com"
CHAT = "/v1/chat/completions"


def preflight(url: str, origin: str, path: str = CHAT) -> httpx.Response:
    return httpx.options(url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "authorization, content-type"})


def chat_body(running) -> dict:
    return {"model": running.routes.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def requests_counted(running) -> float:
    text = httpx.get(f"{running.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("builder_plugin_requests_total"))


def test_cors_is_off_by_default(served, tmp_path):
    with running_server(served, tmp_path) as running:
        response = preflight(running.url, APP)
        assert response.status_code == 405 and "access-control-allow-origin" not in response.headers
        answer = httpx.post(running.url + CHAT, json=chat_body(running), headers={"Origin": APP})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_allowed_origins_get_answers_others_do_not(served, tmp_path):
    with running_server(served, tmp_path, api_keys=[KEY], allowed_origins=[f"{APP}, http://localhost:3000"]) as running:
        before = requests_counted(running)
        allowed = preflight(running.url, APP)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == APP
        assert {"GET", "POST"} <= {m.strip() for m in allowed.headers["access-control-allow-methods"].split(",")}
        assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                      allowed.headers["access-control-allow-headers"].split(",")}
        assert allowed.headers["access-control-max-age"] == str(MAX_AGE_S)
        assert "access-control-allow-credentials" not in allowed.headers  # no cookies: a bearer key is a header
        assert preflight(running.url, "http://localhost:3000").status_code == 200

        refused = preflight(running.url, OTHER)
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        assert requests_counted(running) == before  # preflights are not chat responses

        answer = httpx.post(running.url + CHAT, json=chat_body(running),
                            headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP
        unauthorized = httpx.get(f"{running.url}/v1/models", headers={"Origin": APP})
        assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == APP
        other = httpx.get(f"{running.url}/v1/models", headers={"Origin": OTHER, "Authorization": f"Bearer {KEY}"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    with running_server(served, tmp_path, allowed_origins=["*"]) as running:
        assert preflight(running.url, OTHER).headers["access-control-allow-origin"] == "*"


def test_origins_are_checked():
    assert check_origins(["https://a.example, http://localhost:8080", "*"]) == (
        "https://a.example", "http://localhost:8080", "*")
    assert check_origins([" , "]) == ()
    for bad in ("https://a.example/", "a.example", "HTTPS://A.EXAMPLE", "ftp://a.example", "https://a.example:99999",
                "https://user@a.example", "https://a.example/path", "null"):
        with pytest.raises(ValueError, match=r"^--allowed-origins: '.*' is not an origin: write scheme://host"):
            check_origins([bad])


def test_cli_allowed_origins_and_no_ui(tiny_package, tmp_path):
    bad = subprocess.run([sys.executable, "-m", "builder_plugin.serve", str(tmp_path / "nowhere"),
                          "--allowed-origins", "https://app.example.com/"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == ["error: --allowed-origins: 'https://app.example.com/' is not an origin: write "
                                       "scheme://host[:port] in lower case, without a path (e.g. "
                                       "https://app.example.com), or * for any"]
    command = [sys.executable, "-m", "builder_plugin.serve", str(tiny_package), "--port", "0", "--no-ui",
               "--allowed-origins", APP, "--allowed-origins", "http://localhost:3000"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        url = process.stdout.readline().split(" at ")[1].strip().removesuffix("/v1")
        lines = [process.stdout.readline() for _ in range(3)]
        assert lines[-1] == f"browsers on {APP}, http://localhost:3000 may call the server (CORS)\n", lines
        assert not any("chat page" in line for line in lines)
        assert httpx.get(f"{url}/").status_code == 404
        assert preflight(url, "http://localhost:3000").headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        process.terminate()
        process.wait(timeout=30)


# ---- in a browser -------------------------------------------------------------------------------------------------

CALL = """
const [url, key, done] = arguments;
fetch(url, {method: 'POST', headers: {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'},
            body: JSON.stringify({messages: [{role: 'user', content: 'Hi'}], max_tokens: 2})})
  .then(response => response.json().then(body => done({status: response.status, body})))
  .catch(error => done({error: error.name}));
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def static_site(folder: Path) -> Iterator[str]:
    """An app on another origin: `folder` served on a free 127.0.0.1 port."""
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=folder))
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()
        thread.join(timeout=10)


def test_a_browser_app_on_an_allowed_origin_calls_the_api(browser, served, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<!doctype html><title>An app</title>")
    with static_site(site) as app, static_site(site) as other, \
            running_server(served, tmp_path, api_keys=[KEY], allowed_origins=[app]) as running:
        browser.get(f"{app}/index.html")
        answered = browser.execute_async_script(CALL, running.url + CHAT, KEY)
        assert answered["status"] == 200 and answered["body"]["usage"]["completion_tokens"] > 0, answered
        wrong_key = browser.execute_async_script(CALL, running.url + CHAT, "wrong")
        assert wrong_key["status"] == 401 and wrong_key["body"]["error"]["code"] == "invalid_api_key"
        browser.get(f"{other}/index.html")
        assert browser.execute_async_script(CALL, running.url + CHAT, KEY) == {"error": "TypeError"}
