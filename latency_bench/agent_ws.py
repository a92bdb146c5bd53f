"""The agent benchmark's WebSocket transport: prescient's Responses API, one socket per task.

The first turn sends the instructions, the user message, the tools and the turn's tool_choice;
each later turn sends only the tools' `function_call_output` items with `previous_response_id`
(the server keeps the conversation and its KV; tools and tool_choice are per response, so they
are sent each turn, as the Responses API requires). Timing as in agent_http.py: an emission is a
received event that shows the reader something (a text or arguments delta, a function call's
item opening with its name), carrying the event's `num_tokens` when it has them, else one.
"""

from __future__ import annotations

import json
import time

from prescient.latency_bench.agent_http import Turn, parse_hermes
from prescient.latency_bench.agent_tasks import SYSTEM, AgentTask
from prescient.runtime.slo import RequestTrace

_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")
_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


class WSConversation:
    def __init__(self, task: AgentTask, tools: list[dict]):
        self.task = task
        self.tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
                       "parameters": t["parameters"]} for t in tools]
        self.ws = None
        self.previous_id: str | None = None
        self.pending: list[dict] = [{"type": "message", "role": "user", "content": task.user}]

    def add_turn(self, turn: Turn, results: list[str]) -> None:
        self.pending = [{"type": "function_call_output", "call_id": cid, "output": out}
                        for cid, out in zip(turn.call_ids, results)]


class ResponsesWSTransport:
    name = "ws"
    tool_format = "native"

    def __init__(self, base_url: str, max_tokens: int, model: str = "default", temperature: float = 0.0):
        self.url = base_url.rstrip("/").replace("http://", "ws://").replace("https://", "wss://") + "/v1/responses"
        self.max_tokens, self.model, self.temperature = max_tokens, model, temperature

    def start(self, task: AgentTask, tools: list[dict]) -> WSConversation:
        return WSConversation(task, tools)

    async def turn(self, conv: WSConversation, tool_choice: str, request_id: str) -> Turn:
        from websockets.asyncio.client import connect

        if conv.ws is None:
            conv.ws = await connect(self.url, max_size=None)
        event = {"type": "response.create", "model": self.model, "stream_id": request_id,
                 "max_output_tokens": self.max_tokens, "temperature": self.temperature, "tools": conv.tools,
                 "tool_choice": tool_choice, "parallel_tool_calls": False, "input": conv.pending}
        if conv.previous_id is None:
            event["instructions"] = SYSTEM
        else:
            event["previous_response_id"] = conv.previous_id
        trace = RequestTrace(request_id, time.perf_counter())
        await conv.ws.send(json.dumps(event))
        while True:
            ev = json.loads(await conv.ws.recv())
            now = time.perf_counter()
            kind = ev.get("type")
            if kind == "error":
                raise RuntimeError(f"{request_id}: server error {ev.get('error')}")
            opened_call = kind == "response.output_item.added" and (ev.get("item") or {}).get("type") == "function_call"
            if (kind in _DELTAS and ev.get("delta")) or opened_call:
                trace.add_emission(now, ev.get("num_tokens") or 1)
            elif kind in _TERMINAL and ev.get("num_tokens"):
                trace.add_emission(now, ev["num_tokens"])
            if kind in _TERMINAL:
                trace.finished_time = now
                response = ev["response"]
                conv.previous_id = response["id"]
                return _turn_from_output(trace, response, kind)

    async def end(self, conv: WSConversation) -> None:
        if conv.ws is not None:
            await conv.ws.close()
            conv.ws = None

    async def aclose(self) -> None:
        pass


def _turn_from_output(trace: RequestTrace, response: dict, kind: str) -> Turn:
    text, calls, ids = [], [], []
    for item in response.get("output") or ():
        if item.get("type") == "function_call":
            calls.append((item.get("name", ""), item.get("arguments", "")))
            ids.append(item.get("call_id") or item.get("id"))
        elif item.get("type") == "message":
            text += [p.get("text", "") for p in item.get("content") or () if p.get("type") == "output_text"]
    content = "".join(text)
    head, stray, malformed = parse_hermes(content)
    if stray or malformed:
        malformed = malformed + [json.dumps(c) for c in stray]
        content = head
    return Turn(trace, content, calls, malformed, "length" if kind == "response.incomplete" else "stop", ids)
