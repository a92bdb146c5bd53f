"""The prefill worker of a prefill/decode split: a process with its own model, KV cache and
scheduler that only computes prompts (runtime/disaggregated.py starts it and receives its pages).

    loop:  new prompts (a receiver thread) -> its engine (chunked prefill, prefix cache)
           Engine.step: forwards of the scheduled chunks; each prompt now complete goes to
                 `hand_off`: send [OP_KV header] + [its pages past what the decode worker has
                 cached + logits row]; the engine ends it (its blocks stay in the prefix cache)

It samples nothing and keeps no request state past the handoff. Messages go over
torch.distributed point-to-point (gloo process groups, one per direction).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from prescient.runtime import kv_handoff as kh
from prescient.runtime.request import Request


def open_groups(store, rank: int, timeout_s: float, idle: timedelta):
    """-> (requests group: decode -> prefill, results group: prefill -> decode). A gloo timeout
    is each process's own: the side that waits for news waits without limit (`idle`)."""
    decode = rank == 0
    requests = dist.ProcessGroupGloo(dist.PrefixStore("pd-requests", store), rank, 2,
                                     timedelta(seconds=timeout_s) if decode else idle)
    results = dist.ProcessGroupGloo(dist.PrefixStore("pd-results", store), rank, 2,
                                    idle if decode else timedelta(seconds=timeout_s))
    return requests, results


class PrefillServer:
    """The worker's side: its engine's parts, fed prompts, answering with pages."""

    def __init__(self, engine, requests_group, results_group):
        self.engine = engine
        self.requests_group, self.results_group = requests_group, results_group
        self.inbox: queue.Queue = queue.Queue()
        self.skip: dict[str, int] = {}  # request id -> leading blocks the decode worker has cached
        engine.handoff = self.hand_off  # its steps sample nothing: computed prompts come here

    def send(self, head: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        send(self.results_group, 0, head, payload)

    def receive_forever(self) -> None:
        """Receiver thread: each message from the decode worker into the inbox."""
        while True:
            try:
                head, payload, at = receive(self.requests_group, 0)
            except Exception:  # noqa: BLE001 - the decode worker is gone: the loop must end too
                self.inbox.put((kh.header(kh.OP_STOP), None, time.perf_counter()))
                return
            tokens = None if payload is None else payload.view(torch.int64)
            self.inbox.put((head, tokens, at))
            if int(head[0]) == kh.OP_STOP:
                return

    def take(self, block: bool) -> bool:
        """Apply the inbox's messages; False once told to stop."""
        while True:
            try:
                head, tokens, at = self.inbox.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            op, num = int(head[0]), int(head[1])
            rid = str(num)
            if op == kh.OP_STOP:
                return False
            if op == kh.OP_ABORT:
                self.skip.pop(rid, None)
                self.engine.abort(rid)
                continue
            try:
                request = self.engine.make_request(tokens.tolist(), request_id=rid, arrival_time=at)
                self.engine.enqueue(request)
            except Exception as e:  # noqa: BLE001 - this prompt fails, the worker goes on
                self.send(kh.header(kh.OP_FAILED, num), _text(f"{type(e).__name__}: {e}"))
                continue
            self.skip[rid] = int(head[3])

    def hand_off(self, request: Request, logits_row: torch.Tensor) -> None:
        """The engine's handoff (Engine.handoff): a computed prompt's pages past what the decode
        worker has cached, and its logits row, to the decode worker; the engine then ends it
        here (its blocks stay in this worker's prefix cache)."""
        done = time.perf_counter()
        rid = request.request_id
        skip = self.skip.pop(rid, 0)
        arrived = request.arrival_time  # when its message arrived (make_request's arrival_time)
        t0 = time.perf_counter()
        payload = kh.gather_pages(self.engine.kv_caches, request.block_ids[skip:], logits_row)
        gather_ns = int((time.perf_counter() - t0) * 1e9)
        started = request.first_scheduled_time or arrived
        head = kh.header(kh.OP_KV, int(rid), len(request.block_ids) - skip, payload.numel(),
                         int((started - arrived) * 1e9), int((done - started) * 1e9), gather_ns,
                         kh.ROW_DTYPES.index(logits_row.dtype))
        self.send(head, payload)

    def serve(self) -> None:
        threading.Thread(target=self.receive_forever, name="prefill-receiver", daemon=True).start()
        eng = self.engine
        while self.take(block=not eng.has_unfinished_requests()):
            eng.step()


def send(group, dst: int, head: torch.Tensor, payload: torch.Tensor | None = None) -> None:
    """One message: the header (its last slot says the payload's bytes), then the payload."""
    head[kh.PAYLOAD] = 0 if payload is None else payload.numel()
    group.send([head], dst, 0).wait()
    if payload is not None and payload.numel():
        group.send([payload], dst, 1).wait()


def receive(group, src: int) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """-> (header, uint8 payload or None, when the header arrived)."""
    head = torch.zeros(kh.HEADER, dtype=torch.int64)
    group.recv([head], src, 0).wait()
    at = time.perf_counter()
    n = int(head[kh.PAYLOAD])
    payload = None
    if n:
        payload = torch.empty(n, dtype=torch.uint8)
        group.recv([payload], src, 1).wait()
    return head, payload, at


def _text(message: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(message.encode()[:4000] or b"?"), dtype=torch.uint8)


def worker_main(port: int, source, model_kwargs: dict, engine_config, threads: int, setup=None) -> None:
    """The spawned process: load, build the engine, say ready (with the page layout), serve."""
    from prescient.runtime.engine import Engine
    from prescient.runtime.model import LlamaModel
    from prescient.runtime.tp_worker import _die_with_parent, _set_threads

    _die_with_parent()
    if setup is not None:
        setup()
    _set_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=120))
    requests_group, results_group = open_groups(store, 1, 10.0, timedelta(days=365))
    try:
        config, weights = source()
        model = LlamaModel(config, weights, **model_kwargs)
        del weights
        # its queue is the decode worker's to bound: nothing here expires or refuses for load
        sched = replace(engine_config.scheduler, max_waiting=1 << 30, max_queue_wait_s=float("inf"))
        engine = Engine(model, None, replace(engine_config, scheduler=sched), eos_token_ids=(0,))
    except Exception as e:  # noqa: BLE001 - reported to the decode worker, which names it
        send(results_group, 0, kh.header(kh.OP_FAILED, -1), _text(f"{type(e).__name__}: {e}"))
        return
    engine.prefault_kv()  # as a server's own cache is: no first-touch faults inside the prefills
    server = PrefillServer(engine, requests_group, results_group)
    layout = repr(kh.page_layout(engine.kv_caches)).encode()
    server.send(kh.header(kh.OP_READY, os.getpid(), engine.block_manager.block_size, model.config.vocab_size),
                torch.frombuffer(bytearray(layout), dtype=torch.uint8))
    try:
        server.serve()
    except Exception:  # the decode worker gone or the link broken: say why and leave
        print(f"prescient: prefill worker stopped:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
