"""builder_plugin.serve access control (API keys) and /metrics, on the tiny package: answers behind a key equal a
Chat's run independently on the same package, and the metrics add up to what the responses reported."""

from __future__ import annotations

import hmac
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from builder_plugin.runtime import FOLLOW_UP_ROOM
from builder_plugin.serve import app as served_app
from builder_plugin.serve import auth
from builder_plugin.serve.__main__ import API_KEYS_VARIABLE, requested_keys
from builder_plugin.serve.metrics import CountChatResponses, Metrics
from tests.support.serving import SHORT, Answer, Running, ask_chat, ask_server, running_server, user, wait_for

KEYS = ("key-one", "sk-2nd.KEY_with~punctuation!")
CHAT_URL = "/v1/chat/completions"


@pytest.fixture
def keyed(served, tmp_path) -> Iterator[Running]:
    served.gate.set()
    with running_server(served, tmp_path, api_keys=KEYS) as running:
        yield running


def client(running: Running, key: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0, **options)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def scrape(running: Running, key: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, its labels) -> value, from GET /metrics parsed by prometheus_client's own parser."""
    response = httpx.get(f"{running.url}/metrics", headers=bearer(key))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


# ---- keys ---------------------------------------------------------------------------------------------------------


def test_requests_without_a_valid_key_get_401(keyed):
    body = {"model": keyed.routes.model_id, "messages": [user("Hi")], "max_tokens": SHORT}
    missing = "missing Authorization: Bearer header"
    cases = [({}, missing), ({"Authorization": "Basic a2V5LW9uZQ=="}, missing), ({"Authorization": "Bearer"}, missing),
             (bearer("wrong"), "Incorrect API key provided"), (bearer(KEYS[0][:-1]), "Incorrect API key provided"),
             (bearer(KEYS[0] + "x"), "Incorrect API key provided"),
             (bearer(f"{KEYS[0]},{KEYS[1]}"), "Incorrect API key provided")]
    for headers, message in cases:
        for method, path in (("POST", CHAT_URL), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/nothing")):
            response = httpx.request(method, keyed.url + path, headers=headers, json=body if method == "POST" else None)
            assert response.status_code == 401, (headers, path)
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
            assert error["message"].startswith(message), (headers, error)
            assert KEYS[0] not in error["message"]
    with pytest.raises(openai.AuthenticationError) as refused:
        ask_server(client(keyed, "wrong"), [user("Hi")])
    assert refused.value.code == "invalid_api_key"
    health = httpx.get(f"{keyed.url}/health")  # open, for load balancers
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_each_key_gets_answers_equal_to_chats(keyed, chat):
    for number, key in enumerate(KEYS):
        question = f"Question {number}: what is a lighthouse?"
        for stream in (False, True):
            got = ask_server(client(keyed, key), [user(question)], stream=stream)
            assert got == ask_chat(chat, [(question, (), ())])[0]
    # the scheme is case-insensitive (RFC 9110)
    response = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"bearer {KEYS[1]}"})
    assert response.status_code == 200 and response.json()["data"][0]["id"] == keyed.routes.model_id


def test_every_key_is_compared(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a, b):
        compared.append((a, b))
        return compare(a, b)

    middleware = auth.BearerAuth(app=None, keys=["a", "bb", "ccc"])
    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert middleware._known(b"a") and not middleware._known(b"abc")
    assert len(compared) == 6  # no early exit on the first key's match
    assert {len(a) for pair in compared for a in pair} == {32}  # digests: the key's length is not compared


def test_keys_are_checked_before_anything_else():
    for keys in ([""], ["ok", "with space"], ["tab\t"], ["caf\u00e9"]):
        with pytest.raises(ValueError, match=r"^--api-key: key \d (is empty|has whitespace)"):
            auth.check_keys(keys)
    assert requested_keys(["a"], {API_KEYS_VARIABLE: "b,c"}) == ("a",)  # the flags win
    assert requested_keys(None, {API_KEYS_VARIABLE: "b, c"}) == ("b", "c")
    assert requested_keys(None, {API_KEYS_VARIABLE: " "}) == requested_keys(None, {}) == ()
    with pytest.raises(ValueError, match=f"^{API_KEYS_VARIABLE}: key 2 is empty$"):
        requested_keys(None, {API_KEYS_VARIABLE: "b,,c"})


