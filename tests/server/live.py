"""Live servers for the server tests: in a thread (uvicorn over an in-process engine, whose state
the tests can inspect) or as a `prescient serve` subprocess (the real command line)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import uvicorn

from prescient.runtime.async_engine import AsyncEngine
from prescient.server.app import bound_port, build_app, uvicorn_config
from prescient.server.context import ServerConfig


class LiveServer:
    """`build_app` over `engine`, served by uvicorn on 127.0.0.1 at a free port, in a thread."""

    def __init__(self, engine, config: ServerConfig = ServerConfig(), send_buffer: int | None = None):
        self.engine = engine
        self.aengine = AsyncEngine(engine)
        self.app = build_app(self.aengine, config)
        self.ctx = self.app.state.ctx
        self.server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", 0, config))
        sockets = None
        if send_buffer is not None:  # accepted sockets inherit the listener's send buffer size
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            sock.bind(("127.0.0.1", 0))
            sockets = [sock]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets}, name="uvicorn",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = bound_port(self.server)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/responses"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def engine_state(self) -> dict:
        """Requests and KV blocks, read on the engine thread between steps."""
        def read(e):
            e.block_manager.check_invariants()
            return {"requests": len(e.requests), "running": len(e.scheduler.running),
                    "waiting": len(e.scheduler.waiting), "free": e.block_manager.num_free_blocks,
                    "sessions": len(e.sessions)}
        return self.aengine.call(read)

    def wait_until(self, pred, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine_state()
            if pred(state) or time.monotonic() > deadline:
                return state
            time.sleep(0.02)


class ServeProcess:
    """`prescient serve ... --port 0` in a subprocess; the URL is read from what it prints."""

    def __init__(self, *args: str, timeout: float = 240.0):
        exe = os.path.join(os.path.dirname(sys.executable), "prescient")
        self.proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                m = re.search(r"OpenAI API\s+(http://\S+)/v1", line)
                if m:
                    self.url = m.group(1)
                if "/metrics" in line:  # the banner's last line
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError("prescient serve did not start:\n" + "\n".join(self.lines))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def interrupt(self, timeout: float = 60.0) -> int:
        """SIGINT (Ctrl-C), then wait for the process to exit; returns its exit code."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
