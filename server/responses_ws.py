"""`/v1/responses` over WebSocket: OpenAI's Responses WebSocket mode.

The client sends `response.create` (the `POST /v1/responses` fields, flat, plus `stream_id`)
and `response.cancel` (`response_id` optional: without it every response in flight on the
connection is cancelled). The server answers every frame with at least one event; all events on
a connection carry one increasing `sequence_number`. Several responses may run on one
connection at once (up to `max_responses_per_connection`); their events interleave and are told
apart by item ids and `stream_id`.

Flow control: events go through a bounded per-connection outbox drained by one writer task.
The engine and the response tasks never wait on the socket: when a slow reader lets the outbox
fill up, the response that overflowed it is stopped (its KV freed) and ends with an `error`
event (`code: "slow_consumer"`), and every other connection keeps streaming. A client that keeps
sending frames while reading nothing is disconnected (1008) once even error events do not fit.

A failure inside a response's task (a server bug, too) ends that response with an `error`
event (500, `code: "server_error"`), and one inside a frame's handling answers the frame so;
either way the connection and its other responses go on.

Cancel stops generation within one engine step (the abort reaches the engine thread before its
next step) and ends the response with `response.incomplete`, `response.status: "cancelled"`.
A disconnect cancels every response of the connection and frees their KV the same way. A
connection with no frame and no response running for `ws_idle_timeout_s` is closed (1001).

A `response.create` whose `stream_id` or `metadata` is over its cap (server/limits.py) is
refused with an `error` event naming the field, which does not echo the refused `stream_id`. A
frame over `OFF_LOOP_BYTES` is decoded on a worker thread, while this connection waits for it
before reading its next frame (so frames are still handled in order). A response's arrival,
which its time limit and timings count from, is its frame's receipt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from functools import partial

import msgspec
from starlette.websockets import WebSocket

from prescient.server import responses_wire as w
from prescient.server.errors import APIError, bad_request
from prescient.server.limits import check_echoed
from prescient.server.protocol import ClientEvent, ResponseCancelEvent, decode
from prescient.server.responses import ResponseRun
from prescient.server.sessions import Client

log = logging.getLogger("prescient.server")
_encode = msgspec.json.Encoder().encode


def _internal(err: Exception) -> APIError:
    return APIError(500, f"internal error: {type(err).__name__}: {err}", code="server_error")


class Outbox:
    """Encoded events waiting for the socket, bounded in bytes."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._items: deque[str] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, data: str, force: bool = False) -> bool:
        """Queue `data`; False (nothing queued) if it would pass the limit. `force` (the events
        that end a response or answer a bad frame) may use up to twice the limit, so a client that
        floods the socket with frames and reads nothing cannot grow it without bound."""
        limit = 2 * self.limit_bytes if force else self.limit_bytes
        if self._items and self._bytes + len(data) > limit:
            return False
        self._items.append(data)
        self._bytes += len(data)
        self._ready.set()
        return True

    async def get(self) -> str:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        data = self._items.popleft()
        self._bytes -= len(data)
        return data


class _Overflow(Exception):
    pass


@dataclass
class _Active:
    run: ResponseRun
    task: asyncio.Task | None = None
    started: bool = False  # response.created was sent
    cancel_requested: bool = False