def test_cli_refuses_a_bad_key_in_one_line(tmp_path):
    """Before the package is even looked at: the folder does not exist, the error is about the key."""
    env = {k: v for k, v in os.environ.items() if k != API_KEYS_VARIABLE}
    for flags, variable, message in ((["--api-key", ""], None, "error: --api-key: key 1 is empty"),
                                     ([], "good, two words", f"error: {API_KEYS_VARIABLE}: key 2 has whitespace")):
        run_env = env if variable is None else {**env, API_KEYS_VARIABLE: variable}
        result = subprocess.run([sys.executable, "-m", "builder_plugin.serve", str(tmp_path / "nowhere"), *flags],
                                capture_output=True, text=True, timeout=60, env=run_env)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), result.stderr


def test_cli_says_whether_keys_are_required(tiny_package):
    env = {**os.environ, API_KEYS_VARIABLE: "from-the-environment"}
    command = [sys.executable, "-m", "builder_plugin.serve", str(tiny_package), "--port", "0", "--api-key", KEYS[0]]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = process.stdout.readline().split(" at ")[1].strip().removesuffix("/v1")
        keys_line = process.stdout.readline()
        assert keys_line.startswith("API keys: 1 accepted, required") and KEYS[0] not in keys_line
        assert httpx.get(f"{url}/v1/models", headers=bearer(KEYS[0])).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers=bearer("from-the-environment")).status_code == 401
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_no_keys_no_checks(served, tmp_path):
    served.gate.set()
    with running_server(served, tmp_path) as running:
        assert httpx.get(f"{running.url}/metrics").status_code == 200
        assert httpx.get(f"{running.url}/v1/models", headers=bearer("anything")).status_code == 200


# ---- metrics ------------------------------------------------------------------------------------------------------


def test_metrics_add_up_to_the_responses(served, chat, tmp_path):
    key = KEYS[1]
    started = time.perf_counter()
    served.gate.set()
    with running_server(served, tmp_path, api_keys=KEYS, max_queue=1) as running:
        assert httpx.get(f"{running.url}/metrics").status_code == 401
        api = client(running, key)
        questions = ["Name a color.", "Name a bird.", "Name a tree."]
        answers: list[Answer] = []
        for number, question in enumerate(questions):
            answers.append(ask_server(api, [user(question)], stream=number == 1))
            assert answers[-1] == ask_chat(chat, [(question, (), ())])[0]
        with pytest.raises(openai.BadRequestError):
            ask_server(api, [user("Hi")], temperature=3)
        with pytest.raises(openai.NotFoundError):
            api.chat.completions.create(model="gpt-5", messages=[user("Hi")], max_tokens=SHORT)
        with pytest.raises(openai.AuthenticationError):
            client(running, "wrong").chat.completions.create(model="m", messages=[user("Hi")], max_tokens=SHORT)

        # One request held at the gate (active), one waiting (queue), one refused (429); the held one's client gives
        # up (499) before its answer starts.
        results: dict[str, Answer | BaseException] = {}

        def send(question: str, timeout: float | None = None) -> None:
            try:
                results[question] = ask_server(client(running, key, timeout=timeout), [user(question)])
            except BaseException as exc:
                results[question] = exc

        def gauge(name: str) -> float:
            return scrape(running, key)[(f"builder_plugin_{name}", ())]

        served.gate.clear()
        try:
            held = threading.Thread(target=send, args=("Held.", 2.0))
            held.start()
            wait_for(lambda: gauge("active_requests") == 1, "a busy worker")
            waiting = threading.Thread(target=send, args=("Waiting.",))
            waiting.start()
            wait_for(lambda: gauge("queue_depth") == 1, "a waiting request")
            with pytest.raises(openai.RateLimitError):
                ask_server(api, [user("Refused.")])
            held.join(timeout=30)
            wait_for(lambda: ("builder_plugin_requests_total", (("status", "499"),)) in scrape(running, key),
                     "the disconnect to be seen")
        finally:
            served.gate.set()
        waiting.join(timeout=30)
        assert isinstance(results["Held."], openai.APITimeoutError)
        assert results["Waiting."] == ask_chat(chat, [("Waiting.", (), ())])[0]
        answers.append(results["Waiting."])
        wait_for(lambda: gauge("active_requests") == 0, "an idle worker")
        samples = scrape(running, key)
    elapsed = time.perf_counter() - started

    statuses = {dict(labels)["status"]: value for (name, labels), value in samples.items()
                if name == "builder_plugin_requests_total"}
    assert statuses == {"200": 4, "400": 1, "404": 1, "401": 1, "429": 1, "499": 1}
    assert samples[("builder_plugin_prompt_tokens_total", ())] == sum(a.prompt_tokens for a in answers)
    assert samples[("builder_plugin_generated_tokens_total", ())] == sum(a.completion_tokens for a in answers)
    gauges = {name: samples[(f"builder_plugin_{name}", ())]
              for name in ("queue_depth", "active_requests", "live_conversations", "kv_cache_bytes")}
    # each answered conversation is kept (up to 8), its cache sized to its prompt, max_tokens and the follow-up room
    decoder = json.loads((served.package.dir / "genai_config.json").read_text())["model"]["decoder"]
    float32_kv = decoder["num_hidden_layers"] * 2 * decoder["num_key_value_heads"] * decoder["head_size"] * 4
    positions = sum(a.prompt_tokens + SHORT + FOLLOW_UP_ROOM for a in answers)
    assert gauges == {"queue_depth": 0, "active_requests": 0, "live_conversations": len(answers),
                      "kv_cache_bytes": positions * float32_kv}
    with_text = [a for a in answers if a.text]  # the time to the first piece is observed when there is one
    check_histogram(samples, "builder_plugin_time_to_first_token_seconds", len(with_text), elapsed * len(with_text))
    check_histogram(samples, "builder_plugin_time_per_output_token_seconds",
                    sum(a.completion_tokens - 1 for a in with_text), elapsed)


