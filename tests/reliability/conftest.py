"""Fault-suite fixtures: the tiny live server of the server tests, and a canary stream.

The canary is a long greedy stream on its own connection that runs while a test throws bad
input at the server; the test then checks it kept receiving tokens (a generous liveness bound:
no stall of seconds), i.e. that no bad request slowed or broke anyone else's.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.server.conftest import make_tiny_server, smol_tokenizer_dir, tiny, tiny_model_dir  # noqa: F401 (fixtures)


class Canary:
    """Streamed chat completions, one after another on one connection, read on a thread until
    `close`; `arrivals` are the local receive times of the chunks that carried content (so a
    gap also covers the moment between two streams)."""

    def __init__(self, url: str, max_tokens: int = 500):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "canary"}],
                                "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True})
        self.arrivals: list[float] = []
        self.streams = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.conn.request("POST", "/v1/chat/completions", body=self.body,
                                  headers={"content-type": "application/json"})
                response = self.conn.getresponse()
                if response.status != 200:
                    self.errors.append(f"status {response.status}: {response.read()[:200]!r}")
                    return
                finish = None
                for line in response:
                    if not line.startswith(b"data: {"):
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            self.arrivals.append(time.perf_counter())
                        finish = choice.get("finish_reason") or finish
                if finish != "length":
                    self.errors.append(f"a canary stream ended with {finish!r}")
                    return
                self.streams += 1
            except Exception as e:  # noqa: BLE001 - recorded: the test fails on it
                if not self._stop.is_set():
                    self.errors.append(f"{type(e).__name__}: {e}")
                return

    def max_gap_since(self, t0: float) -> float:
        """The longest wait between content chunks after t0 (up to now)."""
        times = [t0] + [t for t in self.arrivals if t > t0] + [time.perf_counter()]
        return max(b - a for a, b in zip(times, times[1:]))

    def check(self, t0: float, bound_s: float = 5.0) -> None:
        """The canary is alive, error-free, and never waited `bound_s` for a token since t0."""
        assert not self.errors, self.errors
        assert self.thread.is_alive()
        gap = self.max_gap_since(t0)
        assert gap < bound_s, f"the canary stalled {gap:.2f} s"

    def close(self) -> None:
        self._stop.set()
        self.conn.close()
        self.thread.join(10)


@pytest.fixture
def canary_server(make_tiny_server):  # noqa: F811
    """A tiny server (small frame and token limits) with a canary stream running on it."""
    server = make_tiny_server(default_max_tokens=3, max_frame_bytes=2000)
    canary = Canary(server.url)
    deadline = time.monotonic() + 60
    while not canary.arrivals and time.monotonic() < deadline:
        time.sleep(0.01)
    assert canary.arrivals, "the canary never started"
    yield server, canary
    canary.close()
