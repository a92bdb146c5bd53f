"""Property: whatever frame a client sends, the Responses WebSocket answers it with an event
(an `error`, or a response that runs to its end), keeps the connection, and stays up."""

from __future__ import annotations

import json
import urllib.request

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)

event_types = st.sampled_from(["response.create", "response.cancel", "response.steer", "session.update", ""])
input_items = st.lists(st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | st.text(max_size=8),
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | json_values,
    "content": st.text(max_size=30) | json_values, "name": st.text(max_size=8), "arguments": st.text(max_size=20),
    "call_id": st.text(max_size=8), "output": st.text(max_size=20) | json_values}), max_size=3)
events = st.fixed_dictionaries({"type": event_types | st.text(max_size=15)}, optional={
    "model": st.sampled_from(["tiny", "default", "gpt-4o"]) | json_values,
    "input": st.text(max_size=40) | input_items | json_values,
    "instructions": st.text(max_size=30) | json_values,
    "max_output_tokens": st.integers(-1, 3) | json_values,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | json_values,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                             "name": st.text(max_size=6)}), max_size=2) | json_values,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "regex", "grammar", "yaml"])},
        optional={"schema": json_values, "regex": st.text(max_size=10), "grammar": st.text(max_size=10)})})
    | json_values,
    "previous_response_id": st.text(max_size=10) | json_values,
    "response_id": st.text(max_size=10) | json_values,
    "generate": st.booleans() | json_values,
})
frames = st.one_of(st.text(max_size=200), st.binary(max_size=200), json_values.map(json.dumps),
                   events.map(json.dumps), events.map(lambda e: json.dumps(e).encode()))


def test_random_frames_each_get_an_answer_and_the_server_stays_up(make_tiny_server):
    server = make_tiny_server(default_max_tokens=3, max_frame_bytes=150)
    with connect(server.ws_url, max_size=None) as ws:
        seq = [-1]

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(frame=frames)
        def answered(frame):
            ws.send(frame)
            while True:  # an error, or a response run to its end
                event = json.loads(ws.recv(timeout=60))
                assert event["sequence_number"] == seq[0] + 1
                seq[0] = event["sequence_number"]
                if event["type"] in TERMINAL:
                    break
            if event["type"] == "error":
                assert event["error"]["message"] and event["status"] in (400, 404, 413, 429)

        answered()
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as resp:
        assert resp.status == 200
    with connect(server.ws_url) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "tiny", "input": "still there?"}))
        while (event := json.loads(ws.recv(timeout=60)))["type"] not in TERMINAL:
            pass
        assert event["type"] == "response.incomplete"
    assert server.wait_until(lambda s: s["requests"] == 0)["requests"] == 0
