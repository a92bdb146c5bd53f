"""The engine's view of speculation: propose trees, verify them, keep KV and budgets in step.

`Speculator` implements runtime/speculation.py's protocol; `Engine.step` calls nothing else of
speculative/:

    drafts  = speculator.propose(seqs)                       # Drafts: a tree (or None) + forced span per seq
    results = speculator.verify(seqs, trees, logits, kv)     # a SeqResult or None per seq
    speculator.on_committed(request, first)                  # budgets for the next step
    speculator.release(request)                              # when a request ends
    speculator.idle_work()                                   # calibration, between requests

The verify-cost table is measured again (in idle moments) when batch-1 forwards drift from what
it predicts (verify_cost.DriftMonitor); a request's own ITL bound (`params.max_itl_s`) caps the
plan through its measured gaps (adaptive.py). A finished request with a `params.tenant` hands its
output to the proposer's shared pool (`learn_output`, if it has one); its accepted drafts are
reported as `draft` whichever source proposed them.

A constrained request's tree comes from its grammar where it forces a span
(speculative/grammar_drafts.py), else from the proposer; runtime/constrain.py then prunes it to
its grammar-valid nodes and masks it. The forced span (`Drafts.forced`, the tree's first nodes)
is not a guess: the grammar allows nothing else, so the masked target accepts it by
construction. `propose` remembers each request's span until `verify`, which counts its tokens
apart (`SpecStats.num_forced_tokens_accepted`) and tells the adaptive planner only about the
other drafts: counted as drafts they would inflate the acceptance rate and the planner's
estimates on tool-call traffic, where most of a reply may be forced.

Every request that samples this step goes through `verify.verify` (a plain decode is a 1-node
tree), so greedy and seeded sampling behave identically with and without speculation. After
verification the accepted path's K/V moves from its scratch slots (node order) to the slots of
its positions (depth order), and the adaptive controller sets each request's draft budget for
the next step (`request.spec_budget`, which the scheduler reserves KV slots for).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from prescient.kernels import ops
from prescient.runtime.batch import slot_of
from prescient.runtime.request import SOURCE_DRAFT, SOURCE_TARGET, Request
from prescient.runtime.speculation import Drafts
from prescient.runtime.step_result import SeqResult
from prescient.speculative.adaptive import CPU_VERIFY_COST, AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.grammar_drafts import grammar_draft_paths, grammar_tree, tree_size
from prescient.speculative.proposer import ProposalContext, Proposer
from prescient.speculative.tree import DraftTree
from prescient.speculative.verify import VerifyOutcome, verify, verify_on_device
from prescient.speculative.verify_cost import Calibration, CostTables, DriftMonitor, load_cached, load_sibling, save_cached

log = logging.getLogger("prescient.speculative")


@dataclass
class SpecStats:
    """Speculation counters. "Draft" tokens are guesses (the proposer's, the grammar's narrow
    choices); a grammar-forced span is not one and is counted apart (`num_forced_*`)."""

    num_steps: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0  # forced span tokens excluded
    num_accepted_tokens: int = 0  # forced span tokens excluded
    num_emitted_tokens: int = 0  # accepted drafts + bonus/recovered, over steps with drafts
    # index d: drafts accepted / offered at draft depth d+1, counted below the forced span
    accepted_by_position: list[int] = field(default_factory=list)
    offered_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    num_forced_tokens_proposed: int = 0  # grammar-forced span tokens drafted
    num_forced_tokens_accepted: int = 0  # ... and accepted (all of them: the mask allows nothing else)
    num_grammar_branch_tokens: int = 0  # draft nodes on the grammar's narrow choices (draft_paths)
    num_span_tail_tokens: int = 0  # proposer draft nodes grafted after a forced span

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculative step, bonus included."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0


class Speculator:
    def __init__(self, proposer: Proposer, block_size: int, adaptive: AdaptiveSpeculation | None = None,
                 calibration: Calibration | None = None, cache_key: str | None = None,
                 recalibrate: Callable[[], Calibration] | None = None, tables: CostTables | None = None,
                 recalibrate_interval_s: float = 300.0):
        self.proposer = proposer
        self.block_size = block_size
        self.adaptive = adaptive or AdaptiveSpeculation()
        self.stats = SpecStats()
        # measured in idle moments (idle_work) and then saved under cache_key, if given
        self.calibration = calibration
        self.cache_key = cache_key
        # a fresh measurement when the installed tables drift from the forwards timed here
        self.recalibrate = recalibrate
        self.recalibrate_interval_s = recalibrate_interval_s
        self.drift = DriftMonitor(tables) if tables is not None and recalibrate is not None else None
        self.num_recalibrations = 0
        self._last_recalibration = time.monotonic()
        self._proposed_at: float | None = None  # end of propose(): verify's start - this = the forward
        self._step_cost = 1.0  # relative cost of the last forward (for requests' ITL gaps)
        # EMAs: seconds per unit of verify cost (batch-1 forwards), drafting seconds per request
        self._unit_s: float | None = None
        self._draft_s: float | None = None
        self._last_stamp: dict[str, float] = {}  # request -> its last delivery's engine time
        # request -> its tree's forced span length, set by propose, read by verify (the engine
        # may verify a sub-batch, or one request at a time after a failure: keyed by id, not by
        # position); every propose resets its requests' entries, release drops them
        self._forced: dict[str, int] = {}
        # an EAGLE-style proposer reads the target's features: request -> (its rows' hidden
        # states [rows, hidden], the first row's position), from observe_hidden to verify
        self.wants_hidden = bool(getattr(proposer, "wants_hidden", False))
        self._hidden: dict[str, tuple[torch.Tensor, int]] = {}

    def propose(self, seqs) -> Drafts:
        trees = self._proposer_trees(seqs)
        forced = [0] * len(seqs)
        for seq in seqs:
            self._forced.pop(seq.request.request_id, None)
        for i, seq in enumerate(seqs):
            r = seq.request
            if not (seq.samples and r.grammar is not None and r.params.speculate):
                continue
            shaped = grammar_tree(seq, r.eos_token_ids, self.propose_after)
            if shaped is not None:
                trees[i], forced[i], tail = shaped
                if forced[i]:
                    self._forced[r.request_id] = forced[i]
                self.stats.num_forced_tokens_proposed += forced[i]
                self.stats.num_span_tail_tokens += tail
                if not tail:
                    self.stats.num_grammar_branch_tokens += trees[i].num_nodes - 1 - forced[i]
        self._proposed_at = time.perf_counter()
        return Drafts(trees, forced)

    def _proposer_trees(self, seqs) -> list[DraftTree | None]:
        t0 = time.perf_counter()
        contexts, where = [], []
        for i, seq in enumerate(seqs):
            r = seq.request
            # slots only for a grammar's forced span: grammar_tree fills them, no proposer tail fits
            forced_only = r.grammar is not None and seq.num_spec_slots <= r.forced_budget
            if seq.num_spec_slots > 0 and r.params.speculate and not forced_only:
                contexts.append(ProposalContext(r.request_id, r.session_id, r.all_token_ids, seq.num_spec_slots,
                                                r.params.tenant))
                where.append(i)
        trees: list[DraftTree | None] = [None] * len(seqs)
        if contexts:
            proposed = self.proposer.propose(contexts)
            self._observe_drafting((time.perf_counter() - t0) / len(contexts))
            for i, ctx, tree in zip(where, contexts, proposed):
                if tree is not None and tree.num_nodes > 1:
                    if tree.num_nodes - 1 > ctx.max_draft_tokens:
                        raise RuntimeError(f"proposer exceeded its budget: {tree.num_nodes - 1} > {ctx.max_draft_tokens}")
                    trees[i] = tree
        self.stats.draft_seconds += time.perf_counter() - t0
        return trees

    def propose_after(self, seq, span: list[int], budget: int) -> DraftTree | None:
        """A draft of what follows `span` (tokens not yet verified: a grammar's forced span),
        rooted at span[-1], at most `budget` nodes; None if the proposer has none or cannot
        draft from a context it has not seen committed (a draft model keeps KV for it)."""
        if budget <= 0 or not getattr(self.proposer, "drafts_past_unverified", False):
            return None
        r = seq.request
        t0 = time.perf_counter()
        ctx = ProposalContext(r.request_id, r.session_id, [*r.all_token_ids, *span], budget, r.params.tenant)
        tree = self.proposer.propose([ctx])[0]
        self.stats.draft_seconds += time.perf_counter() - t0
        return tree if tree is not None and 1 < tree.num_nodes <= budget + 1 else None

    def observe_hidden(self, seqs, trees: list[DraftTree | None], hidden: list[torch.Tensor | None]) -> None:
        """The step's hidden states per sequence (run_forward's `hidden`): a chunk that does not
        sample hands all its rows to the proposer now; a sampling one's wait for verify, which
        knows which tree rows were accepted."""
        for seq, tree, h in zip(seqs, trees, hidden):
            if h is None or not seq.request.params.speculate:
                continue
            request = seq.request
            if seq.samples:
                self._hidden[request.request_id] = (h, request.num_computed_tokens)
            else:
                self._feed(request.request_id, request.num_computed_tokens, h)

    def _feed(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """Hand features to the proposer; a failure costs that request its drafts only (its
        draft state is dropped and rebuilt from later features), never the step."""
        try:
            self.proposer.on_features(request_id, start, hidden)
        except Exception:
            log.warning("the proposer failed to take request %s's features; its drafts start over", request_id,
                        exc_info=True)
            self.proposer.on_request_finished(request_id)

    def verify(self, seqs, trees: list[DraftTree | None], logits: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], path=None) -> list[SeqResult | None]:
        """logits: [num_logits, vocab], rows in batch order: a tree's nodes, or one row for a
        request whose step samples, none for an unfinished prefill chunk. path: the engine's
        device step path (runtime/step_path.DeviceStepPath), with which the verdict is read once
        (verify_on_device), the draws are counter-based and the KV moves go up in one
        non-blocking copy; None on the CPU path (each request's generator, as ever)."""
        t0 = time.perf_counter()
        self._observe_forward(seqs, trees, t0)
        sampling = [i for i, seq in enumerate(seqs) if seq.samples]
        full_trees = [trees[i] or DraftTree.chain(seqs[i].request.all_token_ids[-1], []) for i in sampling]
        requests = [seqs[i].request for i in sampling]
        if path is not None:
            outcomes = verify_on_device(full_trees, logits, [r.params for r in requests], requests, path)
        else:
            outcomes = verify(full_trees, logits, [r.params for r in requests], [r.generator for r in requests])
        results: list[SeqResult | None] = [None] * len(seqs)
        src_slots: list[int] = []
        dst_slots: list[int] = []
        row = 0
        for i, tree, request, outcome in zip(sampling, full_trees, requests, outcomes):
            rows = logits[row:row + tree.num_nodes]
            row += tree.num_nodes
            prefix_len = request.num_computed_tokens  # the root's position
            src, dst = outcome.kv_moves(prefix_len)
            src_slots += [self._slot(request, p) for p in src]
            dst_slots += [self._slot(request, p) for p in dst]
            self._record(request, tree, outcome, self._forced.get(request.request_id, 0))
            held = self._hidden.pop(request.request_id, None)
            if held is not None:  # the rows of the root and the accepted drafts, in depth order
                h, start = held
                self._feed(request.request_id, start, h[list(outcome.accepted_nodes)] if trees[i] is not None else h)
            results[i] = SeqResult(
                tokens=outcome.tokens,
                sources=[SOURCE_DRAFT] * outcome.num_accepted + [SOURCE_TARGET],
                num_accepted_draft=outcome.num_accepted,
                logits=rows[list(outcome.accepted_nodes)] if request.params.logprobs is not None else None,
            )
        if src_slots:
            if path is not None:  # one non-blocking upload for both lists, shared by every layer
                src_t, dst_t = path.upload([src_slots, dst_slots])
            else:
                src_t, dst_t = (torch.tensor(xs, dtype=torch.int64, device=logits.device)
                                for xs in (src_slots, dst_slots))
            # a cache spread over processes (TP) or stacked over layers (the device path's) moves
            # all layers at once
            copy_slots = getattr(kv_caches, "copy_slots", None)
            if copy_slots is not None:
                copy_slots(src_t, dst_t)
            else:
                for kv in kv_caches:
                    ops.kv_copy(kv[0], kv[1], src_t, dst_t, **getattr(kv, "scales", {}))
        num_base = sum(seq.num_new_tokens for seq in seqs)  # what the next step carries without drafts
        context = max((r.num_tokens for r in requests), default=None)
        budgets = self.adaptive.plan([r.request_id for r in requests], num_base, context,
                                     [r.params.max_itl_s for r in requests])
        for request, budget in zip(requests, budgets):
            request.spec_budget = budget if request.params.speculate else 0
        self.stats.verify_seconds += time.perf_counter() - t0
        return results

    def on_committed(self, request: Request, first: bool) -> None:
        """After a step's tokens are committed (request still running; `first`: its first
        tokens, i.e. the prompt is now prefilled)."""
        if not request.params.speculate:
            return
        if request.params.max_itl_s is not None and request.token_times:
            stamp, before = request.token_times[-1], self._last_stamp.get(request.request_id)
            if before is not None and stamp > before:
                self.adaptive.observe_gap(request.request_id, stamp - before, self._step_cost)
            self._last_stamp[request.request_id] = stamp
        if first:  # index the prompt now rather than in the first decode step
            self.proposer.on_tokens_appended(request.request_id, request.session_id, request.all_token_ids)
        if request.grammar is not None:
            # room for the next forced span and the grammar's narrow choices after it, even
            # when drafts are not paying
            request.spec_budget = max(request.spec_budget, tree_size(grammar_draft_paths(request.grammar)))
            request.forced_budget = len(request.grammar.forced_tokens())

    def idle_work(self) -> bool:
        """One forward of a pending calibration; True while there is more to do."""
        cal = self.calibration
        if cal is None:
            return False
        try:
            done = cal.step()
        except Exception:
            self.calibration = None  # keep the table it had; never retry a failing measurement
            raise
        if done:
            cal.tables.install(self.adaptive)
            if self.cache_key is not None:
                save_cached(self.cache_key, cal.tables)
            if self.recalibrate is not None:
                self.drift = DriftMonitor(cal.tables)
            self.calibration = None
            return False
        return True

    def _observe_drafting(self, seconds: float) -> None:
        """One proposal's seconds per request: the planner's draft cost, in units of a 1-token
        forward (once a forward has been timed)."""
        self._draft_s = seconds if self._draft_s is None else 0.8 * self._draft_s + 0.2 * seconds
        if self._unit_s:
            self.adaptive.set_draft_cost(self._draft_s / self._unit_s)

    def _observe_forward(self, seqs, trees: list[DraftTree | None], now: float) -> None:
        """Time the forward that just ran (propose's end to verify's start): its relative cost,
        for the requests' ITL gaps, and at batch 1 a sample for the drift monitor."""
        started, self._proposed_at = self._proposed_at, None
        num_tokens = sum(t.num_nodes if t is not None else s.num_new_tokens for s, t in zip(seqs, trees))
        context = max((s.request.num_computed_tokens for s in seqs), default=0)
        self._step_cost = self.adaptive.cost(num_tokens, context)
        # what the tables measure: one sequence's decode or verify forward without a grammar's
        # masks (not several sequences, not a prompt's last chunk with its one logits row)
        if (started is None or not now > started or len(seqs) != 1 or not seqs[0].samples
                or seqs[0].num_new_tokens != 1 or seqs[0].request.grammar is not None):
            return
        if num_tokens <= 32:
            unit = (now - started) / self._step_cost  # seconds per 1-token forward, by this one
            self._unit_s = unit if self._unit_s is None else 0.8 * self._unit_s + 0.2 * unit
        drift = self.drift
        if drift is None:
            return
        drift.observe(now - started, num_tokens, context)
        if (drift.drifted and self.calibration is None
                and time.monotonic() - self._last_recalibration >= self.recalibrate_interval_s):
            log.info("forwards take %.0f%% of what the verify-cost table predicts; measuring it again when idle",
                     100 * np.exp(drift.log_ratio))
            self.calibration = self.recalibrate()
            self.drift = None  # until the new tables are in
            self.num_recalibrations += 1
            self._last_recalibration = time.monotonic()

    def release(self, request: Request) -> None:
        self.proposer.on_request_finished(request.request_id)
        self.adaptive.forget(request.request_id)
        self._last_stamp.pop(request.request_id, None)
        self._forced.pop(request.request_id, None)
        self._hidden.pop(request.request_id, None)
        learn = getattr(self.proposer, "learn_output", None)
        if learn is not None and request.params.tenant is not None and request.output_token_ids:
            learn(request.params.tenant, request.prompt_token_ids, request.output_token_ids)

    def _slot(self, request: Request, position: int) -> int:
        return slot_of(request.block_ids, position, self.block_size)

    def _record(self, request: Request, tree: DraftTree, outcome: VerifyOutcome, forced: int = 0) -> None:
        """Fold one verify outcome into the stats, the request's counters and the planner.
        `forced`: the tree's first `forced` nodes were the grammar's forced span (a chain from
        the root), counted apart from the drafts below it."""
        forced = max(0, min(forced, outcome.num_draft_tokens))  # a pruned tree keeps its span whole
        self.stats.num_forced_tokens_accepted += min(forced, outcome.num_accepted)
        self.adaptive.observe(request.request_id, outcome, forced)
        num_drafts = outcome.num_draft_tokens - forced
        if num_drafts == 0 or outcome.num_accepted < forced:
            # no drafts, or the span was cut short and the drafts below it went unjudged (the
            # mask allows nothing else on the span, so this is a safeguard, not a case)
            return
        accepted = outcome.num_accepted - forced  # depths below are counted from the span's end
        s = self.stats
        s.num_steps += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += accepted
        s.num_emitted_tokens += accepted + 1
        max_depth = tree.max_depth - forced
        depth_counts = [0] * (max_depth + 1)
        for d in tree.depth[1:]:
            if d > forced:
                depth_counts[d - forced] += 1
        while len(s.offered_by_position) < max_depth:
            s.offered_by_position.append(0)
            s.accepted_by_position.append(0)
        for d in range(1, max_depth + 1):
            s.offered_by_position[d - 1] += 1 if depth_counts[d] else 0
        for d in range(accepted):
            s.accepted_by_position[d] += 1
        request.num_verify_steps += 1
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += accepted


def make_speculator(model, block_size: int, method: str, draft_model_path: str | None = None,
                    tokenizer=None, proposer_config=None, adaptive_config: AdaptiveConfig | None = None,
                    calibrate: str = "now", cache_key: str | None = None, use_cache: bool = True) -> Speculator | None:
    """A speculator for a target `model` by proposer name ("ngram", "draft"); "off" -> None.

    calibrate: how the verify-cost table is obtained (ignored with an adaptive_config, whose
    table is given): "now" measures before returning (benchmarks), "idle" leaves the
    measurement to idle moments (`Speculator.idle_work`, a server), "off" keeps the default
    table. With a `cache_key` a cached table is used when there is one, and a new measurement
    is saved under it (use_cache=False: measure again whatever is cached). Until then the
    planner uses an earlier kernel build's table for this key (verify_cost.load_sibling), or on
    a CPU adaptive.CPU_VERIFY_COST."""
    from prescient.speculative.proposer import make_proposer

    if method == "off":
        return None
    if calibrate not in ("now", "idle", "off"):
        raise ValueError(f"calibrate must be 'now', 'idle' or 'off', got {calibrate!r}")
    if method == "draft" and proposer_config is None:
        from prescient.speculative.draft_model import draft_config_for

        proposer_config = draft_config_for(model, tokenizer, draft_model_path)
    proposer = make_proposer(method, proposer_config)
    adaptive = AdaptiveSpeculation(adaptive_config)
    calibration = cached = recalibrate = None
    if adaptive_config is None and calibrate != "off":
        cached = load_cached(cache_key) if cache_key is not None and use_cache else None
        if method != "draft":  # a draft model's table adds its forwards, which the drift check does not time
            recalibrate = lambda: Calibration(model, block_size)  # noqa: E731
        if cached is not None:
            cached.install(adaptive)
        else:
            draft = proposer_config.build_draft() if method == "draft" else None
            calibration = Calibration(model, block_size, draft)
            # until it is measured: an earlier kernel build's table here, else a CPU's typical one
            prior = load_sibling(cache_key) if cache_key is not None else None
            if prior is not None:
                prior.install(adaptive)
            elif getattr(getattr(model, "device", None), "type", None) == "cpu":
                adaptive.set_verify_cost(CPU_VERIFY_COST)
    spec = Speculator(proposer, block_size, adaptive, calibration, cache_key, recalibrate=recalibrate, tables=cached)
    if calibrate == "now":
        while spec.idle_work():
            pass
    return spec
