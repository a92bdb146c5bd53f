"""`AsyncEngine`: the engine loop on a background thread, one asyncio stream per request.

The server's event loop never runs model code. Submissions and aborts cross to the engine thread
through a lock-protected inbox that the loop drains between steps (so an abort stops generation
within one step); outputs cross back with `loop.call_soon_threadsafe` into each request's
`asyncio.Queue`. Bad input raises at `submit` (validated on the caller's thread against the same
rules `Engine.add_request` applies), and an exception inside a step fails the requests of that
step with an error output instead of killing the loop. A full waiting queue is refused at
`submit` (`OverloadedError`) or, if it filled meanwhile, with an "overloaded" error output. With
nothing to run, the loop does the engine's idle work (`Engine.idle_work`: a verify-cost
calibration, one forward at a time); a step that could run nothing waits for news, never spins.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from prescient.runtime.engine import Engine, overloaded_output
from prescient.runtime.request import OverloadedError, RequestOutput
from prescient.runtime.sampling_params import SamplingParams

log = logging.getLogger("prescient.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[Callable[[], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = False
        # when the engine thread last found nothing to run (None while it has work): written by
        # that thread only, read by the server's idle-time chores (idle_seconds)
        self._idle_since: float | None = None
        self.step_hooks: list[Callable[[Engine, list[RequestOutput], float], None]] = []
        remote = getattr(engine, "remote_prefill", None)
        if remote is not None:  # a prefill/decode split: pages arriving wake the loop
            remote.wake = self._wake.set
        self._thread = threading.Thread(target=self._loop, name="prescient-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- caller side (event loop)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       session_id: str | None = None, grammar=None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate its outputs; cancelling the iteration aborts it."""
        request_id = request_id or f"req-{next(self._ids)}"
        queue = self.submit(prompt, params, request_id, session_id, grammar, arrival_time)
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            if request_id in self._streams:
                self.abort(request_id)

    def submit(self, prompt, params: SamplingParams, request_id: str, session_id: str | None = None,
               grammar=None, arrival_time: float | None = None) -> asyncio.Queue:
        """Validate here (raises ValueError at once; OverloadedError when the queue is full),
        queue on the engine thread, return the request's output queue. Never blocks the event
        loop on an engine step. `arrival_time` (perf_counter; default now): when the request
        arrived at the server, which the queue-wait bound and the request's timings count from."""
        request = self.engine.make_request(prompt, params, request_id, session_id, grammar, arrival_time)
        self.engine.scheduler.check_room()  # a read from this thread; enqueue checks again
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = _Stream(loop, queue)

        def add() -> None:
            try:
                self.engine.enqueue(request)
            except ValueError as e:  # e.g. a duplicate id: an error output, the loop goes on
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RequestOutput(
                        request_id, [], "", True, "error", error=str(e)))
            except OverloadedError as e:  # the queue filled up since submit checked
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, overloaded_output(request_id, e))

        self._post(add)
        return queue

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._post(do_abort)

    def call(self, fn: Callable[[Engine], object]) -> object:
        """Run `fn(engine)` on the engine thread between steps and return its result (blocks the
        calling thread: for startup, shutdown and tests, not for request handlers)."""
        done = threading.Event()
        box: list = []

        def run() -> None:
            try:
                box.append((True, fn(self.engine)))
            except BaseException as e:
                box.append((False, e))
            finally:
                done.set()

        self._post(run)
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def idle_seconds(self) -> float:
        """How long the engine has had nothing to run (0 while it has requests or a submission
        waits in its inbox): for work that should not take the CPU from decoding."""
        since = self._idle_since
        if since is None or self._inbox:
            return 0.0
        return time.monotonic() - since

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        remote = getattr(self.engine, "remote_prefill", None)
        if remote is not None:
            remote.close()

    # ---------------------------------------------------------------- engine thread

    def _post(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._inbox.append(fn)
        self._wake.set()

    def _drain(self) -> None:
        if self._inbox:  # first: idle_seconds must not read an emptied inbox beside a stale idle time
            self._idle_since = None
        with self._lock:
            pending, self._inbox = self._inbox, []
        for fn in pending:
            fn()

    def _loop(self) -> None:
        while not self._stop:
            self._drain()
            if not self.engine.has_unfinished_requests():
                if self._idle_since is None:
                    self._idle_since = time.monotonic()
                if self._idle_work():
                    continue  # one forward of background work; the inbox is looked at first
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._idle_since = None  # (work that came without the inbox: a P/D split's handed-off prompts)
            t0 = time.perf_counter()
            steps = self.engine.num_steps
            try:
                outputs = self.engine.step()
            except Exception:  # keep serving: fail the in-flight requests, not the process
                # Per-request failures never get here (Engine.step ends those requests alone):
                # this is the forward or the engine's own state, which every request shares.
                # Clients get a generic message: the cause may name other clients' requests.
                log.error("engine step failed: %s", traceback.format_exc())
                outputs = self._fail_all("engine error: a model step failed and the requests in flight were "
                                         "stopped; the cause is in the server's log")
            for hook in self.step_hooks:
                hook(self.engine, outputs, time.perf_counter() - t0)
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
            if not outputs and self.engine.num_steps == steps:
                # Nothing could be scheduled (the scheduler's rules make this rare): wait for a
                # submission, an abort or a queue deadline instead of spinning a core.
                self._wake.wait(timeout=0.01)
                self._wake.clear()
        # Shutdown: cancel whatever is still running, cleanly.
        self._drain()
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            stream = self._streams.pop(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RequestOutput(
                request_id, [], "", True, "abort", error="server shutting down"))

    def _idle_work(self) -> bool:
        try:
            return self.engine.idle_work()
        except Exception:  # background work must never take the loop down
            log.error("idle work failed: %s", traceback.format_exc())
            return False

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """End the failed step's requests (all of them when it failed before scheduling: the
        engine's state is then in doubt); requests waiting outside that step go on."""
        step = [r for r in self.engine.in_step if r in self.engine.requests]
        outs = []
        for request_id in step or list(self.engine.requests):
            self.engine.abort(request_id)
            outs.append(RequestOutput(request_id, [], "", True, "error", error=message))
        return outs
