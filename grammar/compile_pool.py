"""Grammar compiles in worker processes: at low CPU priority, sharing no GIL, killed at the limit.

Measured on the 2-core machine, four fresh ~1.5 s schema compiles beside one streaming request:
on this process's threads the compiles took the engine's CPU (the stream's median gap 3.6 ->
13.6 ms, its worst 76 ms), nice'd threads inverted priority through the GIL their Python parts
hold (worst gap 122 ms under outside load), and a compile past its time limit ran on, holding
its worker. A worker process runs at `CompilerConfig.nice`, shares no GIL, and is killed (a fresh
one started) when its compile passes the time limit: the refusal is cached like any other. In
workers the same stream kept a 3.4-4.1 ms median and a 14-27 ms worst gap (other tenants then
loaded the machine to ~3 runnable tasks, under which the nice'd compiles ran past 10 s and were
refused: a heavy grammar defers its own request, not the others').

The time limit runs on the compile itself, from when a worker takes it: the queue in front of
it (heavy compiles, a busy machine) does not count. Under load a schema that compiles in
milliseconds was refused for waiting, not for its own cost (issue 28: 13 of 100 refusals with
another server busy). The wait is bounded by the compiles ahead of it (each stopped at the
limit) and by the pool growing while jobs queue; a request past its own
`--request-time-limit-s` once its grammar is ready is refused then (server/generation.py).

Costs: starting a worker takes ~2.5 s (xgrammar imports torch) and ~310 MB, so WARM_WORKERS
start with the pool and are kept; when every worker is busy, a new one starts, up to
`max_workers` (more idle ones end after IDLE_EXIT_S), so a light grammar queued behind heavy
compiles waits about a worker's start rather than for them. A result comes back in xgrammar's
serialized form: median ~100 KB of JSON, deserialized here in ~1 ms (without the GIL); the
slowest schemas' run to 25-95 MB, ~0.6 s. The worker's side of the socket is compile_worker.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from dataclasses import asdict
from typing import Callable

import xgrammar as xgr

from prescient.grammar.errors import GrammarError
from prescient.grammar.spec import GrammarSpec

log = logging.getLogger("prescient.grammar")


WARM_WORKERS = 2  # started with the pool, and kept
IDLE_EXIT_S = 60.0  # a worker beyond those ends after idling this long
START_LIMIT_S = 120.0  # a worker not ready by then is killed; its thread compiles in this process
# The limit counts a compile's CPU time; a worker the engine leaves no CPU (nice 10 under full
# decode load gets ~10% of a core) is still stopped after this many limits of wall time.
STARVED_WALL_FACTOR = 6.0
CPU_POLL_S = 0.05  # how often a running compile's CPU time is read (an answer ends the wait at once)


class CompilePool:
    def __init__(self, tokenizer, config, make_result: Callable, fallback: Callable, disk=None):
        """`make_result(spec, handle, compile_s, forced_spans)` builds the CompiledGrammar;
        `fallback(spec)` compiles in this process when no worker can be started; `disk`: a
        GrammarDiskCache (disk_cache.py) looked in before a compile and written after one."""
        self._tokenizer = tokenizer
        self._disk = disk
        self._config = config
        self._make_result = make_result
        self._fallback = fallback
        self._spawn_args = (tokenizer.info.serialize_json(), list(tokenizer.stop_token_ids),
                            {**asdict(config), "isolate": False, "max_workers": 1})
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._procs: set = set()  # live workers, for close()
        self._lock = threading.Lock()
        self._threads = 0  # one per worker process
        self._idle = 0  # of them, waiting for a job or starting up
        self._queued = 0  # jobs no worker has taken yet
        self._ready: set = set()  # workers that said they can compile (their imports done)
        for _ in range(min(WARM_WORKERS, config.max_workers)):
            self._add_worker()

    def submit(self, spec: GrammarSpec) -> Future:
        """Queue a compile; its time limit starts when a worker takes it (a compile that would
        take milliseconds is not refused for the queue in front of it on a busy machine)."""
        future: Future = Future()
        with self._lock:
            self._queued += 1
            # more jobs waiting than workers to take them (heavy compiles, say): one more worker,
            # up to max_workers, so a light grammar behind them waits for a worker's start
            # (~2.5 s), not for their ends
            grow = self._queued > self._idle and self._threads < self._config.max_workers
        self._jobs.put((spec, future))
        if grow:
            self._add_worker()
        return future

    def idle(self) -> bool:
        """A worker is free and no job waits: a job submitted now delays nobody's."""
        with self._lock:
            return self._queued == 0 and self._idle > 0

    @property
    def ready_workers(self) -> int:
        """Workers up and able to take a compile at once (not those still importing)."""
        return len(self._ready)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._jobs.put(None)
        for proc in list(self._procs):
            self._stop(proc)

    # ---------------------------------------------------------------- one worker's thread

    def _add_worker(self) -> None:
        with self._lock:
            self._threads += 1
            self._idle += 1  # counted idle from the start: it takes the next job once up
        threading.Thread(target=self._serve, name="grammar-worker", daemon=True).start()

    def _next_job(self, first: bool):
        """The next job, or None when this worker should end: the pool closed, or it idled for
        IDLE_EXIT_S while more than WARM_WORKERS workers were up."""
        if not first:
            with self._lock:
                self._idle += 1
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._threads > WARM_WORKERS:
                        self._threads -= 1
                        self._idle -= 1
                        return None
                continue
            with self._lock:
                if job is None:
                    self._threads -= 1
                else:
                    self._queued -= 1
                self._idle -= 1
            return job

    def _serve(self) -> None:
        proc = conn = None
        try:
            proc, conn = self._start()  # at once: the first compile should not wait ~2.5 s for it
            first = True
            while (job := self._next_job(first)) is not None:
                first = False
                spec, future = job
                if not future.set_running_or_notify_cancel():
                    continue
                cached = self._disk.load(spec) if self._disk is not None else None
                if cached is not None:  # compiled before, by an earlier server: no worker needed
                    self._settle(future, self._receive, spec, "ok", *cached)
                    continue
                if proc is None or proc.poll() is not None:
                    self._stop(proc)
                    proc, conn = self._start()
                if proc is None:
                    self._settle(future, self._fallback, spec)
                    continue
                try:
                    result = self._run(proc, conn, spec)
                except GrammarError as err:  # over the limit, or the worker died
                    self._stop(proc)
                    future.set_exception(err)
                    proc, conn = self._start()  # now: the next compile should not wait for its start
                else:
                    if self._disk is not None and result[0] != "error":
                        self._disk.store(spec, *result[1:])
                    self._settle(future, self._receive, spec, *result)
        finally:
            self._stop(proc)

    def _run(self, proc, conn, spec: GrammarSpec) -> tuple:
        """The worker's answer, or a time-limit refusal once its compile has had `time_limit_s`
        of its own run: its CPU time (all threads summed: never looser than the wall clock on an
        idle machine) where /proc gives it, so a worker
        starved by the engine's decoding (it runs at nice 10) is not refused for waiting on the
        CPU; wall time is a backstop (STARVED_WALL_FACTOR limits) and the rule without /proc."""
        limit = self._config.time_limit_s
        cpu0 = _cpu_seconds(proc.pid)
        start = time.monotonic()
        wall_limit = limit * (STARVED_WALL_FACTOR if cpu0 is not None else 1.0)
        try:
            conn.send((spec.kind, spec.source))
            while True:
                left = wall_limit - (time.monotonic() - start)
                if conn.poll(max(0.0, min(CPU_POLL_S, left))):
                    return conn.recv()
                if left <= 0:
                    raise _time_limit(limit)
                if cpu0 is not None:
                    cpu = _cpu_seconds(proc.pid)
                    if cpu is None or cpu - cpu0 >= limit:
                        raise _time_limit(limit)
        except (EOFError, OSError):  # killed from outside: most likely out of memory
            raise GrammarError("the grammar compile's worker process died (out of memory?)",
                               feature="compile") from None

    def _receive(self, spec: GrammarSpec, status: str, *payload):
        if status == "error":
            message, feature = payload
            raise GrammarError(message, feature=feature)
        blob, compile_s, forced_spans = payload
        handle = xgr.CompiledGrammar.deserialize_json(blob, self._tokenizer.info)
        return self._make_result(spec, handle, compile_s, forced_spans)

    @staticmethod
    def _settle(future: Future, fn, *args) -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:
            future.set_exception(err)

    def _start(self):
        """A fresh interpreter (not fork: unsafe beside the engine's threads; not multiprocessing's
        spawn: it re-runs the parent's main script) on one end of a socket pair."""
        if self._closed:
            return None, None
        proc = None
        try:
            ours, theirs = socket.socketpair()
            with theirs:
                # nice before the imports: starting a worker is ~2.5 s of CPU the engine comes first for
                proc = subprocess.Popen(
                    [sys.executable, "-c", "import os, sys; os.nice(int(sys.argv[2])); "
                     "from prescient.grammar.compile_worker import worker_main; worker_main(int(sys.argv[1]))",
                     str(theirs.fileno()), str(self._config.nice)],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            self._procs.add(proc)
            conn = Connection(ours.detach())
            conn.send(self._spawn_args)  # waits for the worker to read it (its imports: ~2 s)
            # ready once its compiler is built: a first compile's limit should not count the start
            if not conn.poll(START_LIMIT_S) or conn.recv() != "ready":
                raise OSError("the grammar compile worker did not start")
            self._ready.add(proc)
            return proc, conn
        except Exception as e:  # no processes here (a sandbox): compile in this process instead
            # said once per failed start: compiles then share this process's CPU and GIL with
            # the engine, which an operator should know (it is why isolation exists)
            log.warning("a grammar compile worker could not start (%s: %s); compiling in the server process "
                        "until one can", type(e).__name__, e)
            self._stop(proc)
            return None, None

    def _stop(self, proc) -> None:
        if proc is not None:
            self._procs.discard(proc)
            self._ready.discard(proc)
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(1.0)
        return None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), from /proc; None where
    there is no /proc (macOS) or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14, 15


def _time_limit(limit_s: float) -> GrammarError:
    return GrammarError(f"grammar compile exceeded the {limit_s:g} s time limit", feature="time_limit")
