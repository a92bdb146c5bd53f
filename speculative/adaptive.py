"""Adaptive speculation: how many draft tokens each request may propose this step.

Each request's drafts are judged one depth at a time; the controller keeps an EMA estimate of
`acceptance_rate` = P(the next offered draft is accepted), from the outcomes it observes. With
k draft tokens the expected output of a step is E(k) = 1 + a + a^2 + ... + a^k (a chain under
an i.i.d. acceptance model: (1 - a^(k+1)) / (1 - a) in Leviathan et al. 2023), so the j-th
draft token adds a^j. A forward over T tokens costs `verify_cost(T)` relative to a 1-token step
(measured by the engine at a short and a long context and interpolated by the batch's longest
context, since a draft's attention cost grows with it; between and past the measured sizes as
verify_cost.CostModel reads every table). The plan maximises the batch's expected tokens per
unit cost:

    max over m of (num_requests + sum of the m largest marginal gains) / verify_cost(T0 + m)

For a fixed total m the best drafts are the m largest gains (each request's gains shrink with
depth), so scanning m over the sorted gains finds the exact optimum even where the measured cost
curve is not convex. Speculation switches itself off when it does not pay (large batches, where
an extra token costs as much as the request's whole share; persistent rejection), and a request
that got no drafts for `probe_interval` steps gets `probe_tokens` anyway so that its estimate can
recover when the text turns copyable again.

A request may state its own bound on the gap between its deliveries (`SamplingParams.max_itl_s`).
Its measured gaps, each divided by the relative cost of the forward that produced it, give its
seconds per unit of verify cost (`observe_gap`); the bound over that is the most a forward may
cost, so the plan only considers totals m with cost(T0 + m) within every bounded request's
slack (one forward serves the whole batch). Without measurements yet, no cap applies.

Drafting itself is priced too (`draft_cost`, in 1-token forwards per request that drafts, which
the speculator measures): free for an n-gram lookup, a tenth of a step or so for an EAGLE head's
depths on a CPU, enough to tip a low-acceptance request to plain decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from prescient.speculative.verify import RECOVERED, VerifyOutcome
from prescient.speculative.verify_cost import CostModel

DEFAULT_VERIFY_COST = {1: 1.0, 4: 1.1, 8: 1.25, 16: 1.5}
# A CPU's until its own table is measured (make_speculator, calibrate "idle"): the middle of the
# tables measured on the 2-core Zen 4 (avx512_bf16, Q4_1; 2026-12-07: 8 tokens 1.5-2.6x a step,
# 16 2.7-4.2x, 32 6.0-7.9x), where the table above, a GPU's, is 1.6-2.8x too cheap from 8 tokens.
# (Planning with either, never measured, gave speedups within the noise of each other and of the
# measured table's on the shared workloads: chat 1.41 / 1.37 / 1.39x, tool_call 1.23 / 1.27 /
# 1.29x, long_edit 1.57 / 1.42 / 1.27x, one interleaved run.)
CPU_VERIFY_COST = {1: 1.0, 2: 1.08, 4: 1.3, 8: 2.0, 16: 3.5, 32: 6.8}


@dataclass(frozen=True)
class AdaptiveConfig:
    max_draft_tokens: int = 16  # per request per step
    ema_decay: float = 0.7  # weight kept by the past at each observation
    prior_acceptance: float = 0.5  # belief before any observation...
    prior_weight: float = 2.0  # ...worth this many judged drafts
    # forward tokens -> cost relative to a 1-token step; the engine replaces it with measurements
    verify_cost: Mapping[int, float] = field(default_factory=lambda: dict(DEFAULT_VERIFY_COST))
    probe_interval: int = 16  # steps without drafts before a probe
    probe_tokens: int = 2

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0 <= self.prior_acceptance <= 1 or self.prior_weight <= 0:
            raise ValueError("prior_acceptance must be in [0, 1] and prior_weight > 0")
        if self.probe_interval < 1 or self.probe_tokens < 0:
            raise ValueError("probe_interval must be >= 1 and probe_tokens >= 0")
        CostModel(self.verify_cost)  # validates the table


@dataclass
class _RequestStats:
    # Both start at the prior's weight and stay > 0: a step with drafts judges at least one.
    judged: float  # EMA of drafts judged per step (accepted + the rejected one, if any)
    accepted: float  # EMA of drafts accepted per step
    steps_without_drafts: int = 0
    unit_seconds: float | None = None  # EMA of emission gap / relative cost of its forward


class AdaptiveSpeculation:
    """Per-request draft budgets from observed acceptance and the verify cost model."""

    def __init__(self, config: AdaptiveConfig | None = None) -> None:
        self.config = config or AdaptiveConfig()
        self.verify_cost = CostModel(self.config.verify_cost)
        self._long: tuple[int, int, CostModel] | None = None
        # _cost_rows' memo of the tables above: install tables through set_verify_cost (it
        # resets this), never by assigning verify_cost / _long
        self._rows: dict[int, tuple[list[float], list[float] | None]] = {}
        self._stats: dict[str, _RequestStats] = {}
        # what drafting costs per request that drafts, in 1-token forwards (the speculator
        # measures it: an n-gram lookup is ~0, an EAGLE head's depths are not)
        self.draft_cost = 0.0

    def set_draft_cost(self, cost: float) -> None:
        self.draft_cost = max(0.0, float(cost))

    def set_verify_cost(self, table: Mapping[int, float], long_context: tuple[int, int, Mapping[int, float]] | None = None) -> None:
        """Install the engine's measured cost table (forward tokens -> cost / 1-token cost).

        long_context = (short_ctx, long_ctx, table_at_long_ctx): `table` was measured after
        short_ctx cached tokens and this one after long_ctx. A draft's attention cost grows with
        the context it attends over, so `plan` interpolates linearly between the two tables by
        the batch's longest context (the long table beyond long_ctx)."""
        self.verify_cost = CostModel(table)
        self._long = None if long_context is None else (long_context[0], long_context[1], CostModel(long_context[2]))
        self._rows = {}

    def acceptance_rate(self, request_id: str) -> float:
        stats = self._get(request_id)
        return min(stats.accepted / stats.judged, 1.0)

    def mean_accepted(self, request_id: str) -> float:
        """EMA of the accepted draft length per speculative step (for metrics; starts from
        the prior)."""
        return self._get(request_id).accepted

    def cost_many(self, num_tokens: np.ndarray, context: int | None = None) -> np.ndarray:  # [n] -> [n]
        """verify_cost at `context` cached tokens (the short-context table without one)."""
        short = self.verify_cost.many(num_tokens)
        if self._long is None or context is None:
            return short
        lo, hi, long_model = self._long
        # within the measured range only: the two tables are ratios to different 1-token times,
        # so extrapolating them (or timing noise between them) could drive costs below 1
        weight = min(1.0, max(0.0, (context - lo) / (hi - lo)))
        return np.maximum(short + weight * (long_model.many(num_tokens) - short), 1.0)

    def cost(self, num_tokens: int, context: int | None = None) -> float:
        """cost_many for one count (the same operations on plain floats)."""
        short = self.verify_cost(num_tokens)
        if self._long is None or context is None:
            return short
        lo, hi, long_model = self._long
        weight = min(1.0, max(0.0, (context - lo) / (hi - lo)))
        return max(short + weight * (long_model(num_tokens) - short), 1.0)

    def observe_gap(self, request_id: str, gap_s: float, forward_cost: float) -> None:
        """One measured gap between the request's deliveries, made by a forward of relative
        cost `forward_cost` (cost_many of its tokens): the request's seconds per unit of cost."""
        if not gap_s > 0 or not forward_cost > 0:
            return
        stats, unit = self._get(request_id), gap_s / forward_cost
        decay = self.config.ema_decay
        stats.unit_seconds = unit if stats.unit_seconds is None else decay * stats.unit_seconds + (1 - decay) * unit

    def max_forward_cost(self, request_ids: Sequence[str], itl_bounds: Sequence[float | None] | None) -> float:
        """The most a forward may cost within every bounded request's ITL bound (inf: no cap)."""
        allowed = float("inf")
        for request_id, bound in zip(request_ids, itl_bounds or ()):
            if bound is not None:
                unit = self._get(request_id).unit_seconds
                if unit is not None:
                    allowed = min(allowed, bound / unit)
        return allowed

    def plan(self, request_ids: Sequence[str], num_base_tokens: int | None = None,
             context: int | None = None, itl_bounds: Sequence[float | None] | None = None) -> list[int]:
        """Draft budgets for this step's decoding requests (0 = decode plainly).

        num_base_tokens: tokens the forward carries without drafts (prefill chunks + one per
        decoding request); defaults to len(request_ids). context: the longest sequence in the
        batch, for the context-dependent cost (set_verify_cost). itl_bounds: per request, its
        own bound on the gap between deliveries in seconds (None: none)."""
        cfg = self.config
        num_base = len(request_ids) if num_base_tokens is None else num_base_tokens
        budgets = [0] * len(request_ids)
        allowed = self.max_forward_cost(request_ids, itl_bounds)
        if len(request_ids) == 1 and cfg.max_draft_tokens > 0:
            budgets = [self._plan_one(request_ids[0], num_base, context, allowed)]
        elif request_ids and cfg.max_draft_tokens > 0:
            budgets = self._plan_many(request_ids, num_base, context, allowed)
        for i, request_id in enumerate(request_ids):
            stats = self._get(request_id)
            if budgets[i] == 0:
                stats.steps_without_drafts += 1
                probe = min(cfg.probe_tokens, cfg.max_draft_tokens)
                if (stats.steps_without_drafts > cfg.probe_interval and probe > 0
                        and self.cost(num_base + sum(budgets) + probe, context) <= allowed):
                    budgets[i] = probe  # retry now and then
            if budgets[i] > 0:
                stats.steps_without_drafts = 0
        return budgets

    def _plan_many(self, request_ids: Sequence[str], num_base: int, context: int | None,
                   allowed: float) -> list[int]:
        """plan's optimum for a batch: the m largest marginal gains over every request, m scanned."""
        cfg = self.config
        # numpy, not torch: a few dozen small arrays per step, where per-op overhead rules.
        rates = np.array([self.acceptance_rate(r) for r in request_ids])
        gains = rates[:, None] ** np.arange(1, cfg.max_draft_tokens + 1)  # [num_requests, max_draft_tokens]
        # Descending and stable: equal gains keep request-major, depth-ascending order, so
        # every request's chosen drafts are its first ones.
        order = np.argsort(-gains.ravel(), kind="stable")
        value = len(request_ids) + np.concatenate([[0.0], np.cumsum(gains.ravel()[order])])
        cost = self.cost_many(num_base + np.arange(len(value)), context)
        if self.draft_cost:  # each request among the first m drafts pays its drafting once
            first = (order % cfg.max_draft_tokens) == 0  # a request's first draft comes first
            cost = cost + self.draft_cost * np.concatenate([[0], np.cumsum(first)])
        ratio = value / cost
        ratio[1:][cost[1:] > allowed] = -np.inf  # m = 0 stays: the bound cannot ask for less
        best_m = int(np.argmax(ratio))  # the first maximum: fewer drafts on ties
        chosen = order[:best_m] // cfg.max_draft_tokens
        return np.bincount(chosen, minlength=len(request_ids)).tolist()

    def _plan_one(self, request_id: str, num_base: int, context: int | None, allowed: float) -> int:
        """plan's optimum for a lone request (batch 1, the common agent step), in plain floats:
        the same gains, running sums, costs and first maximum as _plan_many, at a fraction
        of its per-call cost (numpy's was ~0.2 ms a step in a decode loop, 2-3% of a step)."""
        a = self.acceptance_rate(request_id)
        # cost(num_base + m, context) for every m, as cost() computes it, from the two tables'
        # values at these counts (read once per table and count: ~30 table lookups a step were
        # most of this function's ~50 us)
        short, long = self._cost_rows(num_base)
        if long is None or context is None:
            costs = short
        else:
            lo, hi, _ = self._long
            weight = min(1.0, max(0.0, (context - lo) / (hi - lo)))
            costs = [max(s + weight * (x - s), 1.0) for s, x in zip(short, long)]
        gained, best_m = 0.0, 0  # the gains' running sum, added to the 1 token as numpy does
        best = 1.0 / costs[0]
        for m in range(1, self.config.max_draft_tokens + 1):
            gained += a ** m
            cost = costs[m] + self.draft_cost
            if cost <= allowed and (1.0 + gained) / cost > best:
                best, best_m = (1.0 + gained) / cost, m
        return best_m

    def _cost_rows(self, num_base: int) -> tuple[list[float], list[float] | None]:
        """The short- and long-context tables at num_base + m, m = 0 .. max_draft_tokens (None:
        no long table); kept until set_verify_cost installs new tables."""
        rows = self._rows.get(num_base)
        if rows is None:
            counts = range(num_base, num_base + self.config.max_draft_tokens + 1)
            rows = ([self.verify_cost(n) for n in counts],
                    None if self._long is None else [self._long[2](n) for n in counts])
            if len(self._rows) >= 64:  # prefill chunks make many counts: keep a few
                self._rows.clear()
            self._rows[num_base] = rows
        return rows

    def observe(self, request_id: str, outcome: VerifyOutcome, forced: int = 0) -> None:
        """Fold one verify step's result into the request's estimate. The tree's first `forced`
        nodes were a grammar-forced span, accepted by construction: they say nothing about the
        drafts this plan budgets, so only the drafts below the span count. Steps without such
        drafts (or whose span was cut short, leaving them unjudged) are ignored."""
        if outcome.num_draft_tokens - forced <= 0 or outcome.num_accepted < forced:
            return
        stats, decay = self._get(request_id), self.config.ema_decay
        accepted = outcome.num_accepted - forced
        judged = accepted + (1 if outcome.next_role == RECOVERED else 0)
        stats.judged = decay * stats.judged + (1 - decay) * judged
        stats.accepted = decay * stats.accepted + (1 - decay) * accepted

    def forget(self, request_id: str) -> None:
        self._stats.pop(request_id, None)

    def _get(self, request_id: str) -> _RequestStats:
        stats = self._stats.get(request_id)
        if stats is None:
            cfg = self.config
            stats = self._stats[request_id] = _RequestStats(cfg.prior_weight, cfg.prior_weight * cfg.prior_acceptance)
        return stats


def expected_tokens(acceptance_rate: float, num_draft_tokens: int) -> float:
    """E(k) = 1 + a + ... + a^k: expected tokens a step emits with k drafts (chain model)."""
    return sum(acceptance_rate**j for j in range(num_draft_tokens + 1))
