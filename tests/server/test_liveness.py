"""One request cannot stall the others: tokenizing runs off the event loop (and a prompt that
cannot fit is refused without tokenizing it), and a grammar with a huge forced run does not stall
its neighbours' streams (tiny model; liveness bounds, not performance targets)."""

from __future__ import annotations

import asyncio
import http.client
import json
import statistics
import threading
import time

import websockets

from tests.server.conftest import TINY_CONTEXT
from tests.server.test_http import chat, request

HEAVY_REGEX = "(c{1000}){1000}"  # forces a million characters: ~1.3 s per forced-span lookup


def _health_latency(server) -> float:
    start = time.monotonic()
    assert request(server, "GET", "/health")[0] == 200
    return time.monotonic() - start


def test_tokenizing_runs_off_the_event_loop(make_tiny_server):
    server = make_tiny_server()
    tok = server.ctx.tokenizer
    real = tok.encode

    def slow_encode(text, *args, **kwargs):  # a long prompt's tokenizing, made deterministic
        time.sleep(1.0)
        return real(text, *args, **kwargs)

    tok.encode = slow_encode
    bodies = [("/v1/chat/completions", chat(max_tokens=1)),
              ("/v1/completions", {"model": "tiny", "prompt": "Say hi", "max_tokens": 1}),
              ("/v1/responses", {"model": "tiny", "input": "Say hi", "max_output_tokens": 1})]
    try:
        for path, body in bodies:
            result = {}
            worker = threading.Thread(target=lambda: result.update(status=request(server, "POST", path, body)[0]))
            worker.start()
            time.sleep(0.2)  # the request is tokenizing now
            assert _health_latency(server) < 0.5, path
            worker.join()
            assert result["status"] == 200, path

        async def over_websocket():
            async with websockets.connect(server.ws_url) as ws:
                await ws.send(json.dumps({"type": "response.create", "input": "Say hi", "max_output_tokens": 1}))
                await asyncio.sleep(0.2)
                latency = await asyncio.to_thread(_health_latency, server)
                return latency, json.loads(await ws.recv())["type"]

        latency, first = asyncio.run(over_websocket())
        assert latency < 0.5 and first == "response.created"
    finally:
        tok.encode = real


def test_prompt_that_cannot_fit_is_refused_without_tokenizing(make_tiny_server):
    server = make_tiny_server()
    calls = []
    real = server.ctx.tokenizer.encode
    server.ctx.tokenizer.encode = lambda text, *a, **k: calls.append(len(text)) or real(text, *a, **k)
    text = "hello world " * 200_000  # 2.4 MB: ~30x what a 1024-token context can hold
    try:
        for path, body, param in [
                ("/v1/chat/completions", chat(messages=[{"role": "user", "content": text}]), "messages"),
                ("/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1}, "prompt"),
                ("/v1/responses", {"model": "tiny", "input": text}, "input")]:
            status, body = request(server, "POST", path, body)
            assert status == 400 and body["error"]["code"] == "context_length_exceeded", path
            assert body["error"]["param"] == param and "characters" in body["error"]["message"]
        assert calls == []  # refused on its length alone
        # the bound is the longest token, not a typical one: 40,000 characters of "#" are ~625
        # tokens, which fit; a bound of 16 characters a token (16k here) would refuse them
        status, body = request(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "#" * 40_000,
                                                                   "max_tokens": 1})
        assert status == 200 and 40_000 / 16 > TINY_CONTEXT > body["usage"]["prompt_tokens"]
    finally:
        server.ctx.tokenizer.encode = real


def _stream_times(server, body: dict, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    out["status"], out["times"] = resp.status, []
    for line in resp:
        if line.startswith(b"data: {"):
            out["times"] += json.loads(line[6:]).get("token_times") or []
    conn.close()


def test_heavy_grammar_does_not_stall_a_neighbour(make_tiny_server):
    server = make_tiny_server()
    plain = chat(max_tokens=150, ignore_eos=True, stream=True)
    heavy = chat(max_tokens=20, stream=True, response_format={"type": "regex", "regex": HEAVY_REGEX})
    assert request(server, "POST", "/v1/chat/completions",  # compiler built, xgrammar warm
                   chat(max_tokens=2, response_format={"type": "regex", "regex": "[ab]{3}"}))[0] == 200
    neighbour, constrained = {}, {}
    threads = [threading.Thread(target=_stream_times, args=(server, plain, neighbour)),
               threading.Thread(target=_stream_times, args=(server, heavy, constrained))]
    threads[0].start()
    time.sleep(0.1)
    threads[1].start()
    for t in threads:
        t.join()
    assert neighbour["status"] == constrained["status"] == 200
    assert len(constrained["times"]) == 20
    gaps = sorted((b - a for a, b in zip(neighbour["times"], neighbour["times"][1:])), reverse=True)
    # Before the fix every constrained step (~20 of the neighbour's steps ran beside them) stalled
    # the batch for over a second: many of the neighbour's gaps were over a second. Normal gaps are
    # a few ms. One or two gaps of tens of ms are a GC or another process taking the CPU for a
    # moment on a shared 2-core machine, not the bug, so the bound is on the third-largest gap
    # (under 0.2 s, ~50x a normal gap: a stall that recurs fails it), and the worst gap only has
    # to stay under a second (so even a single stall as long as the bug's still fails)
    assert len(gaps) == 149
    assert gaps[0] < 1.0 and gaps[2] < 0.2, (gaps[:5], statistics.median(gaps))
