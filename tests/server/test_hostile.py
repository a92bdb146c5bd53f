"""Issue 13, a hostile but honest client: no request wedges the server. Malformed fields,
nesting deep enough to exhaust recursion, server bugs inside a response task and bodies cut off
by a disconnect each get an answer (an `error` event / a 4xx naming the field) or a quiet log
line; the socket and the other responses on it go on; a bad API key is a 401 on both transports."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import openai
import pytest
import websockets

from prescient.server import responses as responses_module
from prescient.server.limits import MAX_JSON_DEPTH, deep_field, too_deep
from prescient.server.protocol import ChatCompletionRequest, decode
from tests.server.test_http import chat, request
from tests.server.test_responses_ws import create, run, until_terminal

DEEP = 10_000  # past msgspec's (Python's) recursion limit


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ---------------------------------------------------------------- the nesting check itself

def test_too_deep_counts_structure_not_strings():
    assert not too_deep(json.dumps({"a": "[" * 500, "b": "\\" * 3 + "{[" * 200, "c": [[1]] * 300}))
    assert not too_deep(json.dumps({"a": '\\"[[', "b": json.loads(nested(MAX_JSON_DEPTH - 1))}))
    assert too_deep(json.dumps({"a": '\\"[[', "b": json.loads(nested(MAX_JSON_DEPTH))}))
    assert too_deep(json.dumps({"a": "\\\\", "b": json.loads(nested(MAX_JSON_DEPTH))}).encode())


def test_decode_refuses_deep_json_naming_the_field():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for depth, param in ((300, "tools[0].function.parameters"), (DEEP, None)):
        body = json.dumps(base)[:-1] + ', "tools": [{"function": {"name": "f", "parameters": {"x": ' + \
            nested(depth) + "}}}]}"
        with pytest.raises(Exception) as err:
            decode(body.encode(), ChatCompletionRequest)
        assert (err.value.status, err.value.param, err.value.code) == (400, param, "json_too_deep")
        assert str(MAX_JSON_DEPTH) in err.value.message
    assert deep_field(decode(json.dumps(base), ChatCompletionRequest)) is None


# ---------------------------------------------------------------- WebSocket

def test_a_malformed_format_type_is_an_error_event_naming_it(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(json.dumps({"type": "response.create", "input": "hi", "text": {"format": {"type": ["x"]}}}))
            error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            await ws.send(create(max_output_tokens=2))
            return error, await until_terminal(ws)

    error, after = run(go())
    assert error["type"] == "error" and error["status"] == 400
    assert error["error"]["param"] == "text.format.type" and "must be a string" in error["error"]["message"]
    assert after[-1]["type"] == "response.incomplete"


def test_a_failure_inside_a_response_task_ends_in_an_error_event(tiny, monkeypatch):
    """Before the response starts (in prepare) and mid-stream (after response.created)."""
    def boom(*args, **kwargs):
        raise TypeError("a bug")

    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            monkeypatch.setattr(responses_module, "format_spec", boom)
            await ws.send(create(stream_id="early"))
            early = await until_terminal(ws)
            monkeypatch.undo()
            on = responses_module.ResponseRun._on
            monkeypatch.setattr(responses_module.ResponseRun, "_on",
                                lambda self, ev: boom() if self.gen.output_ids else on(self, ev))
            await ws.send(create(stream_id="late"))
            late = await until_terminal(ws)
            monkeypatch.undo()
            await ws.send(create(max_output_tokens=2))
            return early, late, await until_terminal(ws)

    early, late, after = run(go())
    for events, lane in ((early, "early"), (late, "late")):
        error = events[-1]
        assert error["type"] == "error" and error["status"] == 500 and error["stream_id"] == lane
        assert error["error"]["code"] == "server_error" and "TypeError: a bug" in error["error"]["message"]
    assert late[0]["type"] == "response.created"
    assert after[-1]["type"] == "response.incomplete"
    assert tiny.wait_until(lambda s: s["requests"] == 0)["requests"] == 0


def test_a_deeply_nested_frame_is_an_error_event_and_other_responses_go_on(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url, max_size=None) as ws:
            await ws.send(create(max_output_tokens=64, stream_id="long"))
            events = []
            while not any(e["type"] == "response.output_text.delta" for e in events):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            for field in ('"tool_choice": {"a": ' + nested(DEEP) + '}', '"tools": [{"type": "function", "name": "f", '
                          '"parameters": {"a": ' + nested(300) + "}}]"):
                await ws.send('{"type": "response.create", "input": "hi", ' + field + "}")
            errors = []
            while len(errors) < 2 or events[-1]["type"] not in ("response.completed", "response.incomplete"):
                event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                (errors if event["type"] == "error" else events).append(event)
            await ws.send(create(max_output_tokens=2))
            return events, errors, await until_terminal(ws)

    events, errors, after = run(go())
    assert [(e["status"], e["error"]["code"], e["error"]["param"]) for e in errors] == [
        (400, "json_too_deep", None), (400, "json_too_deep", "tools[0].parameters")]
    assert events[-1]["stream_id"] == "long" and events[-1]["response"]["usage"]["output_tokens"] >= 1
    assert after[-1]["type"] == "response.incomplete"


# ---------------------------------------------------------------- HTTP

@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", chat(response_format={"type": ["json_object"]}), "response_format.type"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "text": {"format": {"type": {}}}}, "text.format.type"),
])
def test_a_malformed_format_type_is_a_400_naming_it(tiny, path, body, param):
    status, got = request(tiny, "POST", path, body)
    assert status == 400 and got["error"]["param"] == param and "must be a string" in got["error"]["message"]


@pytest.mark.parametrize("schema", [{"$defs": 5, "$ref": "#/$defs/a"}, {"properties": []}, {"$ref": 5},
                                    {"type": "string", "pattern": "("}])
def test_a_malformed_schema_is_a_400_on_either_path(tiny, schema):
    for body in (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
                 chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                      tool_choice="required")):
        status, got = request(tiny, "POST", "/v1/chat/completions", body)
        assert status in (200, 400), got  # refused, or enforced as written; never a server error


@pytest.mark.parametrize("path,field,param", [
    ("/v1/chat/completions", '"response_format": {"type": "json_schema", "json_schema": ' + nested(DEEP) + "}",
     None),
    ("/v1/chat/completions", '"tool_choice": {"a": ' + nested(400) + "}", "tool_choice"),
    ("/v1/responses", '"text": {"format": {"schema": ' + nested(200) + "}}", "text.format"),
    ("/v1/completions", '"user": ' + nested(DEEP), None),  # unknown fields are skipped, recursively
    ("/v1/completions", '"user": ' + nested(300), None),
])
def test_deep_json_in_any_field_is_a_400(tiny, path, field, param):
    head = {"/v1/completions": '{"model": "tiny", "prompt": "x", ', "/v1/responses": '{"model": "tiny", "input": "hi", '}
    body = head.get(path, json.dumps(chat())[:-1] + ", ") + field + "}"
    status, got = request(tiny, "POST", path, body.encode())
    assert status == 400, got
    assert got["error"]["code"] == "json_too_deep" and got["error"]["param"] == param


def test_a_body_cut_off_by_a_disconnect_is_a_quiet_log_line(tiny, caplog):
    caplog.set_level(logging.DEBUG, logger="prescient.server")
    uvicorn_log = logging.getLogger("uvicorn")  # uvicorn's loggers do not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        sock = socket.create_connection(("127.0.0.1", tiny.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n" + b'{"model": "tiny", "messages": [')
        time.sleep(0.2)
        sock.close()
        deadline = time.monotonic() + 10
        while "client disconnected" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # anything the server logs after the disconnect
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert "client disconnected while sending its body" in caplog.text
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]
    assert request(tiny, "GET", "/health")[0] == 200


def test_a_bad_api_key_is_401_on_the_websocket_too(make_tiny_server):
    server = make_tiny_server(api_key="sk-right")

    async def raw():
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(server.ws_url, additional_headers={"Authorization": "Bearer sk-wrong"})
        return refused.value.response

    response = run(raw())
    assert response.status_code == 401 and json.loads(response.body)["error"]["code"] == "invalid_api_key"
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(websockets.InvalidStatus) as refused:
        with sdk.responses.connect():
            pass
    assert refused.value.response.status_code == 401
