"""Server-sent events: framing, and a streaming response that stops on client disconnect.

`SSEResponse` runs the event stream and a listener for `http.disconnect` side by side: when the
client goes away, the stream is cancelled at once, even while it waits for a token, so the
request's `Generation` aborts its engine request and frees the KV (Starlette's StreamingResponse
would notice only at its next write).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

DONE = b"data: [DONE]\n\n"


def data(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def event(name: str, payload: bytes) -> bytes:
    return b"event: " + name.encode() + b"\n" + data(payload)


class SSEResponse:
    def __init__(self, chunks: AsyncIterator[bytes]):
        self.chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        listen = asyncio.ensure_future(self._listen(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            await self.chunks.aclose()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _listen(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
