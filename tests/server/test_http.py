"""OpenAI-compatible HTTP on the tiny model: the official SDK for the happy paths, raw HTTP for
what the SDK would refuse to send, and every refusal naming its field."""

from __future__ import annotations

import http.client
import json
import socket

import openai
import pytest

from tests.server.conftest import TINY_CONTEXT


def request(server, method: str, path: str, body=None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0)


def chat(**overrides):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    body.update(overrides)
    return body


def test_health_and_models(tiny, client):
    assert request(tiny, "GET", "/health") == (200, {"status": "ok", "model": "tiny"})
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("default").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_completion(client):
    r = client.chat.completions.create(model="default", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Hello"}],
                                       max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_chat_stream_matches_non_stream(client):
    args = dict(model="tiny", messages=[{"role": "user", "content": "Count to three"}], max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    times = [t for c in chunks for t in (getattr(c, "token_times", None) or [])]
    assert len(times) in (5, 6) and times == sorted(times) and times[0] > 0  # the stop token may ride last


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-9  # greedy picks the top token


def test_completions(client):
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    streamed = list(client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    by_ids = client.completions.create(model="tiny", prompt=[504, 3575, 282], max_tokens=2, temperature=0)
    assert by_ids.usage.prompt_tokens == 3


LONG_PROMPT = "word " * (TINY_CONTEXT + 50)

BAD_REQUESTS = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None, "invalid_json"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", None),
    ("/v1/chat/completions", chat(temperature=5), 400, "temperature", None),
    ("/v1/chat/completions", chat(max_tokens="4"), 400, "max_tokens", "invalid_type"),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role",
     "invalid_role"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0].type", "unsupported_content"),
    ("/v1/chat/completions", chat(model="gpt-4o"), 404, "model", "model_not_found"),
    ("/v1/chat/completions", chat(n=2), 400, "n", None),
    ("/v1/chat/completions", chat(presence_penalty=2.5), 400, "presence_penalty", None),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", chat(max_tokens=TINY_CONTEXT), 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}), 400, "response_format",
     "invalid_grammar"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "banana"}}}), 400, "response_format", "invalid_grammar"),
    ("/v1/chat/completions", chat(response_format={"type": "xml"}), 400, "response_format.type",
     "invalid_response_format"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                  tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice",
     "invalid_tools"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": 'a"b'}}]), 400, "tools",
     "invalid_tools"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt", "empty_input"),
    ("/v1/completions", {"model": "tiny", "prompt": [49999999]}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/v1/responses", {"model": "tiny"}, 400, "input", "empty_input"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "previous_response_id": "resp_nope"}, 400,
     "previous_response_id", "previous_response_not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_REQUESTS,
                         ids=[f"{i}-{r[0].rsplit('/', 1)[1]}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_requests_name_the_field(tiny, path, body, status, param, code):
    got_status, got = request(tiny, "POST", path, body)
    assert got_status == status, got
    error = got["error"]
    assert error["param"] == param and error["message"]
    if code is not None:
        assert error["code"] == code
    if param:
        assert param.split("[")[0].split(".")[0] in error["message"] or error["param"] == param


def test_refusals_leave_the_server_serving(tiny, client):
    for path, body, *_ in BAD_REQUESTS[:6]:
        request(tiny, "POST", path, body)
    assert request(tiny, "GET", "/v1/nothing-here")[0] == 404
    assert request(tiny, "GET", "/v1/chat/completions")[0] == 405
    assert client.chat.completions.create(**chat()).usage.completion_tokens == 4
    assert tiny.wait_until(lambda s: s["requests"] == 0)["requests"] == 0


def test_sse_disconnect_frees_the_request(tiny):
    baseline = tiny.wait_until(lambda s: s["requests"] == 0)
    body = json.dumps(chat(max_tokens=900, stream=True, messages=[{"role": "user", "content": "go on"}])).encode()
    sock = socket.create_connection(("127.0.0.1", tiny.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    seen = b""
    while seen.count(b"data: ") < 4:
        seen += sock.recv(65536)
    assert tiny.engine_state()["requests"] == 1
    sock.close()
    # 2 s: well before the 800-900 tokens could have been generated (~5 ms each)
    state = tiny.wait_until(lambda s: s["requests"] == 0 and s["free"] == baseline["free"], timeout=2)
    assert state["requests"] == 0 and state["free"] == baseline["free"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat(max_tokens=900, messages=[{"role": "user", "content": "go on"}])),
    ("/v1/responses", {"model": "tiny", "input": "go on", "max_output_tokens": 900, "store": False}),
])
def test_non_streamed_request_is_aborted_when_the_client_hangs_up(tiny, path, body):
    baseline = tiny.wait_until(lambda s: s["requests"] == 0)
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", tiny.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n\r\n".encode() + data)
    assert tiny.wait_until(lambda s: s["requests"] == 1)["requests"] == 1
    sock.close()
    # 2 s: well before the 800-900 tokens could have been generated (~5 ms each)
    state = tiny.wait_until(lambda s: s["requests"] == 0 and s["free"] == baseline["free"], timeout=2)
    assert state["requests"] == 0 and state["free"] == baseline["free"]


def test_responses_over_http(client):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.usage.output_tokens == 5 and r.output_text
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=5, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text
    follow = client.responses.create(model="tiny", input="More", previous_response_id=r.id, max_output_tokens=2)
    assert follow.previous_response_id == r.id
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + 5 - 16
