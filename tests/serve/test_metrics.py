"""The gauges under the names the Kubernetes Gateway API inference extension and llm-d read from vLLM
(vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc), labelled with the model's name:
while one request is answered and one waits, and after, against what /health reports."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serving import ask_server, running_server, user, wait_for

GATEWAY_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def gateway_gauges(url: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """name -> (type, labels, value) of the vllm:* samples of GET /metrics, by prometheus_client's own parser."""
    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in GATEWAY_GAUGES:
                assert sample.name not in found, f"{sample.name} twice"
                found[sample.name] = (family.type, sample.labels, sample.value)
    return found


def test_gateway_gauges(served, tmp_path):
    budget = 64 << 20
    with running_server(served, tmp_path, kv_budget_bytes=budget, max_conversations=1) as running:
        model = running.routes.model_id
        idle = gateway_gauges(running.url)
        assert idle == {name: ("gauge", {"model_name": model}, 0.0) for name in GATEWAY_GAUGES}

        ask_server(running.client(), [user("Hello!")])
        health = httpx.get(f"{running.url}/health").json()
        usage = gateway_gauges(running.url)["vllm:kv_cache_usage_perc"][2]
        assert health["kv_bytes"] > 0 and usage == pytest.approx(health["kv_bytes"] / health["kv_budget_bytes"])
        assert health["kv_budget_bytes"] == budget

        # one request held inside the runtime (running), one waiting for the only conversation (waiting)
        served.gate.clear()
        threads = [threading.Thread(target=ask_server, args=(running.client(), [user(q)])) for q in ("One", "Two")]
        try:
            threads[0].start()
            wait_for(lambda: gateway_gauges(running.url)["vllm:num_requests_running"][2] == 1, "a running request")
            threads[1].start()
            wait_for(lambda: gateway_gauges(running.url)["vllm:num_requests_waiting"][2] == 1, "a waiting request")
            health = httpx.get(f"{running.url}/health").json()
            assert (health["answering"], health["waiting"]) == (1, 1)
        finally:
            served.gate.set()
            for thread in threads:
                thread.join(timeout=60)
        wait_for(lambda: gateway_gauges(running.url)["vllm:num_requests_running"][2] == 0, "an idle server")
        assert gateway_gauges(running.url)["vllm:num_requests_waiting"][2] == 0


def test_kv_usage_is_at_most_one(served, tmp_path):
    """A budget smaller than one conversation's cache: the answer still runs (answers are never cut); usage: full."""
    with running_server(served, tmp_path, kv_budget_bytes=1) as running:
        ask_server(running.client(), [user("Hello!")])
        assert httpx.get(f"{running.url}/health").json()["kv_bytes"] > 1
        assert gateway_gauges(running.url)["vllm:kv_cache_usage_perc"][2] == 1.0
