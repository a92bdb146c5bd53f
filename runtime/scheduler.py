"""Continuous (iteration-level) batching with chunked prefill, prefix caching and preemption.

Every step the scheduler decides which requests run and how many new tokens each feeds:
running requests first (a decode token plus the slots its draft tree may use, or the next
chunk of an unfinished prefill), then waiting requests in arrival order while the per-step
token budget and the sequence limit allow. A long prompt is split into chunks so it never stalls
the decodes running beside it. When KV blocks run out, the most recently arrived running request
is preempted (its blocks freed; it is recomputed later, often from the prefix cache) — never a
crash. After a step, `register_full_blocks` keys blocks that became full in the prefix cache.

Every request fits the whole cache alone (the engine refuses prompts that cannot and ends a
sequence at `max_seq_len`), so a waiting request only ever waits for others to finish. While it
does, the requests behind it that fit go first, up to `max_overtakes` of them; then admission
waits for it. The queue is bounded: `add` refuses past `max_waiting` (OverloadedError), and
`expire_waiting` takes out the requests not started within `max_queue_wait_s` for the engine to
end as "overloaded".
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from prescient.runtime.config import SchedulerConfig
from prescient.runtime.kv_cache import BlockManager
from prescient.runtime.request import OverloadedError, Request, RequestStatus


# Waiting requests that do not fit looked at per step before the scan stops: each look matches
# the prompt against the prefix cache (hashing it), and a full queue must not slow every step.
_MAX_PASSED = 8


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # uncomputed tokens fed this step (chunk, or 1 when decoding)
    num_spec_slots: int  # extra KV slots reserved for draft-tree nodes (decode only)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so its logits give a next token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_slots for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_seq_len: int,
                 reclaim=None):
        """`max_seq_len`: the longest sequence (prompt + output) a request reaches, within both
        the context and the KV cache. `reclaim()` frees memory held outside running requests
        (session pins); it returns False when it has nothing left to give."""
        self.config = config
        self.reclaim = reclaim or (lambda: False)
        self.blocks = block_manager
        self.max_seq_len = max_seq_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def check_room(self) -> None:
        """Raise OverloadedError when the waiting queue is full (any thread: it only reads)."""
        if len(self.waiting) >= self.config.max_waiting:
            raise OverloadedError(f"the server is overloaded: {len(self.waiting)} requests are already "
                                  "waiting to start", self.config.retry_after_s)

    def add(self, request: Request) -> None:
        self.check_room()
        self.waiting.append(request)

    def expire_waiting(self, now: float) -> list[Request]:
        """Take out the requests that have waited `max_queue_wait_s` without starting. A preempted
        request (it has streamed tokens already) is never expired: it waits its turn."""
        if not self.waiting:
            return []
        limit = self.config.max_queue_wait_s
        expired = [r for r in self.waiting if r.first_scheduled_time is None and now - r.arrival_time >= limit]
        for request in expired:
            self.waiting.remove(request)  # it holds no blocks: a waiting request never does
        return expired

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- scheduling

    def _blocks_needed(self, request: Request, num_slots: int) -> int:
        needed = -(-(request.num_computed_tokens + num_slots) // self.block_size)
        return max(0, needed - len(request.block_ids))

    def _grow(self, request: Request, num_slots: int) -> bool:
        n = self._blocks_needed(request, num_slots)
        while not self.blocks.can_allocate(n):
            if not self.reclaim():
                return False
        request.block_ids.extend(self.blocks.allocate(n))
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free_blocks(request.block_ids)
        request.block_ids = []
        request.block_hashes = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        # Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_uncomputed, budget)
            spec = min(request.spec_budget, budget - num_new) if num_new == request.num_uncomputed == 1 else 0
            spec = max(0, min(spec, self.max_seq_len - request.num_tokens - 1))
            while not self._grow(request, num_new + spec):
                if spec:  # first give up the draft slots
                    spec = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            seqs.append(ScheduledSeq(request, num_new, spec))
            budget -= num_new + spec
            i += 1
        # Waiting requests in arrival order; one that does not fit now is passed over (bounded).
        passed: list[Request] = []
        limit = self.config.max_overtakes
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or len(passed) >= _MAX_PASSED:
                break
            if any(p.num_overtaken >= limit for p in passed):
                break  # a passed-over request's turn: nothing more until the running ones make room
            num_new = self._admit(request, budget)
            if num_new is None:
                passed.append(request)
                continue
            for p in passed:
                p.num_overtaken += 1
            if self.waiting[0] is request:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seqs.append(ScheduledSeq(request, num_new, 0))
            budget -= num_new
        return SchedulerOutput(seqs, preempted)

    def _admit(self, request: Request, budget: int) -> int | None:
        """Take the blocks for a waiting request's next chunk (prefix-cache hits first, session
        pins released if need be) -> the chunk's size; None, holding nothing, if it does not fit."""
        if request.num_computed_tokens == 0 and not request.block_ids:
            while True:
                hit_ids, hit_hashes = self.blocks.match_prefix(request.all_token_ids)
                # Blocks not yet held: check they plus the chunk fit before taking them.
                num_new = min(request.num_tokens - len(hit_ids) * self.block_size, budget)
                fresh = -(-(len(hit_ids) * self.block_size + num_new) // self.block_size) - len(hit_ids)
                held = sum(1 for b in hit_ids if self.blocks.blocks[b].ref_count == 0)
                if self.blocks.can_allocate(fresh + held):
                    break
                if not self.reclaim():
                    return None
                # pins released: match again, their blocks may be gone
            self.blocks.acquire_prefix(hit_ids, len(request.prompt_token_ids) if not request.num_preemptions else 0)
            request.block_ids = list(hit_ids)
            request.block_hashes = list(hit_hashes)
            request.num_computed_tokens = len(hit_ids) * self.block_size
            if not request.num_preemptions:
                request.num_cached_tokens = request.num_computed_tokens
        num_new = min(request.num_uncomputed, budget)
        if self._grow(request, num_new):
            return num_new
        # Not reached after the check above; kept so a waiting request never sits on blocks.
        self.blocks.free_blocks(request.block_ids)
        request.block_ids, request.block_hashes, request.num_computed_tokens = [], [], 0
        return None

    # ---------------------------------------------------------------- after the forward

    def register_full_blocks(self, request: Request) -> None:
        """Key every block now fully covered by computed tokens in the prefix cache."""
        tokens = None
        bs = self.block_size
        while (len(request.block_hashes) + 1) * bs <= request.num_computed_tokens:
            b = len(request.block_hashes)
            if tokens is None:
                tokens = request.all_token_ids
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes.append(
                self.blocks.register_full_block(request.block_ids[b], parent, tuple(tokens[b * bs:(b + 1) * bs])))

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's blocks (they stay in the prefix cache)."""
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        if request.block_ids:
            self.blocks.free_blocks(request.block_ids)
        request.block_ids = []
        request.status = RequestStatus.FINISHED