class ResponsesConnection:
    def __init__(self, ws: WebSocket, ctx):
        self.ws = ws
        self.ctx = ctx
        self.config = ctx.config
        self.outbox = Outbox(ctx.config.ws_buffer_bytes)
        self.client = Client.of(ws.headers, connection=uuid.uuid4().hex)  # whose stored responses it may continue
        self._next_seq = 0
        self.active: dict[str, _Active] = {}
        self.flooded = False  # set when even an error event no longer fits: the connection is dropped
        self._last_activity = 0.0  # loop time of the last frame or the last response's end

    async def serve(self) -> None:
        writer = asyncio.create_task(self._write())
        try:
            while True:
                message = await self._next_message()
                if message is None or message["type"] == "websocket.disconnect":
                    break
                arrival = time.perf_counter()
                frame = message.get("text")
                try:
                    await self.on_frame(frame if frame is not None else message.get("bytes") or b"", arrival)
                except Exception as err:  # a bug must not take the socket and its other responses down
                    log.exception("unhandled error on a WebSocket frame")
                    self.send_error(_internal(err))
                if self.flooded:
                    # The socket is backed up, so the close frame may never be written: bounded.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.ws.close(code=1008, reason="the client does not read"), 1.0)
                    break
        finally:
            tasks = [a.task for a in self.active.values() if a.task is not None]
            for task in tasks:
                task.cancel()  # each task's generation aborts its engine request
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _next_message(self) -> dict | None:
        """The client's next message, or None once the connection has gone `ws_idle_timeout_s`
        with no frame and no response running (it is closed with 1001 then): an idle client must
        not hold a connection slot for good."""
        loop = asyncio.get_running_loop()
        idle_s = self.config.ws_idle_timeout_s
        self._last_activity = loop.time()
        while True:
            # while responses run, look again every idle_s: the clock starts at the last one's end
            wait_s = idle_s if self.active else self._last_activity + idle_s - loop.time()
            try:
                return await asyncio.wait_for(self.ws.receive(), max(wait_s, 0.0))
            except TimeoutError:  # receive() is cancelled with no message lost: it waits on a queue
                if self.active or loop.time() - self._last_activity < idle_s:
                    continue
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code=1001, reason=f"idle for {idle_s:g} s"), 1.0)
            return None

    async def _write(self) -> None:
        try:
            while True:
                await self.ws.send_text(await self.outbox.get())
        except Exception:  # the socket is gone: the reader sees the disconnect and cleans up
            return

    def send(self, events: list[w.Event], force: bool = False) -> bool:
        for event in events:
            event.sequence_number = self._next_seq  # consumed only by an event that is queued: no gaps
            if not self.outbox.put(_encode(event).decode(), force):
                return False
            self._next_seq += 1
        return True

    def send_error(self, err: APIError, stream_id: str | None = None) -> None:
        if not self.send([w.error_event(err, stream_id)], force=True):
            self.flooded = True

    # ---------------------------------------------------------------- client frames

    async def on_frame(self, frame: str | bytes, arrival: float | None = None) -> None:
        if len(frame) > self.config.max_frame_bytes:
            self.send_error(APIError(413, f"frame of {len(frame)} bytes exceeds the limit of "
                                     f"{self.config.max_frame_bytes}", code="frame_too_large"))
            return
        try:
            event = await self.ctx.parse(len(frame), partial(decode, frame, ClientEvent))
        except APIError as err:
            if err.param == "type" and "Invalid value" in err.message:
                err = bad_request(f"unknown event type; expected 'response.create' or 'response.cancel' "
                                  f"({err.message})", param="type", code="unknown_event_type")
            self.send_error(err)
            return
        if isinstance(event, ResponseCancelEvent):
            self.cancel(event.response_id)
            return
        try:
            check_echoed(event.stream_id, event.metadata)
        except APIError as err:  # without the stream_id: it may be the refused string
            self.send_error(err)
            return
        if len(self.active) >= self.config.max_responses_per_connection:
            self.send_error(APIError(429, f"{len(self.active)} responses are already in flight on this "
                                     "connection", code="too_many_responses"), event.stream_id)
            return
        active = _Active(ResponseRun(self.ctx, event, self.client, arrival))
        self.active[active.run.id] = active
        active.task = asyncio.create_task(self._run(active))

    def cancel(self, response_id: str | None) -> None:
        targets = ([self.active[response_id]] if response_id in self.active else []) if response_id else \
            list(self.active.values())
        if not targets:
            what = f"response {response_id!r}" if response_id else "any response"
            self.send_error(bad_request(f"no response to cancel: {what} is not in progress on this connection",
                                        param="response_id", code="response_not_found"))
            return
        for active in targets:
            if not active.cancel_requested:
                active.cancel_requested = True
                active.task.cancel()

    # ---------------------------------------------------------------- one response

    async def _run(self, active: _Active) -> None:
        run = active.run
        try:
            await run.prepare()
            active.started = True
            self.send(run.opening(), force=True)
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    if not self.send([event]):
                        raise _Overflow
        except APIError as err:
            self.send_error(err, run.stream_id)
        except _Overflow:
            self.send_error(APIError(503, f"the client is not reading: the connection's buffer of "
                                     f"{self.config.ws_buffer_bytes} bytes overflowed, response {run.id} was "
                                     "stopped", code="slow_consumer"), run.stream_id)
        except asyncio.CancelledError:
            if not active.cancel_requested:
                raise  # a disconnect or shutdown: nobody to tell
            self.send((run.opening() if not active.started else []) + run.cancelled(), force=True)
        except Exception as err:  # a bug: the client still gets its answer, the log the traceback
            log.exception("unhandled error in response %s", run.id)
            self.send_error(_internal(err), run.stream_id)
        finally:
            self.active.pop(run.id, None)
            self._last_activity = asyncio.get_running_loop().time()


async def responses_websocket(ws: WebSocket) -> None:
    await ws.accept()
    await ResponsesConnection(ws, ws.app.state.ctx).serve()
