"""`POST /v1/responses`: the Responses API over HTTP, as JSON or (`stream: true`) SSE.

The same `ResponseRun` as the WebSocket drives it; over SSE each event is framed as
`event: <type>` + `data: <json>` with `sequence_number` counting from 0 within the response.
Refusals (bad input, unknown model, unknown previous_response_id, a full engine queue) are HTTP
errors before the stream starts; a request that then waits too long to start is a 429 with
Retry-After, or once streaming an `error` event (code "overloaded", `retry_after`). Without
`stream`, the answer is the final `Response` object, or for a failed response the error
`finish_error` gives (a 400 for the time limit or the request's own fault, else a 500); streamed,
a failed response ends in `response.failed` with that code. A body over `OFF_LOOP_BYTES` is
decoded on a worker thread; the request's arrival is its body's last byte.
"""

from __future__ import annotations

import itertools
from contextlib import aclosing
from functools import partial

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from prescient.server import responses_wire as w
from prescient.server import sse
from prescient.server.errors import APIError
from prescient.server.generation import finish_error
from prescient.server.openai_http import read_body, unless_disconnected
from prescient.server.protocol import ResponseCreateParams, decode
from prescient.server.responses import ResponseRun
from prescient.server.sessions import Client

_encode = msgspec.json.Encoder().encode


async def create_response(request: Request) -> Response:
    ctx = request.app.state.ctx
    body, arrival = await read_body(request, ctx.config.max_body_bytes)
    params = await ctx.parse(len(body), partial(decode, body, ResponseCreateParams))
    run = ResponseRun(ctx, params, Client.of(request.headers), arrival)
    await run.prepare()
    if params.stream:
        return sse.SSEResponse(_stream(run))
    return await unless_disconnected(request, _whole(run))


async def _whole(run: ResponseRun) -> Response:
    async with aclosing(run.events()) as events:
        async for _ in events:
            pass
    if run.response.status == "failed":
        raise finish_error(run.gen.finished)
    return Response(_encode(run.response), media_type="application/json")


async def _stream(run: ResponseRun):
    seq = itertools.count()

    def frame(event) -> bytes:
        event.sequence_number = next(seq)
        return sse.event(type(event).__struct_config__.tag, _encode(event))

    for event in run.opening():
        yield frame(event)
    try:
        async with aclosing(run.events()) as events:
            async for event in events:
                yield frame(event)
    except APIError as err:  # refused for load after the opening events: an `error` event ends it
        yield frame(w.error_event(err, run.stream_id))
