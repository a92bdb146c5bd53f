"""Issue 24, every per-request input bounded before it costs anyone else: strings the server
echoes on its events (`stream_id`, `metadata`), the message count and total characters (checked
before the chat template renders), `logit_bias` and stop sequences; bodies of megabytes decoded
off the event loop, so a bystander stream keeps its pace while they are refused."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import websockets

from prescient.server import openai_http
from prescient.server.limits import (MAX_MESSAGES, MAX_METADATA_PAIRS, MAX_METADATA_VALUE_CHARS,
                                     MAX_STREAM_ID_CHARS)
from tests.server.conftest import TINY_CONTEXT
from tests.server.test_http import chat, request
from tests.server.test_responses_ws import create, run, until_terminal


def test_a_huge_stream_id_is_refused_without_being_echoed(make_tiny_server):
    server = make_tiny_server(max_frame_bytes=2 << 20)

    async def go():
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(create(stream_id="s" * 1_000_000, max_output_tokens=40))
            refused = await until_terminal(ws)
            await ws.send(create(stream_id="s" * MAX_STREAM_ID_CHARS, max_output_tokens=2))
            return refused, await until_terminal(ws)

    refused, ok = run(go())
    (event,) = refused
    assert event["type"] == "error" and event["error"]["param"] == "stream_id", event
    assert event["stream_id"] is None and len(json.dumps(event)) < 1000
    assert ok[-1]["type"] in ("response.completed", "response.incomplete")
    assert all(e["stream_id"] == "s" * MAX_STREAM_ID_CHARS for e in ok)
    status, got = request(server, "POST", "/v1/responses", {"model": "tiny", "input": "hi", "stream": True,
                                                            "stream_id": "s" * (MAX_STREAM_ID_CHARS + 1)})
    assert status == 400 and got["error"]["param"] == "stream_id", got


def test_metadata_is_bounded_as_openai_bounds_it(make_tiny_server):
    tiny = make_tiny_server()
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1}
    for metadata, param in [({f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}, "metadata"),
                            ({"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}, "metadata.k"),
                            ({"k" * 65: "v"}, "metadata")]:
        status, got = request(tiny, "POST", "/v1/responses", body | {"metadata": metadata})
        assert status == 400 and got["error"]["param"] == param, got
    status, got = request(tiny, "POST", "/v1/responses", body | {"metadata": {"k": "v" * MAX_METADATA_VALUE_CHARS}})
    assert status == 200 and got["metadata"] == {"k": "v" * MAX_METADATA_VALUE_CHARS}


def test_message_count_and_length_are_refused_before_the_template_renders(make_tiny_server, monkeypatch):
    server = make_tiny_server()
    hf = server.ctx.renderer.tokenizer.hf
    rendered = []
    real = hf.apply_chat_template
    monkeypatch.setattr(hf, "apply_chat_template", lambda *a, **k: rendered.append(1) or real(*a, **k))
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    long = [{"role": "user", "content": "x" * (TINY_CONTEXT * server.ctx.renderer.max_token_chars + 1)}]
    cases = [("/v1/chat/completions", chat(messages=many), "messages", "too_many_messages"),
             ("/v1/responses", {"model": "tiny", "input": many}, "input", "too_many_messages"),
             ("/v1/chat/completions", chat(messages=long), "messages", "context_length_exceeded"),
             ("/v1/responses", {"model": "tiny", "input": long}, "input", "context_length_exceeded"),
             ("/v1/responses", {"model": "tiny", "input": "hi", "instructions": long[0]["content"]}, "input",
              "context_length_exceeded")]
    for path, body, param, code in cases:
        status, got = request(server, "POST", path, body)
        assert status == 400 and (got["error"]["param"], got["error"]["code"]) == (param, code), (path, got)
    assert not rendered, "the chat template rendered a conversation that could never fit"
    assert request(server, "POST", "/v1/chat/completions", chat())[0] == 200 and rendered


def test_logit_bias_and_stop_are_checked(make_tiny_server):
    tiny = make_tiny_server()
    refusals = [{"logit_bias": {"abc": 1}}, {"logit_bias": {"99999999": 1}}, {"logit_bias": {"-5": 1}},
                {"logit_bias": {"5": 1e9}}, {"logit_bias": {"5": -101}}, {"logit_bias": {str(i): 1 for i in range(1025)}},
                {"logit_bias": {"1" * 40: 1}}]
    for path, base in [("/v1/chat/completions", chat()), ("/v1/completions", {"model": "tiny", "prompt": "hi"})]:
        for fields in refusals:
            status, got = request(tiny, "POST", path, base | fields)
            assert status == 400 and got["error"]["param"] == "logit_bias", (path, fields, got)
        for stop in (["a", "b", "c", "d", "e"], ["x" * 257]):
            status, got = request(tiny, "POST", path, base | {"stop": stop})
            assert status == 400 and got["error"]["param"] == "stop", (path, stop, got)
    assert request(tiny, "POST", "/v1/chat/completions", chat(logit_bias={"5": -100, "7": 2.5}))[0] == 200


def _post(port: int, body: bytes, out: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    out.append((response.status, json.loads(response.read())))
    conn.close()


def test_megabyte_bodies_are_decoded_off_the_event_loop(canary_server, monkeypatch):
    """200,000 empty messages (6 MB): decoding and converting them on the event loop froze every
    stream 0.5 s per body (1.7 s for three at once). Now each is decoded on a worker thread, so the
    canary keeps streaming and /health keeps answering while three such bodies are refused."""
    server, canary = canary_server
    # The cause, checked directly rather than through timings (which a loaded 2-core host
    # stretches): where the chat body's decode and conversion run. A thread with a running
    # asyncio loop is the event loop's.
    decoded_on: list[tuple[str, bool]] = []
    real_parse = openai_http._parse_chat

    def recording_parse(body):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        decoded_on.append((threading.current_thread().name, on_loop))
        return real_parse(body)

    monkeypatch.setattr(openai_http, "_parse_chat", recording_parse)
    body = json.dumps(chat(messages=[{"role": "user", "content": ""}] * 200_000)).encode()
    assert len(body) > 5 << 20
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        while not done.is_set():
            t = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            health.append(time.perf_counter() - t)
            time.sleep(0.01)
        conn.close()

    prober = threading.Thread(target=probe)
    prober.start()
    t0 = time.perf_counter()
    for _ in range(2):
        answers: list = []
        posts = [threading.Thread(target=_post, args=(server.port, body, answers)) for _ in range(3)]
        for p in posts:
            p.start()
        for p in posts:
            p.join(60)
        assert [(s, a["error"]["param"]) for s, a in answers] == [(400, "messages")] * 3, answers
    done.set()
    prober.join(30)
    # all six bodies decoded, none of them on the event loop's thread
    assert len(decoded_on) == 6 and not any(on_loop for _, on_loop in decoded_on), decoded_on
    # and the server stayed live: liveness bounds only (msgspec holds the GIL while it decodes in
    # its thread, so on 2 shared cores the canary and /health do slow down while it works); a
    # stall of seconds is a wedged server, not load
    canary.check(t0, bound_s=3.0)
    assert health and max(health) < 3.0, f"/health took {max(health):.3f} s"