def check_histogram(samples: dict, name: str, count: int, most: float) -> None:
    """`count` observations, their sum in [0, most], cumulative buckets ending in +Inf = count."""
    buckets = sorted((float(dict(labels)["le"]), value) for (sample, labels), value in samples.items()
                     if sample == f"{name}_bucket")
    assert buckets[-1] == (float("inf"), count) and samples[(f"{name}_count", ())] == count, name
    assert [value for _, value in buckets] == sorted(value for _, value in buckets), name
    assert 0 < samples[(f"{name}_sum", ())] <= most, name


def test_every_chat_response_is_counted_once_with_the_status_the_client_got():
    """Without a model: a route that fails unexpectedly (500, answered by Starlette's outermost error middleware), a
    wrong method (405), a stream (counted when it starts) and another path (not counted)."""
    async def chat_route(request):
        if request.query_params.get("fail"):
            raise RuntimeError("a bug")
        return StreamingResponse(iter(["data: 1\n\n", "data: [DONE]\n\n"]), media_type="text/event-stream")

    metrics = Metrics(queue_depth=lambda: 0, active_requests=lambda: 0, live_conversations=lambda: 0,
                      kv_bytes=lambda: 0, kv_usage=lambda: 0.0, model_name="m")
    handlers = {Exception: served_app._unexpected_error}
    app = Starlette(routes=[Route(CHAT_URL, chat_route, methods=["POST"]), Route("/other", chat_route)],
                    exception_handlers=handlers, middleware=[Middleware(CountChatResponses, metrics=metrics)])
    test_client = TestClient(app, raise_server_exceptions=False)
    seen = [test_client.post(CHAT_URL, params={"fail": "1"}).status_code, test_client.get(CHAT_URL).status_code,
            test_client.post(CHAT_URL).status_code, test_client.post(CHAT_URL).status_code]
    assert test_client.get("/other").status_code == 200
    assert seen == [500, 405, 200, 200]
    text = metrics.exposition()[0].decode()
    counted = {s.labels["status"]: s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "builder_plugin_requests_total"}
    assert counted == {"500": 1, "405": 1, "200": 2}
