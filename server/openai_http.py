"""OpenAI-compatible HTTP: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

Both generation endpoints answer as JSON or, with `stream: true`, as SSE chunks ending in
`data: [DONE]` (`stream_options.include_usage` adds a last chunk with the usage). Everything that
can be refused is refused before the first byte of the answer: malformed or mistyped bodies, an
unknown model (404), a prompt over the context or the KV cache or `max_tokens` over what fits,
a refused schema or tool list, one over the server's limits (server/limits.py), a body the client
stopped sending (499, logged at debug level), a full engine queue (429 + Retry-After), an OpenAI
field prescient cannot honour (400 "unsupported_parameter", server/fields.py). A failed
generation is answered by `finish_error` (server/generation.py): not streamed, a 400 for a
request stopped at `--request-time-limit-s` (code "request_time_limit_exceeded") or failed by its
own input (code "invalid_request"), a 500 for an engine failure; streamed, an `{"error": ...}`
chunk with the same code, which the SDK raises as an APIError. A request that waited too long to
start is a 429 (streamed, an error chunk with code "overloaded").

The time limit and the reported timings count from the request's arrival, the moment its
body's last byte was read (`read_body`). Bodies over `OFF_LOOP_BYTES` are decoded, audited and
their messages converted on a worker thread (ServerContext.parse).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from functools import partial

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from prescient.server import chat_wire as w
from prescient.server import sse
from prescient.server.chat import messages_from_chat, split_system
from prescient.server.constraints import format_spec, pick_spec
from prescient.server.context import ServerContext
from prescient.server.errors import APIError, bad_request
from prescient.server.fields import CHAT, refuse_unsupported
from prescient.server.generation import (CallDelta, CallStart, Finished, Generation, TextDelta, check_max_tokens,
                                         finish_error, new_id)
from prescient.server.limits import check_schemas
from prescient.server.metrics import CONTENT_TYPE
from prescient.server.protocol import ChatCompletionRequest, CompletionRequest, decode
from prescient.server.sessions import Client
from prescient.server.tools import FunctionTool, tool_setup

log = logging.getLogger("prescient.server")
_encode = msgspec.json.Encoder().encode
_CHUNK, _TEXT = "chat.completion.chunk", "text_completion"


async def read_body(request: Request, limit: int) -> tuple[bytes, float]:
    """The body, and its arrival (perf_counter when its last byte was read): where the request's
    time limit and timings start."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    except ClientDisconnect:
        # The client's own doing, not a server error: one quiet line, and an answer nobody reads
        log.debug("client disconnected while sending its body to %s", request.url.path)
        raise APIError(499, "the client disconnected before its request body arrived",
                       code="client_disconnected") from None
    return bytes(body), time.perf_counter()


