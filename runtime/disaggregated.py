"""The decode worker's side of a prefill/decode split: it owns every request, routes each new
prompt to the prefill worker (runtime/prefill_worker.py), and takes the pages back into its own
KV cache (the engine calls `submit`, `collect`, `abort`; a receiver thread waits for pages).

    submit:  k = the prompt's leading blocks in this worker's prefix cache (nothing held);
             queue [OP_PREFILL, num, len, k] + prompt for the sender thread  (engine thread)
    threads: the sender sends in order; the receiver takes [OP_KV header] + payload ->
             arrivals and wakes the engine loop
    collect: arrivals in order while max_num_seqs and the free blocks allow: the k blocks
             matched again and held, fresh blocks for the rest, pages scattered in, the request
             running with its prompt computed -> (request, logits row) for the engine to
             sample the first token from                                    (engine thread)

The decode worker computes no prompt token, except for a request its own scheduler preempts
later (recomputed here, as any preempted request is) and an arrival whose k blocks were evicted
meanwhile (prefilled here). A prefill worker that dies, or answers nothing within the queue-wait
bound, fails the requests waiting on it with an error naming it; later prompts are prefilled
locally."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from prescient.runtime import kv_handoff as kh
from prescient.runtime.prefill_worker import open_groups, receive, send
from prescient.runtime.request import OverloadedError, Request

log = logging.getLogger("prescient.pd")
IDLE = timedelta(days=365)


class PrefillWorkerError(RuntimeError):
    """The prefill worker could not start, or failed a prompt."""


@dataclass
class _Pending:
    request: Request
    hashes: list[int]  # the prompt's leading blocks cached here at submit (their pages are not sent)
    submitted: float


class RemotePrefill:
    def __init__(self, proc, requests_group, results_group, vocab_size: int, max_pending: int, store=None):
        self.proc = proc
        self.store = store  # the rendezvous must outlive the groups
        self.requests_group, self.results_group = requests_group, results_group
        self.vocab_size = vocab_size
        self.max_pending = max_pending
        self.pending: dict[int, _Pending] = {}  # request num -> its request, engine thread only
        self.nums: dict[str, int] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._arrivals: deque = deque()  # (header, payload, header time, payload time)
        self.wake = lambda: None  # the engine loop's wake-up (AsyncEngine sets it)
        self.failure: str | None = None
        self._closing = self._closed = False
        self.num_handoffs = 0
        self.num_prompt_tokens_moved = 0  # prompt tokens whose KV the prefill worker handed over
        self.num_local_fallbacks = 0  # arrivals whose cached prefix here was evicted: prefilled here
        self.last_timing: dict[str, kh.HandoffTiming] = {}  # request id -> its TTFT split
        self.totals = kh.HandoffTiming()  # summed over every split request's first token (/metrics)
        self.num_first_tokens = 0
        self._outbox: queue.Queue = queue.Queue()  # (header, payload) to the prefill worker, in order
        self._threads = [threading.Thread(target=self._receive_forever, name="pd-receiver", daemon=True),
                         threading.Thread(target=self._send_forever, name="pd-sender", daemon=True)]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- engine thread

    def has_pending(self) -> bool:
        return bool(self.pending)

    def accepts(self) -> bool:
        return self.failure is None

    def submit(self, engine, request: Request) -> None:
        """Route a new request's prompt to the prefill worker: it is pending here until its pages
        arrive (or the worker fails it). The sender thread sends it: a slow link never stalls a
        step. Nothing is held meanwhile (a waiting request holds no blocks, as co-located): the
        prefix this worker has cached is matched again when the pages land."""
        if len(self.pending) >= self.max_pending:
            raise OverloadedError(f"the server is overloaded: {len(self.pending)} prompts are already "
                                  "waiting for the prefill worker", engine.config.scheduler.retry_after_s)
        _, hit_hashes = engine.block_manager.match_prefix(request.prompt_token_ids)
        num = self._next
        self._next += 1
        tokens = torch.tensor(request.prompt_token_ids, dtype=torch.int64)
        self._outbox.put((kh.header(kh.OP_PREFILL, num, tokens.numel(), len(hit_hashes)), tokens.view(torch.uint8)))
        request.first_scheduled_time = time.perf_counter()
        self.pending[num] = _Pending(request, hit_hashes, request.first_scheduled_time)
        self.nums[request.request_id] = num

    def abort(self, request: Request) -> None:
        num = self.nums.pop(request.request_id, None)
        if num is None or self.pending.pop(num, None) is None:
            return
        self._outbox.put((kh.header(kh.OP_ABORT, num), None))

    def collect(self, engine) -> tuple[list[tuple[Request, torch.Tensor]], list[tuple[Request, str]]]:
        """Arrived pages into this worker's cache -> ([(request now running, logits [1, vocab])],
        [(request, error) for prompts that failed]). Arrivals are taken in order; one that does
        not fit yet (blocks, or `max_num_seqs` running) waits for the running requests to finish."""
        ready, failed = [], []
        sched = engine.scheduler
        while True:
            with self._lock:
                if not self._arrivals:
                    break
                head, payload, t_head, t_payload = self._arrivals[0]
            op, num = int(head[0]), int(head[1])
            entry = self.pending.get(num)
            if entry is None:  # aborted meanwhile: its pages are not wanted
                self._pop()
                continue
            if op == kh.OP_FAILED:
                self._pop()
                self._forget(num)
                failed.append((entry.request, "the prefill worker failed the prompt: " + _decode_text(payload)))
                continue
            if len(sched.running) >= sched.config.max_num_seqs:
                break
            placed = self._place(engine, entry, head, payload, t_head, t_payload)
            if placed is None:
                break  # later: running requests will free blocks
            self._pop()
            self._forget(num)
            if isinstance(placed, str):
                failed.append((entry.request, placed))
            elif placed is not False:
                ready.append((entry.request, placed))
        now = time.perf_counter()
        limit = engine.config.scheduler.max_queue_wait_s
        for num, entry in list(self.pending.items()):
            if self.failure is not None or now - entry.submitted >= limit:
                self._forget(num)
                failed.append((entry.request, self.failure or f"the prefill worker did not hand over the prompt's "
                               f"KV within {limit:g} s"))
                if self.failure is None:
                    self._outbox.put((kh.header(kh.OP_ABORT, num), None))
        return ready, failed

    def _place(self, engine, entry: "_Pending", head, payload, t_head: float, t_payload: float):
        """Take one arrival into the cache -> the logits row, None when it does not fit yet, False
        when it went to this worker's own prefill (its cached prefix was evicted meanwhile), or an
        error message (the request fails alone)."""
        t0 = time.perf_counter()
        request, blocks = entry.request, engine.block_manager
        fresh = -(-len(request.prompt_token_ids) // blocks.block_size) - len(entry.hashes)
        if fresh != int(head[2]):
            return f"the prefill worker handed over {int(head[2])} KV blocks for a prompt that needs {fresh}"
        new_ids = engine.scheduler.admit_prefilled(request, entry.hashes, fresh)
        if new_ids is None:
            return None
        if new_ids is False:  # the pages before k are gone: prefilled here instead
            self.num_local_fallbacks += 1
            return False
        try:
            logits = kh.scatter_pages(engine.kv_caches, new_ids, payload, self.vocab_size,
                                      kh.ROW_DTYPES[int(head[kh.ROW_DTYPE])])
        except Exception as e:  # noqa: BLE001 - a malformed handoff fails its request alone
            log.error("a KV handoff could not be placed: %s", e)
            return "the prefill worker's KV handoff was malformed"  # the engine ends it (its blocks freed)
        engine.scheduler.register_full_blocks(request)  # only now do its blocks hold its pages
        scattered = time.perf_counter()
        prefill, gather = int(head[kh.T_PREFILL]) / 1e9, int(head[kh.T_GATHER]) / 1e9
        self.last_timing[request.request_id] = kh.HandoffTiming(
            queue_s=max(0.0, t_head - entry.submitted - prefill - gather), prefill_s=prefill,
            transfer_s=gather + (t_payload - t_head) + (scattered - t0),
            first_decode_s=-(t_payload + (scattered - t0)))  # completed by `first_token_committed`
        self.num_handoffs += 1
        self.num_prompt_tokens_moved += len(request.prompt_token_ids) - request.num_cached_tokens
        return logits

    def first_token_committed(self, request: Request, now: float) -> kh.HandoffTiming | None:
        timing = self.last_timing.get(request.request_id)
        if timing is not None and timing.first_decode_s < 0:
            timing.first_decode_s += now
            for part, value in timing.as_dict().items():
                setattr(self.totals, part, getattr(self.totals, part) + value)
            self.num_first_tokens += 1
        if len(self.last_timing) > 1024:  # recent requests' splits only
            for rid in list(self.last_timing)[:512]:
                del self.last_timing[rid]
        return timing

    def _pop(self) -> None:
        with self._lock:
            self._arrivals.popleft()

    def _forget(self, num: int) -> None:
        entry = self.pending.pop(num, None)
        if entry is not None:
            self.nums.pop(entry.request.request_id, None)

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error("prefill/decode split: %s; prompts are prefilled locally from now on", message)

    # ---------------------------------------------------------------- link threads

    def _send_forever(self) -> None:
        while True:
            head, payload = self._outbox.get()
            try:
                send(self.requests_group, 1, head, payload)
            except Exception as e:  # noqa: BLE001 - gone or hung past the send's bound
                if not self._closing:
                    log.error("prefill/decode split: sending to the prefill worker: %s", e)
                    self._fail("the prefill worker stopped answering")
                    self.wake()
                return
            if int(head[0]) == kh.OP_STOP:
                return

    def _receive_forever(self) -> None:
        while True:
            try:
                head, payload, t_head = receive(self.results_group, 1)
            except Exception as e:  # noqa: BLE001 - the worker died or the link broke
                if self._closing:
                    return
                log.error("prefill/decode split: receiving from the prefill worker: %s", e)
                code = self._exit_code(timeout_s=2.0)
                self._fail(f"the prefill worker stopped (exit code {code})" if code is not None
                           else "the link to the prefill worker broke")
                self.wake()
                return
            with self._lock:
                self._arrivals.append((head, payload, t_head, time.perf_counter()))
            self.wake()

    def _exit_code(self, timeout_s: float) -> int | None:
        """The worker's exit code, or None while it runs. Polled, not joined: another thread may
        reap the process first, and a join here would then see no child and report it running."""
        if self.proc is None:
            return None
        deadline = time.monotonic() + timeout_s
        while (code := self.proc.exitcode) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return code

    def close(self) -> None:
        """Stop the worker and wait for the link threads (idempotent; also run at exit: a gloo
        operation still in flight when the interpreter ends aborts the process)."""
        if self._closed:
            return
        self._closed = self._closing = True
        self._outbox.put((kh.header(kh.OP_STOP), None))
        if self.proc is not None:
            self.proc.join(timeout=10 if self._threads[1].is_alive() else 1)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        for t in self._threads:  # the worker gone, a pending receive ends with an error
            t.join(timeout=5)


def _decode_text(payload: torch.Tensor | None) -> str:
    return "" if payload is None else bytes(payload.tolist()).decode(errors="replace")


def launch_prefill_worker(engine, source, model_kwargs: dict, threads: int = 1, setup=None,
                          startup_timeout_s: float = 300.0) -> RemotePrefill:
    """Spawn the prefill worker for `engine` (the decode worker; its EngineConfig is the worker's
    too) and wait for it to say ready with the same page layout. source: a picklable () ->
    (config, weights), as tensor parallel's workers take (runtime/tp_worker.py)."""
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=startup_timeout_s),
                          wait_for_workers=False)
    from prescient.runtime.prefill_worker import worker_main
    from prescient.runtime.tp_worker import _join

    proc = mp.get_context("spawn").Process(target=worker_main, name="prescient-prefill", daemon=True,
                                           args=(store.port, source, model_kwargs, engine.config, threads, setup))
    proc.start()

    def meet():
        groups = open_groups(store, 0, 10.0, IDLE)
        return groups, receive(groups[1], 1)

    try:
        (requests_group, results_group), (head, payload, _) = _join(
            meet, [proc], startup_timeout_s, name=lambda _: "the prefill worker", error=PrefillWorkerError)
    except BaseException:
        proc.kill()
        raise
    if int(head[0]) == kh.OP_FAILED:
        proc.join(timeout=10)
        raise PrefillWorkerError("the prefill worker failed to start: " + _decode_text(payload))
    layout = _decode_text(payload)
    ours = repr(kh.page_layout(engine.kv_caches))
    vocab = engine.model.config.vocab_size
    if int(head[2]) != engine.block_manager.block_size or layout != ours or int(head[3]) != vocab:
        send(requests_group, 1, kh.header(kh.OP_STOP))
        raise PrefillWorkerError(f"the prefill worker's KV pages ({layout}, blocks of {int(head[2])}, vocab "
                                 f"{int(head[3])}) are not this worker's ({ours}, blocks of "
                                 f"{engine.block_manager.block_size}, vocab {vocab})")
    remote = RemotePrefill(proc, requests_group, results_group, engine.model.config.vocab_size,
                           engine.config.scheduler.max_waiting, store)
    atexit.register(remote.close)
    return remote
