"""The Starlette app and `prescient serve`.

    build_app(aengine, ServerConfig(...)) -> Starlette app over one AsyncEngine
    run_server(spec, config, host, port)  -> `prescient serve`: bind, build the engine, serve under uvicorn

Routes: `GET /health`, `GET /metrics`, `GET /v1/models[/{model}]`, `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /v1/responses`, WebSocket `/v1/responses`. The app's lifespan warms
the engine up (one tiny generation, so the first request does not pay torch's first-call costs)
before `/health` says ok, and on shutdown stops the engine after uvicorn has let in-flight HTTP
requests finish (up to `shutdown_grace_s`) and closed the WebSockets (code 1012), whose
responses are cancelled and their KV freed; requests still queued are aborted cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
import threading

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from prescient.runtime.sampling_params import SamplingParams
from prescient.server.access import AccessGuard
from prescient.server.context import ServerConfig, ServerContext
from prescient.server.errors import APIError
from prescient.server.generation import Generation
from prescient.server.openai_http import chat_completions, completions, get_model, health, list_models, metrics
from prescient.server.responses_http import create_response
from prescient.server.responses_ws import responses_websocket
from prescient.server.transport import h11_with_header_deadline
from prescient.server.ws_transport import DenialAwareWebSocket

log = logging.getLogger("prescient.server")
_encode = msgspec.json.Encoder().encode


def _error_response(err: APIError) -> Response:
    return Response(_encode(err.body()), status_code=err.status, media_type="application/json",
                    headers=err.headers)  # Retry-After on a 429 for load


async def _api_error(request: Request, exc: APIError) -> Response:
    return _error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return _error_response(APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                                    code="not_found" if exc.status_code == 404 else None))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="server_error"))


async def warm_up(ctx: ServerContext) -> None:
    ids = ctx.renderer.render([], [{"role": "user", "content": "Hi"}]).token_ids
    gen = Generation(ctx.aengine, ids, SamplingParams(max_tokens=2, temperature=0.0), request_id="warmup")
    gen.start()
    async with contextlib.aclosing(gen.events()) as events:
        async for _ in events:
            pass


def build_app(aengine, config: ServerConfig = ServerConfig()) -> Starlette:
    ctx = ServerContext(aengine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await warm_up(ctx)
        if config.warm_grammar and ctx.engine.tokenizer is not None:
            # in the background, once the engine has been idle a moment: /health need not wait
            # for the workers' imports, and no stream decodes beside them
            ctx.warm_grammar_task = asyncio.create_task(
                ctx.constraints.warm_when_idle(aengine.idle_seconds, config.warm_grammar_idle_s))
        ctx.ready = True
        try:
            yield
        finally:
            ctx.ready = False
            if ctx.warm_grammar_task is not None:
                ctx.warm_grammar_task.cancel()
                with contextlib.suppress(BaseException):
                    await ctx.warm_grammar_task
            with contextlib.suppress(BaseException):
                await ctx.constraints.settle()  # a compiler being built must exist before close() stops it
            ctx.close()
            await asyncio.to_thread(aengine.shutdown)

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", get_model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_websocket),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan,
        middleware=[Middleware(AccessGuard, api_key=config.api_key, max_connections=config.max_connections,
                               metrics=ctx.metrics, body_timeout_s=config.body_timeout_s)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.ctx = ctx
    return app


def uvicorn_config(app, host: str, port: int, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, lifespan="on", log_level="warning", access_log=False,
        ws=DenialAwareWebSocket,  # uvicorn's websockets-sansio, refused handshakes logged at info only
        http=h11_with_header_deadline(config.header_timeout_s),  # h11 + a deadline for headers
        # Frames over max_frame_bytes get an `error` event; past 4x that (at least 1 MiB) uvicorn
        # closes with 1009 before buffering more of it.
        ws_max_size=max(4 * config.max_frame_bytes, 1 << 20),
        timeout_graceful_shutdown=config.shutdown_grace_s)


class GracefulServer(uvicorn.Server):
    """Ctrl-C / SIGTERM end in a graceful shutdown and a normal exit (uvicorn would re-raise the
    signal afterwards, ending `prescient serve` in a KeyboardInterrupt traceback)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def bound_port(server) -> int:
    """The port a started uvicorn server listens on (the real one when asked for port 0)."""
    return server.servers[0].sockets[0].getsockname()[1]


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a port in use is reported at once (OSError naming it)
    rather than after the load; uvicorn serves on this socket. Created with IPPROTO_TCP, not 0:
    asyncio sets TCP_NODELAY on accepted sockets only when the listener's protocol says TCP, and
    without it Nagle's algorithm holds a small write until the client's delayed ACK (~40 ms on
    every response after a connection's first, and on every WebSocket event)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_server(spec, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, quiet: bool = False) -> int:
    """`prescient serve`: build the engine for `spec` (an EngineSpec), serve until a signal."""
    from prescient.build import build_engine
    from prescient.runtime.async_engine import AsyncEngine

    sock = listening_socket(host, port)
    from prescient.runtime.memory import freeze_startup_objects, tune_allocator

    config = dataclasses.replace(config, warm_grammar=True)  # a server's first grammar waits for no worker start

    tune_allocator()  # before the model loads: a server's memory stays flat over days (runtime/memory.py)
    engine = build_engine(spec)
    engine.prefault_kv()  # a server's memory is flat from the start, not growing as the KV cache fills
    app = build_app(AsyncEngine(engine), config)
    freeze_startup_objects()  # full collections walk only what requests make (runtime/memory.py)
    server = GracefulServer(uvicorn_config(app, host, port, config))
    if engine.model.is_sharded:  # --tp: a lost rank ends the server (runtime/tp_worker.py)
        engine.model.set_failure_handler(lambda message: setattr(server, "should_exit", True))

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            base = f"http://{host}:{sock.getsockname()[1]}"
            ws = base.replace("http://", "ws://", 1)
            print(f"prescient: serving {app.state.ctx.model_name!r}\n"
                  f"  OpenAI API          {base}/v1\n"
                  f"  Responses WebSocket {ws}/v1/responses\n"
                  f"  health / metrics    {base}/health  {base}/metrics", flush=True)
        await task

    asyncio.run(serve())
    if not quiet:
        print("prescient: stopped", file=sys.stderr, flush=True)
    if engine.model.is_sharded and engine.model.failure:  # said on stderr when it happened
        return 1
    return 0 if server.started else 1
