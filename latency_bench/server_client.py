"""A load-generator client for a running `prescient serve`: the Responses API over WebSocket.

Same interface as load_client.InProcessClient (`await chat(messages, ...)` -> reply text), so the
agent loop and the open loop drive a server unchanged. Latencies are what the client observes:
arrival = when `response.create` is sent, each emission = when a delta event is received, with
the event's `num_tokens` (prescient's extension: a speculative step's accepted tokens arrive in
one delta), finish = the terminal event. Network and serialization are included, as a user
would see them.

An agent session keeps one WebSocket open and continues its conversation with
`previous_response_id`, sending only the messages added since its last turn; the server then
reuses the conversation's pinned KV. The Responses API knows no `tool` role (tool results go
back as `function_call_output` of a call the server parsed), and the workloads declare their
tools in the system prompt, so a simulated tool result is sent as a user message here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from prescient.runtime.slo import SLOTracker

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")


@dataclass
class _Session:
    ws: object
    response_id: str | None = None
    num_messages: int = 0  # messages the server already holds for this conversation


class ServerClient:
    def __init__(self, base_url: str, tracker: SLOTracker, model: str | None = None):
        base = base_url.rstrip("/")
        self.ws_url = base.replace("https://", "wss://").replace("http://", "ws://") + "/v1/responses"
        self.tracker = tracker
        self.model = model
        self._sessions: dict[str, _Session] = {}

    async def _socket(self, session_id: str | None):
        from websockets.asyncio.client import connect

        if session_id is not None and session_id in self._sessions:
            return self._sessions[session_id]
        session = _Session(await connect(self.ws_url, max_size=None))
        if session_id is not None:
            self._sessions[session_id] = session
        return session

    async def chat(self, messages: list[dict], max_tokens: int, request_id: str, session_id: str | None = None,
                   **tags) -> str:
        session = await self._socket(session_id)
        event = {"type": "response.create", "max_output_tokens": max_tokens, "temperature": 0, "stream_id": request_id}
        if self.model:
            event["model"] = self.model
        if session.response_id is None:
            system = [m["content"] for m in messages if m["role"] == "system"]
            if system:
                event["instructions"] = "\n".join(system)
            new = [m for m in messages if m["role"] != "system"]
        else:
            event["previous_response_id"] = session.response_id
            new = messages[session.num_messages + 1:]  # +1: the server stored our last reply itself
        event["input"] = [{"type": "message", "role": "user" if m["role"] == "tool" else m["role"],
                           "content": m["content"]} for m in new]
        self.tracker.on_arrival(request_id, time.perf_counter(), **tags)
        await session.ws.send(json.dumps(event))
        text = []
        try:
            while True:
                ev = json.loads(await session.ws.recv())
                now = time.perf_counter()
                kind = ev.get("type")
                if kind in DELTAS or (kind in TERMINAL and ev.get("num_tokens")):
                    n = ev.get("num_tokens") or len(ev.get("token_times") or ()) or 1
                    self.tracker.on_emission(request_id, n, now, ev.get("token_sources") or ())
                    if kind in DELTAS:
                        text.append(ev.get("delta", ""))
                if kind == "error":
                    raise RuntimeError(f"{request_id}: server error {ev.get('error')}")
                if kind in TERMINAL:
                    self.tracker.on_finish(request_id, now)
                    session.response_id = ev["response"]["id"]
                    session.num_messages = len(messages)
                    return "".join(text)
        except BaseException:
            self.tracker.on_finish(request_id)
            raise
        finally:
            if session_id is None:
                await session.ws.close()

    async def end_session(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            await session.ws.close()

    def engine_stats(self) -> dict:
        return {}

    def close(self) -> None:
        self._sessions.clear()
