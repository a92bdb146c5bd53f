"""Prometheus metrics for `GET /metrics`, on a registry of the app's own.

Request latencies come from runtime/slo.py, the code latency_bench's reports use, so /metrics and
a report agree on every figure. Each `Generation` feeds its engine outputs into the `SLOTracker`
here: the arrival is the stamp it passes to `on_submit` (the request's arrival), each output that
carried tokens is one emission at the engine's stamp for it (`RequestOutput.token_times`, the
engine's `perf_counter` clock, the server's too), the finish is the finishing output's stamp (or
the time it arrives, when it carried no token). From the samples the tracker returns: TTFT; ITL
on both bases, per emission (`prescient_itl_emission_seconds`: one sample per output after the
first, the gap a reader waits) and per token (`prescient_itl_token_seconds`: that gap split
evenly over the tokens the output carried); TPOT and E2E when a request finishes. Buckets start
at 1 ms.

SLO (the server's `ServerConfig.slo_*`, judged as runtime/slo.py defines): counters of judged and
SLO-meeting requests (and per objective), and gauges of the attainment and goodput (SLO-meeting
requests per second) over the last `slo_window_s` seconds. Every request ends in one outcome
(runtime/slo.py `OUTCOMES`), counted in `prescient_request_outcomes_total{outcome=...}`:

- judged: "met" / "missed" (it finished: stop, length), and the misses the server caused, judged
  as misses whatever their latencies: "refused" (overloaded: the queue filled after it was
  accepted), "expired" (waited past --max-queue-wait-s without starting: seen here as the
  engine's "overloaded" output in a step, through `step_hook`), "timed_out" (past
  --request-time-limit-s), "failed" (an engine error, a shutdown: a finish with reason "error"
  and no other error_type);
- not judged: "cancelled" (the client aborted or disconnected: `discard`), "invalid" (a 4xx for
  its own input: the engine's error_type "invalid_request", or `observe_refusal`), "rejected" (a
  429 at admission, before the request was accepted).

Without the misses a server shedding load would look better the more it shed. Engine state
(running / waiting requests, KV usage, prefix-cache hit rate, pinned sessions, speculation
acceptance, grammar mask time) is read from the engine's own counters when scraped; the step
time comes from `AsyncEngine.step_hooks`. Speculation counts proposer drafts apart from
grammar-forced tokens (`prescient_spec_forced_tokens_accepted`): a forced span is accepted by
construction, so counting it as drafts would inflate the acceptance rate on tool-call traffic.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prescient.runtime.slo import APART_OUTCOMES, CLOCK, CPU_INTERACTIVE, MISS_OUTCOMES, OUTCOMES, SLOConfig, SLOTracker

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """Engine gauges read at scrape time (plain attribute reads: safe from the event loop)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield GaugeMetricFamily("prescient_num_requests_running", "requests being decoded or prefilled",
                                value=len(e.scheduler.running))
        yield GaugeMetricFamily("prescient_num_requests_waiting", "requests queued for the engine",
                                value=len(e.scheduler.waiting))
        yield GaugeMetricFamily("prescient_kv_cache_usage_ratio", "fraction of KV blocks held",
                                value=e.block_manager.usage())
        stats = e.block_manager.stats
        yield GaugeMetricFamily("prescient_prefix_cache_hit_rate", "prompt tokens served from the prefix cache "
                                "/ prompt tokens looked up", value=stats.hit_rate)
        queries = CounterMetricFamily("prescient_prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        queries.add_metric([], stats.queries)
        yield queries
        hits = CounterMetricFamily("prescient_prefix_cache_hits", "prompt tokens served from the prefix cache")
        hits.add_metric([], stats.hits)
        yield hits
        yield GaugeMetricFamily("prescient_pinned_sessions", "agent sessions whose KV is pinned between turns",
                                value=len(e.sessions))
        speculator = e.speculator
        if speculator is not None:
            spec = speculator.stats
            for name, doc, value in (
                    ("draft_tokens", "draft tokens proposed and verified (grammar-forced tokens excluded)",
                     spec.num_draft_tokens),
                    ("accepted_tokens", "draft tokens accepted (grammar-forced tokens excluded)",
                     spec.num_accepted_tokens),
                    ("forced_tokens_proposed", "grammar-forced span tokens verified beside the drafts",
                     spec.num_forced_tokens_proposed),
                    ("forced_tokens_accepted", "grammar-forced span tokens accepted (not drafts: the grammar "
                     "allowed nothing else)", spec.num_forced_tokens_accepted)):
                family = CounterMetricFamily(f"prescient_spec_{name}", doc)
                family.add_metric([], value)
                yield family
            yield GaugeMetricFamily("prescient_spec_acceptance_rate", "accepted / proposed draft tokens "
                                    "(grammar-forced tokens excluded)", value=spec.acceptance_rate)
            yield GaugeMetricFamily("prescient_spec_mean_accepted_length", "tokens per speculative step with "
                                    "drafts, bonus included, forced tokens excluded",
                                    value=spec.mean_accepted_length)
        remote = getattr(e, "remote_prefill", None)
        if remote is not None:  # --pd-split: where the split requests' TTFT went (runtime/disaggregated.py)
            for name, doc, value in (
                    ("handoffs", "prompts prefilled by the prefill worker", remote.num_handoffs),
                    ("prompt_tokens", "prompt tokens whose KV the prefill worker handed over",
                     remote.num_prompt_tokens_moved),
                    ("first_tokens", "split requests' first tokens committed", remote.num_first_tokens),
                    ("local_fallbacks", "handed-over prompts prefilled here after all (their cached prefix "
                     "was evicted meanwhile)", remote.num_local_fallbacks)):
                family = CounterMetricFamily(f"prescient_pd_{name}", doc)
                family.add_metric([], value)
                yield family
            parts = CounterMetricFamily("prescient_pd_ttft_seconds", "split requests' time to first token by "
                                        "part (queue, prefill, transfer, first_decode), summed", labels=["part"])
            for part, value in remote.totals.as_dict().items():
                parts.add_metric([part.removesuffix("_s")], value)
            yield parts
        grammar = e.grammar_step.stats
        mask = CounterMetricFamily("prescient_grammar_mask_seconds", "time spent filling and applying grammar masks")
        mask.add_metric([], grammar.mask_seconds)
        yield mask
        rows = CounterMetricFamily("prescient_grammar_masked_rows", "logits rows masked by a grammar")
        rows.add_metric([], grammar.num_masked_rows)
        yield rows


class SLOCollector:
    """The SLO series, read from the tracker at scrape time."""

    def __init__(self, tracker: SLOTracker, window_s: float):
        self.tracker = tracker
        self.window_s = window_s

    def collect(self):
        t = self.tracker
        live = t.live(self.window_s)
        finished = CounterMetricFamily("prescient_slo_requests_finished", "requests judged against the SLO: "
                                       "finished, or accepted and then refused / expired / timed out / failed "
                                       "(misses)")
        finished.add_metric([], t.num_finished_total)
        yield finished
        met = CounterMetricFamily("prescient_slo_requests_met", "finished requests that met every SLO objective")
        met.add_metric([], t.num_met_total)
        yield met
        by_objective = CounterMetricFamily("prescient_slo_objective_met", "finished requests that met one "
                                           "objective", labels=["objective"])
        for name, count in t.num_met_by_slo_total.items():
            by_objective.add_metric([name], count)
        yield by_objective
        bounds = GaugeMetricFamily("prescient_slo_bound_seconds", "the SLO: ttft = TTFT, itl_emission = p99 of a "
                                   "request's per-emission gaps, tpot = TPOT, e2e = E2E", labels=["objective"])
        for name, bound in t.slo.bounds().items():
            bounds.add_metric([name], bound)
        yield bounds
        attainment = live["slo_attainment"]
        yield GaugeMetricFamily("prescient_slo_attainment_ratio", f"SLO-meeting / judged requests over the last "
                                f"{self.window_s:g} s (NaN: none finished)",
                                value=float("nan") if attainment is None else attainment)
        yield GaugeMetricFamily("prescient_slo_goodput_requests_per_second", f"SLO-meeting requests finished in "
                                f"the last {self.window_s:g} s per second of it", value=live["goodput_rps"] or 0.0)
        yield GaugeMetricFamily("prescient_slo_window_seconds", "the span of the attainment and goodput gauges "
                                "(shorter while the server is younger)", value=live["duration_s"])


class ServerMetrics:
    def __init__(self, engine, slo: SLOConfig = CPU_INTERACTIVE, slo_window_s: float = 60.0,
                 clock=CLOCK):
        """`engine` None registers no engine gauges (tests of the latency path alone)."""
        self.registry = CollectorRegistry()
        r = self.registry
        # verdicts only: a server runs for days, and the gauges need no per-token history
        self.tracker = SLOTracker(slo, clock=clock, keep_traces=False)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("prescient_time_to_first_token_seconds", "submission to the first emission")
        self.itl_emission = hist("prescient_itl_emission_seconds", "gap between consecutive emissions of a request "
                                 "(one sample per engine output that carried tokens)")
        self.itl_token = hist("prescient_itl_token_seconds", "each emission's gap split evenly over the tokens it "
                              "carried (one sample per token after the first emission)")
        self.tpot = hist("prescient_time_per_output_token_seconds", "(E2E - TTFT) / (tokens - 1)")
        self.e2e = hist("prescient_e2e_request_latency_seconds", "submission to finish")
        self.step = hist("prescient_engine_step_seconds", "one engine step")
        self._phases_seen = None  # the engine step whose phases were observed last
        # where a step's time went (runtime/engine.PhaseClock): the next stall is found by reading
        # which phase grew, not by guessing (sum / count per phase = its mean share of a step)
        self.step_phase = Histogram("prescient_step_phase_seconds", "one engine step's time by phase: schedule, "
                                    "draft, mask (grammar), forward, sample (penalties, sampling, verification), "
                                    "commit (detokenize, stops)", ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.grammar_compile = hist("prescient_grammar_compile_seconds",
                                    "time a constrained request waited for its grammar (cache hits ~0)")
        self.requests = Counter("prescient_requests", "finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.outcomes = Counter("prescient_request_outcomes", "requests by how they ended: met / missed the SLO, "
                                "refused / expired / timed_out / failed (misses), cancelled / invalid / rejected "
                                "(not judged)", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every series from the start: a rate over a missing series is no rate
            self.outcomes.labels(outcome)
        # requests the engine expired in a step (engine thread) -> when; read when their
        # Generation reports them, which may come before or after this server followed them
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._expired_lock = threading.Lock()
        self.prompt_tokens = Counter("prescient_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("prescient_cached_prompt_tokens",
                                            "prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("prescient_generation_tokens", "generated tokens by where they came from "
                                         "(target model, accepted draft, grammar-forced)", ["source"], registry=r)
        self.connections = Gauge("prescient_open_connections", "HTTP requests in flight + open WebSockets",
                                 registry=r)
        self.store_bytes = Gauge("prescient_response_store_bytes", "memory held by stored responses "
                                 "(previous_response_id), bounded by --response-store-mb", registry=r)
        self.store_entries = Gauge("prescient_response_store_entries", "stored responses", registry=r)
        r.register(SLOCollector(self.tracker, slo_window_s))
        if engine is not None:
            r.register(EngineCollector(engine))

    def watch_store(self, store) -> None:
        """Report `store`'s size (server/sessions.py ResponseStore) at every scrape."""
        self.store_bytes.set_function(lambda: store.nbytes)
        self.store_entries.set_function(lambda: len(store))

    def step_hook(self, engine, outputs, step_seconds: float) -> None:
        """For `AsyncEngine.step_hooks` (runs on the engine thread; prometheus_client is thread-safe).
        An "overloaded" output made in a step is a request that waited past the queue-wait limit
        (one refused because the queue filled never passes here): "expired", a miss."""
        if outputs:
            self.step.observe(step_seconds)
        steps = getattr(engine, "num_steps", None)
        if steps is not None and steps != self._phases_seen:  # each step's phases once
            self._phases_seen = steps
            for phase, seconds in engine.step_phases.items():
                self.step_phase.labels(phase).observe(seconds)
        for out in outputs:
            if out.finished and out.error_type == "overloaded":
                now = self.tracker.clock()
                with self._expired_lock:
                    self._expired[out.request_id] = now
                    while len(self._expired) > 4096:  # ids no Generation ever reported
                        self._expired.popitem(last=False)
                self._resolve(out.request_id, "expired", now)

    def on_submit(self, request_id: str, t: float, num_prompt_tokens: int) -> None:
        self.tracker.on_arrival(request_id, t, num_prompt_tokens=num_prompt_tokens)
        # the engine may have expired it before this call (its arrival stamp is the body's
        # last byte, so a slow compile can spend the queue-wait limit before submission)
        with self._expired_lock:
            t_expired = self._expired.get(request_id)
        if t_expired is not None:
            self._resolve(request_id, "expired", t_expired)

    def observe_output(self, request_id: str, num_tokens: int, t: float | None, sources: list[str]) -> None:
        """One engine output that carried `num_tokens` tokens, stamped `t` (engine clock)."""
        sample = self.tracker.on_emission(request_id, num_tokens, t, sources)
        if sample is not None:
            if sample.ttft_s is not None:
                self.ttft.observe(sample.ttft_s)
            else:
                self.itl_emission.observe(sample.itl_emission_s)
                for gap in sample.itl_token_s:
                    self.itl_token.observe(gap)
        for source in sources:
            self.generation_tokens.labels(source).inc()

    def observe_finish(self, request_id: str, reason: str, t: float | None, num_prompt_tokens: int,
                       num_cached_tokens: int, error_type: str | None = None) -> None:
        """The request finished at `t` (its last token's stamp; None: now) with `reason`; with
        reason "error", `error_type` says whose fault: "time_limit" (timed_out), "invalid_request"
        (invalid: not judged), "overloaded" (refused), anything else the server's (failed)."""
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)
        if reason == "error":
            outcome = {"time_limit": "timed_out", "invalid_request": "invalid",
                       "overloaded": self._overloaded(request_id)}.get(error_type, "failed")
        elif reason == "abort":  # stopped on the client's behalf (a shutdown arrives as "error")
            outcome = "cancelled"
        else:
            outcome = None  # judged on its latencies
        self._resolve(request_id, outcome, t)

    def observe_refusal(self, request_id: str, kind: str = "refused", t: float | None = None,
                        arrival_time: float | None = None) -> None:
        """The server did not serve the request: `kind` one of runtime/slo.py's MISS_OUTCOMES
        (judged a miss) or APART_OUTCOMES (counted, not judged). For a request already followed
        (`on_submit`), at `t` (None: now); for one refused before it was submitted (a 400 or a
        429 at `start()`, a time limit spent before it), pass its `arrival_time`: without it an
        unfollowed request is taken as already resolved, and is not counted twice. A "refused"
        request that the engine expired for its queue wait is counted "expired"."""
        if kind not in MISS_OUTCOMES and kind not in APART_OUTCOMES:
            raise ValueError(f"kind must be one of {MISS_OUTCOMES + APART_OUTCOMES}, got {kind!r}")
        if kind == "refused":
            kind = self._overloaded(request_id)
        if arrival_time is not None and not self.tracker.is_live(request_id):
            if kind in APART_OUTCOMES:  # never followed: nothing to judge, only to count
                self.outcomes.labels(kind).inc()
                return
            self.tracker.on_arrival(request_id, arrival_time)
        self._resolve(request_id, kind, t)

    def discard(self, request_id: str) -> None:
        """The request was abandoned before it finished (the client left, or its handler
        stopped reading it): "cancelled", not judged. After a refusal or a finish: nothing."""
        with self._expired_lock:
            expired = self._expired.pop(request_id, None)
        if expired is not None:  # its Generation raised for the expiry: a miss, not a cancel
            self._resolve(request_id, "expired", expired)
        self._resolve(request_id, "cancelled", None)

    def _overloaded(self, request_id: str) -> str:
        """An overload refusal's outcome: "expired" if the engine ended it for its queue wait."""
        with self._expired_lock:
            return "expired" if self._expired.pop(request_id, None) is not None else "refused"

    def _resolve(self, request_id: str, outcome: str | None, t: float | None) -> None:
        """End a followed request once: judged on its latencies (outcome None), judged a miss
        (MISS_OUTCOMES), or dropped unjudged (APART_OUTCOMES); counted by how it ended. The
        tracker pops the request under its lock, so of racing calls (engine thread, event loop)
        one counts it."""
        if outcome in APART_OUTCOMES:
            if self.tracker.discard(request_id):
                self.outcomes.labels(outcome).inc()
            return
        m = self.tracker.on_finish(request_id, t, outcome=outcome)
        if m is None:
            return
        self.outcomes.labels(m.outcome).inc()
        if m.tpot_s is not None:
            self.tpot.observe(m.tpot_s)
        if m.e2e_s is not None:
            self.e2e.observe(m.e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
