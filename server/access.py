"""Who may connect: the optional API key and the connection limit, as one ASGI middleware.

- API key (`--api-key`): every path but `/health` needs `Authorization: Bearer <key>` (what the
  OpenAI SDK sends). HTTP without it gets 401; a WebSocket handshake without it is refused
  (the socket is closed before it opens, which the client sees as HTTP 403).
- Connection limit (`--max-connections`): HTTP requests in flight plus open WebSockets. Over
  it, HTTP gets 503 and a WebSocket is accepted only to receive one `error` event
  (`code: "too_many_connections"`) and close with 1013 (try again later). `/health` is exempt,
  so a saturated server still answers its probes.
"""

from __future__ import annotations

import hmac

import msgspec

from prescient.server.errors import APIError

EXEMPT_PATHS = ("/health",)
_encode = msgspec.json.Encoder().encode


class AccessGuard:
    def __init__(self, app, api_key: str | None, max_connections: int, metrics=None):
        self.app = app
        self.api_key = api_key
        self.max_connections = max_connections
        self.metrics = metrics
        self.open = 0

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and not self._authorized(scope):
            if kind == "http":
                await _send_http_error(send, APIError(401, "missing or invalid API key: send 'Authorization: "
                                                      "Bearer <key>'", code="invalid_api_key"))
            elif (await receive())["type"] == "websocket.connect":
                await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
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
            await self.app(scope, receive, send)
        finally:
            self._count(-1)

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


async def _send_http_error(send, err: APIError) -> None:
    body = _encode(err.body())
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _refuse_websocket(receive, send, err: APIError) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    event = {"type": "error", "sequence_number": 0, "status": err.status, "error": err.error_object()}
    await send({"type": "websocket.send", "text": _encode(event).decode()})
    await send({"type": "websocket.close", "code": 1013})
