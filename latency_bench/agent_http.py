"""The benchmarks' HTTP transport: chat completions streamed over SSE, through the openai SDK.

One `Conversation` is one task's message history, re-sent whole each turn, as an agent framework
does. Three ways of handling tools (`tool_format`):

    native   `tools` + the turn's `tool_choice` (+ parallel_tool_calls=false); calls come back
             as `tool_calls` deltas, results go back as `tool` messages. Text that still holds
             `<tool_call>` markup is counted as a malformed call.
    free     prescient without its tool grammar: `tools` with `tool_choice: "none"` (the server
             renders the tools into the prompt all the same, so the prompt is the native one's)
             and the calls parsed here from the hermes markup in the text.
    hermes   a server that cannot stream tool calls: no `tools`; the tools are rendered into the
             system message and calls / results into the history exactly as prescient's server
             renders them (server/tools.py), and calls parsed here from the text.

`ChatHTTPTransport.stream` is the one streaming request underneath (messages as given, no tool
handling): the load benchmark (load_driver.py) and `pd_bench --server` send through it too, so
every HTTP figure of every benchmark comes from the same client code.

Timing: arrival = just before the request is sent; an emission = a received chunk that shows the
reader something (text or a tool-call delta), carrying `len(token_times)` tokens when the server
sends prescient's timing extension, else one token.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from prescient.latency_bench.agent_tasks import AgentTask, openai_tools
from prescient.runtime.slo import RequestTrace
from prescient.server.tools import FunctionTool, render_tool_calls, render_tool_results, tools_system_text

TOOL_FORMATS = ("native", "free", "hermes")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


# body fields that are prescient's extensions, not the SDK's parameters (sent in `extra_body`)
_EXTENSIONS = ("ignore_eos", "slo", "speculate")


@dataclass
class Reply:
    """One streamed completion as it arrived: its timeline, text, tool-call deltas, finish reason."""

    trace: RequestTrace
    content: str
    calls: dict[int, list]  # index -> [id, name, arguments text]
    finish_reason: str | None = None


@dataclass
class Turn:
    trace: RequestTrace
    content: str
    calls: list[tuple[str, str]]  # (name, arguments JSON text)
    malformed: list[str]  # tool-call markup that did not parse into {"name", "arguments"}
    finish_reason: str | None = None
    call_ids: list[str] = field(default_factory=list)


def parse_hermes(text: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(text before the first call, calls, malformed markup) of a reply in the hermes format."""
    calls, malformed = [], []
    head = text.split("<tool_call>", 1)[0]
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            malformed.append(body)
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            malformed.append(body)
            continue
        args = call.get("arguments", {})
        calls.append((call["name"], args if isinstance(args, str) else json.dumps(args)))
    tail = _CALL.sub("", text)
    if "<tool_call>" in tail:  # an opened call that never closed (cut by max_tokens)
        malformed.append(tail.split("<tool_call>", 1)[1])
    return head, calls, malformed


class Conversation:
    def __init__(self, task: AgentTask, tools: list[dict], tool_format: str):
        self.task = task
        self.tool_format = tool_format
        self.tools = openai_tools(tools)
        self.messages = task.messages()
        if tool_format == "hermes":
            self.messages[0] = {"role": "system", "content": self.messages[0]["content"] + "\n\n" + tools_system_text(
                tuple(FunctionTool(t["name"], t.get("description"), t.get("parameters")) for t in tools))}

    def add_turn(self, turn: Turn, results: list[str]) -> None:
        """The assistant's reply and the tools' results, as the next request will send them."""
        if self.tool_format == "hermes":
            text = turn.content.strip()
            if turn.calls:
                text = (text + "\n" if text else "") + render_tool_calls(turn.calls)
            self.messages.append({"role": "assistant", "content": text})
            if results:
                self.messages.append({"role": "user", "content": render_tool_results(results)})
            return
        msg: dict = {"role": "assistant", "content": turn.content or None}
        if turn.calls:
            msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                                 for cid, (n, a) in zip(turn.call_ids, turn.calls)]
        self.messages.append(msg)
        for cid, out in zip(turn.call_ids, results):
            self.messages.append({"role": "tool", "tool_call_id": cid, "content": out})


