"""One engine request as a stream of API-neutral events: text deltas, tool calls, the finish.

Every handler (chat completions, completions, Responses over SSE and WebSocket) runs its
request through a `Generation`, so timing, tool-call parsing, metrics and cancellation behave
the same everywhere:

    gen = Generation(aengine, prompt_ids, params, ...)
    gen.start()                       # validates + submits; bad input raises APIError(400)
    async for event in gen.events():  # TextDelta / CallStart / CallDelta / CallEnd / Finished
        ...

Leaving the loop early (a cancel, a disconnect, an exception) aborts the engine request, which
frees its KV within one engine step.

Token timing: each delta carries the tokens whose text it completes, with their engine times
in seconds since submission and their source (target / draft / forced). A token whose text is
not yet visible (an unfinished UTF-8 character, a tool-call header) rides with the next delta;
what is left at the end (the stop token) rides with `Finished`.

Tool calls are found by `ToolCallStreamParser` (grammar/tool_parser.py) on the hermes format
the tool grammar enforces: a call's name is reported once its header is complete (the grammar
fixes it there), then its arguments stream as deltas.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from prescient.grammar import (ContentDelta, ToolCall, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
                               ToolCallStreamParser)
from prescient.runtime.request import RequestOutput
from prescient.runtime.sampling_params import SamplingParams
from prescient.server.errors import APIError, bad_request


@dataclass
class Tokens:
    """Tokens reported with one event: engine times (s since submission), sources, logprobs."""

    times: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.times)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: Tokens


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str
    call_id: str


@dataclass(frozen=True)
class CallDelta:
    index: int
    text: str
    tokens: Tokens


@dataclass(frozen=True)
class CallEnd:
    index: int
    arguments: str


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | abort | error
    error: str | None
    tokens: Tokens
    usage: Usage


Event = TextDelta | CallStart | CallDelta | CallEnd | Finished


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Generation:
    def __init__(self, aengine, prompt_ids: list[int] | tuple[int, ...], params: SamplingParams, *,
                 request_id: str | None = None, session_id: str | None = None, grammar=None,
                 parse_calls: bool = False, metrics=None, prompt_param: str = "prompt"):
        self.aengine = aengine
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.request_id = request_id or new_id("req")
        self.session_id = session_id
        self.grammar = grammar
        self.metrics = metrics
        self.prompt_param = prompt_param
        self._parser = ToolCallStreamParser() if parse_calls else None
        self._queue: asyncio.Queue | None = None
        self._pending = Tokens()
        self._last_time: float | None = None
        self.t_submit = 0.0
        self.ttft: float | None = None
        self.output_ids: list[int] = []
        self.num_cached_tokens = 0
        self.content = ""  # text outside tool calls
        self.calls: list[tuple[str, ToolCall]] = []  # (call_id, call)
        self.finished: Finished | None = None

    def start(self) -> None:
        self.t_submit = time.perf_counter()
        try:
            self._queue = self.aengine.submit(self.prompt_ids, self.params, self.request_id, self.session_id,
                                              self.grammar)
        except ValueError as err:
            message = str(err)
            param = "max_tokens" if "max_tokens" in message else self.prompt_param if "prompt" in message else None
            raise bad_request(message, param=param) from None

    async def events(self):
        if self._queue is None:
            raise RuntimeError("Generation.start() was not called")
        try:
            while self.finished is None:
                out: RequestOutput = await self._queue.get()
                for event in self._on_output(out):
                    yield event
        finally:
            if self.finished is None:  # left early: free the engine request (and its KV)
                self.aengine.abort(self.request_id)

    # ---------------------------------------------------------------- per engine output

    def _on_output(self, out: RequestOutput) -> list[Event]:
        self._take_tokens(out)
        events: list[Event] = []
        if out.new_text:
            events.extend(self._text_events(out.new_text))
        if out.finished:
            if self._parser is not None:
                events.extend(self._convert(self._parser.finish()))
            reason = out.finish_reason or "stop"
            error = out.error
            if reason == "abort" and error:  # the server is shutting down
                reason = "error"
            usage = Usage(out.num_prompt_tokens or len(self.prompt_ids), out.num_cached_tokens,
                          out.num_output_tokens or len(self.output_ids))
            self.finished = Finished(reason, error, self._claim(), usage)
            self._observe_finish()
            events.append(self.finished)
        return events

    def _take_tokens(self, out: RequestOutput) -> None:
        if out.num_prompt_tokens:  # a real step output (an error output carries no counts)
            self.num_cached_tokens = out.num_cached_tokens
        self.output_ids.extend(out.new_token_ids)
        times = [t - self.t_submit for t in out.token_times]
        if times and self.ttft is None:
            self.ttft = times[0]
            if self.metrics is not None:
                self.metrics.ttft.observe(self.ttft)
        if self.metrics is not None and times:
            seq = ([self._last_time] if self._last_time is not None else []) + times
            self.metrics.observe_tokens([b - a for a, b in zip(seq, seq[1:])], out.token_sources)
        if times:
            self._last_time = times[-1]
        self._pending.times.extend(round(t, 6) for t in times)
        self._pending.sources.extend(out.token_sources)
        if out.logprobs:
            self._pending.logprobs.extend(out.logprobs)

    def _claim(self) -> Tokens:
        tokens, self._pending = self._pending, Tokens()
        return tokens

    def _text_events(self, text: str) -> list[Event]:
        if self._parser is None:
            self.content += text
            return [TextDelta(text, self._claim())]
        return self._convert(self._parser.feed(text))

    def _convert(self, parsed) -> list[Event]:
        events: list[Event] = []
        for p in parsed:
            if isinstance(p, ContentDelta):
                self.content += p.text
                events.append(TextDelta(p.text, self._claim()))
            elif isinstance(p, ToolCallStart):
                call_id = new_id("call")
                self.calls.append((call_id, self._parser.calls[p.index]))
                events.append(CallStart(p.index, p.name, call_id))
            elif isinstance(p, ToolCallArgumentsDelta):
                events.append(CallDelta(p.index, p.text, self._claim()))
            elif isinstance(p, ToolCallEnd):
                events.append(CallEnd(p.index, self._parser.calls[p.index].arguments))
        return events

    def _observe_finish(self) -> None:
        if self.metrics is None or self.finished is None:
            return
        n = len(self.output_ids)
        first, last = self.ttft, self._last_time
        tpot = (last - first) / (n - 1) if n > 1 and first is not None and last is not None else None
        u = self.finished.usage
        self.metrics.observe_finish(self.finished.reason, time.perf_counter() - self.t_submit, tpot,
                                    u.prompt_tokens, u.cached_tokens)

    def usage_so_far(self) -> Usage:
        """For a generation stopped early (its engine request aborted, so no final output)."""
        return Usage(len(self.prompt_ids), self.num_cached_tokens, len(self.output_ids))

    @property
    def complete_calls(self) -> list[tuple[str, ToolCall]]:
        return [(cid, c) for cid, c in self.calls if c.complete]


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, default: int, max_model_len: int,
                     param: str, prompt_param: str = "input") -> int:
    """The request's output budget: an explicit value must fit the context (400 naming the
    field); the default is cut to what fits."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(f"the prompt has {num_prompt_tokens} tokens; the context is {max_model_len} "
                          "(prompt + at least one generated token must fit)", param=prompt_param,
                          code="context_length_exceeded")
    if max_tokens is None:
        return min(default, room)
    if max_tokens > room:
        raise APIError(400, f"{param} is {max_tokens}, but the prompt has {num_prompt_tokens} tokens and the "
                       f"context is {max_model_len}: at most {room} tokens can be generated", param=param,
                       code="context_length_exceeded")
    return max_tokens
