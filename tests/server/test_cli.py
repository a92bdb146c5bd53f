"""`prescient serve` as a user runs it: a subprocess on the tiny model that prints its URLs,
answers /health, and on Ctrl-C lets an in-flight stream finish, closes its WebSockets, and exits 0."""

from __future__ import annotations

import http.client
import json
import threading

from websockets.sync.client import connect

from tests.server.live import ServeProcess


def test_serve_prints_urls_serves_and_shuts_down_gracefully(tiny_model_dir):
    proc = ServeProcess("--model", str(tiny_model_dir), "--max-connections", "8")
    try:
        host, port = proc.url.removeprefix("http://").split(":")
        assert f"ws://{host}:{port}/v1/responses" in proc.output and "/metrics" in proc.output
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert health.status == 200 and json.loads(health.read())["model"] == "tiny-chat"

        ws = connect(f"ws://{host}:{port}/v1/responses")
        body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "go"}], "max_tokens": 150,
                           "temperature": 0, "stream": True, "ignore_eos": True})
        conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        stream = conn.getresponse()
        first = stream.readline()
        assert first.startswith(b"data: ")
        rest: list[bytes] = []
        reader = threading.Thread(target=lambda: rest.append(stream.read()))
        reader.start()
        code = proc.interrupt(timeout=60)
        reader.join(30)
        assert code == 0, proc.output
        assert rest and rest[0].rstrip().endswith(b"data: [DONE]")  # the in-flight stream finished
        chunks = [json.loads(line[6:]) for line in (first + rest[0]).split(b"\n")
                  if line.startswith(b"data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        try:
            ws.recv(timeout=10)
            closed_code = None
        except Exception as err:  # ConnectionClosed: the server closed it while going away
            closed_code = getattr(getattr(err, "rcvd", None), "code", None)
        assert closed_code == 1012
        assert "prescient: stopped" in proc.output
    finally:
        proc.kill()


def test_serve_with_a_missing_model_exits_with_a_message(tmp_path):
    proc = None
    try:
        ServeProcess("--model", str(tmp_path / "nope"), timeout=120)
    except RuntimeError as err:
        proc = str(err)
    assert proc is not None and "model path does not exist" in proc
