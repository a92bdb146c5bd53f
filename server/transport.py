"""The HTTP/1.1 protocol uvicorn serves with: its h11 one plus a deadline for request headers.

uvicorn has no such deadline: its keep-alive timer is cancelled by the first byte that arrives,
so a client that connects and sends nothing, or half a request line, or headers without the
blank line that ends them, keeps its socket (and uvicorn's per-connection state) open forever.
Here a connection must complete each request's headers within `header_timeout_s` of connecting,
or of its previous response; otherwise it is closed. Once the headers are in, the application's
deadlines take over (the body: access.py; a WebSocket's idle time: responses_ws.py). Every
accepted connection also gets TCP_NODELAY (`set_nodelay`).
"""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineH11(H11Protocol):
    header_timeout_s: float = 10.0  # set per server by `h11_with_header_deadline`

    _header_timer: asyncio.TimerHandle | None = None
    _armed_at = None  # the request cycle that was current when the deadline was set

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        set_nodelay(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._disarm_on_new_request()

    def on_response_complete(self) -> None:
        # The next request's headers get a fresh deadline; so does the rest of a body the
        # application answered without reading (a 401, a 413): h11 must read it before the next
        # request, and a client dribbling it would hold the socket otherwise.
        self._arm()
        super().on_response_complete()  # may go straight on to a pipelined request
        self._disarm_on_new_request()

    def handle_websocket_upgrade(self, event) -> None:
        self._disarm()  # the socket now belongs to the WebSocket protocol and its idle deadline
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._armed_at = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_on_new_request(self) -> None:
        # uvicorn starts a new request cycle once a request's headers are complete
        if self._header_timer is not None and (self.cycle is not self._armed_at or self.transport.is_closing()):
            self._disarm()

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._armed_at and not self.transport.is_closing():
            self.transport.close()


def set_nodelay(transport) -> None:
    """TCP_NODELAY on an accepted connection whatever made its listening socket (asyncio sets it
    only for listeners created with IPPROTO_TCP): streamed tokens are small writes, and Nagle +
    delayed ACK would hold each for ~40 ms. The WebSocket protocol inherits the socket."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is already gone
            pass


def h11_with_header_deadline(header_timeout_s: float) -> type[HeaderDeadlineH11]:
    """The protocol class for uvicorn.Config(http=...), with this server's header deadline."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})
