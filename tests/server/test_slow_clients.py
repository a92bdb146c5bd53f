"""Slow and idle clients cannot hold connections: deadlines for headers, bodies and idle
WebSockets, and /health + /metrics answered at the connection limit (raw sockets, tiny model,
timeouts of about a second so each test takes a few)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import websockets

from tests.server.test_access import metric
from tests.server.test_http import request


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _half_body(server, path: str = "/v1/chat/completions") -> socket.socket:
    """A request whose headers promise 1000 bytes of body, of which 10 are sent."""
    sock = _connect(server)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 1000\r\n\r\n".encode() + b'{"model": ')
    return sock


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the socket, and when it closed (raises
    socket.timeout if it is still open after `timeout`)."""
    sock.settimeout(timeout)
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (headers and a Content-Length body) from a kept-alive connection."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _open_connections(server) -> float:
    status, text = request(server, "GET", "/metrics")  # scrapes are answered at the limit too
    assert status == 200
    return metric(text.decode(), "prescient_open_connections")


def test_half_sent_bodies_get_408_and_free_their_slots(make_tiny_server):
    # 2 s for a body: the checks below must run while both requests still wait for theirs
    server = make_tiny_server(max_connections=2, body_timeout_s=2.0)
    slow = [_half_body(server) for _ in range(2)]
    deadline = time.monotonic() + 10
    while _open_connections(server) < 2:  # until both requests are in the app, holding the two slots
        assert time.monotonic() < deadline, "the half-sent requests never reached the app"
        time.sleep(0.02)
    assert request(server, "GET", "/v1/models")[0] == 503
    assert request(server, "GET", "/health")[0] == 200
    assert _open_connections(server) == 2
    for sock in slow:
        data, waited = _read_until_closed(sock, timeout=5)
        assert data.startswith(b"HTTP/1.1 408 "), data[:80]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert waited < 4  # at the 2 s body deadline (counted from before this read), not never
        sock.close()
    assert request(server, "GET", "/v1/models")[0] == 200  # the slots are free again


def test_unfinished_headers_are_closed(make_tiny_server):
    server = make_tiny_server(header_timeout_s=0.5)
    silent = _connect(server)  # sends nothing at all
    partial = _connect(server)
    partial.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # no blank line: headers never end
    for sock in (silent, partial):
        data, waited = _read_until_closed(sock, timeout=5)
        assert data == b"" and waited < 3
        sock.close()

    # after a complete request on a kept-alive connection, the next headers get a deadline too
    kept = _connect(server)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _read_response(kept).startswith(b"HTTP/1.1 200 ")
    kept.sendall(b"GET /health HTTP/1.1\r\n")
    data, waited = _read_until_closed(kept, timeout=5)
    assert data == b"" and waited < 3
    kept.close()

    # a client that finishes its headers in time is served, and a WebSocket outlives the deadline
    assert request(server, "GET", "/health")[0] == 200

    async def ws_after_deadline():
        async with websockets.connect(server.ws_url) as ws:
            await asyncio.sleep(1.0)
            await ws.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 1}))
            return json.loads(await ws.recv())["type"]

    assert asyncio.run(ws_after_deadline()) == "response.created"


def test_idle_websocket_is_closed(make_tiny_server):
    server = make_tiny_server(ws_idle_timeout_s=1.0)

    async def go():
        async with websockets.connect(server.ws_url) as busy, websockets.connect(server.ws_url) as idle:
            start = time.monotonic()
            # a frame every 0.5 s (each answered with an error event) keeps `busy` open
            for _ in range(4):
                await busy.send("{}")
                assert json.loads(await busy.recv())["type"] == "error"
                await asyncio.sleep(0.5)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(idle.recv(), 5)
            closed_after = time.monotonic() - start
            await busy.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 2}))
            events = [json.loads(await busy.recv())["type"] for _ in range(2)]
            return closed.value.rcvd.code, closed_after, events

    code, closed_after, events = asyncio.run(go())
    assert code == 1001 and closed_after < 3.5
    assert events == ["response.created", "response.in_progress"]
