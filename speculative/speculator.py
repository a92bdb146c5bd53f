"""The engine's view of speculation: propose trees, verify them, keep KV and budgets in step.

`Engine.step` calls three things and nothing else of speculative/:

    trees   = speculator.propose(seqs)                       # a DraftTree or None per seq
    results = speculator.verify(seqs, trees, logits, kv)     # a SeqResult or None per seq
    speculator.release(request)                              # when a request ends

Every request that samples this step goes through `verify.verify` (a plain decode is a 1-node
tree), so greedy and seeded sampling behave identically with and without speculation. After
verification the accepted path's K/V moves from its scratch slots (node order) to the slots of
its positions (depth order), and the adaptive controller sets each request's draft budget for
the next step (`request.spec_budget`, which the scheduler reserves KV slots for).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from prescient.kernels import ops
from prescient.runtime.request import SOURCE_DRAFT, SOURCE_TARGET, Request
from prescient.runtime.step_result import SeqResult
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.proposer import ProposalContext, Proposer
from prescient.speculative.tree import DraftTree
from prescient.speculative.verify import VerifyOutcome, verify


@dataclass
class SpecStats:
    num_steps: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + bonus/recovered, over steps with drafts
    accepted_by_position: list[int] = field(default_factory=list)  # index d: accepted at depth d+1
    offered_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculative step, bonus included."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0


class Speculator:
    def __init__(self, proposer: Proposer, block_size: int, adaptive: AdaptiveSpeculation | None = None):
        self.proposer = proposer
        self.block_size = block_size
        self.adaptive = adaptive or AdaptiveSpeculation()
        self.stats = SpecStats()

    def propose(self, seqs) -> list[DraftTree | None]:
        t0 = time.perf_counter()
        contexts, where = [], []
        for i, seq in enumerate(seqs):
            r = seq.request
            if seq.num_spec_slots > 0 and r.params.speculate:
                contexts.append(ProposalContext(r.request_id, r.session_id, r.all_token_ids, seq.num_spec_slots))
                where.append(i)
        trees: list[DraftTree | None] = [None] * len(seqs)
        if contexts:
            for i, ctx, tree in zip(where, contexts, self.proposer.propose(contexts)):
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
        ctx = ProposalContext(r.request_id, r.session_id, [*r.all_token_ids, *span], budget)
        tree = self.proposer.propose([ctx])[0]
        self.stats.draft_seconds += time.perf_counter() - t0
        return tree if tree is not None and 1 < tree.num_nodes <= budget + 1 else None

    def verify(self, seqs, trees: list[DraftTree | None], logits: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[SeqResult | None]:
        """logits: [num_logits, vocab], rows in batch order: a tree's nodes, or one row for a
        request whose step samples, none for an unfinished prefill chunk."""
        t0 = time.perf_counter()
        sampling = [i for i, seq in enumerate(seqs) if seq.samples]
        full_trees = [trees[i] or DraftTree.chain(seqs[i].request.all_token_ids[-1], []) for i in sampling]
        requests = [seqs[i].request for i in sampling]
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
            self._record(request, tree, outcome)
            results[i] = SeqResult(
                tokens=outcome.tokens,
                sources=[SOURCE_DRAFT] * outcome.num_accepted + [SOURCE_TARGET],
                num_accepted_draft=outcome.num_accepted,
                logits=rows[list(outcome.accepted_nodes)] if request.params.logprobs is not None else None,
            )
        if src_slots:
            as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=logits.device)  # noqa: E731
            for k_cache, v_cache in kv_caches:
                ops.kv_copy(k_cache, v_cache, as_long(src_slots), as_long(dst_slots))
        num_base = sum(seq.num_new_tokens for seq in seqs)  # what the next step carries without drafts
        context = max((r.num_tokens for r in requests), default=None)
        budgets = self.adaptive.plan([r.request_id for r in requests], num_base, context)
        for request, budget in zip(requests, budgets):
            request.spec_budget = budget if request.params.speculate else 0
        self.stats.verify_seconds += time.perf_counter() - t0
        return results

    def on_prefilled(self, request: Request) -> None:
        """Index the prompt now rather than in the first decode step."""
        if request.params.speculate:
            self.proposer.on_tokens_appended(request.request_id, request.session_id, request.all_token_ids)

    def release(self, request: Request) -> None:
        self.proposer.on_request_finished(request.request_id)
        self.adaptive.forget(request.request_id)

    def _slot(self, request: Request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _record(self, request: Request, tree: DraftTree, outcome: VerifyOutcome) -> None:
        self.adaptive.observe(request.request_id, outcome)
        if outcome.num_draft_tokens == 0:
            return
        s = self.stats
        s.num_steps += 1
        s.num_draft_tokens += outcome.num_draft_tokens
        s.num_accepted_tokens += outcome.num_accepted
        s.num_emitted_tokens += outcome.num_accepted + 1
        depth_counts = [0] * (tree.max_depth + 1)
        for d in tree.depth[1:]:
            depth_counts[d] += 1
        while len(s.offered_by_position) < tree.max_depth:
            s.offered_by_position.append(0)
            s.accepted_by_position.append(0)
        for d in range(1, tree.max_depth + 1):
            s.offered_by_position[d - 1] += 1 if depth_counts[d] else 0
        for d in range(outcome.num_accepted):
            s.accepted_by_position[d] += 1
        request.num_verify_steps += 1
        request.num_draft_tokens += outcome.num_draft_tokens
        request.num_accepted_tokens += outcome.num_accepted


# Contexts the verify cost is measured at: a chat turn and an agent's long tool output / document.
SHORT_CONTEXT, LONG_CONTEXT = 256, 1024


def measure_verify_cost(model, block_size: int, sizes=(1, 2, 4, 8, 16, 32), context: int = 256,
                        repeats: int = 5, return_seconds: bool = False):
    """Forward time of T new tokens after `context` cached ones, relative to T = 1 (best of
    `repeats`), on a scratch KV cache: the cost model the adaptive planner sizes drafts with."""
    from prescient.runtime.batch import build_forward_batch
    from prescient.runtime.request import Request
    from prescient.runtime.sampling_params import SamplingParams
    from prescient.runtime.scheduler import ScheduledSeq

    num_blocks = -(-(context + max(sizes)) // block_size)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    batches = {}
    for t in sizes:
        req = Request("calibrate", [1] * (context + t), SamplingParams(), (), 0.0)
        req.block_ids = list(range(num_blocks))
        req.num_computed_tokens = context
        batch = build_forward_batch([ScheduledSeq(req, t, 0)], [None], block_size, model.device)
        batch.logits_indices = torch.arange(t, device=model.device)
        batches[t] = batch
    timings = {t: float("inf") for t in sizes}
    # Sweep all sizes once per round and keep each size's best: a burst of load from elsewhere
    # then hits every size alike instead of inflating one (which would switch drafting off).
    for _ in range(repeats):
        for t in sizes:
            t0 = time.perf_counter()
            model.forward(batches[t], kv)
            if model.device.type == "cuda":  # time the kernels, not their launch
                torch.cuda.synchronize(model.device)
            timings[t] = min(timings[t], time.perf_counter() - t0)
    base = timings[sizes[0]]
    # costs never decrease with more tokens (timing noise must not make 8 look cheaper than 4)
    table, running = {}, 1.0
    for t in sizes:
        running = max(running, timings[t] / base)
        table[t] = running
    return (table, base) if return_seconds else table


def _forward_seconds(model, block_size: int) -> float:
    """Best-of-3 time of a 1-token forward after 256 cached tokens."""
    table_and_time = measure_verify_cost(model, block_size, sizes=(1,), repeats=3, return_seconds=True)
    return table_and_time[1]


def make_speculator(engine, method: str, draft_model_path: str | None = None, proposer_config=None,
                    adaptive_config: AdaptiveConfig | None = None, calibrate: bool = True) -> Speculator | None:
    """A speculator for `engine` by proposer name ("ngram", "draft"); "off" -> None. With
    `calibrate`, the verify cost table is measured on the engine's model at start-up."""
    from prescient.speculative.proposer import make_proposer

    if method == "off":
        return None
    if method == "draft" and proposer_config is None:
        from prescient.speculative.draft_model import draft_config_for

        proposer_config = draft_config_for(engine, draft_model_path)
    proposer = make_proposer(method, proposer_config)
    adaptive = AdaptiveSpeculation(adaptive_config)
    if calibrate and adaptive_config is None:
        block_size = engine.block_manager.block_size
        table = measure_verify_cost(engine.model, block_size, context=SHORT_CONTEXT)
        # the long context must fit the model's positions, with room for the largest verify
        long_ctx = min(LONG_CONTEXT, engine.model.config.max_position_embeddings - 64)
        long_table = measure_verify_cost(engine.model, block_size, context=long_ctx) if long_ctx > SHORT_CONTEXT else None
        if method == "draft":
            # A draft model's own forwards are no longer free: each draft token costs about one
            # draft forward (chain drafting), measured relative to a target step.
            cfg = proposer_config
            draft = cfg.draft_model or cfg.target_model.early_exit(cfg.early_exit_layers or max(1, cfg.target_model.num_layers // 4))
            target_s = _forward_seconds(engine.model, block_size)
            draft_ratio = _forward_seconds(draft, block_size) / target_s
            table = {t: c + (t - 1) * draft_ratio for t, c in table.items()}
            long_table = long_table and {t: c + (t - 1) * draft_ratio for t, c in long_table.items()}
        adaptive.set_verify_cost(table, (SHORT_CONTEXT, long_ctx, long_table) if long_table else None)
    return Speculator(proposer, engine.block_manager.block_size, adaptive)
