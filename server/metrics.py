"""Prometheus metrics for `GET /metrics`, on a registry of the app's own.

Per-request latencies are observed by the server from the engine's per-token times
(`RequestOutput.token_times`, the engine's `perf_counter` clock, the same clock the server reads
at submission): TTFT = first token - submission, ITL = gap between consecutive tokens (0 for the
tokens of one speculative step: they arrive together), TPOT = (last - first) / (tokens - 1),
E2E = finish - submission. Buckets start at 1 ms. Engine state (running / waiting requests, KV
usage, prefix-cache hit rate, pinned sessions, speculation acceptance, grammar mask time) is read
from the engine's own counters when scraped; the step time comes from `AsyncEngine.step_hooks`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
            for name, doc, value in (("draft_tokens", "draft tokens proposed and verified", spec.num_draft_tokens),
                                     ("accepted_tokens", "draft tokens accepted", spec.num_accepted_tokens)):
                family = CounterMetricFamily(f"prescient_spec_{name}", doc)
                family.add_metric([], value)
                yield family
            yield GaugeMetricFamily("prescient_spec_acceptance_rate", "accepted / proposed draft tokens",
                                    value=spec.acceptance_rate)
            yield GaugeMetricFamily("prescient_spec_mean_accepted_length", "tokens per speculative step, bonus "
                                    "included", value=spec.mean_accepted_length)
        grammar = e.grammar_step.stats
        mask = CounterMetricFamily("prescient_grammar_mask_seconds", "time spent filling and applying grammar masks")
        mask.add_metric([], grammar.mask_seconds)
        yield mask
        rows = CounterMetricFamily("prescient_grammar_masked_rows", "logits rows masked by a grammar")
        rows.add_metric([], grammar.num_masked_rows)
        yield rows


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("prescient_time_to_first_token_seconds", "submission to first token")
        self.itl = hist("prescient_inter_token_latency_seconds", "gap between consecutive tokens of a request")
        self.tpot = hist("prescient_time_per_output_token_seconds", "(last - first token time) / (tokens - 1)")
        self.e2e = hist("prescient_e2e_request_latency_seconds", "submission to finish")
        self.step = hist("prescient_engine_step_seconds", "one engine step")
        self.grammar_compile = hist("prescient_grammar_compile_seconds",
                                    "time a constrained request waited for its grammar (cache hits ~0)")
        self.requests = Counter("prescient_requests", "finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("prescient_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("prescient_cached_prompt_tokens",
                                            "prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("prescient_generation_tokens", "generated tokens by where they came from "
                                         "(target model, accepted draft, grammar-forced)", ["source"], registry=r)
        self.connections = Gauge("prescient_open_connections", "HTTP requests in flight + open WebSockets",
                                 registry=r)
        r.register(EngineCollector(engine))

    def step_hook(self, engine, outputs, step_seconds: float) -> None:
        """For `AsyncEngine.step_hooks` (runs on the engine thread; prometheus_client is thread-safe)."""
        if outputs:
            self.step.observe(step_seconds)

    def observe_tokens(self, gaps: list[float], sources: list[str]) -> None:
        for gap in gaps:
            self.itl.observe(gap)
        for source in sources:
            self.generation_tokens.labels(source).inc()

    def observe_finish(self, reason: str, e2e: float, tpot: float | None, num_prompt_tokens: int,
                       num_cached_tokens: int) -> None:
        self.requests.labels(reason).inc()
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
