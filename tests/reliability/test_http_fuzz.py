"""Property: whatever body a client POSTs to an OpenAI endpoint, the server answers it with a
2xx or a 4xx naming the problem (never a 5xx, never silence), while a canary stream on another
connection keeps receiving its tokens, and the server serves a normal request afterwards."""

from __future__ import annotations

import http.client
import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)

messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | json_values,
    "content": st.text(max_size=40) | json_values,
    "tool_calls": json_values, "tool_call_id": st.text(max_size=8), "name": st.text(max_size=8)}), max_size=3)
formats = st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "regex", "grammar"])
                                 | json_values},
                                optional={"json_schema": json_values, "regex": st.text(max_size=12) | json_values,
                                          "grammar": st.text(max_size=12) | json_values, "schema": json_values})
sampling = {
    "model": st.sampled_from(["default", "tiny", "gpt-4o"]) | json_values,
    "max_tokens": st.integers(-2, 4) | json_values, "max_output_tokens": st.integers(-2, 4) | json_values,
    "temperature": st.floats(-1, 3) | st.sampled_from([1e-300, 5e-324, 1e308]) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values, "seed": st.integers(-(2**70), 2**70) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5) | json_values,
    "presence_penalty": st.floats(-3, 3) | json_values, "frequency_penalty": st.floats(-3, 3) | json_values,
    "logprobs": st.booleans() | json_values, "top_logprobs": st.integers(-1, 30) | json_values,
    "stream": st.booleans() | json_values, "n": st.integers(-1, 3) | json_values,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]),
                                             "function": st.fixed_dictionaries(
                                                 {"name": st.text(max_size=8)},
                                                 optional={"parameters": json_values})}), max_size=2) | json_values,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
}
chat_bodies = st.fixed_dictionaries({}, optional={"messages": messages | json_values, "response_format": formats
                                                  | json_values, **sampling})
completion_bodies = st.fixed_dictionaries({}, optional={"prompt": st.text(max_size=40) | json_values, **sampling})
response_bodies = st.fixed_dictionaries({}, optional={"input": st.text(max_size=40) | messages | json_values,
                                                      "instructions": st.text(max_size=20) | json_values,
                                                      "text": st.fixed_dictionaries({"format": formats}) | json_values,
                                                      "previous_response_id": st.text(max_size=8) | json_values,
                                                      **sampling})
# deep nesting and raw bytes: the parser's limits, not the fields'
nested = st.integers(1, 20_000).map(lambda n: '{"messages": ' + "[" * n + "]" * n + "}")
raw = st.binary(max_size=200) | st.text(max_size=200).map(str.encode)

def _one_field_off(base: dict, fields: dict):
    """A valid body with one field replaced by a fuzzed value (or nothing replaced): most such
    requests run, so the canary shares the engine with real work, and each 4xx names one field."""
    keys = sorted(fields)
    return st.one_of(st.just(base), st.sampled_from(keys).flatmap(
        lambda k: fields[k].map(lambda v: json.dumps({**base, k: v}))).map(json.loads)).map(json.dumps)


VALID_CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
VALID_RESPONSE = {"model": "default", "input": "hi", "max_output_tokens": 3}

requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), _one_field_off(VALID_CHAT, {**sampling, "messages": messages,
                                                                           "response_format": formats})),
    st.tuples(st.just("/v1/responses"), _one_field_off(VALID_RESPONSE, {**sampling, "input": messages,
                                                                        "text": st.fixed_dictionaries(
                                                                            {"format": formats})})),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies.map(json.dumps)),
    st.tuples(st.just("/v1/completions"), completion_bodies.map(json.dumps)),
    st.tuples(st.just("/v1/responses"), response_bodies.map(json.dumps)),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/responses"]), nested),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]), raw),
)


def test_random_bodies_get_a_4xx_or_an_answer_and_the_canary_keeps_streaming(canary_server):
    server, canary = canary_server
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.perf_counter()
    statuses: dict[int, int] = {}

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=requests)
    def answered(request):
        path, body = request
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        statuses[response.status] = statuses.get(response.status, 0) + 1
        assert response.status < 500, (path, body[:300], payload[:300])
        if response.status >= 400:
            error = json.loads(payload)["error"]
            assert isinstance(error["message"], str) and error["message"]

    answered()
    canary.check(t0)
    assert any(s >= 400 for s in statuses) and any(s == 200 for s in statuses), statuses
    # a normal request still gets a normal answer, and the engine drains to idle
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        headers={"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] >= 1
