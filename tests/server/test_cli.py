"""`prescient` as a user runs it: `serve` in a subprocess on the tiny model prints its URLs,
answers /health, and on Ctrl-C lets an in-flight stream finish, closes its WebSockets, and exits
0; every flag has help and states its default; a bad model path, a port in use or a bad flag is
one line and a non-zero exit; `generate` streams its reply to stdout, stage lines to stderr."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
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


def _run(*args: str, timeout: float = 120):
    exe = os.path.join(os.path.dirname(sys.executable), "prescient")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


def _subparsers():
    from prescient.cli import _parser
    from prescient.latency_bench.__main__ import _parser as bench_parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {"serve": sub.choices["serve"], "generate": sub.choices["generate"], "bench": bench_parser()}


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_every_flag_has_help_and_states_its_default(command):
    parser = _subparsers()[command]
    undocumented = []
    for action in _options(parser):
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        # a value to show, or words saying what unset / a switch means
        if not text or not ("(default:" in text or action.default is None or action.default is False):
            undocumented.append((action.option_strings[0], text))
        if "(default: None)" in text:
            undocumented.append((action.option_strings[0], text))
        if action.default is None and "default" not in text and "unset" not in text:
            undocumented.append((action.option_strings[0], text))
    assert not undocumented


def test_a_bad_model_path_for_generate_is_one_line_and_exit_1(tmp_path):
    res = _run("generate", "hi", "--model", str(tmp_path / "nope"), "--quiet")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [f"prescient: error: model path does not exist: {tmp_path / 'nope'}"]


def test_a_port_in_use_is_one_line_before_any_loading(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _run("serve", "--model", str(tiny_model_dir), "--port", str(port), timeout=60)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and "loading" not in res.stderr
    assert f"prescient: error: cannot listen on 127.0.0.1:{port}" in res.stderr


def test_a_bad_flag_exits_2_with_a_usage_line():
    res = _run("serve", "--no-such-flag")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "unrecognized arguments: --no-such-flag" in res.stderr


def test_generate_streams_the_reply_to_stdout(tiny_model_dir):
    res = _run("generate", "hello", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "8",
               "--temperature", "0", "--speculate", "off")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()  # the tiny model's reply, then a newline
    assert "prescient: loading" in res.stderr  # stage lines go to stderr, never into the reply
    quiet = _run("generate", "hello", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "8",
                 "--temperature", "0", "--speculate", "off", "--quiet")
    assert quiet.stdout == res.stdout and quiet.stderr == ""
