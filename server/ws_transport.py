"""The WebSocket protocol uvicorn serves with: its sans-io one, quiet about refused handshakes.

The access guard (access.py) refuses a handshake with an HTTP answer (the ASGI
`websocket.http.response` extension: a 401 for a missing or wrong API key). uvicorn logs that
answer at info ('"WebSocket /v1/responses" 401'), but never marks such a handshake complete, so
when the application returns it also logs "ASGI callable returned without completing
handshake." at ERROR: one per refused client, which a flood of bad keys turns into an alert
storm. A denial that was sent whole is a complete answer; this marks it so.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class DenialAwareWebSocket(WebSocketsSansIOProtocol):
    async def send(self, message) -> None:  # type: ignore[override]
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True  # answered (and the socket closed): nothing left to report
