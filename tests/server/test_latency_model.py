"""One latency model: the same engine token stamps, a speculative step delivering 3 tokens at once
among single-token steps, fed to the server's /metrics path (a `Generation` over a stand-in
engine, feeding `ServerMetrics`) and to the report paths (`RequestTrace.from_request` +
`request_metrics` + `summarize` as latency_bench/analysis.py runs them, and an `SLOTracker` fed
`RequestOutput`s as latency_bench/load_client.py does) give the same TTFT, ITL per emission and
per token, TPOT, E2E, SLO verdicts, attainment and goodput."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prescient.runtime.request import RequestOutput
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.slo import CPU_INTERACTIVE, RequestTrace, SLOTracker, request_metrics, summarize
from prescient.server.generation import Generation
from prescient.server.metrics import LATENCY_BUCKETS, ServerMetrics

# per request: (offset from arrival s, tokens) per engine output; the last output finishes it
PLANS = {
    # TTFT 100 ms, then a speculative step of 3 tokens after 40 ms, then single tokens every 20 ms
    "spec": [(0.100, 1), (0.140, 3), (0.160, 1), (0.180, 1), (0.200, 1)],
    # a 250 ms stall: misses the 100 ms per-emission bound (as the per-token split would too)
    "stall": [(0.050, 1), (0.300, 1), (0.320, 1)],
    # a 4-token step after 120 ms: 30 ms per token, but the reader waited 120 ms, so it misses
    "burst": [(0.080, 1), (0.200, 4), (0.220, 1)],
}
WINDOW_S = 60.0
SCRAPE_AFTER_S = 10.0  # the scrape's clock, past the tracker's start: the goodput span


class StandInEngine:
    """The `AsyncEngine` surface a `Generation` uses; outputs are put on its queues by the test."""

    def __init__(self):
        self.queues: dict[str, asyncio.Queue] = {}

    def submit(self, prompt_ids, params, request_id, session_id, grammar, arrival_time=None):
        self.queues[request_id] = asyncio.Queue()
        return self.queues[request_id]

    def abort(self, request_id):
        raise AssertionError("no request is left early here")


def outputs(rid: str, arrival: float) -> list[RequestOutput]:
    plan = PLANS[rid]
    return [RequestOutput(rid, list(range(k)), "", i == len(plan) - 1, "stop" if i == len(plan) - 1 else None,
                          token_times=[arrival + offset] * k,
                          token_sources=["target"] if k == 1 else ["draft"] * (k - 1) + ["target"],
                          num_prompt_tokens=3, num_output_tokens=sum(n for _, n in plan[:i + 1]))
            for i, (offset, k) in enumerate(plan)]


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_and_reports_compute_the_same_latencies():
    now = [time.perf_counter()]
    metrics = ServerMetrics(None, CPU_INTERACTIVE, WINDOW_S, clock=lambda: now[0])
    started = now[0]
    engine = StandInEngine()
    load_tracker = SLOTracker(CPU_INTERACTIVE)
    traces = []

    async def serve(rid: str) -> None:
        gen = Generation(engine, [1, 2, 3], SamplingParams(max_tokens=16), request_id=rid, metrics=metrics)
        gen.start()
        load_tracker.on_arrival(rid, gen.t_submit)
        outs = outputs(rid, gen.t_submit)
        for out in outs:
            engine.queues[rid].put_nowait(out)
            load_tracker.on_output(out)
        async for _ in gen.events():
            pass
        assert gen.finished.reason == "stop"
        # the engine's own record of the same request, as a batch-1 report reads it
        stamps = [t for out in outs for t in out.token_times]
        traces.append(RequestTrace.from_request(SimpleNamespace(
            request_id=rid, arrival_time=gen.t_submit, first_scheduled_time=None, finished_time=stamps[-1],
            prompt_token_ids=[1, 2, 3], num_cached_tokens=0, token_times=stamps,
            token_sources=[s for out in outs for s in out.token_sources])))

    async def main():
        for rid in PLANS:
            await serve(rid)

    asyncio.run(main())
    report = [request_metrics(t, CPU_INTERACTIVE) for t in traces]
    by_id = {m.request_id: m for m in report}
    assert by_id["spec"].itl_emission_s == pytest.approx((0.040, 0.020, 0.020, 0.020))
    assert by_id["spec"].itl_token_s == pytest.approx((0.040 / 3,) * 3 + (0.020,) * 3)
    assert [by_id[r].met_all for r in PLANS] == [True, False, False]
    assert by_id["burst"].slo_met == {"ttft": True, "itl_emission": False}
    assert max(by_id["burst"].itl_token_s) < CPU_INTERACTIVE.itl_emission_p99_s  # the split would flatter it

    now[0] = started + SCRAPE_AFTER_S
    got = samples(metrics.render().decode())
    summary = summarize(report, CPU_INTERACTIVE, duration_s=SCRAPE_AFTER_S)

    # every histogram holds exactly the report's samples: count, sum and each bucket
    for name, values in (
            ("prescient_time_to_first_token_seconds", [m.ttft_s for m in report]),
            ("prescient_itl_emission_seconds", [x for m in report for x in m.itl_emission_s]),
            ("prescient_itl_token_seconds", [x for m in report for x in m.itl_token_s]),
            ("prescient_time_per_output_token_seconds", [m.tpot_s for m in report]),
            ("prescient_e2e_request_latency_seconds", [m.e2e_s for m in report])):
        assert got[(f"{name}_count", ())] == len(values), name
        assert got[(f"{name}_sum", ())] == pytest.approx(sum(values), abs=1e-12), name
        for bound in LATENCY_BUCKETS:
            assert got[(f"{name}_bucket", (("le", str(bound)),))] == sum(v <= bound for v in values), (name, bound)
    assert summary["itl_emission_s"]["count"] == 4 + 2 + 2 and summary["itl_token_s"]["count"] == 6 + 2 + 5

    # the SLO verdicts: counters, attainment and goodput as the report computes them
    assert got[("prescient_slo_requests_finished_total", ())] == summary["num_requests"] == 3
    assert got[("prescient_slo_requests_met_total", ())] == 1
    assert got[("prescient_slo_attainment_ratio", ())] == pytest.approx(summary["slo_attainment"])
    assert got[("prescient_slo_goodput_requests_per_second", ())] == pytest.approx(summary["goodput_rps"])
    assert got[("prescient_slo_window_seconds", ())] == pytest.approx(SCRAPE_AFTER_S)
    for name, share in summary["slo_attainment_by_slo"].items():
        assert got[("prescient_slo_objective_met_total", (("objective", name),))] == pytest.approx(3 * share)
    assert got[("prescient_generation_tokens_total", (("source", "draft"),))] == 2 + 3

    # the load clients' tracker, fed the same outputs, reports the same figures
    load = load_tracker.summary()
    for key in ("ttft_s", "itl_emission_s", "itl_token_s", "tpot_s", "e2e_s"):
        assert load[key] == pytest.approx(summary[key]), key
    assert load["slo_attainment"] == summary["slo_attainment"]
    assert load["slo_attainment_by_slo"] == summary["slo_attainment_by_slo"]


def test_metrics_break_each_step_down_by_phase(make_tiny_server):
    """/metrics says where step time goes (schedule, draft, mask, forward, sample, commit)."""
    import http.client
    import json as _json

    server = make_tiny_server()
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=_json.dumps(
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}),
        headers={"content-type": "application/json"})
    assert conn.getresponse().read()
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for phase in ("schedule", "draft", "mask", "forward", "sample", "commit"):
        line = next(l for l in text.splitlines() if l.startswith(f'prescient_step_phase_seconds_count{{phase="{phase}"}}'))
        assert float(line.split()[-1]) >= 1, line
