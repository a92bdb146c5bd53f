"""API key, connection limit, body limit and /metrics (latencies, SLO attainment and goodput) on the
tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import openai
import pytest
import websockets

from tests.server.test_http import chat, request

KEY = "sk-prescient-test"


def test_api_key(make_tiny_server):
    server = make_tiny_server(api_key=KEY)
    status, body = request(server, "POST", "/v1/chat/completions", chat())
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert request(server, "GET", "/v1/models", headers={"authorization": "Bearer wrong"})[0] == 401
    assert request(server, "GET", "/health")[0] == 200  # probes need no key
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert client.chat.completions.create(**chat()).usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()

    async def ws_attempts():
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(server.ws_url)
        async with websockets.connect(server.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await ws.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 1}))
            first = json.loads(await ws.recv())
        return refused.value.response.status_code, first

    status, first = asyncio.run(ws_attempts())
    assert status == 401 and first["type"] == "response.created"


def test_connection_limit(make_tiny_server):
    server = make_tiny_server(max_connections=2)

    async def go():
        a = await websockets.connect(server.ws_url)
        b = await websockets.connect(server.ws_url)
        c = await websockets.connect(server.ws_url)
        refused = json.loads(await c.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await c.recv()
        http_status = await asyncio.to_thread(lambda: request(server, "GET", "/v1/models")[0])
        health = await asyncio.to_thread(lambda: request(server, "GET", "/health")[0])
        await a.close()
        # the closed socket's slot is freed once the server has seen it close: asked again until
        # then (a slot never freed stays 503 past the deadline)
        deadline = time.monotonic() + 10
        while (after := await asyncio.to_thread(lambda: request(server, "GET", "/v1/models")[0])) != 200:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        await b.close()
        return refused, closed.value.rcvd.code, http_status, health, after

    refused, code, http_status, health, after = asyncio.run(go())
    assert refused["type"] == "error" and refused["error"]["code"] == "too_many_connections"
    assert code == 1013 and http_status == 503 and health == 200 and after == 200


def test_body_limit(make_tiny_server):
    server = make_tiny_server(max_body_bytes=2048)
    status, body = request(server, "POST", "/v1/chat/completions",
                           chat(messages=[{"role": "user", "content": "x" * 4096}]))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert request(server, "POST", "/v1/chat/completions", chat())[0] == 200


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing"
    return float(m.group(1))


def test_metrics(tiny):
    before = request(tiny, "GET", "/metrics")[1].decode()
    request(tiny, "POST", "/v1/chat/completions", chat(max_tokens=5))
    status, raw = request(tiny, "GET", "/metrics")
    text = raw.decode()
    assert status == 200
    for name in ("prescient_time_to_first_token_seconds", "prescient_itl_emission_seconds",
                 "prescient_itl_token_seconds", "prescient_time_per_output_token_seconds",
                 "prescient_e2e_request_latency_seconds"):
        assert f'{name}_bucket{{le="0.001"}}' in text  # buckets from 1 ms
        assert metric(text, f"{name}_count") >= metric(before, f"{name}_count") + 1
    # 5 tokens: 4 gaps after the first, on both bases when every output carries one token
    for name in ("prescient_itl_emission_seconds_count", "prescient_itl_token_seconds_count"):
        assert metric(text, name) >= metric(before, name) + 4
    assert metric(text, "prescient_generation_tokens_total", '{source="target"}') >= 5
    assert metric(text, "prescient_requests_total", '{finish_reason="length"}') >= 1
    assert metric(text, "prescient_num_requests_running") == 0
    assert metric(text, "prescient_num_requests_waiting") == 0
    assert 0 <= metric(text, "prescient_kv_cache_usage_ratio") <= 1
    assert 0 <= metric(text, "prescient_prefix_cache_hit_rate") <= 1
    for name in ("prescient_prefix_cache_hits_total", "prescient_grammar_mask_seconds_total",
                 "prescient_grammar_compile_seconds_count", "prescient_engine_step_seconds_count",
                 "prescient_pinned_sessions", "prescient_open_connections"):
        metric(text, name)


def test_speculation_metrics(make_tiny_server):
    server = make_tiny_server(speculate="ngram")
    # A repetitive prompt gives the n-gram proposer something to copy.
    body = chat(max_tokens=40, messages=[{"role": "user", "content": "a b c d a b c d a b c d a b c d"}])
    assert request(server, "POST", "/v1/chat/completions", body)[0] == 200
    text = request(server, "GET", "/metrics")[1].decode()
    drafted = metric(text, "prescient_spec_draft_tokens_total")
    accepted = metric(text, "prescient_spec_accepted_tokens_total")
    assert 0 <= accepted <= drafted
    rate = metric(text, "prescient_spec_acceptance_rate")
    assert rate == (accepted / drafted if drafted else 0.0)
    metric(text, "prescient_spec_mean_accepted_length")


def test_metrics_slo_attainment_and_goodput(make_tiny_server):
    """The SLO series move with the verdicts: a 1-token reply has no gap and meets a 1 ns ITL
    bound, a 5-token reply misses it (the TTFT bound is a minute: a loaded CPU cannot miss it)."""
    server = make_tiny_server(slo_ttft_ms=60_000.0, slo_itl_ms=1e-6)
    text = request(server, "GET", "/metrics")[1].decode()
    assert metric(text, "prescient_slo_requests_finished_total") == 0
    assert metric(text, "prescient_slo_requests_met_total") == 0
    assert math.isnan(metric(text, "prescient_slo_attainment_ratio"))  # nothing judged yet
    assert metric(text, "prescient_slo_goodput_requests_per_second") == 0
    assert metric(text, "prescient_slo_bound_seconds", '{objective="ttft"}') == 60.0
    assert metric(text, "prescient_slo_bound_seconds", '{objective="itl_emission"}') == pytest.approx(1e-9)

    assert request(server, "POST", "/v1/chat/completions", chat(max_tokens=1))[0] == 200
    met = request(server, "GET", "/metrics")[1].decode()
    assert metric(met, "prescient_slo_requests_finished_total") == 1
    assert metric(met, "prescient_slo_requests_met_total") == 1
    assert metric(met, "prescient_slo_attainment_ratio") == 1.0
    goodput = metric(met, "prescient_slo_goodput_requests_per_second")
    window = metric(met, "prescient_slo_window_seconds")
    assert 0 < window <= 60 and goodput == pytest.approx(1 / window, rel=0.05)

    assert request(server, "POST", "/v1/chat/completions", chat(max_tokens=5))[0] == 200
    missed = request(server, "GET", "/metrics")[1].decode()
    assert metric(missed, "prescient_slo_requests_finished_total") == 2
    assert metric(missed, "prescient_slo_requests_met_total") == 1
    assert metric(missed, "prescient_slo_attainment_ratio") == 0.5
    assert metric(missed, "prescient_slo_objective_met_total", '{objective="ttft"}') == 2
    assert metric(missed, "prescient_slo_objective_met_total", '{objective="itl_emission"}') == 1
    # still one good request, now over a longer span
    later = metric(missed, "prescient_slo_window_seconds")
    assert metric(missed, "prescient_slo_goodput_requests_per_second") == pytest.approx(1 / later, rel=0.05)
    assert metric(missed, "prescient_slo_goodput_requests_per_second") < goodput
