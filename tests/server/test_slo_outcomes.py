"""Honest SLO accounting in /metrics (issue 25, item 4): a request the server accepted and then
refused (overloaded), expired, timed out or failed is an SLO miss in attainment and goodput, while
a client's cancellation and a 4xx for invalid input are counted apart, never judged; each request
is counted in exactly one outcome; speculation exports grammar-forced tokens apart from drafts.

Policy only, on a fake clock: `ServerMetrics` fed directly, or by a `Generation` over a stand-in
engine (the server's own path from engine outputs to metrics)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prescient.runtime.engine import overloaded_output
from prescient.runtime.request import OverloadedError, RequestOutput
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.slo import CPU_INTERACTIVE
from prescient.server.errors import APIError
from prescient.server.generation import Generation
from prescient.server.metrics import EngineCollector, ServerMetrics
from prescient.speculative.speculator import SpecStats

# the outcomes /metrics counts (runtime/slo.py OUTCOMES), spelled out: they are the policy
OUTCOMES = ("met", "missed", "refused", "expired", "timed_out", "failed", "cancelled", "invalid", "rejected")
WINDOW_S = 60.0
SCRAPE_AFTER_S = 10.0  # the goodput span: the scrape's clock, past the tracker's start


class Clock:
    def __init__(self):
        self.t = time.perf_counter()  # Generation stamps arrivals with perf_counter

    def __call__(self) -> float:
        return self.t


class StandInEngine:
    """The `AsyncEngine` surface a `Generation` uses; the test puts the outputs on its queues.
    `on_submit(request_id)` runs inside submit, as the engine thread may before it returns."""

    def __init__(self, on_submit=None):
        self.queues: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []
        self.on_submit = on_submit

    def submit(self, prompt_ids, params, request_id, session_id, grammar, arrival_time=None):
        self.queues[request_id] = asyncio.Queue()
        if self.on_submit is not None:
            self.on_submit(request_id)
        return self.queues[request_id]

    def abort(self, request_id):
        self.aborted.append(request_id)


def token(rid: str, t: float, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput(rid, [7], "x", finished, reason, token_times=[t], token_sources=["target"],
                         num_prompt_tokens=3, num_output_tokens=1)


def served(metrics: ServerMetrics, rid: str, t0: float) -> None:
    """A request well within the SLO: first token after 50 ms, finished at 60 ms."""
    metrics.on_submit(rid, t0, 3)
    metrics.observe_output(rid, 1, t0 + 0.05, ["target"])
    metrics.observe_finish(rid, "stop", t0 + 0.06, 3, 0)


def scrape(metrics: ServerMetrics, clock: Clock, started: float) -> dict:
    clock.t = started + SCRAPE_AFTER_S
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def outcomes(got: dict) -> dict:
    counts = {o: got[("prescient_request_outcomes_total", (("outcome", o),))] for o in OUTCOMES}
    return {o: n for o, n in counts.items() if n}


def slo(got: dict) -> tuple:
    """(judged, met, attainment, goodput) as /metrics exports them."""
    return (got[("prescient_slo_requests_finished_total", ())], got[("prescient_slo_requests_met_total", ())],
            got[("prescient_slo_attainment_ratio", ())], got[("prescient_slo_goodput_requests_per_second", ())])


async def read(gen: Generation) -> APIError | None:
    """Read a started generation to its end -> the APIError it raised, or None."""
    try:
        async for _ in gen.events():
            pass
    except APIError as err:
        return err
    return None


@pytest.fixture
def setup():
    clock = Clock()
    return ServerMetrics(None, CPU_INTERACTIVE, WINDOW_S, clock=clock), clock, clock.t


def test_a_refused_request_is_a_miss(setup):
    metrics, clock, t0 = setup
    served(metrics, "ok", t0)
    metrics.on_submit("shed", t0, 3)  # accepted, then the queue filled: refused
    metrics.observe_refusal("shed", "refused", t=t0 + 0.01)
    got = scrape(metrics, clock, t0)
    assert slo(got) == (2, 1, 0.5, pytest.approx(1 / SCRAPE_AFTER_S))
    assert outcomes(got) == {"met": 1, "refused": 1}


@pytest.mark.parametrize("before_submit", [False, True], ids=["expired-queued", "expired-before-on_submit"])
def test_a_request_expired_in_the_queue_is_a_miss_through_a_generation(setup, before_submit):
    """The engine's "overloaded" output for a queue wait past its limit passes the step hook:
    the Generation raises the 429 (and discards) and the request still counts, as "expired",
    whether the engine expired it before or after the Generation's on_submit."""
    metrics, clock, t0 = setup
    served(metrics, "ok", t0)
    expiry = lambda rid: overloaded_output(rid, OverloadedError("waited too long", 2.0), 3)  # noqa: E731
    hook = lambda rid: metrics.step_hook(None, [expiry(rid)], 0.001)  # noqa: E731
    engine = StandInEngine(on_submit=hook if before_submit else None)
    gen = Generation(engine, [1, 2, 3], SamplingParams(max_tokens=8), request_id="late", metrics=metrics)

    async def serve():
        gen.start()
        if not before_submit:
            hook("late")  # the engine thread: hooks run before the output reaches the queue
        engine.queues["late"].put_nowait(expiry("late"))
        return await read(gen)

    err = asyncio.run(serve())
    assert err is not None and err.status == 429
    got = scrape(metrics, clock, t0)
    assert slo(got) == (2, 1, 0.5, pytest.approx(1 / SCRAPE_AFTER_S))
    assert outcomes(got) == {"met": 1, "expired": 1}  # not "cancelled", though the Generation discarded it