async def unless_disconnected(request: Request, work) -> Response:
    """Await `work` (a non-streamed answer) unless the client hangs up first: then it is
    cancelled, which aborts its generation and frees the KV, instead of generating for no one."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # "client closed request": nobody reads it
    return task.result()


def _finish_reason(gen: Generation, reason: str) -> str:
    if reason == "stop" and gen.complete_calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


# ---------------------------------------------------------------- chat completions

def _parse_chat(body: bytes) -> tuple[ChatCompletionRequest, list[dict]]:
    """Decode, refuse what cannot be honoured, bound and convert the messages."""
    req = decode(body, ChatCompletionRequest)
    refuse_unsupported(req, CHAT)
    return req, messages_from_chat(req.messages)


async def chat_completions(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body, arrival = await read_body(request, ctx.config.max_body_bytes)
    req, messages = await ctx.parse(len(body), partial(_parse_chat, body))
    ctx.check_model(req.model)
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            raise bad_request(f"tool type {t.type!r} is not supported (function only)", param=f"tools[{i}].type")
        tools.append(FunctionTool(t.function.name, t.function.description, t.function.parameters))
    check_schemas(tools, req.response_format, "response_format", ctx.config.max_tools, ctx.config.max_schema_bytes)
    setup = tool_setup(tools, req.tool_choice, req.parallel_tool_calls)
    system, rest = split_system(messages)
    prompt = await ctx.render(system + [setup.system_text()], rest, param="messages")
    spec = pick_spec(format_spec(req.response_format, "response_format"), setup.grammar, "response_format")
    max_tokens = check_max_tokens(len(prompt.token_ids), req.max_completion_tokens or req.max_tokens,
                                  ctx.config.default_max_tokens, ctx.max_model_len,
                                  "max_completion_tokens" if req.max_completion_tokens else "max_tokens", "messages",
                                  kv_tokens=ctx.kv_tokens)
    params = ctx.sampling(req, max_tokens, stop=req.stop, ignore_eos=req.ignore_eos,
                          logprobs=(req.top_logprobs or 0) if req.logprobs else None, client=Client.of(request.headers))
    matcher = await ctx.constraints.matcher(spec, "response_format" if req.response_format else "tools")
    gen = Generation(ctx.aengine, prompt.token_ids, params, grammar=matcher, parse_calls=setup.parse_calls,
                     metrics=ctx.metrics, prompt_param="messages", time_limit_s=ctx.config.request_time_limit_s,
                     arrival_time=arrival)
    gen.start()
    rid, created = new_id("chatcmpl"), int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse.SSEResponse(_refusable(_chat_chunks(ctx, gen, rid, created, include_usage, req.logprobs)))
    return await unless_disconnected(request, _chat_json(ctx, gen, rid, created, req.logprobs))


async def _chat_json(ctx: ServerContext, gen: Generation, rid: str, created: int, logprobs: bool) -> Response:
    entries: list[dict] = []
    async with aclosing(gen.events()) as events:
        async for ev in events:
            if isinstance(ev, (TextDelta, CallDelta, Finished)):
                entries.extend(ev.tokens.logprobs)
    done = gen.finished
    if done.reason == "error":
        raise finish_error(done)
    calls = [w.ToolCallOut(cid, w.FunctionOut(c.name, c.arguments)) for cid, c in gen.complete_calls]
    message = w.MessageOut(gen.content if (gen.content or not calls) else None, tool_calls=calls or None)
    choice = w.Choice(0, message, _finish_reason(gen, done.reason),
                      w.chat_logprobs(entries, ctx.token_text) if logprobs else None)
    body = w.ChatCompletion(rid, created, ctx.model_name, [choice], w.usage(done.usage))
    return Response(_encode(body), media_type="application/json")


async def _chat_chunks(ctx: ServerContext, gen: Generation, rid: str, created: int, include_usage: bool,
                       logprobs: bool):
    def chunk(delta: w.Delta, finish: str | None = None, tokens=None) -> bytes:
        lp = w.chat_logprobs(tokens.logprobs, ctx.token_text) if logprobs and tokens and tokens.logprobs else None
        c = w.ChatCompletionChunk(rid, created, ctx.model_name, [w.ChunkChoice(0, delta, finish, lp)], _CHUNK,
                                  token_times=tokens.times if tokens else None,
                                  token_sources=tokens.sources if tokens else None)
        return sse.data(_encode(c))

    yield chunk(w.Delta(role="assistant", content=""))
    async with aclosing(gen.events()) as events:
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield chunk(w.Delta(content=ev.text), tokens=ev.tokens)
            elif isinstance(ev, CallStart):
                yield chunk(w.Delta(tool_calls=[w.ToolCallDelta(ev.index, ev.call_id, "function",
                                                                w.FunctionDelta(name=ev.name, arguments=""))]))
            elif isinstance(ev, CallDelta):
                call = w.ToolCallDelta(ev.index, function=w.FunctionDelta(arguments=ev.text))
                yield chunk(w.Delta(tool_calls=[call]), tokens=ev.tokens)
            elif isinstance(ev, Finished):
                if ev.reason == "error":
                    yield _error_chunk(finish_error(ev))
                    return
                yield chunk(w.Delta(), _finish_reason(gen, ev.reason), tokens=ev.tokens if len(ev.tokens) else None)
                if include_usage:
                    yield sse.data(_encode(w.ChatCompletionChunk(rid, created, ctx.model_name, [], _CHUNK,
                                                                 usage=w.usage(ev.usage))))
    yield sse.DONE


# ---------------------------------------------------------------- completions

async def completions(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body, arrival = await read_body(request, ctx.config.max_body_bytes)
    req = await ctx.parse(len(body), partial(decode, body, CompletionRequest))
    ctx.check_model(req.model)
    if req.echo:
        raise bad_request("echo is not supported", param="echo", code="unsupported_parameter")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
    if isinstance(req.prompt, str):
        prompt_ids = await ctx.encode_prompt(req.prompt, "prompt")
    else:
        prompt_ids = list(req.prompt)
    if not prompt_ids:
        raise bad_request("prompt is empty", param="prompt", code="empty_input")
    max_tokens = check_max_tokens(len(prompt_ids), req.max_tokens, ctx.config.default_completion_tokens,
                                  ctx.max_model_len, "max_tokens", "prompt", kv_tokens=ctx.kv_tokens)
    params = ctx.sampling(req, max_tokens, stop=req.stop, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                          client=Client.of(request.headers))
    gen = Generation(ctx.aengine, prompt_ids, params, metrics=ctx.metrics, prompt_param="prompt",
                     time_limit_s=ctx.config.request_time_limit_s, arrival_time=arrival)
    gen.start()
    rid, created = new_id("cmpl"), int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse.SSEResponse(_refusable(_completion_chunks(ctx, gen, rid, created, include_usage,
                                                             req.logprobs is not None)))
    return await unless_disconnected(request, _completion_json(ctx, gen, rid, created, req.logprobs is not None))


async def _completion_json(ctx: ServerContext, gen: Generation, rid: str, created: int, logprobs: bool) -> Response:
    entries: list[dict] = []
    async with aclosing(gen.events()) as events:
        async for ev in events:
            if isinstance(ev, (TextDelta, Finished)):
                entries.extend(ev.tokens.logprobs)
    done = gen.finished
    if done.reason == "error":
        raise finish_error(done)
    lp = w.completion_logprobs(entries, ctx.token_text, 0) if logprobs else None
    choice = w.CompletionChoice(0, gen.content, "length" if done.reason == "length" else "stop", lp)
    body = w.Completion(rid, created, ctx.model_name, [choice], _TEXT, usage=w.usage(done.usage))
    return Response(_encode(body), media_type="application/json")


async def _completion_chunks(ctx: ServerContext, gen: Generation, rid: str, created: int, include_usage: bool,
                             logprobs: bool):
    def chunk(choices: list, **extra) -> bytes:
        return sse.data(_encode(w.Completion(rid, created, ctx.model_name, choices, _TEXT, **extra)))

    offset = 0
    async with aclosing(gen.events()) as events:
        async for ev in events:
            if isinstance(ev, TextDelta):
                lp = w.completion_logprobs(ev.tokens.logprobs, ctx.token_text, offset) if logprobs else None
                offset += len(ev.text)
                yield chunk([w.CompletionChoice(0, ev.text, None, lp)], token_times=ev.tokens.times,
                            token_sources=ev.tokens.sources)
            elif isinstance(ev, Finished):
                if ev.reason == "error":
                    yield _error_chunk(finish_error(ev))
                    return
                yield chunk([w.CompletionChoice(0, "", "length" if ev.reason == "length" else "stop")])
                if include_usage:
                    yield chunk([], usage=w.usage(ev.usage))
    yield sse.DONE


async def _refusable(chunks):
    """A stream whose request is refused for load after the 200 went out (it waited too long to
    start): the refusal as an error chunk, code "overloaded" with `retry_after`, then the end."""
    async with aclosing(chunks):
        try:
            async for c in chunks:
                yield c
        except APIError as err:
            yield sse.data(_encode(err.body())) + sse.DONE


def _error_chunk(err: APIError) -> bytes:
    """A failed generation mid-stream: an error chunk (the SDK raises it), then the end."""
    return sse.data(_encode(err.body())) + sse.DONE


# ---------------------------------------------------------------- models, health, metrics

def _model_card(ctx: ServerContext) -> dict:
    return {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "prescient",
            "max_model_len": ctx.max_model_len}


async def list_models(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return JSONResponse({"object": "list", "data": [_model_card(ctx)]})


async def get_model(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(request.path_params["model"])
    return JSONResponse(_model_card(ctx))


async def health(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    if not ctx.ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    return JSONResponse({"status": "ok", "model": ctx.model_name})


async def metrics(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
