"""Property: whatever frames a client sends on the Responses WebSocket, each gets an answer (an
`error` event or a response run to its end) on a connection that stays open, while a canary
stream on another connection keeps receiving tokens; and a hostile frame (10,000 nested arrays)
beside a streaming response gets an error event while that response still reaches its end.
Frames are those of tests/server/test_ws_fuzz.py plus deep nesting."""

from __future__ import annotations

import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from tests.server.test_ws_fuzz import TERMINAL, frames

nested = st.integers(100, 20_000).map(
    lambda n: '{"type": "response.create", "input": "hi", "metadata": ' + "[" * n + "]" * n + "}")


def test_random_frames_each_get_an_answer_and_the_canary_keeps_streaming(canary_server):
    server, canary = canary_server
    t0 = time.perf_counter()
    with connect(server.ws_url, max_size=None) as ws:
        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
        @given(frame=frames | nested)
        def answered(frame):
            ws.send(frame)
            while (event := json.loads(ws.recv(timeout=60)))["type"] not in TERMINAL:
                pass
            if event["type"] == "error":
                assert event["error"]["message"]

        answered()
    canary.check(t0)


def test_a_deeply_nested_frame_beside_a_streaming_response(canary_server):
    server, canary = canary_server
    with connect(server.ws_url, max_size=None) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "default", "input": "long", "max_output_tokens": 300,
                            "ignore_eos": True, "temperature": 0}))
        created = json.loads(ws.recv(timeout=60))
        assert created["type"] == "response.created"
        long_id = created["response"]["id"]
        ws.send('{"type": "response.create", "input": "hi", "metadata": ' + "[" * 10_000 + "]" * 10_000 + "}")
        got_error, long_end = False, None
        deadline = time.monotonic() + 60
        while (not got_error or long_end is None) and time.monotonic() < deadline:
            event = json.loads(ws.recv(timeout=60))
            if event["type"] == "error":
                got_error = True
            elif event["type"] in TERMINAL and event["response"]["id"] == long_id:
                long_end = event["type"]
        assert got_error, "the nested frame got no error event"
        assert long_end == "response.incomplete"  # ran to its max_output_tokens on the same socket
        ws.send(json.dumps({"type": "response.create", "model": "default", "input": "still open?",
                            "max_output_tokens": 2}))
        while (event := json.loads(ws.recv(timeout=60)))["type"] not in TERMINAL:
            pass
        assert event["type"] in ("response.completed", "response.incomplete")