class ChatHTTPTransport:
    name = "http"

    def __init__(self, base_url: str, tool_format: str, max_tokens: int, model: str = "default",
                 temperature: float = 0.0):
        import openai

        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
        # no SDK retries: a failed request is a failed turn, not a hidden second attempt
        self.client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="bench", max_retries=0,
                                         timeout=300.0)
        self.tool_format, self.max_tokens, self.model, self.temperature = tool_format, max_tokens, model, temperature

    def start(self, task: AgentTask, tools: list[dict]) -> Conversation:
        return Conversation(task, tools, self.tool_format)

    async def turn(self, conv: Conversation, tool_choice: str, request_id: str) -> Turn:
        kwargs: dict = {}
        if self.tool_format == "native":
            kwargs = {"tools": conv.tools, "tool_choice": tool_choice, "parallel_tool_calls": False}
        elif self.tool_format == "free":
            kwargs = {"tools": conv.tools, "tool_choice": "none"}
        reply = await self.stream(conv.messages, request_id, **kwargs)
        trace, content, calls, finish = reply.trace, reply.content, reply.calls, reply.finish_reason
        if self.tool_format == "native":
            parsed = [(s[1], s[2]) for _, s in sorted(calls.items())]
            ids = [s[0] or f"{request_id}-c{i}" for i, (_, s) in enumerate(sorted(calls.items()))]
            head, stray, malformed = parse_hermes(content)
            if stray or malformed:  # markup the server did not parse as a call
                malformed = malformed + [json.dumps(c) for c in stray]
                content = head
            return Turn(trace, content, parsed, malformed, finish, ids)
        head, parsed, malformed = parse_hermes(content)
        return Turn(trace, head, parsed, malformed, finish, [f"{request_id}-c{i}" for i in range(len(parsed))])

    async def stream(self, messages: list[dict], request_id: str, max_tokens: int | None = None,
                     trace: RequestTrace | None = None, **kwargs) -> Reply:
        """One streamed chat completion of `messages` as they are (`kwargs` go into the body: tools,
        extensions). The trace is filled as chunks arrive, so a caller holding it (`trace=`) can
        watch a stream in flight; its arrival is stamped here, just before the request is sent."""
        trace = trace if trace is not None else RequestTrace(request_id, 0.0)
        trace.arrival_time = time.perf_counter()
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k in _EXTENSIONS}
        stream = await self.client.chat.completions.create(
            model=self.model, messages=messages, stream=True, max_tokens=max_tokens or self.max_tokens,
            temperature=self.temperature, extra_body=extra or None, **kwargs)
        text: list[str] = []
        calls: dict[int, list] = {}  # index -> [id, name, arguments]
        finish = None
        async for chunk in stream:
            now = time.perf_counter()
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            delta = choice.delta
            finish = choice.finish_reason or finish
            visible = bool(delta.content) or bool(delta.tool_calls)
            if delta.content:
                text.append(delta.content)
            for tc in delta.tool_calls or ():
                slot = calls.setdefault(tc.index, [tc.id, "", ""])
                if tc.id:
                    slot[0] = tc.id
                if tc.function and tc.function.name:
                    slot[1] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot[2] += tc.function.arguments
            if visible:
                times = getattr(chunk, "token_times", None)
                trace.add_emission(now, len(times) if times else 1)
                if times:  # the server's own stamp (seconds since it took the request), beside ours
                    trace.tags.setdefault("server_times", []).append(times[-1])
        trace.finished_time = time.perf_counter()
        return Reply(trace, "".join(text), calls, finish)

    async def end(self, conv: Conversation) -> None:
        pass

    async def aclose(self) -> None:
        await self.client.close()