def test_timed_out_and_failed_requests_are_misses_however_fast_their_tokens(setup):
    metrics, clock, t0 = setup
    # past the time limit after a first token in 50 ms (no E2E bound: it met every objective)
    metrics.on_submit("slow", t0, 3)
    metrics.observe_output("slow", 1, t0 + 0.05, ["target"])
    metrics.observe_finish("slow", "error", None, 3, 0, error_type="time_limit")
    # an engine error after a fast first token, through a Generation
    engine = StandInEngine()
    gen = Generation(engine, [1, 2, 3], SamplingParams(max_tokens=8), request_id="broken", metrics=metrics)

    async def serve():
        gen.start()
        engine.queues["broken"].put_nowait(token("broken", gen.t_submit + 0.05))
        engine.queues["broken"].put_nowait(RequestOutput("broken", [], "", True, "error", error="engine error"))
        await read(gen)

    asyncio.run(serve())
    assert gen.finished.reason == "error"
    got = scrape(metrics, clock, t0)
    assert slo(got) == (2, 0, 0.0, 0.0)
    assert outcomes(got) == {"timed_out": 1, "failed": 1}
    assert got[("prescient_slo_objective_met_total", (("objective", "ttft"),))] == 2  # measured, not faked


def test_cancellations_and_invalid_input_are_counted_apart(setup):
    metrics, clock, t0 = setup
    served(metrics, "ok", t0)
    # the client leaves after a token that came late (a miss, had it been judged)
    engine = StandInEngine()
    gen = Generation(engine, [1, 2, 3], SamplingParams(max_tokens=8), request_id="left", metrics=metrics)

    async def leave():
        gen.start()
        engine.queues["left"].put_nowait(token("left", gen.t_submit + 5.0))
        events = gen.events()
        await events.__anext__()
        await events.aclose()  # what a disconnect does to the handler's loop

    asyncio.run(leave())
    assert engine.aborted == ["left"]
    # the engine ended one for its own input (a grammar that admits no token): a 400
    metrics.on_submit("bad", t0, 3)
    metrics.observe_finish("bad", "error", None, 3, 0, error_type="invalid_request")
    # refused at start(), never submitted: a 400, a 429 at admission
    metrics.observe_refusal("bad-400", "invalid", arrival_time=t0)
    metrics.observe_refusal("full-429", "rejected", arrival_time=t0)
    got = scrape(metrics, clock, t0)
    assert slo(got) == (1, 1, 1.0, pytest.approx(1 / SCRAPE_AFTER_S))
    assert outcomes(got) == {"met": 1, "cancelled": 1, "invalid": 2, "rejected": 1}


def test_each_request_is_counted_once(setup):
    metrics, clock, t0 = setup
    metrics.on_submit("q", t0, 3)
    metrics.step_hook(None, [overloaded_output("q", OverloadedError("waited", 1.0), 3)], 0.001)
    metrics.observe_refusal("q", "refused")  # what its Generation may say too, then discard
    metrics.discard("q")
    metrics.on_submit("done", t0, 3)
    metrics.observe_finish("done", "stop", t0 + 0.05, 3, 0)
    metrics.discard("done")
    # a time limit spent before submission (a slow compile): judged from its arrival
    metrics.observe_refusal("compile", "timed_out", t=t0 + 12.0, arrival_time=t0)
    got = scrape(metrics, clock, t0)
    assert outcomes(got) == {"expired": 1, "missed": 1, "timed_out": 1}  # "done": no token, a miss
    assert slo(got)[:2] == (3, 0)
    with pytest.raises(ValueError):
        metrics.observe_refusal("q", "met")


def test_forced_tokens_are_exported_apart_from_drafts():
    stats = SpecStats(num_steps=2, num_draft_tokens=4, num_accepted_tokens=1, num_emitted_tokens=3,
                      num_forced_tokens_proposed=6, num_forced_tokens_accepted=6)
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(running=[], waiting=[]), sessions={}, speculator=SimpleNamespace(stats=stats),
        block_manager=SimpleNamespace(usage=lambda: 0.0, stats=SimpleNamespace(hit_rate=0.0, queries=0, hits=0)),
        grammar_step=SimpleNamespace(stats=SimpleNamespace(mask_seconds=0.0, num_masked_rows=0)))
    got = {s.name: s.value for family in EngineCollector(engine).collect() for s in family.samples}
    assert got["prescient_spec_acceptance_rate"] == 0.25
    assert got["prescient_spec_accepted_tokens_total"] == 1 and got["prescient_spec_draft_tokens_total"] == 4
    assert got["prescient_spec_forced_tokens_accepted_total"] == 6
    assert got["prescient_spec_forced_tokens_proposed_total"] == 6
