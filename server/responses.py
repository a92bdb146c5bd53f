"""One Responses API `response.create`, independent of the transport (WebSocket or SSE).

    run = ResponseRun(ctx, params, client)
    await run.prepare()               # validate, render the conversation, compile its grammar, submit
    send(run.opening())               # response.created, response.in_progress
    async for event in run.events():  # output items and deltas ... response.completed
        send(event)
    send(run.cancelled())             # when the transport stops it early: the closing events

Events are wire Structs that the transport must encode as it receives them: later events
mutate the same response object. A response refused for load after `prepare` (it waited too
long to start, or the engine's queue filled meanwhile) raises APIError(429, "overloaded") from
`events()` before any output: the transport answers it as it answers a refused `prepare`.

Output items follow the generation: text opens a `message` item with one `output_text` part; a
tool call opens a `function_call` item as soon as its name is fixed and streams its arguments.
A finished response is stored under its id (server/sessions.py) unless `store` is false, so
`previous_response_id` can continue it (for the clients the store's scope admits; `client` is
the sender, its API key and WebSocket connection); the conversation's `session_id` (its first
response's id) goes to the engine with every turn, which pins the conversation's KV between turns.

Before anything is rendered, `prepare` refuses the OpenAI fields prescient cannot honour
(server/fields.py) and client strings the events would echo past their caps (`stream_id`,
`metadata`: server/limits.py); `tool_choice` is echoed in its normalized form. A response that
fails is `response.failed` with the code `finish_error` gives (server/generation.py):
"request_time_limit_exceeded" past `--request-time-limit-s` (counted from `arrival_time`: the
HTTP body's last byte or the WebSocket frame's receipt), "invalid_request" for a request failed
by its own input, "server_error" for an engine failure.

`generate: false` warms a conversation: its prompt (without the assistant prefix) is prefilled
into the KV cache and stored, and the response completes with no output.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from functools import partial

from prescient.server import responses_wire as w
from prescient.server.chat import Rendered, messages_from_items, split_system
from prescient.server.constraints import format_spec, pick_spec
from prescient.server.errors import APIError, bad_request
from prescient.server.fields import INCLUDE_LOGPROBS, RESPONSES, check_include, refuse_unsupported
from prescient.server.generation import (CallDelta, CallEnd, CallStart, Finished, Generation, TextDelta, Tokens,
                                         check_max_tokens, finish_error, new_id)
from prescient.server.protocol import ResponseCreateParams
from prescient.server.limits import OFF_LOOP_MESSAGES, check_echoed, check_schemas
from prescient.server.sessions import Client, Conversation
from prescient.server.tools import FunctionTool, tool_setup


def _tools(params: ResponseCreateParams) -> list[FunctionTool]:
    out = []
    for i, t in enumerate(params.tools or []):
        if t.type != "function":
            raise bad_request(f"tool type {t.type!r} is not supported (function only)", param=f"tools[{i}].type",
                              code="unsupported_tool")
        if not t.name:
            raise bad_request("a function tool needs a name", param=f"tools[{i}].name")
        out.append(FunctionTool(t.name, t.description, t.parameters))
    return out


def _echo_choice(tool_choice):
    """`tool_choice` as the response object echoes it: a named function as OpenAI's
    `{"type": "function", "name"}`, not the client's whole object (extra keys and all)."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function", tool_choice)
        return {"type": "function", "name": fn.get("name") if isinstance(fn, dict) else None}
    return tool_choice


