"""Failures say why: `prescient generate` prints the reason a generation failed, a grammar
compile that falls back into the server process is logged, and an accepted socket has
TCP_NODELAY (without it every response after a connection's first waits ~40 ms for a delayed
ACK)."""

from __future__ import annotations

import gc
import http.client
import json
import logging
import socket
import subprocess

from websockets.sync.client import connect

from prescient.build import EngineSpec
from tests.server.conftest import tiny_engine, tiny_model_dir, smol_tokenizer_dir  # noqa: F401 (fixtures)


def test_generate_prints_why_a_generation_failed(tiny_model_dir, monkeypatch, capsys):  # noqa: F811
    import prescient.build
    import prescient.runtime.engine as engine_mod
    from prescient import cli

    engine = tiny_engine(tiny_model_dir)
    monkeypatch.setattr(prescient.build, "build_engine", lambda spec: engine)

    def broken(*args, **kwargs):
        raise RuntimeError("the detokenizer exploded")
    monkeypatch.setattr(engine_mod, "commit_tokens", broken)
    assert cli._generate(EngineSpec(model=str(tiny_model_dir)), "hi", 4, 0.0) == 1
    err = capsys.readouterr().err
    assert "generation failed" in err and "the detokenizer exploded" in err


def test_a_compile_worker_that_cannot_start_is_logged(monkeypatch, caplog):
    from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarSpec, GrammarTokenizer

    def no_processes(*args, **kwargs):
        raise OSError("no processes in this sandbox")
    monkeypatch.setattr(subprocess, "Popen", no_processes)
    vocab = [f"<{i}>" for i in range(3)] + ["a", "b", "ab"]
    compiler = GrammarCompiler(GrammarTokenizer.from_vocab(vocab, stop_token_ids=[0]),
                               CompilerConfig(isolate=True, max_workers=1, time_limit_s=30))
    try:
        with caplog.at_level(logging.WARNING, logger="prescient.grammar"):
            compiled = compiler.compile(GrammarSpec("regex", "ab"))  # compiled here, all the same
        assert compiled.matcher() is not None
    finally:
        compiler.close()
    assert any("could not start" in r.getMessage() and "no processes" in r.getMessage() for r in caplog.records)


def _server_side(client: socket.socket):
    """The accepted socket of `client`'s connection, found among the server's transports."""
    peer = client.getsockname()
    for obj in gc.get_objects():
        get = getattr(obj, "get_extra_info", None)
        if get is None or not callable(get):
            continue
        try:
            sock = get("socket")
            if sock is not None and sock.getpeername() == peer:
                return sock
        except Exception:  # noqa: BLE001 - other objects with get_extra_info
            continue
    raise AssertionError("no server-side socket for this connection")


def _nodelay(sock) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_accepted_sockets_have_tcp_nodelay(make_tiny_server):
    # served on a listener made with socket.socket() (protocol 0), as `prescient serve` made its
    # own: asyncio then leaves TCP_NODELAY off, so the server must set it per connection
    tiny = make_tiny_server(send_buffer=1 << 20)
    host, port = tiny.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().read()
    assert _nodelay(_server_side(conn.sock)) != 0  # HTTP
    conn.close()
    with connect(tiny.ws_url) as ws:
        ws.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 2}))
        ws.recv(timeout=30)
        assert _nodelay(_server_side(ws.socket)) != 0  # WebSocket, after the upgrade


def test_the_serve_listener_is_a_tcp_socket():
    """asyncio sets TCP_NODELAY itself on what a listener created with IPPROTO_TCP accepts."""
    from prescient.server.app import listening_socket

    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
