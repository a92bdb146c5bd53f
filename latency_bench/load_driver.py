"""The load benchmark's driver: N closed-loop clients streaming cold prompts while an injector sends
a long prompt every few seconds, against one server, through agent_http's `ChatHTTPTransport.stream`.

Each client sends the next of the shared workloads (cycled in file order, so the kinds mix) as
soon as its last reply ended, each with a fresh prefix (workloads.with_fresh_prefix) so every
prefill is cold, until `duration_s` has passed; requests in flight then finish, for up to
`drain_s` more (any still running are cancelled and counted as unfinished). The injector sends
the long prompt (a fresh prefix each time) at period/2, 3 period/2, ... seconds into the phase,
against absolute deadlines and whatever the clients are doing (open loop: a user pasting a
document does not wait for the others). Finished traces go to runtime/slo.py's `SLOTracker`, the
clients' and the long prompts' apart, so every figure is the latency model's own. A request that
raised is kept apart as failed (the report counts it as a miss); after a failure the client
pauses `FAILURE_PAUSE_S` so that a dead server is not hammered in a tight loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field

from prescient.latency_bench.workloads import Workload, with_fresh_prefix
from prescient.runtime.slo import RequestTrace, SLOConfig, SLOTracker

FAILURE_PAUSE_S = 0.1
LONG = "long"  # the workload kind the injector's requests are tagged with


@dataclass
class LoadRun:
    """What one system did at one concurrency: the trackers and what they cannot hold."""

    clients: SLOTracker
    long: SLOTracker
    failed: list[dict] = field(default_factory=list)  # {"request_id", "kind", "error"}
    unfinished: list[dict] = field(default_factory=list)  # {"request_id", "kind"}: cancelled at the drain limit
    long_offsets: dict = field(default_factory=dict)  # long request id -> seconds into the phase it was sent
    wall_s: float = 0.0

    def count(self, records: list[dict], long: bool) -> int:
        return sum((r["kind"] == LONG) == long for r in records)


async def run_load(transport, workloads: list[Workload], long_messages: list[dict] | None, num_clients: int,
                   duration_s: float, slo: SLOConfig, tag: str, inject_period_s: float | None = None,
                   long_max_tokens: int = 8, drain_s: float = 120.0) -> LoadRun:
    """One phase: `num_clients` closed-loop clients for `duration_s` (+ the drain), the injector
    on when `inject_period_s` and `long_messages` are given."""
    run = LoadRun(SLOTracker(slo), SLOTracker(slo))
    nonce = uuid.uuid4().hex[:8]  # a rerun against the same server is cold too
    counter = itertools.count()
    start = time.perf_counter()
    deadline = start + duration_s

    async def send(tracker: SLOTracker, messages, request_id: str, kind: str, max_tokens: int) -> bool:
        trace = RequestTrace(request_id, 0.0, tags={"workload": kind})
        try:
            await transport.stream(with_fresh_prefix(messages, f"{nonce}-{request_id}"), request_id, max_tokens,
                                   trace=trace)
        except asyncio.CancelledError:
            run.unfinished.append({"request_id": request_id, "kind": kind})
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the request is a failed request, named
            run.failed.append({"request_id": request_id, "kind": kind, "error": f"{type(e).__name__}: {e}"[:300]})
            return False
        tracker.add_trace(trace)
        return True

    async def client(c: int) -> None:
        while time.perf_counter() < deadline:
            i = next(counter)
            w = workloads[i % len(workloads)]
            if not await send(run.clients, w.messages, f"{tag}-c{c}-{i}", w.kind, w.max_tokens):
                await asyncio.sleep(FAILURE_PAUSE_S)

    longs: list[asyncio.Task] = []

    async def injector() -> None:
        for k in itertools.count():
            at = start + (k + 0.5) * inject_period_s
            if at >= deadline:
                return
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            request_id = f"{tag}-long{k}"
            run.long_offsets[request_id] = time.perf_counter() - start
            longs.append(asyncio.create_task(send(run.long, long_messages, request_id, LONG, long_max_tokens)))

    tasks = [asyncio.create_task(client(c)) for c in range(num_clients)]
    if inject_period_s and long_messages:
        tasks.append(asyncio.create_task(injector()))
    limit = deadline + drain_s
    await asyncio.wait(tasks, timeout=max(0.0, limit - time.perf_counter()))
    if longs:  # the injector has returned (or is cancelled below): every long prompt is in `longs` now
        await asyncio.wait(longs, timeout=max(0.0, limit - time.perf_counter()))
    stragglers = [t for t in tasks + longs if not t.done()]
    for t in stragglers:
        t.cancel()
    await asyncio.gather(*stragglers, return_exceptions=True)
    run.wall_s = time.perf_counter() - start
    return run