class ResponseRun:
    def __init__(self, ctx, params: ResponseCreateParams, client: Client = Client(),
                 arrival_time: float | None = None):
        self.ctx = ctx
        self.params = params
        self.client = client
        self.arrival_time = arrival_time  # perf_counter: the body's last byte / the frame's receipt
        self.id = new_id("resp")
        self.stream_id = params.stream_id
        self.generate = params.generate is not False
        self.gen: Generation | None = None
        self._messages: list[dict] = []
        self._call_ids: set[str] = set()
        self._rendered: Rendered | None = None
        self._session_id: str | None = None
        self._message: w.OutputMessage | None = None  # the open text item
        self._calls: dict[int, w.FunctionCallItem] = {}  # open function_call items by call index
        self.response = w.ResponseObject(
            id=self.id, created_at=int(time.time()), model=ctx.model_name, status="in_progress",
            instructions=params.instructions, max_output_tokens=params.max_output_tokens,
            previous_response_id=params.previous_response_id,
            temperature=1.0 if params.temperature is None else params.temperature,
            top_p=1.0 if params.top_p is None else params.top_p,
            tool_choice=_echo_choice(params.tool_choice),
            tools=[{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                    "strict": t.strict} for t in params.tools or []],
            parallel_tool_calls=params.parallel_tool_calls is not False,
            text={"format": (params.text.format if params.text and params.text.format else {"type": "text"})},
            metadata=params.metadata or {})

    # ---------------------------------------------------------------- before the first event

    async def prepare(self) -> None:
        ctx, p = self.ctx, self.params
        check_echoed(p.stream_id, p.metadata)
        refuse_unsupported(p, RESPONSES)
        check_include(p.include)
        ctx.check_model(p.model)
        previous = None
        if p.previous_response_id is not None:
            previous = ctx.store.get(p.previous_response_id, self.client)
            if previous is None:
                raise bad_request(f"previous response {p.previous_response_id!r} not found (unknown or expired)",
                                  param="previous_response_id", code="previous_response_not_found")
        tools = _tools(p)
        fmt = p.text.format if p.text else None
        check_schemas(tools, fmt, "text.format", ctx.config.max_tools, ctx.config.max_schema_bytes)
        setup = tool_setup(tools, p.tool_choice, p.parallel_tool_calls)
        self._call_ids = set(previous.call_ids) if previous else set()  # what function_call_output may answer
        items = len(p.input) if isinstance(p.input, list) else 0
        new = await ctx.parse(items, partial(messages_from_items, p.input, calls=self._call_ids),
                              limit=OFF_LOOP_MESSAGES)
        if not new and previous is None:
            raise bad_request("input is required", param="input", code="empty_input")
        self._messages = (list(previous.messages) if previous else []) + new
        system, rest = split_system(self._messages)
        try:
            self._rendered = await ctx.render([p.instructions or ""] + system + [setup.system_text()], rest,
                                              param="input", add_generation_prompt=self.generate,
                                              prefix=previous.rendered if previous else None)
            prompt_ids = self._rendered.token_ids
            max_tokens = (check_max_tokens(len(prompt_ids), p.max_output_tokens, ctx.config.default_max_tokens,
                                           ctx.max_model_len, "max_output_tokens", kv_tokens=ctx.kv_tokens)
                          if self.generate else check_max_tokens(len(prompt_ids), None, 1, ctx.max_model_len,
                                                                 "max_output_tokens", kv_tokens=ctx.kv_tokens))
        except APIError as err:
            if err.code == "context_length_exceeded" and p.truncation == "auto":  # asked for, not silently skipped
                err = APIError(err.status, f"{err.message}; truncation 'auto' (dropping the oldest input items) is "
                               "not supported, so the conversation must fit", param=err.param, code=err.code)
            raise err from None
        spec = pick_spec(format_spec(fmt, "text.format"), setup.grammar, "text.format")
        logprobs = p.top_logprobs
        if logprobs is None and INCLUDE_LOGPROBS in (p.include or ()):
            logprobs = 0  # the chosen tokens' logprobs, no alternatives
        sampling = ctx.sampling(p, max_tokens, logprobs=logprobs)
        matcher = await ctx.constraints.matcher(spec, "text.format" if fmt else "tools") if self.generate else None
        if p.store is not False:
            self._session_id = previous.session_id if previous else self.id
        self.gen = Generation(ctx.aengine, prompt_ids, sampling, request_id=self.id, session_id=self._session_id,
                              grammar=matcher, parse_calls=setup.parse_calls and self.generate, metrics=ctx.metrics,
                              prompt_param="input", time_limit_s=ctx.config.request_time_limit_s,
                              arrival_time=self.arrival_time)
        self.gen.start()

    # ---------------------------------------------------------------- events

    def _ev(self, cls, **fields):
        return cls(stream_id=self.stream_id, **fields)

    def opening(self) -> list[w.Event]:
        return [self._ev(w.ResponseCreated, response=self.response),
                self._ev(w.ResponseInProgress, response=self.response)]

    async def events(self):
        async with aclosing(self.gen.events()) as stream:
            async for ev in stream:
                for out in self._on(ev):
                    yield out
        for out in self._finish(self.gen.finished):
            yield out

    def _on(self, ev) -> list[w.Event]:
        if not self.generate:
            return []  # warming: the one sampled token is discarded
        if isinstance(ev, TextDelta):
            events = self._open_message() if self._message is None else []
            msg = self._message
            logprobs = self._logprobs(ev.tokens)
            msg.content[0].text += ev.text
            msg.content[0].logprobs.extend(logprobs)  # the final object has them too (not only the deltas)
            return events + [self._ev(w.OutputTextDelta, item_id=msg.id, output_index=self._index(msg),
                                      delta=ev.text, **_timing(ev.tokens), logprobs=logprobs)]
        if isinstance(ev, CallStart):
            events = self._close_message("completed")
            item = w.FunctionCallItem(id=new_id("fc"), call_id=ev.call_id, name=ev.name, arguments="",
                                      status="in_progress")
            self._calls[ev.index] = item
            self.response.output.append(item)
            added = w.FunctionCallItem(id=item.id, call_id=item.call_id, name=item.name, arguments="",
                                       status="in_progress")
            return events + [self._ev(w.OutputItemAdded, output_index=self._index(item), item=added)]
        if isinstance(ev, CallDelta):
            item = self._calls[ev.index]
            item.arguments += ev.text
            return [self._ev(w.FunctionCallArgumentsDelta, item_id=item.id, output_index=self._index(item),
                             delta=ev.text, **_timing(ev.tokens))]
        if isinstance(ev, CallEnd):
            return self._close_call(ev.index, "completed")
        return []  # Finished: handled after the stream ends

    def cancelled(self) -> list[w.Event]:
        """Closing events for a response its transport stopped on the client's request."""
        return self._finish(None, cancelled=True)

    # ---------------------------------------------------------------- item bookkeeping

    def _index(self, item) -> int:
        return next(i for i, it in enumerate(self.response.output) if it is item)

    def _logprobs(self, tokens: Tokens) -> list:
        token_text = self.ctx.token_text
        return [{"token": token_text(e["token_id"]), "logprob": e["logprob"],
                 "top_logprobs": [{"token": token_text(i), "logprob": lp} for i, lp in e.get("top", [])]}
                for e in tokens.logprobs]

    def _open_message(self) -> list[w.Event]:
        msg_id = new_id("msg")
        self._message = w.OutputMessage(id=msg_id, status="in_progress", content=[w.OutputText(text="")])
        self.response.output.append(self._message)
        index = self._index(self._message)
        # The events get items of their own: the live one keeps growing after they are sent.
        return [self._ev(w.OutputItemAdded, output_index=index,
                         item=w.OutputMessage(id=msg_id, status="in_progress", content=[])),
                self._ev(w.ContentPartAdded, item_id=msg_id, output_index=index, content_index=0,
                         part=w.OutputText(text=""))]

    def _close_message(self, status: str) -> list[w.Event]:
        msg, self._message = self._message, None
        if msg is None:
            return []
        index, part = self._index(msg), msg.content[0]
        msg.status = status
        return [self._ev(w.OutputTextDone, item_id=msg.id, output_index=index, content_index=0, text=part.text),
                self._ev(w.ContentPartDone, item_id=msg.id, output_index=index, content_index=0, part=part),
                self._ev(w.OutputItemDone, output_index=index, item=msg)]

    def _close_call(self, call_index: int, status: str) -> list[w.Event]:
        item = self._calls.pop(call_index, None)
        if item is None:
            return []
        item.status = status
        index = self._index(item)
        return [self._ev(w.FunctionCallArgumentsDone, item_id=item.id, output_index=index, name=item.name,
                         arguments=item.arguments),
                self._ev(w.OutputItemDone, output_index=index, item=item)]

    def _finish(self, done: Finished | None, cancelled: bool = False) -> list[w.Event]:
        ok = done is not None and done.reason in ("stop", "length")
        item_status = "completed" if done is not None and done.reason == "stop" else "incomplete"
        events = self._close_message(item_status)
        for call_index in list(self._calls):
            events += self._close_call(call_index, "incomplete")
        r = self.response
        r.completed_at = int(time.time())
        u = done.usage if done is not None else self.gen.usage_so_far() if self.gen is not None else None
        if u is not None:
            output_tokens = u.output_tokens if self.generate else 0  # warming: the sampled token is dropped
            r.usage = w.ResponseUsage(u.prompt_tokens, w.InputTokensDetails(u.cached_tokens), output_tokens,
                                      w.OutputTokensDetails(), u.prompt_tokens + output_tokens)
        tokens = done.tokens if done is not None and self.generate else Tokens()
        ttft = self.gen.ttft if self.gen is not None and self.generate else None
        extra = dict(**_timing(tokens), ttft_s=None if ttft is None else round(ttft, 6))
        if cancelled:
            r.status, r.incomplete_details = "cancelled", w.IncompleteDetails("cancelled")
            events.append(self._ev(w.ResponseIncomplete, response=r, **extra))
        elif done.reason == "stop" or (done.reason == "length" and not self.generate):
            r.status = "completed"
            events.append(self._ev(w.ResponseCompleted, response=r, **extra))
        elif done.reason == "length":
            r.status, r.incomplete_details = "incomplete", w.IncompleteDetails("max_output_tokens")
            events.append(self._ev(w.ResponseIncomplete, response=r, **extra))
        else:
            r.status = "failed"
            err = finish_error(done)
            r.error = w.ResponseError(err.code, err.message)
            events.append(self._ev(w.ResponseFailed, response=r, **extra))
        if ok and self._session_id is not None:
            self._store()
        return events

    def _store(self) -> None:
        """Keep the conversation, including the model's raw output, for previous_response_id."""
        rendered, messages = self._rendered, list(self._messages)
        if self.generate:
            ids, text = self.ctx.renderer.model_output(self.gen.output_ids)
            messages.append({"role": "assistant", "content": text})
            rendered = Rendered(rendered.text + text, rendered.token_ids + tuple(ids))
        call_ids = frozenset(self._call_ids | {cid for cid, _ in self.gen.calls})
        self.ctx.store.put(Conversation(self.id, self._session_id, tuple(messages), rendered, call_ids), self.client)


def _timing(tokens: Tokens) -> dict:
    return {"token_times": tokens.times, "num_tokens": len(tokens), "token_sources": tokens.sources}

