"""The soak: mixed agents against a `prescient serve` process for a while, then checks.

Agents, each a loop of multi-turn sessions until the deadline (the closed loop of
latency_bench's agent load, with the tool simulator's results as the next user turn):

- `chat`: chat completions over HTTP + SSE, history re-sent each turn, `include_usage`;
- `tools`: the same with a `tools` parameter (grammar-constrained tool calls, forced spans);
- `ws`: the Responses WebSocket, each turn continuing with `previous_response_id`;
- every few sessions an agent drops its stream mid-way (a client that disconnects).

Every stream is checked as it ends: the concatenated deltas equal the final text (the WebSocket's
`response.completed` output) and `usage` counts exactly the tokens received (each delta's
`num_tokens` / `token_sources`).
After the deadline: the server's RSS is within 10% of its level after warm-up, and once its
session pins expire the KV cache is back to idle, nothing running or waiting.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from websockets.sync.client import connect

from prescient.latency_bench.workloads import load_workloads, tool_result

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}, "required": ["query"]}}}]


@dataclass
class SoakStats:
    streams: int = 0
    dropped: int = 0  # streams the client abandoned on purpose
    tokens: int = 0
    failures: list[str] = field(default_factory=list)  # broken invariants (the test fails on any)
    by_kind: dict[str, int] = field(default_factory=dict)  # finished sessions per agent kind
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, streams: int = 0, dropped: int = 0, tokens: int = 0, session: str | None = None) -> None:
        with self.lock:
            self.streams += streams
            self.dropped += dropped
            self.tokens += tokens
            if session:
                self.by_kind[session] = self.by_kind.get(session, 0) + 1


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _chat_turn(conn: http.client.HTTPConnection, messages: list[dict], tools: bool, max_tokens: int, drop: bool,
               stats: SoakStats, rng: random.Random) -> str | None:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.7, "seed": rng.randrange(1 << 30)}
    if tools:
        body |= {"tools": TOOLS, "tool_choice": "auto"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        stats.failures.append(f"chat status {response.status}: {response.read()[:200]!r}")
        return None
    text, received, usage = [], 0, None
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        received += len(chunk.get("token_sources") or [])  # the chunk's tokens (an extension)
        for choice in chunk.get("choices", []):
            text.append(choice.get("delta", {}).get("content") or "")
        if drop and received >= 3:
            conn.close()  # a client that goes away mid-stream
            stats.add(dropped=1)
            return None
    stats.add(streams=1, tokens=received)
    if usage is None or usage["completion_tokens"] != received:
        stats.failures.append(f"chat usage {usage} != {received} tokens received")
    return "".join(text)


def chat_agent(url: str, deadline: float, tools: bool, max_tokens: int, stats: SoakStats, seed: int) -> None:
    rng = random.Random(seed)
    scripts = [w for w in load_workloads()[0] if w.kind in ("chat", "tool_call")]
    host, port = url.removeprefix("http://").split(":")
    session = 0
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        messages = [dict(m) for m in rng.choice(scripts).messages]
        for turn in range(rng.randint(2, 4)):
            reply = _chat_turn(conn, messages, tools, max_tokens, session % 5 == 4 and turn == 1, stats, rng)
            if reply is None or time.monotonic() > deadline:
                break
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_result(reply, turn)}]
        conn.close()
        session += 1
        stats.add(session="tools" if tools else "chat")


def ws_agent(url: str, deadline: float, max_tokens: int, stats: SoakStats, seed: int) -> None:
    rng = random.Random(seed)
    scripts = [w for w in load_workloads()[0] if w.kind in ("chat", "tool_call")]
    ws_url = url.replace("http://", "ws://") + "/v1/responses"
    session = 0
    while time.monotonic() < deadline:
        with connect(ws_url, max_size=None) as ws:
            previous, user = None, [dict(m) for m in rng.choice(scripts).messages]
            for turn in range(rng.randint(2, 4)):
                event = {"type": "response.create", "model": "default", "input": user, "max_output_tokens": max_tokens,
                         "temperature": 0.7, "seed": rng.randrange(1 << 30)}
                if previous:
                    event["previous_response_id"] = previous
                ws.send(json.dumps(event))
                drop = session % 5 == 4 and turn == 1
                deltas, received = [], 0
                while True:
                    ev = json.loads(ws.recv(timeout=300))
                    if ev["type"] == "response.output_text.delta":
                        deltas.append(ev["delta"])
                        received += ev.get("num_tokens", 0)
                        if drop and received >= 3:
                            break
                    elif ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                        # tokens that made no text of their own (a stop token, a held-back byte)
                        # are counted on the terminal event
                        received += ev.get("num_tokens", 0)
                        break
                if drop:
                    stats.add(dropped=1)
                    break  # closing the socket mid-stream
                if ev["type"] not in ("response.completed", "response.incomplete"):
                    stats.failures.append(f"ws terminal {ev['type']}: {json.dumps(ev)[:200]}")
                    break
                response = ev["response"]
                final = "".join(c.get("text", "") for item in response.get("output", [])
                                for c in item.get("content", []) or [] if c.get("type") == "output_text")
                stats.add(streams=1, tokens=received)
                if "".join(deltas) != final:
                    stats.failures.append(f"ws deltas {''.join(deltas)[:80]!r} != final {final[:80]!r}")
                if response["usage"]["output_tokens"] != received:
                    stats.failures.append(f"ws usage {response['usage']['output_tokens']} != {received} received")
                previous = response["id"]
                user = [{"role": "user", "content": tool_result(final, turn)}]
                if time.monotonic() > deadline:
                    break
        session += 1
        stats.add(session="ws")


def run_soak(url: str, seconds: float, num_agents: int, max_tokens: int, stats: SoakStats) -> None:
    """Agents on threads (chat, tools, ws in turn) until `seconds` have passed."""
    deadline = time.monotonic() + seconds
    threads = []
    for i in range(num_agents):
        kind = ("chat", "tools", "ws")[i % 3]
        target, args = ((ws_agent, (url, deadline, max_tokens, stats, i)) if kind == "ws"
                        else (chat_agent, (url, deadline, kind == "tools", max_tokens, stats, i)))

        def guarded(target=target, args=args):
            try:
                target(*args)
            except Exception as e:  # noqa: BLE001 - a broken agent is a failure, not a hang
                stats.failures.append(f"{target.__name__}: {type(e).__name__}: {e}")

        threads.append(threading.Thread(target=guarded, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)
