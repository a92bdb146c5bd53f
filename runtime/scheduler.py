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
from typing import Any

from prescient.runtime.config import SchedulerConfig
from prescient.runtime.kv_cache import BlockManager
from prescient.runtime.linear import BATCH_INVARIANT_M
from prescient.runtime.request import OverloadedError, Request, RequestStatus
from prescient.runtime.step_cost import StepCostModel, packed_forwards, step_shape


# A prompt that cannot make its TTFT bound even alone is due at this multiple of its prefill alone.
_INFEASIBLE_STRETCH = 1.3

# A prompt this many seconds past its TTFT deadline goes before every other (none starves).
_STARVE_S = 5.0

# Waiting requests that do not fit looked at per step before the scan stops: each look matches
# the prompt against the prefix cache (hashing it), and a full queue must not slow every step.
_MAX_PASSED = 8


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # uncomputed tokens fed this step (chunk, or 1 when decoding)
    num_spec_slots: int  # extra KV slots reserved for draft-tree nodes (decode only)
    # a chunk split by layers: the layers [start, stop) it runs this step; None: all of them
    layers: tuple[int, int] | None = None
    completes: bool = True  # whether its chunk's last layer runs this step
    # its logits row [1, vocab], already computed (a prompt the P/D split's prefill worker
    # computed, its pages placed here): no forward row, it only samples
    logits: Any = None

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so its logits give a next token."""
        r = self.request
        return self.completes and r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    preempted: list[Request]
    # when, in seconds after the step began, chunks split by layers start no more layers
    # (config.itl_cutoff, at least itl_margin, x the step's ITL bound; None: no split chunk, or
    # no bound): the rest of their planned layers go to later steps (runtime/forward_plan.py,
    # then `layers_run`)
    layer_cutoff_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_slots for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_seq_len: int,
                 reclaim=None, cost: StepCostModel | None = None, num_layers: int = 1, layer_split: bool = False):
        """`max_seq_len`: the longest sequence (prompt + output) a request reaches, within both
        the context and the KV cache. `reclaim()` frees memory held outside running requests
        (session pins); it returns False when it has nothing left to give. `cost`: the step cost
        model the time budget is read from (the engine refits it); None: token budgets only.
        `layer_split`: whether the model can run a chunk's layers over several steps."""
        if config.prefill_chunk <= BATCH_INVARIANT_M:  # its chunks would join the decodes' forwards
            raise ValueError(f"prefill_chunk must be > {BATCH_INVARIANT_M}, got {config.prefill_chunk}")
        self.config = config
        self.cost = cost
        self.num_layers = num_layers
        self.layer_split = layer_split and config.layer_split and num_layers > 1
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
        request.chunk_tokens = request.chunk_layer = 0  # a chunk in flight starts over
        request.chunk_state = None
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        # Decoding requests, oldest first; preempt from the newest end when blocks run out. With a
        # time budget, draft slots come last (`_add_drafts`): what the ITL bound leaves after every
        # decode's own row and the step's prefill work, and only grammar-forced tokens while
        # prompt work waits beyond this step (`_prefill_backlog`). The step's time is every
        # stream's gap, a draft only saves time if the step stays within it, and a waiting
        # prompt's TTFT comes before a running stream's speed-up.
        decoding = [r for r in self.running if r.status == RequestStatus.RUNNING and r.num_uncomputed == 1]
        timed = self.cost is not None and itl_bound(decoding, self.config.itl_target_s) is not None
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or request.num_uncomputed != 1 or budget <= 0:
                continue
            spec = 0 if timed else min(request.spec_budget, budget - 1)
            spec = max(0, min(spec, self.max_seq_len - request.num_tokens - 1))
            while not self._grow(request, 1 + spec):
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
            seqs.append(ScheduledSeq(request, 1, spec))
            budget -= 1 + spec
        decodes = list(seqs)
        # What the decodes leave of the step's time budget goes to prefill work.
        plan = _PrefillPlan(self, seqs)
        # Prefill work: a chunk split by layers first (it holds its blocks and hidden states until
        # done), then running prompts and waiting ones together, earliest TTFT deadline first, so
        # a short prompt that can still make its bound goes before a long one that started first.
        # A running prompt's chunk that cannot get its blocks waits a step (taking them from a
        # decode scheduled above would free what it is about to use); a waiting one that does not
        # fit now is passed over (bounded).
        prefilling = [r for r in self.running if r.status == RequestStatus.RUNNING and r.num_uncomputed > 1]
        queue = [r for r in prefilling if r.chunk_layer] + sorted(
            [r for r in prefilling if not r.chunk_layer] + list(self.waiting), key=self._priority(time.perf_counter()))
        passed: list[Request] = []
        limit = self.config.max_overtakes
        admitting = True
        out_of_time = False  # prefill work left for later steps by the budgets, not by seats or blocks
        for request in queue:
            if budget <= 0 or not plan.has_room():
                out_of_time = True
                break
            if request.status == RequestStatus.RUNNING:
                size = plan.chunk(request, budget)
                if size is None:
                    continue
                num_new, layers, completes = size
                if not self._grow(request, num_new):
                    continue
                plan.commit(request, num_new, layers)
                seqs.append(ScheduledSeq(request, num_new, 0, layers, completes))
                budget -= num_new
                continue
            if not admitting:
                continue
            if (len(self.running) >= self.config.max_num_seqs or len(passed) >= _MAX_PASSED
                    or any(p.num_overtaken >= limit for p in passed)):
                admitting = False  # a passed-over request's turn, or no room: no more admissions
                continue
            got = self._admit(request, lambda r: plan.chunk(r, budget))
            if got is None:
                if not plan.stopped:  # out of blocks, not of time: passed over
                    passed.append(request)
                continue
            num_new, layers, completes = got
            for p in passed:
                p.num_overtaken += 1
            self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
                plan.note_ttft(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.commit(request, num_new, layers)
            seqs.append(ScheduledSeq(request, num_new, 0, layers, completes))
            budget -= num_new
        if timed and decodes:
            backlog = self._prefill_backlog(seqs, out_of_time or plan.stopped)
            self._add_drafts(decodes, seqs, budget, forced_only=backlog)
        cutoff = None
        if plan.bound is not None and decodes and any(s.layers is not None for s in seqs):
            cutoff = max(self.config.itl_cutoff, self.config.itl_margin) * plan.bound
        return SchedulerOutput(seqs, preempted, cutoff)

    def layers_run(self, seqs: list[ScheduledSeq]) -> None:
        """After the forward: a chunk split by layers goes on at the first layer the step did not
        run (`seq.layers` as the forward left it: fewer than planned past the step's cutoff)."""
        for seq in seqs:
            if seq.layers is not None:
                _note_chunk(seq.request, seq.num_new_tokens, seq.layers[1], self.num_layers)

    def _prefill_backlog(self, seqs: list[ScheduledSeq], out_of_time: bool) -> bool:
        """Whether prompt work waits beyond this step for time: a running prompt this step
        does not finish (not fed, or fed a chunk or some layers short of its end), or a waiting
        request when the step's budgets ran out (`out_of_time`; one waiting only for a seat or
        KV blocks waits on the running streams, which drafts finish sooner). Under a backlog the
        step carries no guessed drafts (docs/SCHEDULING.md): the time left after the prefill
        work is not free, it lengthens the step, and the backlog only moves as fast as steps
        follow one another."""
        if out_of_time and self.waiting:
            return True
        fed = {id(seq.request): seq for seq in seqs}
        for request in self.running:
            if request.status != RequestStatus.RUNNING or request.num_uncomputed <= 1:
                continue
            seq = fed.get(id(request))
            if seq is None or not seq.completes or seq.num_new_tokens < request.num_uncomputed:
                return True
        return False

    def _add_drafts(self, decodes: list[ScheduledSeq], seqs: list[ScheduledSeq], budget: int,
                    forced_only: bool = False) -> None:
        """Draft slots for the decodes, oldest first, within the step's time left after its
        decode rows and prefill work (the cost model) and the token budget left; a draft that
        cannot get its KV blocks is dropped (never a preemption for a draft). `forced_only`
        (prompt work waits): only the tokens a grammar forces next, which the mask leaves no
        other text for -- rows the stream needs anyway, only sooner."""
        shape = step_shape(seqs, self.num_layers)
        left = self.config.itl_margin * itl_bound([s.request for s in decodes], self.config.itl_target_s) - \
            self.cost.prefill_seconds(shape.prefill_tokens, shape.prefill_ctx)
        # every draft row priced at its own request's context (the oldest requests, first served,
        # have the longest: priced at the decodes' mean, 8 agents' drafts at 1k context made
        # steps the model itself put at 85-99 ms of an 80 ms budget, 2-core Zen 4, `bench load`)
        rows, ctx_sum = shape.decode_rows, shape.decode_rows * shape.decode_ctx
        # the small sequences' rows in the step's order: draft rows can change how the forward
        # plan packs them (a sequence never spans two forwards)
        small_seqs = [s for s in seqs if s.num_new_tokens <= BATCH_INVARIANT_M and s.layers is None]
        small = [s.num_new_tokens + s.num_spec_slots for s in small_seqs]
        where = {id(s): k for k, s in enumerate(small_seqs)}
        for seq in decodes:
            r = seq.request
            want = min(r.forced_budget, r.spec_budget) if forced_only else r.spec_budget
            most = max(0, min(want, budget, self.max_seq_len - r.num_tokens - 1))
            own = r.num_computed_tokens + 1  # its decode row's context, already in ctx_sum
            k = where[id(seq)]

            def grown(spec: int) -> float:  # ctx_sum with `spec` draft rows (step_shape's terms)
                return ctx_sum - own + (1 + spec) * (own + spec)

            def cost(spec: int) -> float:
                small[k] = 1 + spec
                return self.cost.rows_seconds(rows + spec, grown(spec), packed_forwards(small))

            lo, hi = 0, most  # the most draft rows that fit (the cost grows with them)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if cost(mid) <= left:
                    lo = mid
                else:
                    hi = mid - 1
            spec = lo
            small[k] = 1
            n = self._blocks_needed(r, 1 + spec) if spec else 0
            if spec and self.blocks.can_allocate(n):  # free blocks only: never a reclaim for a draft
                r.block_ids.extend(self.blocks.allocate(n))
                seq.num_spec_slots = spec
                budget -= spec
                rows, ctx_sum, small[k] = rows + spec, grown(spec), 1 + spec

    def _priority(self, now: float):
        """Sort key of prefill work: prompts that can still make their TTFT deadline first,
        earliest deadline first; then the ones already late, also by deadline (serving a late
        one first saves nobody and makes the on-time ones late too: under overload, plain EDF
        misses every deadline); a prompt late by more than `_STARVE_S` goes to the very front,
        so none waits on others without bound."""
        def key(r: Request) -> tuple[int, float]:
            d = self._deadline(r)
            late = now - d
            return (0 if late > _STARVE_S else 2 if late > 0 else 1), d
        return key

    def _deadline(self, r: Request) -> float:
        """When a prompt's first token is due: arrival + its TTFT bound (its own, else the
        default), or 1.3x its predicted prefill alone when the bound is below that (a bound it
        cannot make even alone does not take the step from ones that still can; 1.3x is what a
        long prompt beside decodes is held to, docs/SCHEDULING.md). A preempted request (it has
        streamed tokens) comes first."""
        if r.num_preemptions:
            return float("-inf")
        bound = r.params.max_ttft_s if r.params.max_ttft_s is not None else self.config.ttft_target_s
        if self.cost is not None:
            n = len(r.prompt_token_ids)
            bound = max(bound, _INFEASIBLE_STRETCH * self.cost.prefill_seconds(n, n / 2))
        return r.arrival_time + bound

    def _admit(self, request: Request, size) -> tuple[int, tuple[int, int] | None, bool] | None:
        """Take the blocks for a waiting request's next chunk (prefix-cache hits first, session
        pins released if need be) -> `size(request)`'s chunk; None, holding nothing, if it does
        not fit (or `size` gives it no work this step)."""
        if request.num_computed_tokens == 0 and not request.block_ids:
            while True:
                hit_ids, hit_hashes = self.blocks.match_prefix(request.all_token_ids)
                # Sized as if the hit were taken, then checked to fit before taking anything.
                request.num_computed_tokens = len(hit_ids) * self.block_size
                got = size(request)
                request.num_computed_tokens = 0
                if got is None:
                    return None
                num_new = got[0]
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
        else:
            got = size(request)
            if got is None:
                return None
        if self._grow(request, got[0]):
            return got
        # Not reached after the check above; kept so a waiting request never sits on blocks.
        self.blocks.free_blocks(request.block_ids)
        request.block_ids, request.block_hashes, request.num_computed_tokens = [], [], 0
        return None

    def admit_prefilled(self, request: Request, hashes: list[int], fresh: int) -> list[int] | bool | None:
        """Take a prompt whose KV another worker computed (the P/D split): its leading blocks
        `hashes` matched again in this prefix cache and held, `fresh` new blocks for the rest ->
        the new block ids (the request now running, its prompt computed), None when it does not
        fit yet (nothing held), or False when those leading blocks were evicted meanwhile (it
        waits at the front of the queue, to be prefilled here)."""
        k = len(hashes)
        while True:
            hit_ids, hit_hashes = self.blocks.match_prefix(request.prompt_token_ids)
            if hit_hashes[:k] != hashes:
                self.waiting.appendleft(request)
                return False
            hit_ids = hit_ids[:k]
            idle = sum(1 for b in hit_ids if self.blocks.blocks[b].ref_count == 0)  # taken from the free list
            if self.blocks.can_allocate(fresh + idle):
                break
            if not self.reclaim():  # pins released: match again, blocks may be gone
                return None
        self.blocks.acquire_prefix(hit_ids, len(request.prompt_token_ids))
        new_ids = self.blocks.allocate(fresh)
        request.block_ids, request.block_hashes = hit_ids + new_ids, list(hit_hashes[:k])
        request.num_cached_tokens = k * self.block_size
        request.num_computed_tokens = len(request.prompt_token_ids)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.perf_counter()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return new_ids

    # ---------------------------------------------------------------- after the forward

    def advance(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` more of the request's tokens have their KV written (a chunk's last layer
        ran, or a decode's accepted tokens): count them and key the blocks they filled."""
        request.num_computed_tokens += num_tokens
        self.register_full_blocks(request)

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


class _PrefillPlan:
    """One step's prefill work within its time budget (docs/SCHEDULING.md):

        bound  = min ITL bound over the decoding requests      (none decoding: no time limit)
        slack  = margin * bound - predicted cost of the decodes
        chunk  = the prompt's next chunk, whole if its predicted cost fits the slack, else as
                 many of its layers as fit (layer_split); the first prefill work of a step
                 always progresses (at least one layer of one chunk)
        a chunk split by layers continues at its next layer in the next steps, before any other.

    A prompt's chunks are `prefill_chunk` tokens (a tail of <= BATCH_INVARIANT_M tokens joins
    the chunk before it), alone or under load: the time budget decides how many layers of a
    chunk run in a step, never where the prompt is cut, so its KV has the same bits however
    busy the server is (with the kernels loaded a row's bits do not depend on the cuts at all;
    on the fallback GEMM path they do); and every chunk of a prompt longer than
    BATCH_INVARIANT_M tokens runs in a forward of its own."""

    def __init__(self, scheduler: Scheduler, decodes: list[ScheduledSeq]):
        self.s = scheduler
        cfg = scheduler.config
        self.cost = scheduler.cost
        self.stopped = False  # out of time for this step
        self.num_prefills = 0
        bound = itl_bound([seq.request for seq in decodes], cfg.itl_target_s)
        for seq in decodes:
            self.note_itl(seq.request)
        # the step's small-forward rows so far and their contexts' sum (step_shape's terms):
        # short chunks join them, priced by what they add there
        shape = step_shape(decodes, scheduler.num_layers)
        self.rows, self.ctx_sum = shape.decode_rows, shape.decode_rows * shape.decode_ctx
        self.small = [seq.num_new_tokens + seq.num_spec_slots for seq in decodes]  # in step order
        if self.cost is None or bound is None or not decodes:
            self.slack = float("inf")
        else:
            self.slack = cfg.itl_margin * bound - self.cost.rows_seconds(self.rows, self.ctx_sum,
                                                                          packed_forwards(self.small))
        self.bound = bound

    def note_itl(self, request: Request) -> None:
        """A request's own ITL bound below what one decode step costs here even alone."""
        bound = request.params.max_itl_s
        if bound is None or self.cost is None or any(n.startswith("itl_ms") for n in request.slo_notes):
            return
        alone = self.cost.decode_seconds(1, request.num_tokens)
        if alone > bound:
            request.slo_notes.append(f"itl_ms {bound * 1e3:g} is below one decode step here even alone "
                                     f"(predicted {alone * 1e3:.0f} ms)")

    def note_ttft(self, request: Request) -> None:
        """A request's own TTFT bound below its prompt's predicted prefill alone."""
        bound = request.params.max_ttft_s
        if bound is None or self.cost is None:
            return
        rest = request.num_uncomputed
        alone = self.cost.prefill_seconds(rest, request.num_computed_tokens + rest / 2) + \
            self.cost.decode_seconds(1, request.num_tokens)
        if alone > bound:
            request.slo_notes.append(f"ttft_ms {bound * 1e3:g} is below this prompt's prefill here even alone "
                                     f"(predicted {alone * 1e3:.0f} ms for {rest} tokens)")

    def has_room(self) -> bool:
        return not self.stopped and (self.num_prefills == 0 or self.slack > 0)

    def _seconds(self, request: Request, tokens: int, frac: float = 1.0) -> float:
        if self.cost is None:
            return 0.0
        if frac == 1.0 and tokens <= BATCH_INVARIANT_M:
            # a short chunk runs among the decode rows (runtime/forward_plan.py) and the step's
            # prediction prices it so (step_shape), not at a large forward's per-token cost
            rows, ctx_sum = self._with_short(request, tokens)
            return (self.cost.rows_seconds(rows, ctx_sum, packed_forwards(self.small + [tokens]))
                    - self.cost.rows_seconds(self.rows, self.ctx_sum, packed_forwards(self.small)))
        ctx = request.num_computed_tokens + tokens / 2
        return self.cost.prefill_seconds(tokens, ctx, frac)

    def _with_short(self, request: Request, tokens: int) -> tuple[int, float]:
        return self.rows + tokens, self.ctx_sum + tokens * (request.num_computed_tokens + tokens)

    def chunk(self, request: Request, token_budget: int) -> tuple[int, tuple[int, int] | None, bool] | None:
        """(tokens, layers, completes) of `request`'s prefill work this step; None: none."""
        if self.stopped:
            return None
        first = self.num_prefills == 0
        if not first and self.slack <= 0:
            self.stopped = True
            return None
        L = self.s.num_layers
        if request.chunk_layer:  # a chunk in flight: its next layers
            tokens = request.chunk_tokens
            n = self._layers_that_fit(request, tokens, L - request.chunk_layer, first)
            if n == 0:
                return None
            stop = request.chunk_layer + n
            return tokens, (request.chunk_layer, stop), stop == L
        # the prompt's next chunk: set by its length and position alone, never by the load
        tokens = _cut(request.num_uncomputed, self.s.config.prefill_chunk)
        if not first and tokens > token_budget:  # the step is full of tokens: nobody else this step
            self.stopped = True
            return None
        if self._seconds(request, tokens) <= self.slack:
            return tokens, None, True
        if self.s.layer_split and tokens > BATCH_INVARIANT_M:  # a few of its layers this step
            n = self._layers_that_fit(request, tokens, L, first)
            if n == 0:
                return None
            if n < L:
                return tokens, (0, n), False
            return tokens, None, True
        if first:  # it cannot be split: it runs whole (the minimum progress)
            return tokens, None, True
        self.stopped = True
        return None

    def _layers_that_fit(self, request: Request, tokens: int, left: int, first: bool) -> int:
        """How many of a chunk's remaining `left` layers fit the slack (at least one for the
        step's first prefill work); 0 (and the step stopped) when none fits."""
        per_layer = self._seconds(request, tokens, 1.0 / self.s.num_layers)
        if per_layer <= 0 or self.slack == float("inf"):
            return left
        n = min(left, int(max(self.slack, 0.0) // per_layer))
        if n == 0 and first:
            n = 1
        if n == 0:
            self.stopped = True
        return n

    def commit(self, request: Request, tokens: int, layers: tuple[int, int] | None) -> None:
        """Account for the work `chunk` gave (and note a chunk split by layers on the request)."""
        self.num_prefills += 1
        L = self.s.num_layers
        if layers is None:
            self.slack -= self._seconds(request, tokens)
            if tokens <= BATCH_INVARIANT_M:
                self.rows, self.ctx_sum = self._with_short(request, tokens)
                self.small.append(tokens)
            request.chunk_tokens = request.chunk_layer = 0
            return
        start, stop = layers
        self.slack -= self._seconds(request, tokens, (stop - start) / L)
        _note_chunk(request, tokens, stop, L)


def _note_chunk(request: Request, tokens: int, stop: int, num_layers: int) -> None:
    """A chunk of `tokens` split by layers has run to layer `stop`: in flight until the last
    (not yet started at 0: a cutoff may leave a chunk that)."""
    request.chunk_tokens, request.chunk_layer = (0, 0) if stop in (0, num_layers) else (tokens, stop)


def itl_bound(requests: list[Request], default: float | None) -> float | None:
    """The tightest ITL bound among decoding requests: each its own `max_itl_s`, else `default`."""
    bound = None
    for r in requests:
        b = r.params.max_itl_s if r.params.max_itl_s is not None else default
        if b is not None:
            bound = b if bound is None else min(bound, b)
    return bound


def _cut(rest: int, tokens: int) -> int:
    """A chunk of `tokens` from `rest`, taking the rest whole when at most BATCH_INVARIANT_M
    tokens would be left (a short last chunk would run on the other path)."""
    return rest if rest - tokens <= BATCH_INVARIANT_M else tokens
