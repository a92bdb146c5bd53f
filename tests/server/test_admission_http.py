"""No request can wedge the server (issue 13), on the tiny model: a prompt or `max_tokens` the
KV cache can never hold is a 400 naming both numbers and the default budget is cut to fit; a
full engine queue or a wait past its limit is a 429 with Retry-After (an `error` chunk or event
once a stream has begun); tiny temperatures are greedy and out-of-range seeds a 400 on `seed`.
Every test ends by checking that the server still serves (generous bounds: liveness only).

To hold requests in the queue deterministically, the tests park the engine thread (a step hook
or an `AsyncEngine.call` that waits on an event) instead of racing a fast tiny model."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import websockets

from tests.server.test_http import chat, request


def post(server, path: str, body: dict, timeout: float = 30.0):
    """-> (status, headers, raw body); a wedged server fails the test with a timeout."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), raw


def still_serving(server) -> None:
    status, got = request(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                                               "temperature": 0})
    assert status == 200 and got["usage"]["completion_tokens"] == 3, got


def ws_create(server, **fields) -> list[dict]:
    """One response.create over the WebSocket -> its events up to the first terminal one."""
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": "tiny", "input": "Hello",
                                      "max_output_tokens": 4, "temperature": 0, **fields}))
            events = []
            while not events or events[-1]["type"] not in ("error", "response.completed", "response.incomplete",
                                                           "response.failed"):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return events

    return asyncio.run(go())


def test_request_over_the_kv_cache_is_a_400_and_the_default_budget_is_cut(make_tiny_server):
    server = make_tiny_server(engine={"num_blocks": 8})  # 8 x 16 = 128 tokens, far under the context
    assert server.ctx.kv_tokens == 128
    status, got = request(server, "POST", "/v1/completions", {"model": "tiny", "prompt": [5] * 200, "max_tokens": 4})
    assert status == 400 and got["error"]["param"] == "prompt", got
    assert got["error"]["code"] == "context_length_exceeded"
    assert "200 tokens" in got["error"]["message"] and "KV cache holds 128 tokens" in got["error"]["message"]
    status, got = request(server, "POST", "/v1/chat/completions",
                          chat(messages=[{"role": "user", "content": "word " * 300}]))
    assert status == 400 and got["error"]["param"] == "messages" and "128" in got["error"]["message"], got
    status, got = request(server, "POST", "/v1/completions", {"model": "tiny", "prompt": [5] * 20, "max_tokens": 200})
    assert status == 400 and got["error"]["param"] == "max_tokens", got
    assert "KV cache holds 128 tokens: at most 108 tokens can be generated" in got["error"]["message"]
    # No max_tokens: the default (1024) is cut to what the cache holds, and the request finishes.
    status, got = request(server, "POST", "/v1/chat/completions", {**chat(ignore_eos=True), "max_tokens": None})
    assert status == 200, got
    usage = got["usage"]
    assert got["choices"][0]["finish_reason"] == "length" and usage["total_tokens"] == 128, usage
    still_serving(server)


def test_full_queue_is_a_429_with_retry_after_before_any_byte(make_tiny_server):
    server = make_tiny_server(engine={"max_num_seqs": 1, "max_waiting": 1, "retry_after_s": 7.0})
    frozen, release = threading.Event(), threading.Event()

    def park_once_queued(engine, outputs, dt):  # engine thread: hold it while one request waits
        if engine.scheduler.waiting and not frozen.is_set():
            frozen.set()
            release.wait(30)

    long_conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    long_conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "tiny", "prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True}),
        headers={"content-type": "application/json"})
    long_resp = long_conn.getresponse()
    assert long_resp.status == 200 and long_resp.readline().startswith(b"data: ")  # running
    server.aengine.step_hooks.append(park_once_queued)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(post, server, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3})
        try:
            assert frozen.wait(30)
            for path, body in (("/v1/chat/completions", chat(stream=True)), ("/v1/completions",
                                                                              {"model": "tiny", "prompt": "Hi"})):
                status, headers, raw = post(server, path, body)
                error = json.loads(raw)["error"]
                assert status == 429 and headers.get("retry-after") == "7", (status, headers, raw)
                assert error["code"] == "overloaded" and error["retry_after"] == 7.0 and "waiting" in error["message"]
            events = ws_create(server)
            assert [e["type"] for e in events] == ["error"] and events[0]["status"] == 429, events
            assert events[0]["error"]["code"] == "overloaded" and events[0]["error"]["retry_after"] == 7.0
        finally:
            release.set()
            long_conn.close()  # aborts the long request, so the queued one runs
        status, _, raw = queued.result(timeout=60)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    still_serving(server)


def test_request_not_started_in_time_is_a_429_and_the_server_goes_on(make_tiny_server):
    server = make_tiny_server(engine={"max_queue_wait_s": 0.5, "retry_after_s": 2.0})
    release = threading.Event()
    parked = threading.Thread(target=server.aengine.call, args=(lambda engine: release.wait(30),), daemon=True)
    parked.start()
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(post, server, "/v1/chat/completions", chat())
        streamed = pool.submit(post, server, "/v1/chat/completions", chat(stream=True))
        ws = pool.submit(ws_create, server)
        try:
            deadline = time.monotonic() + 30
            while len(server.aengine._inbox) < 3 and time.monotonic() < deadline:  # all three submitted
                time.sleep(0.02)
            time.sleep(0.6)  # past the 0.5 s limit while the engine cannot start them
        finally:
            release.set()
        status, headers, raw = plain.result(timeout=60)
        assert status == 429 and headers.get("retry-after") == "2", (status, raw)
        error = json.loads(raw)["error"]
        assert error["code"] == "overloaded" and error["retry_after"] == 2.0 and "waited" in error["message"]
        status, _, raw = streamed.result(timeout=60)  # the 200 went out first: an error chunk ends it
        chunks = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert status == 200 and chunks[-1] == "[DONE]", raw
        assert json.loads(chunks[-2])["error"]["code"] == "overloaded", raw
        events = ws.result(timeout=60)
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"], events
        assert events[-1]["status"] == 429 and events[-1]["error"]["retry_after"] == 2.0
    parked.join(30)
    # each was accepted and then shed: a miss in attainment, not a request nobody judged
    _, raw = request(server, "GET", "/metrics")
    lines = raw.decode().splitlines()
    assert 'prescient_request_outcomes_total{outcome="expired"} 3.0' in lines, raw
    assert "prescient_slo_requests_met_total 0.0" in lines and "prescient_slo_attainment_ratio 0.0" in lines
    still_serving(server)


def test_tiny_temperature_is_greedy_and_a_bad_seed_names_seed(tiny):
    greedy = request(tiny, "POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True})
    tiny_t = request(tiny, "POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 6,
                                                       "temperature": 1e-300, "ignore_eos": True})
    assert greedy[0] == tiny_t[0] == 200
    assert tiny_t[1]["choices"][0]["text"] == greedy[1]["choices"][0]["text"]
    for seed in (2 ** 63, -2 ** 63 - 1, 2 ** 64):
        status, got = request(tiny, "POST", "/v1/chat/completions", chat(seed=seed, temperature=0.7))
        assert status == 400 and got["error"]["param"] == "seed", got
    status, got = request(tiny, "POST", "/v1/chat/completions", chat(seed=-2 ** 63, temperature=0.7))
    assert status == 200, got
