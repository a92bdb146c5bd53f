"""The engine: `add_request`, `abort`, `step`. Only `step` sequences the parts.

    sched   = scheduler.schedule()          continuous batching, chunked prefill, preemption
    drafts  = speculator.propose(seqs)      draft trees for decoding requests (speculation on)
    logits  = run_forward(model, kv, ...)   the target forward(s), as the step path plans them
                                            (runtime/step_path.py, chosen once in __init__): on CPU
                                            decode/verify rows on the fused native layers, prefill
                                            chunks in forwards of their own on the same layers
                                            (forward_plan); on CUDA one forward (or a CUDA
                                            graph replay, EngineConfig.cuda_graphs)
    tokens  = sampler / verifier            plain sampling, or tree verification (on the device
                                            path batched, its result read back once)
    outputs = commit(...)                   accept tokens, stops, detokenize, free KV, stamp times

Every stage but the forward is per-request work with a fault boundary around each request: an
exception while drafting, masking, penalising, sampling, verifying or committing for one request
ends that request alone with an error output naming the stage (error_type "invalid_request" when
the request itself cannot go on, e.g. its grammar admits no token), and the batch goes on. Only a
forward failure, which no request owns, escapes `step` (AsyncEngine then fails that step's
requests with a generic message).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from prescient.runtime.forward_plan import run_forward
from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.kv_cache import BlockManager
from prescient.runtime.model import LlamaModel
from prescient.runtime.penalties import penalize_rows
from prescient.runtime.constrain import GrammarStep, resolve_matcher
from prescient.runtime.request import (SOURCE_DRAFT, SOURCE_FORCED, SOURCE_TARGET, OverloadedError, Request,
                                      RequestDeadEnd, RequestOutput)
from prescient.runtime.sampler import sample_row
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.scheduler import ScheduledSeq, Scheduler
from prescient.runtime.sessions import SessionPins
from prescient.runtime.speculation import Drafts, Speculation
from prescient.runtime.step_cost import StepCostModel, shape_after_cut, step_shape
from prescient.runtime.step_path import STEP_PATHS, step_path_for
from prescient.runtime.step_result import SeqResult, commit_tokens
from prescient.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


log = logging.getLogger("prescient.engine")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    session_ttl_s: float = 300.0  # how long a finished agent turn keeps its KV pinned
    # how a step meets the device (runtime/step_path.py): "auto" = the device path on CUDA (one
    # forward, one sync a step), the CPU path elsewhere; "device" runs the device path anywhere
    step_path: str = "auto"
    # CUDA graphs for decode and verify forwards (runtime/cuda_graphs.py), device path only.
    # Off by default until a GPU run has validated them: eager.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.step_path not in STEP_PATHS:
            raise ValueError(f"step_path must be one of {STEP_PATHS}, got {self.step_path!r}")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class Engine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None, config: EngineConfig = EngineConfig(),
                 eos_token_ids: tuple[int, ...] = (), speculator: Speculation | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids) or (tokenizer.eos_token_ids if tokenizer else ())
        self.max_model_len = config.scheduler.max_model_len or model.config.max_position_embeddings
        cache = config.cache
        kv_dtype = torch.int8 if cache.kv_dtype == "int8" else None
        num_blocks = cache.num_blocks or max(64, cache.kv_cache_bytes // (model.kv_bytes_per_token(kv_dtype) * cache.block_size))
        # chosen once here: the forward plan, the uploads, the draws and the reads of every step
        self.path = step_path_for(model.device, config.step_path)
        if self.path.stacked_kv and kv_dtype is None and not model.is_sharded:
            self.kv_caches = model.allocate_kv_cache(num_blocks, cache.block_size, kv_dtype, stacked=True)
        else:
            self.kv_caches = model.allocate_kv_cache(num_blocks, cache.block_size, kv_dtype)
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        # What one request can get: the whole cache, since everything else in it gives way
        # (prefix-cache blocks are evicted, session pins released, newer requests preempted).
        self.kv_capacity = num_blocks * cache.block_size  # tokens
        # The KV cache is a second context limit: a sequence ends ("length") at the smaller one,
        # so a running request alone always fits and never waits on itself.
        self.max_seq_len = min(self.max_model_len, self.kv_capacity)
        self.sessions = SessionPins(self.block_manager, config.session_ttl_s)
        # the step cost model: the scheduler reads it to size steps by time, step() refits it
        self.step_cost = StepCostModel(packed=self.path.packs_forwards)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_seq_len,
                                   reclaim=self.sessions.evict_oldest, cost=self.step_cost,
                                   num_layers=model.num_layers,
                                   layer_split=not model.is_sharded and self.path.layer_split)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.speculator = speculator  # proposes + verifies draft trees; None = plain decoding
        # the forwards keep their rows' hidden states for the proposer (run_forward's hidden)
        self._wants_hidden = bool(getattr(speculator, "wants_hidden", False))
        self.grammar_step = GrammarStep(model.config.vocab_size, self.eos_token_ids)
        self._grammar_compiler = None
        # a prefill/decode split's prefill worker (runtime/disaggregated.py): new prompts are
        # computed there and their pages come back here; None = prompts are prefilled here
        self.remote_prefill = None
        self._ids = itertools.count()
        self.num_steps = 0
        self.in_step: list[str] = []  # the requests of the step running (or last run)
        # the recent steps as (StepShape, predicted s, measured s): how well the time budget
        # predicts, read by the benchmarks (bounded: a server runs for weeks)
        self.step_log: deque = deque(maxlen=4096)
        # the last step's wall time by phase (PhaseClock.PHASES), for /metrics' step breakdown
        self.step_phases: dict[str, float] = {}
        # a prefill worker's (runtime/prefill_worker.py): handoff(request, logits row) takes each
        # prompt once computed, and nothing is sampled here; None: an engine that decodes
        self.handoff = None
        # CUDA graphs over bucketed decode / verify batches (config.cuda_graphs, device path)
        self._graphs = None
        if config.cuda_graphs:
            from prescient.runtime.cuda_graphs import GraphRunner

            self._graphs = GraphRunner.for_engine(self)

    # ---------------------------------------------------------------- requests

    def prefault_kv(self):
        """Make the KV cache (and a draft model's) resident now, on a thread (runtime/memory.py):
        a server's memory is then flat from its start instead of growing as the cache fills."""
        from prescient.runtime.memory import prefault_in_background

        tensors = [t for layer in self.kv_caches for t in layer.tensors()]
        draft = getattr(getattr(self.speculator, "proposer", None), "kv_caches", None)  # a draft model's
        if draft:
            tensors += [t for layer in draft for t in layer.tensors()]
        return prefault_in_background(tensors)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, session_id: str | None = None, grammar=None,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue a request; bad input raises ValueError naming the problem and
        changes nothing else, a full queue OverloadedError. `max_tokens` is an upper bound: the
        output also ends ("length") where prompt + output reach `max_seq_len`."""
        return self.enqueue(self.make_request(prompt, params, request_id, session_id, grammar, arrival_time))

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, session_id: str | None = None, grammar=None,
                     arrival_time: float | None = None) -> Request:
        """Validate and build a request without touching engine state (safe from any thread)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be SamplingParams")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt contains token ids outside [0, {vocab})")
        bad_bias = [t for t, _ in params.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias names token id {bad_bias[0]}, outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len} "
                             "(prompt + at least one generated token must fit)")
        if len(prompt_ids) >= self.kv_capacity:  # it could never be scheduled: refuse, never queue
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the KV cache holds {self.kv_capacity} tokens "
                             "(prompt + at least one generated token must fit)")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(request_id, prompt_ids, params, self.eos_token_ids,
                          arrival_time if arrival_time is not None else time.perf_counter(),
                          session_id=session_id, grammar=grammar)
        self.path.init_request(request)  # its random draws: a host generator, or a device seed
        return request

    def enqueue(self, request: Request) -> Request:
        request_id = request.request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        remote = self.remote_prefill
        if remote is not None and remote.accepts():
            self.scheduler.check_room()  # first, like scheduler.add: a refusal leaves nothing behind
            remote.submit(self, request)
        else:
            self.scheduler.add(request)  # first: a full queue (OverloadedError) leaves nothing behind
        self.requests[request_id] = request
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        return request

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        if self.remote_prefill is not None:
            self.remote_prefill.abort(request)
        self.finish(request, "abort")
        return True

    def finish(self, request: Request, reason: str, now: float | None = None) -> None:
        """The one way a request ends, whatever ended it (its output done, an abort, a failure,
        an expiry, or its prompt handed to the decode worker): out of the engine's table, its
        blocks released (a session's kept pinned for its next turn), its per-request state
        dropped."""
        self.requests.pop(request.request_id, None)
        request.finish_reason = reason
        request.finished_time = now if now is not None else time.perf_counter()
        self._release(request)

    def _release(self, request: Request) -> None:
        if request.session_id is not None and request.finish_reason not in ("abort", "error"):
            # keep the conversation's cached blocks for its next turn
            self.sessions.pin(request.session_id, request.block_ids[:len(request.block_hashes)])
        self.scheduler.finish(request)
        self.detokenizers.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.release(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or (self.remote_prefill is not None and self.remote_prefill.has_pending())

    # ---------------------------------------------------------------- the step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step: the scheduler's sequences (and a P/D split's handed-off prompts, whose
        logits row came with their pages) through one forward, sampling or verification and
        commit."""
        self.in_step = []
        self.sessions.expire()
        failed = self._expire_waiting()
        handoffs = self._take_handoffs(failed) if self.remote_prefill is not None else []
        clock = PhaseClock()
        sched = self.scheduler.schedule()
        if not sched.seqs and not handoffs:
            return failed
        shape = step_shape(sched.seqs, self.model.num_layers)
        clock.lap("schedule")
        predicted = self.step_cost.predict(shape)
        cutoff = None
        # the step's end, less what sampling and commit took last step (a host clock: the CPU's
        # forwards; a device's kernels would end after it reads)
        if sched.layer_cutoff_s is not None and self.model.device.type == "cpu":
            last = self.step_phases
            cutoff = clock.start + sched.layer_cutoff_s - last.get("sample", 0.0) - last.get("commit", 0.0)
        planned = [(seq, seq.layers) for seq in sched.seqs if seq.layers is not None] if cutoff is not None else []
        outputs = self._step(handoffs + list(sched.seqs), clock, cutoff)
        if sched.seqs:
            for seq, layers in planned:  # the shape as it ran: a split chunk may have run fewer layers
                if seq.layers != layers:
                    shape = shape_after_cut(shape, seq, layers, self.model.num_layers)
                    predicted = self.step_cost.predict(shape)  # (the log pairs a shape with its own prediction)
            self.step_cost.observe(shape, clock.total())  # what this step's streams waited
            self.step_log.append((shape, predicted, clock.total()))
        self.step_phases = clock.phases
        if handoffs:
            self._note_handoff_ttft(handoffs, outputs)
        return failed + outputs

    def _step(self, seqs, clock: "PhaseClock", cutoff: float | None = None) -> list[RequestOutput]:
        failed: list[RequestOutput] = []
        self.in_step = [seq.request.request_id for seq in seqs]  # whom a failed forward takes down
        failed += self._resolve_grammars(seqs)
        drafts = self._propose(seqs, failed)
        clock.lap("draft")
        trees, masks = self._prepare(seqs, drafts, failed)
        clock.lap("mask")
        if not seqs:
            return failed
        if self.handoff is not None:  # a prefill worker: computed prompts go to the decode worker
            return failed + self._hand_off(seqs)
        # the forwards the step path plans (the CPU's put decode/verify rows on the fused native
        # layers, prefill chunks in forwards of their own: runtime/forward_plan.py; a GPU's is
        # one); the one stage whose failure is everyone's
        # (AsyncEngine answers it for all)
        # an EAGLE head drafts from the target's hidden states: each sequence's rows, kept
        # until verification says which of them were accepted (a failure there is the
        # proposer's, per request: the speculator drops that request's draft state)
        hidden = [] if self._wants_hidden else None
        logits = self._forward(seqs, trees, hidden, cutoff, rows_fixed=masks is not None)  # [num_logits, vocab]
        if cutoff is not None:
            self.scheduler.layers_run(seqs)  # a split chunk cut short goes on from where it stopped
        if hidden is not None:
            self.speculator.observe_hidden(seqs, trees, hidden)
        clock.lap("forward")
        self.num_steps += 1
        return failed + self._decide(seqs, trees, logits, masks, drafts.forced, clock=clock)

    def _forward(self, seqs, trees, hidden: list | None = None, cutoff: float | None = None,
                 rows_fixed: bool = False) -> torch.Tensor:
        """The step's target logits [num_logits, vocab]: the planned forwards of the step path,
        through the CUDA graphs when they are on and the step fits one (not when `hidden`
        asks for the rows' hidden states: a graph keeps only its logits). cutoff, rows_fixed:
        run_forward's (a chunk split by layers may run fewer of them)."""
        graphs = self._graphs
        if graphs is not None and hidden is None:
            logits = graphs.try_forward(seqs, trees, self.block_manager.block_size)
            if logits is not None:
                return logits
        return run_forward(self.model, self.kv_caches, seqs, trees, self.block_manager.block_size, self.path,
                           hidden=hidden, cutoff=cutoff, rows_fixed=rows_fixed)

    # Per-request fault boundaries. Everything between the scheduler and the commit is one
    # request's work except the forward: an exception there ends that request alone (an error
    # output naming the stage and the cause), and the rest of the batch goes on. Before the
    # forward a failed request leaves the batch; after it, its logits rows are skipped.

    def _propose(self, seqs, failed: list[RequestOutput]) -> Drafts:
        # (a handed-off prompt has no draft slots, so it gets no draft: its row is the root's only)
        if self.speculator is None:
            return Drafts([None] * len(seqs), [0] * len(seqs))
        try:
            return self.speculator.propose(seqs)
        except Exception:  # find whose: drafts one request at a time (only on this rare path)
            log.warning("drafting failed for a batch; retrying per request", exc_info=True)
        trees, forced = [], []
        for seq in list(seqs):
            try:
                one = self.speculator.propose([seq])
            except Exception as e:
                seqs.remove(seq)
                failed.append(self._fail_request(seq.request, *_cause("drafting", e)))
                continue
            trees += one.trees
            forced += one.forced
        return Drafts(trees, forced)

    def _prepare(self, seqs, drafts: Drafts, failed: list[RequestOutput]):
        """Grammar-prune the trees and build the masks; a request whose grammar fails (or
        admits no token) leaves the batch, with its draft."""
        trees, masks, bad = self.grammar_step.prepare(seqs, drafts.trees)
        if bad:
            for i in sorted(bad, reverse=True):
                failed.append(self._fail_request(seqs[i].request, *_cause("masking", bad[i])))
                del seqs[i], trees[i], drafts.forced[i]
        return trees, masks

    def _decide(self, seqs, trees, logits: torch.Tensor, masks, forced: list[int],
                clock: "PhaseClock | None" = None) -> list[RequestOutput]:
        """From the forward's logits to committed tokens: penalties and bias, the grammar mask,
        sampling or verification, commit. seqs[i]'s rows are logits[spans[i]]."""
        failed: list[RequestOutput] = []
        spans, row = [], 0
        for seq, tree in zip(seqs, trees):
            n = (tree.num_nodes if tree is not None else 1) if seq.samples else 0
            spans.append((row, row + n))
            row += n
        bad: dict[int, Exception] = {}
        upload = self.path.upload if self.path.device_side else None  # penalties' inputs, no blocking copy
        for i, (seq, (lo, hi)) in enumerate(zip(seqs, spans)):
            if hi > lo:
                try:
                    penalize_rows(logits[lo:hi], seq.request, trees[i], upload)
                except Exception as e:
                    bad[i] = e
        self.grammar_step.apply(logits, masks)
        results = self._choose(seqs, trees, logits, spans, bad)
        for i, e in bad.items():
            failed.append(self._fail_request(seqs[i].request, *_cause("sampling", e)))
        keep = [i for i in range(len(seqs)) if i not in bad]
        if clock is not None:
            clock.lap("sample")
        outputs = self._commit([seqs[i] for i in keep], [results[i] for i in keep], [forced[i] for i in keep])
        if clock is not None:
            clock.lap("commit")
        return failed + outputs

    def _choose(self, seqs, trees, logits, spans, bad: dict[int, Exception]) -> list[SeqResult | None]:
        """Sampling / verification for the requests not in `bad`; one that raises joins `bad`."""
        ok = [i for i in range(len(seqs)) if i not in bad]
        if self.speculator is None and self.path.device_side:
            return self._sample_batch(seqs, logits, spans, ok, bad)
        if self.speculator is None:
            results: list[SeqResult | None] = [None] * len(seqs)
            for i in ok:
                lo, hi = spans[i]
                try:
                    results[i] = self._sample_one(seqs[i], logits[lo:hi]) if hi > lo else None
                except Exception as e:
                    bad[i] = e
            return results
        sub = [seqs[i] for i in ok]
        # the device path's verification reads its verdict once (speculator.verify's `path`)
        extra = {"path": self.path} if self.path.device_side else {}
        try:
            # where a request failed before verification, the others' rows; built only then:
            # torch calls right after a CPU forward cost ~0.1 ms a step
            rows_dev = None
            if len(ok) < len(seqs):
                rows = [j for i in ok for j in range(*spans[i])]
                (rows_dev,) = self.path.upload([rows]) if self.path.device_side else (
                    torch.tensor(rows, dtype=torch.int64, device=logits.device),)
            chosen = self.speculator.verify(sub, [trees[i] for i in ok],
                                            logits if rows_dev is None else logits[rows_dev], self.kv_caches,
                                            **extra)
        except Exception:  # whose: verify one request at a time (its own rows), only on this path
            log.warning("verification failed for a batch; retrying per request", exc_info=True)
            chosen = []
            for i in ok:
                lo, hi = spans[i]
                try:
                    chosen += self.speculator.verify([seqs[i]], [trees[i]], logits[lo:hi], self.kv_caches, **extra)
                except Exception as e:
                    bad[i] = e
                    chosen.append(None)
        results = [None] * len(seqs)
        for i, r in zip(ok, chosen):
            results[i] = r
        return results

    def _sample_batch(self, seqs, logits, spans, ok: list[int], bad: dict[int, Exception]) -> list[SeqResult | None]:
        """The device path's plain decoding: every sampling request's token in one batched
        draw, read back once (DeviceStepPath.sample). A failure retries one request at a time
        to find whose (only on that path)."""
        results: list[SeqResult | None] = [None] * len(seqs)
        live = [i for i in ok if spans[i][1] > spans[i][0]]
        if not live:
            return results
        requests = [seqs[i].request for i in live]
        starts = [spans[i][0] for i in live]
        try:
            if starts == list(range(logits.shape[0])):
                rows = logits  # the common step: every row samples, none failed
            else:
                (index,) = self.path.upload([starts])
                rows = logits[index]
            tokens = self.path.sample(requests, rows)
        except Exception:
            log.warning("batched sampling failed; retrying per request", exc_info=True)
            tokens = []
            for i, r in zip(live, requests):
                lo, hi = spans[i]
                try:
                    tokens += self.path.sample([r], logits[lo:hi])
                except Exception as e:
                    bad[i] = e
                    tokens.append(None)
        for i, token in zip(live, tokens):
            if token is None:
                continue
            lo, hi = spans[i]
            results[i] = SeqResult(tokens=[token], sources=[SOURCE_TARGET], num_accepted_draft=0,
                                   logits=logits[lo:hi] if seqs[i].request.params.logprobs is not None else None)
        return results

    def _take_handoffs(self, failed: list[RequestOutput]) -> list[ScheduledSeq]:
        """Prompts the prefill worker finished, their pages now in this cache: each enters the
        step as a sequence whose logits row is already computed (it came with the pages), and
        samples its first token as a co-located step would (penalties, grammar mask, sampling or
        verification, commit)."""
        ready, bad = self.remote_prefill.collect(self)
        failed += [self._fail_request(request, message) for request, message in bad]
        return [ScheduledSeq(request, 0, 0, logits=row.to(self.model.device)) for request, row in ready]

    def _note_handoff_ttft(self, handoffs: list[ScheduledSeq], outputs: list[RequestOutput]) -> None:
        by_id = {seq.request.request_id: seq.request for seq in handoffs}
        for out in outputs:
            if out.request_id in by_id and out.error is None:
                # the split ends at the first token's own stamp (what its TTFT ends at), not at
                # this bookkeeping after the step
                end = out.token_times[0] if out.token_times else time.perf_counter()
                timing = self.remote_prefill.first_token_committed(by_id[out.request_id], end)
                out.ttft_split = None if timing is None else timing.as_dict()

    def _hand_off(self, seqs) -> list[RequestOutput]:
        """A prefill worker's step: the chunks' forward; each prompt now computed goes to
        `handoff(request, logits row [vocab])` and ends here (its blocks stay in the prefix
        cache). It samples nothing."""
        logits = run_forward(self.model, self.kv_caches, seqs, [None] * len(seqs),
                             self.block_manager.block_size)  # [prompts completed this step, vocab]
        self.num_steps += 1
        row = 0
        for seq in seqs:
            request, samples = seq.request, seq.samples
            if seq.completes:  # (a prefill worker runs no decodes: its chunks are never split by layers)
                self.scheduler.advance(request, seq.num_new_tokens)
            if samples:
                self.handoff(request, logits[row])
                row += 1
                self.finish(request, "handoff")
        return []

    def _fail_request(self, request: Request, text: str, error_type: str | None = None) -> RequestOutput:
        """End one request with an error output (its blocks released); the others go on.
        error_type "invalid_request": its own input cannot go on (a 4xx); None: a server fault."""
        try:
            self.finish(request, "error")
        except Exception:  # releasing must not take the step down; the blocks may leak, say so
            log.error("releasing failed request %s failed", request.request_id, exc_info=True)
        return RequestOutput(request.request_id, [], "", True, "error", error=text, error_type=error_type,
                             num_prompt_tokens=len(request.prompt_token_ids))

    def _expire_waiting(self) -> list[RequestOutput]:
        """End the requests that waited too long to start, each with an "overloaded" error."""
        now = time.perf_counter()
        outputs = []
        for request in self.scheduler.expire_waiting(now):
            self.finish(request, "error", now)
            err = OverloadedError(f"the server is overloaded: the request waited {now - request.arrival_time:.1f} s "
                                  f"without starting (the limit is {self.config.scheduler.max_queue_wait_s} s)",
                                  self.config.scheduler.retry_after_s)
            outputs.append(overloaded_output(request.request_id, err, len(request.prompt_token_ids)))
        return outputs

    def _resolve_grammars(self, seqs) -> list[RequestOutput]:
        """Requests about to sample their first token wait for their grammar compile here; a
        failed compile fails that request alone (removed from this step's batch)."""
        failed = []
        for seq in list(seqs):
            request = seq.request
            if request.grammar is None or not seq.samples or hasattr(request.grammar, "accept_token"):
                continue
            try:
                resolve_matcher(request)
            except Exception as e:  # GrammarError, compile errors: this request only
                seqs.remove(seq)
                failed.append(self._fail_request(request, str(e), "invalid_request"))
        return failed

    def _sample_one(self, seq, row_logits: torch.Tensor) -> SeqResult:
        """Plain decoding: one token for a request whose step reached the end of its sequence.
        row_logits: [1, vocab]."""
        params = seq.request.params
        token = sample_row(row_logits, params, seq.request.generator)
        return SeqResult(tokens=[token], sources=[SOURCE_TARGET], num_accepted_draft=0,
                         logits=row_logits if params.logprobs is not None else None)

    def idle_work(self) -> bool:
        """Background work for a moment with no requests (the speculator's calibration, one
        forward at a time); True while more remains. Callers run it only when idle."""
        return self.speculator is not None and self.speculator.idle_work()

    def _commit(self, seqs, results: list[SeqResult | None], forced: list[int]) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        for seq, result, span in zip(seqs, results, forced):
            try:
                out = self._commit_one(seq, result, span, now)
            except Exception as e:  # its grammar refused a token, its detokenizer failed...: its alone
                outputs.append(self._fail_request(seq.request, *_cause("committing", e)))
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    def _commit_one(self, seq, result: SeqResult | None, forced: int, now: float) -> RequestOutput | None:
        request = seq.request
        n_accepted = result.num_accepted_draft if result else 0
        out = None
        if result is not None:
            if forced:
                # the first accepted drafts are the forced span; past it, grammar-branch drafts
                result.sources = [SOURCE_FORCED if s == SOURCE_DRAFT and j < forced else s
                                  for j, s in enumerate(result.sources)]
            taken = self.grammar_step.advance(request, result.tokens)
            if taken < len(result.tokens):
                # tokens after the grammar's stop (a stop drafted as forced, then the dead
                # row's bonus stop): plain decoding would have ended there
                result.tokens, result.sources = result.tokens[:taken], result.sources[:taken]
                result.logits = None if result.logits is None else result.logits[:taken]
            self.grammar_step.append_forced_stop(request, result)
            out = commit_tokens(request, result, self.detokenizers.get(request.request_id), self.max_seq_len, now)
        if seq.completes:  # a chunk split by layers counts once its last layer has run
            self.scheduler.advance(request, seq.num_new_tokens + n_accepted)
        if out is None:
            return None
        if out.finished:
            self.finish(request, request.finish_reason, now)
            return out
        if self.speculator is not None:
            self.speculator.on_committed(request, first=len(request.output_token_ids) == len(result.tokens))
        return out

    # ---------------------------------------------------------------- convenience

    def grammar_compiler(self, backend: str = "xgrammar"):
        """The one grammar compiler for this engine's tokenizer (cached grammars, time limit);
        `backend` (CompilerConfig.backend: xgrammar | llguidance | auto) applies when it is built."""
        if self._grammar_compiler is None:
            from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarTokenizer

            gtok = GrammarTokenizer.from_huggingface(self.tokenizer.hf, vocab_size=self.model.config.vocab_size,
                                                     stop_token_ids=list(self.eos_token_ids))
            # compiles in low-priority worker processes, killed at the time limit: a heavy one
            # must not take the CPU (or the GIL) from the steps (grammar/compile_pool.py)
            self._grammar_compiler = GrammarCompiler(gtok, CompilerConfig(isolate=True, max_workers=6, disk_cache_mb=256,
                                                                          backend=backend))
        return self._grammar_compiler

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion; returns the generated token ids of each (tests, benchmarks)."""
        ids = [self.add_request(p, params).request_id for p in prompts]
        done: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished_requests():
            outs = self.step()
            for out in outs:
                if out.request_id in done:
                    done[out.request_id].extend(out.new_token_ids)
            if not outs and self.remote_prefill is not None:
                time.sleep(0.0005)  # waiting for the prefill worker's pages: leave it the core
        return [done[i] for i in ids]


class PhaseClock:
    """Laps of one step by phase: where a step's time went, so the next stall is found by
    reading a table (/metrics: prescient_step_phase_seconds)."""

    PHASES = ("schedule", "draft", "mask", "forward", "sample", "commit")

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def _cause(stage: str, e: Exception) -> tuple[str, str | None]:
    """A per-request failure's message and error type: the request's own dead end is an invalid
    request (4xx); anything else is the server's fault (logged with its traceback)."""
    if isinstance(e, RequestDeadEnd):
        return str(e), "invalid_request"
    log.error("a request failed while %s", stage, exc_info=e)
    return f"the request failed while {stage}: {type(e).__name__}: {e}", None


def overloaded_output(request_id: str, err: OverloadedError, num_prompt_tokens: int = 0) -> RequestOutput:
    """The final output of a request refused for load (never started, so it carries no tokens)."""
    return RequestOutput(request_id, [], "", True, "error", error=str(err), num_prompt_tokens=num_prompt_tokens,
                         error_type="overloaded", retry_after_s=err.retry_after_s)
