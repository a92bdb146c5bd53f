"""Who may connect: the optional API key and the connection limit, as one ASGI middleware.

- API key (`--api-key`): every path but `/health` needs `Authorization: Bearer <key>` (what the
  OpenAI SDK sends). HTTP without it gets 401, and so does a WebSocket handshake without it
  (a denial response with the same JSON error body, before the socket opens; a server without
  the ASGI denial-response extension can only close it, which clients see as 403).
- Connection limit (`--max-connections`): HTTP requests in flight plus open WebSockets. Over
  it, HTTP gets 503 and a WebSocket is accepted only to receive one `error` event
  (`code: "too_many_connections"`) and close with 1013 (try again later). `/health` and
  `/metrics` are not counted, so a saturated server still answers its probes and scrapes.
- Body deadline (`--body-timeout-s`): an HTTP request's body must arrive within this long of its
  headers, or the request gets 408 and its connection is closed; a client that sends half a body
  cannot hold a connection slot for good. (Headers have their own deadline: transport.py.)
"""

from __future__ import annotations

import asyncio
import hmac

import msgspec

from prescient.server.errors import APIError

OPEN_PATHS = ("/health",)  # no API key needed
UNCOUNTED_PATHS = ("/health", "/metrics")  # answered even at the connection limit
_encode = msgspec.json.Encoder().encode


class _BodyLate(BaseException):
    """Raised into the application by `receive` when the body misses its deadline. Not an
    Exception, so no handler's `except Exception` turns it into a 500: the guard answers 408."""


class AccessGuard:
    def __init__(self, app, api_key: str | None, max_connections: int, metrics=None, body_timeout_s: float = 30.0):
        self.app = app
        self.api_key = api_key
        self.max_connections = max_connections
        self.metrics = metrics
        self.body_timeout_s = body_timeout_s
        self.open = 0

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and not self._authorized(scope):
            err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
            if kind == "http":
                await _send_http_error(send, err)
            elif (await receive())["type"] == "websocket.connect":
                await _deny_websocket(scope, send, err)
            return
        if scope["path"] in UNCOUNTED_PATHS:
            await self._serve(scope, receive, send)
            return
        if self.open >= self.max_connections:
            err = APIError(503, f"the server is at its limit of {self.max_connections} connections; retry later",
                           code="too_many_connections")
            if kind == "http":
                await _send_http_error(send, err)
            else:
                await _refuse_websocket(receive, send, err)
            return
        self._count(+1)
        try:
            await self._serve(scope, receive, send)
        finally:
            self._count(-1)

    async def _serve(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        body_done = started = False

        async def timed_receive():
            nonlocal body_done
            if body_done:  # afterwards the application only listens for a disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyLate from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except _BodyLate:
            if not started:  # closed after the answer: h11 would otherwise wait for the rest of the body
                await _send_http_error(send, APIError(408, f"the request body did not arrive within "
                                                      f"{self.body_timeout_s:g} s", code="request_timeout"),
                                       close=True)

    def _count(self, delta: int) -> None:
        self.open += delta
        if self.metrics is not None:
            self.metrics.connections.set(self.open)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        return False


async def _send_http_error(send, err: APIError, close: bool = False) -> None:
    body = _encode(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": body})


async def _deny_websocket(scope, send, err: APIError) -> None:
    """Refuse a handshake with an HTTP status, as HTTP would answer (uvicorn supports the
    `websocket.http.response` extension; a plain close would read as 403)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008, "reason": err.message[:120]})
        return
    body = _encode(err.body())
    await send({"type": "websocket.http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "websocket.http.response.body", "body": body})


async def _refuse_websocket(receive, send, err: APIError) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    event = {"type": "error", "sequence_number": 0, "status": err.status, "error": err.error_object()}
    await send({"type": "websocket.send", "text": _encode(event).decode()})
    await send({"type": "websocket.close", "code": 1013})
