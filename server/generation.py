"""One engine request as a stream of API-neutral events: text deltas, tool calls, the finish.

Every handler (chat completions, completions, Responses over SSE and WebSocket) runs its
request through a `Generation`, so timing, tool-call parsing, metrics and cancellation behave
the same everywhere:

    gen = Generation(aengine, prompt_ids, params, ...)
    gen.start()                       # validates + submits; bad input raises APIError(400)
    async for event in gen.events():  # TextDelta / CallStart / CallDelta / CallEnd / Finished
        ...

A request refused for load raises APIError(429, code "overloaded", with `retry_after_s`): from
`start()` when the engine's queue is full, from `events()` (before any event) when the queue
filled meanwhile or the request waited too long to start.

Leaving the loop early (a cancel, a disconnect, an exception) aborts the engine request, which
frees its KV within one engine step. So does `time_limit_s` (`--request-time-limit-s`), counted
from the request's `arrival_time` (its HTTP body's last byte, its WebSocket frame's receipt; by
default `start()`), so rendering, tokenizing and a grammar compile count: past it the request is
aborted and finishes with reason "error", error_type "time_limit"; one already past it at
`start()` is refused there, unsubmitted. `finish_error` turns a failed finish into the error
a client is told: a 400 the openai SDK does not retry for the time limit and for a request that
failed for its own input (the engine's error_type "invalid_request", e.g. a grammar that admits
no token), a 500 for an engine failure.

Token timing: each delta carries the tokens whose text it completes, with their engine times
in seconds since the request's arrival and their source (target / draft / forced). A token whose text is
not yet visible (an unfinished UTF-8 character, a tool-call header) rides with the next delta;
what is left at the end (the stop token) rides with `Finished`. For /metrics, each engine
output that carried tokens is one emission at its engine stamp (server/metrics.py, whose latency
arithmetic is runtime/slo.py's, the reports' own).

Tool calls are found by `ToolCallStreamParser` (grammar/tool_parser.py) on the hermes format
the tool grammar enforces: a call's name is reported once its header is complete (the grammar
fixes it there), then its arguments stream as deltas. Text that may still be call markup (a
partial `<tool_call`, the whitespace between calls) is held back, so no delta ever carries markup
as content; a reply cut short (max_tokens, abort) drops what is held there.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from prescient.grammar import (ContentDelta, ToolCall, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
                               ToolCallStreamParser)
from prescient.runtime.request import OverloadedError, RequestOutput
from prescient.runtime.sampling_params import SamplingParams
from prescient.server.errors import APIError, bad_request, overloaded


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
    error_type: str | None = None  # with reason "error": "time_limit", "invalid_request", None (the engine's)


Event = TextDelta | CallStart | CallDelta | CallEnd | Finished


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


TIME_LIMIT_CODE = "request_time_limit_exceeded"


def time_limit_error(limit_s: float) -> APIError:
    # 400, not 408 / 5xx: the openai SDK retries those, and a retry would run past the limit again
    return bad_request(f"the request ran past the server's limit of {limit_s:g} s per request and was stopped",
                       code=TIME_LIMIT_CODE)


def finish_error(done: Finished) -> APIError:
    """The error a client is told for a generation that finished with reason "error"."""
    message = done.error or f"generation ended: {done.reason}"
    if done.error_type == "time_limit":
        return bad_request(message, code=TIME_LIMIT_CODE)
    if done.error_type == "invalid_request":  # the request's own doing (its grammar admits no token)
        return bad_request(message, code="invalid_request")
    return APIError(500, message, code="server_error")


class Generation:
    def __init__(self, aengine, prompt_ids: list[int] | tuple[int, ...], params: SamplingParams, *,
                 request_id: str | None = None, session_id: str | None = None, grammar=None,
                 parse_calls: bool = False, metrics=None, prompt_param: str = "prompt",
                 time_limit_s: float | None = None, arrival_time: float | None = None):
        self.aengine = aengine
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.request_id = request_id or new_id("req")
        self.session_id = session_id
        self.grammar = grammar
        self.metrics = metrics
        self.prompt_param = prompt_param
        self.time_limit_s = time_limit_s
        self.arrival_time = arrival_time  # perf_counter; None: start()
        self._timer: asyncio.TimerHandle | None = None
        self._parser = ToolCallStreamParser() if parse_calls else None
        self._queue: asyncio.Queue | None = None
        self._pending = Tokens()
        self.t_submit = 0.0  # the request's arrival: token times, TTFT and the time limit count from it
        self.ttft: float | None = None
        self.output_ids: list[int] = []
        self.num_cached_tokens = 0
        self.content = ""  # text outside tool calls
        self.calls: list[tuple[str, ToolCall]] = []  # (call_id, call)
        self.finished: Finished | None = None

    def start(self) -> None:
        now = time.perf_counter()
        self.t_submit = now if self.arrival_time is None else min(self.arrival_time, now)
        remaining = None if self.time_limit_s is None else self.t_submit + self.time_limit_s - now
        if remaining is not None and remaining <= 0:  # spent before it reached the engine (a slow compile)
            self._refused("timed_out")
            raise time_limit_error(self.time_limit_s)
        try:
            self._queue = self.aengine.submit(self.prompt_ids, self.params, self.request_id, self.session_id,
                                              self.grammar, arrival_time=self.t_submit)
        except ValueError as err:
            self._refused("invalid")
            message = str(err)
            param = ("logit_bias" if message.startswith("logit_bias") else "max_tokens" if "max_tokens" in message
                     else self.prompt_param if "prompt" in message else None)
            raise bad_request(message, param=param) from None
        except OverloadedError as err:
            self._refused("rejected")  # never accepted: counted apart, not judged
            raise overloaded(str(err), err.retry_after_s) from None
        if self.metrics is not None:
            self.metrics.on_submit(self.request_id, self.t_submit, len(self.prompt_ids))
        if remaining is not None:  # one timer, not a timeout on every output's wait
            self._timer = asyncio.get_running_loop().call_later(remaining, self._expire)

    def _expire(self) -> None:
        """Past the time limit: abort the engine request (it reports nothing after an abort), so
        the stream's finish is ours to write. A real finish already queued is read first."""
        if self.finished is not None:
            return
        self.aengine.abort(self.request_id)
        self._queue.put_nowait(RequestOutput(self.request_id, [], "", True, "error",
                                             error=time_limit_error(self.time_limit_s).message,
                                             error_type="time_limit"))

    async def events(self):
        if self._queue is None:
            raise RuntimeError("Generation.start() was not called")
        try:
            while self.finished is None:
                out: RequestOutput = await self._queue.get()
                for event in self._on_output(out):
                    yield event
        finally:
            if self._timer is not None:
                self._timer.cancel()
            if self.finished is None:  # left early: free the engine request (and its KV)
                self.aengine.abort(self.request_id)
                if self.metrics is not None:
                    self.metrics.discard(self.request_id)

    # ---------------------------------------------------------------- per engine output

    def _refused(self, kind: str) -> None:
        """A request refused at start, for /metrics' outcomes (judged from its arrival stamp)."""
        if self.metrics is not None:
            self.metrics.observe_refusal(self.request_id, kind, arrival_time=self.t_submit)

    def _on_output(self, out: RequestOutput) -> list[Event]:
        if out.error_type == "overloaded":  # never started: a refusal, not a finish (events() ends)
            if self.metrics is not None:  # accepted, then refused: a miss ("expired" if it waited out the queue)
                self.metrics.observe_refusal(self.request_id, "refused")
            raise overloaded(out.error or "the server is overloaded", out.retry_after_s or 1.0)
        self._take_tokens(out)
        events: list[Event] = []
        if out.new_text:
            events.extend(self._text_events(out.new_text))
        if out.finished:
            reason = out.finish_reason or "stop"
            if self._parser is not None:
                # cut short (max_tokens, abort, error): held-back markup was an unwritten call
                events.extend(self._convert(self._parser.finish(cut=reason != "stop")))
            error = out.error
            if reason == "abort" and error:  # the server is shutting down
                reason = "error"
            usage = Usage(out.num_prompt_tokens or len(self.prompt_ids), out.num_cached_tokens,
                          out.num_output_tokens or len(self.output_ids))
            self.finished = Finished(reason, error, self._claim(), usage,
                                     out.error_type if reason == "error" else None)
            self._observe_finish(out.token_times[-1] if out.token_times else None)
            events.append(self.finished)
        return events

    def _take_tokens(self, out: RequestOutput) -> None:
        if out.num_prompt_tokens:  # a real step output (an error output carries no counts)
            self.num_cached_tokens = out.num_cached_tokens
        self.output_ids.extend(out.new_token_ids)
        times = [t - self.t_submit for t in out.token_times]
        if times and self.ttft is None:
            self.ttft = times[0]
        if self.metrics is not None and out.new_token_ids:
            # one output = one emission: the tokens of a step share its stamp
            self.metrics.observe_output(self.request_id, len(out.new_token_ids),
                                        out.token_times[0] if out.token_times else None, out.token_sources)
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

    def _observe_finish(self, stamp: float | None) -> None:
        """`stamp`: the finishing output's token time (the engine commits the last tokens and
        finishes in one step); None for a finish without tokens (an error, a shutdown): now."""
        if self.metrics is None or self.finished is None:
            return
        u = self.finished.usage
        self.metrics.observe_finish(self.request_id, self.finished.reason, stamp, u.prompt_tokens, u.cached_tokens,
                                    error_type=self.finished.error_type)

    def usage_so_far(self) -> Usage:
        """For a generation stopped early (its engine request aborted, so no final output)."""
        return Usage(len(self.prompt_ids), self.num_cached_tokens, len(self.output_ids))

    @property
    def complete_calls(self) -> list[tuple[str, ToolCall]]:
        return [(cid, c) for cid, c in self.calls if c.complete]


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, default: int, max_model_len: int,
                     param: str, prompt_param: str = "input", kv_tokens: int | None = None) -> int:
    """The request's output budget: prompt + output must fit the context and `kv_tokens`, what
    the whole KV cache holds (the engine's `kv_capacity`; a sequence gets all of it, others
    giving way). An explicit value that cannot fit is a 400 naming the field and the limit; the
    default is cut to what fits."""
    limits = [(max_model_len, f"the context is {max_model_len}")]
    if kv_tokens is not None and kv_tokens < max_model_len:
        limits.append((kv_tokens, f"the KV cache holds {kv_tokens} tokens"))
    for limit, what in limits:  # the context first: a prompt over both is told about the context
        if num_prompt_tokens >= limit:
            raise bad_request(f"the prompt has {num_prompt_tokens} tokens; {what} "
                              "(prompt + at least one generated token must fit)", param=prompt_param,
                              code="context_length_exceeded")
    limit, what = limits[-1]  # the smaller
    room = limit - num_prompt_tokens
    if max_tokens is None:
        return min(default, room)
    if max_tokens > room:
        raise APIError(400, f"{param} is {max_tokens}, but the prompt has {num_prompt_tokens} tokens and "
                       f"{what}: at most {room} tokens can be generated", param=param,
                       code="context_length_exceeded")
    return max_tokens
