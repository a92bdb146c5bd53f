"""An exception inside an engine step ends that step's requests with an error output (clients
may retry), frees their KV, and the engine goes on serving new requests: over HTTP (streamed and
not) and over the Responses WebSocket."""

from __future__ import annotations

import http.client
import json
import threading

from websockets.sync.client import connect

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def _break_next_forward(engine, times: int = 1):
    """Make the model's next `times` forwards raise; returns an event set once they have."""
    forward, done, left = engine.model.forward, threading.Event(), [times]

    def broken(batch, kv):
        if left[0] > 0:
            left[0] -= 1
            if not left[0]:
                done.set()
            raise RuntimeError("injected fault")
        return forward(batch, kv)

    engine.model.forward = broken
    return done, lambda: setattr(engine.model, "forward", forward)


def _post(server, body: dict) -> tuple[int, bytes]:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "ignore_eos": True,
        "temperature": 0}


def test_a_failing_step_fails_its_requests_and_the_engine_serves_the_next(make_tiny_server):
    server = make_tiny_server()
    done, restore = _break_next_forward(server.engine)
    try:
        status, body = _post(server, CHAT)
        assert done.is_set()
        message = json.loads(body)["error"]["message"]
        # a generic message: a forward's cause could name other clients' requests (it is logged)
        assert status >= 500 and "engine error" in message and "injected fault" not in message
        # streamed: the stream ends with an error chunk, not a hang or a silent close
        done, _ = _break_next_forward(server.engine)
        status, body = _post(server, {**CHAT, "stream": True})
        assert status == 200 and b"engine error" in body and body.rstrip().endswith(b"data: [DONE]")
        # the Responses WebSocket: an error event, and the connection lives on
        done, _ = _break_next_forward(server.engine)
        with connect(server.ws_url) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "default", "input": "hi", "max_output_tokens": 5}))
            while (event := json.loads(ws.recv(timeout=60)))["type"] not in TERMINAL:
                pass
            assert event["type"] in ("response.failed", "error")
            ws.send(json.dumps({"type": "response.create", "model": "default", "input": "again",
                                "max_output_tokens": 3}))
            while (event := json.loads(ws.recv(timeout=60)))["type"] not in TERMINAL:
                pass
            assert event["type"] in ("response.completed", "response.incomplete")
    finally:
        restore()
    status, body = _post(server, CHAT)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 20
    state = server.wait_until(lambda s: s["requests"] == 0)
    assert state["requests"] == 0 and state["running"] == 0 and state["waiting"] == 0
