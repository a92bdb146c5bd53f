"""Issue 13, the limits a public endpoint needs (tools per request, schema bytes per request, a
wall-clock limit per request, the stored-response count and TTL), each a ServerConfig field and
a `serve` flag, and who may continue a stored response (`--response-scope`)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import websockets

from prescient import cli
from prescient.server.context import ServerConfig
from prescient.server.tools import FunctionTool, tool_setup
from tests.server.test_http import chat, request
from tests.server.test_responses_ws import create, run, until_terminal

FLAGS = {"max_tools": ("--max-tools", "3"), "max_schema_bytes": ("--max-schema-bytes", "1000"),
         "request_time_limit_s": ("--request-time-limit-s", "2.5"),
         "response_store_size": ("--response-store-size", "7"), "response_ttl_s": ("--response-ttl-s", "60"),
         "response_store_mb": ("--response-store-mb", "3.5"),
         "response_scope": ("--response-scope", "connection")}


def test_serve_flags_reach_the_server_config_with_the_same_defaults(monkeypatch):
    defaults = cli._parser().parse_args(["serve"])
    for field, (flag, _) in FLAGS.items():
        assert getattr(defaults, field) == getattr(ServerConfig(), field), flag
    seen = {}
    monkeypatch.setattr("prescient.server.app.run_server", lambda spec, config, *a, **k: seen.setdefault("c", config)
                        and 0)
    assert cli.main(["serve", *[x for flag, value in FLAGS.values() for x in (flag, value)]]) == 0
    got = {f.name: getattr(seen["c"], f.name) for f in dataclasses.fields(ServerConfig) if f.name in FLAGS}
    assert got == {"max_tools": 3, "max_schema_bytes": 1000, "request_time_limit_s": 2.5, "response_store_size": 7,
                   "response_ttl_s": 60.0, "response_scope": "connection", "response_store_mb": 3.5}
    for bad in ({"max_tools": 0}, {"max_schema_bytes": 0}, {"request_time_limit_s": 0}, {"response_ttl_s": -1},
                {"response_store_size": 0}, {"response_store_mb": 0}, {"response_scope": "world"}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def tools(n: int, prop_bytes: int = 1) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x" * prop_bytes: {"type": "string"}}}}} for i in range(n)]


def test_tool_count_schema_size_and_time_limit(make_tiny_server):
    server = make_tiny_server(max_tools=2, max_schema_bytes=400, request_time_limit_s=0.5)
    refusals = [
        ("/v1/chat/completions", chat(tools=tools(3)), "tools", "too_many_tools"),
        ("/v1/chat/completions", chat(tools=tools(2, 200)), "tools", "schema_too_large"),
        ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "description": "d" * 400}}}), "response_format",
         "schema_too_large"),
        ("/v1/responses", {"model": "tiny", "input": "hi", "tools": [t["function"] | {"type": "function"}
                                                                     for t in tools(3)]}, "tools", "too_many_tools"),
        ("/v1/responses", {"model": "tiny", "input": "hi", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object", "description": "d" * 400}}}},
         "text.format", "schema_too_large"),
    ]
    for path, body, param, code in refusals:
        status, got = request(server, "POST", path, body)
        assert status == 400 and (got["error"]["param"], got["error"]["code"]) == (param, code), (path, got)
        assert "limit" in got["error"]["message"]
    # The time limit counts the grammar compile; the compiler's first start (~3 s) is not what
    # this test measures, so it is warmed first, with the request's own grammar.
    declared = [FunctionTool(t["function"]["name"], None, t["function"]["parameters"]) for t in tools(2)]
    server.engine.grammar_compiler().submit(tool_setup(declared, None, None).grammar).result()
    assert request(server, "POST", "/v1/chat/completions", chat(tools=tools(2)))[0] == 200

    # Past 0.5 s of wall clock: stopped (its KV freed) with an error the SDK does not retry (a 400,
    # code request_time_limit_exceeded), on every transport.
    long = chat(max_tokens=900, ignore_eos=True)
    t0 = time.monotonic()
    status, got = request(server, "POST", "/v1/chat/completions", long)
    assert status == 400 and "limit of 0.5 s per request" in got["error"]["message"]
    assert got["error"]["code"] == "request_time_limit_exceeded"
    assert time.monotonic() - t0 < 5
    status, sse = request(server, "POST", "/v1/chat/completions", long | {"stream": True})
    assert status == 200 and b"limit of 0.5 s per request" in sse and sse.endswith(b"data: [DONE]\n\n")
    assert b'"code":"request_time_limit_exceeded"' in sse

    async def ws():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(create(input="Go on and on", max_output_tokens=900))
            return await until_terminal(ws)

    final = run(ws())[-1]
    assert final["type"] == "response.failed" and "limit of 0.5 s" in final["response"]["error"]["message"]
    assert final["response"]["error"]["code"] == "request_time_limit_exceeded"
    assert server.wait_until(lambda s: s["requests"] == 0)["requests"] == 0


def respond(server, key: str | None = None, **body):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return request(server, "POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1} | body,
                   headers)


def test_stored_responses_are_bounded_in_count_and_time(make_tiny_server):
    server = make_tiny_server(response_store_size=1, response_ttl_s=1.0)
    first, second = respond(server)[1]["id"], respond(server)[1]["id"]
    status, got = respond(server, previous_response_id=first)
    assert status == 400 and got["error"]["code"] == "previous_response_not_found"  # evicted by the second
    assert respond(server, previous_response_id=second)[0] == 200
    third = respond(server)[1]["id"]
    time.sleep(1.1)
    assert respond(server, previous_response_id=third)[1]["error"]["code"] == "previous_response_not_found"


async def ws_turn(server, key: str | None = None, ws=None, **fields) -> dict:
    """One response on `ws` (or on a fresh connection); its terminal event."""
    if ws is not None:
        await ws.send(create(max_output_tokens=1, **fields))
        return (await until_terminal(ws))[-1]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with websockets.connect(server.ws_url, additional_headers=headers) as fresh:
        return await ws_turn(server, ws=fresh, **fields)


def continued(answer) -> bool:
    """Whether a (status, body) / terminal event is a continuation, not a not-found."""
    if isinstance(answer, tuple):
        return answer[0] == 200
    if answer["type"] == "error":
        assert answer["error"]["code"] == "previous_response_not_found"
        return False
    return True


def test_key_scope_by_default_confines_a_response_to_the_key_that_made_it(tiny):
    assert tiny.ctx.config.response_scope == "key"
    rid = respond(tiny, "alice")[1]["id"]
    assert not continued(respond(tiny, "bob", previous_response_id=rid))
    assert not continued(respond(tiny, previous_response_id=rid))
    assert continued(respond(tiny, "alice", previous_response_id=rid))

    async def go():
        async with websockets.connect(tiny.ws_url, additional_headers={"Authorization": "Bearer alice"}) as ws:
            made = (await ws_turn(tiny, ws=ws))["response"]["id"]
        # another connection with the same key continues both, over the WebSocket and HTTP
        return (made, await ws_turn(tiny, "alice", previous_response_id=rid),
                await ws_turn(tiny, "bob", previous_response_id=made))

    made, same_key, other_key = run(go())
    assert continued(same_key) and not continued(other_key)
    assert continued(respond(tiny, "alice", previous_response_id=made))


def test_connection_scope_confines_a_websocket_response_to_its_connection(make_tiny_server):
    server = make_tiny_server(response_scope="connection", api_key="sk-one")
    over_http = respond(server, "sk-one")[1]["id"]

    async def go():
        headers = {"Authorization": "Bearer sk-one"}
        async with websockets.connect(server.ws_url, additional_headers=headers) as ws:
            made = (await ws_turn(server, ws=ws))["response"]["id"]
            other = await ws_turn(server, "sk-one", previous_response_id=made)
            http = respond(server, "sk-one", previous_response_id=made)
            same = await ws_turn(server, ws=ws, previous_response_id=made)
            # a response made over HTTP is confined to its key, which every connection here holds
            from_http = await ws_turn(server, "sk-one", previous_response_id=over_http)
            return other, http, same, from_http

    other, http, same, from_http = run(go())
    assert not continued(other) and not continued(http)
    assert continued(same) and continued(from_http)


def test_global_scope_lets_anyone_with_the_id_continue(make_tiny_server):
    server = make_tiny_server(response_scope="global")
    rid = respond(server, "alice")[1]["id"]
    assert continued(respond(server, "bob", previous_response_id=rid))

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            made = (await ws_turn(server, ws=ws))["response"]["id"]
        return await ws_turn(server, "carol", previous_response_id=made)

    assert continued(run(go()))
