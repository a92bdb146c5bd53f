"""SLO arithmetic on a fake clock: queue time, TTFT, per-emission and per-token ITL (with
multi-token emissions), TPOT, E2E, accepted length, SLO checks (the ITL bound on the per-emission
gap), attainment and goodput, live (windowed) and over a report's requests."""

from __future__ import annotations

import pytest

from prescient.runtime.request import RequestOutput
from prescient.runtime.slo import (
    CPU_INTERACTIVE, GPU_INTERACTIVE, RequestTrace, SLOConfig, SLOTracker, delivery, percentile, request_metrics,
)


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


def out(rid: str, n: int, finished: bool = False, times=None) -> RequestOutput:
    return RequestOutput(rid, list(range(n)), "", finished, "stop" if finished else None,
                         token_times=list(times or []), token_sources=["target"] * n)


def test_percentile_is_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([0, 10], 90) == pytest.approx(9.0)


def test_single_token_emissions():
    clock = FakeClock()
    tr = SLOTracker(SLOConfig(ttft_s=0.2, itl_emission_p99_s=0.025), clock=clock)
    tr.on_arrival("a")                      # t = 100.000
    clock.advance(0.050)
    tr.on_scheduled("a")                    # queued 50 ms
    clock.advance(0.100)
    tr.on_output(out("a", 1))               # TTFT 150 ms
    for _ in range(3):
        clock.advance(0.020)
        tr.on_output(out("a", 1))
    clock.advance(0.020)
    m = tr.on_output(out("a", 1, finished=True))
    assert m.num_output_tokens == 5 and m.num_emissions == 5
    assert m.queue_s == pytest.approx(0.050)
    assert m.ttft_s == pytest.approx(0.150)
    assert m.e2e_s == pytest.approx(0.230)
    assert m.tpot_s == pytest.approx(0.080 / 4)
    assert m.itl_emission_s == pytest.approx((0.02,) * 4)
    assert m.itl_token_s == pytest.approx((0.02,) * 4)
    assert m.mean_accepted_len == 1.0
    assert m.decode_tok_s == pytest.approx(4 / 0.080)
    assert m.slo_met == {"ttft": True, "itl_emission": True} and m.met_all


def test_multi_token_emissions_split_per_token_itl():
    """An emission of 4 tokens after 40 ms is one 40 ms stall but four 10 ms tokens; the SLO
    judges the stall."""
    clock = FakeClock(0.0)
    tr = SLOTracker(SLOConfig(ttft_s=0.2, itl_emission_p99_s=0.025), clock=clock)
    tr.on_arrival("s")
    clock.advance(0.100)
    first = tr.on_emission("s", 1)   # t=0.10 first token
    assert first.ttft_s == pytest.approx(0.100) and first.itl_emission_s is None and first.itl_token_s == ()
    clock.advance(0.040)
    burst = tr.on_emission("s", 4)   # t=0.14: 3 accepted drafts + bonus
    assert burst.ttft_s is None and burst.itl_emission_s == pytest.approx(0.040)
    assert burst.itl_token_s == pytest.approx((0.010,) * 4)
    clock.advance(0.030)
    tr.on_output(out("s", 2))        # t=0.17
    clock.advance(0.015)
    m = tr.on_output(out("s", 1, finished=True))  # t=0.185
    assert m.num_output_tokens == 8 and m.num_emissions == 4
    assert m.itl_emission_s == pytest.approx((0.040, 0.030, 0.015))
    assert m.itl_token_s == pytest.approx((0.010,) * 4 + (0.015,) * 2 + (0.015,))
    assert m.decode_tokens_per_emission == (4, 2, 1)
    assert m.mean_accepted_len == pytest.approx(7 / 3)
    assert m.tpot_s == pytest.approx((0.185 - 0.100) / 7)
    # the 40 ms stall breaks a 25 ms bound, though the per-token split (p99 15 ms) would not
    assert m.itl_emission_p99_s == pytest.approx(0.030 + 0.98 * 0.010)  # sorted gaps 15, 30, 40 ms
    assert percentile(m.itl_token_s, 99) == pytest.approx(0.015)
    assert m.slo_met == {"ttft": True, "itl_emission": False} and not m.met_all
    # the live samples are the report's: one `delivery` per emission either way
    trace = tr.finished()[0][0]
    assert [e.itl_emission_s for e in trace.emissions()[1:]] == list(m.itl_emission_s)
    assert delivery(0.0, 0.14, 0.17, 2).itl_token_s == pytest.approx((0.015, 0.015))


def test_engine_stamps_win_over_the_clock():
    clock = FakeClock(50.0)
    tr = SLOTracker(GPU_INTERACTIVE, clock=clock)
    tr.on_arrival("x", t=10.0)
    tr.on_output(out("x", 1, times=[10.1]))
    m = tr.on_output(out("x", 3, finished=True, times=[10.13] * 3))
    assert m.ttft_s == pytest.approx(0.1)
    assert m.e2e_s == pytest.approx(0.13)
    assert m.itl_token_s == pytest.approx((0.01,) * 3)


def test_slo_misses_attainment_and_goodput():
    clock = FakeClock(0.0)
    tr = SLOTracker(SLOConfig(ttft_s=0.2, itl_emission_p99_s=0.025, e2e_s=1.0), clock=clock)
    # r1: meets everything; r2: TTFT 300 ms; r3: a 50 ms stall among 1-token emissions; r4: slow E2E
    plans = {"r1": (0.1, [0.02] * 5), "r2": (0.3, [0.02] * 5), "r3": (0.1, [0.02, 0.05, 0.02]),
             "r4": (0.1, [0.02] * 60)}
    for rid, (ttft, gaps) in plans.items():
        t0 = clock.t
        tr.on_arrival(rid, t=t0)
        t = t0 + ttft
        tr.on_output(out(rid, 1, times=[t]))
        for i, g in enumerate(gaps):
            t += g
            tr.on_output(out(rid, 1, finished=i == len(gaps) - 1, times=[t]))
        clock.t = t
    ms = {m.request_id: m for _, m in tr.finished()}
    assert ms["r1"].met_all
    assert ms["r2"].slo_met == {"ttft": False, "itl_emission": True, "e2e": True}
    assert ms["r3"].slo_met["itl_emission"] is False
    assert ms["r4"].slo_met["e2e"] is False and ms["r4"].slo_met["itl_emission"] is True
    s = tr.summary()
    span = clock.t  # first arrival at 0, last finish now
    assert s["num_requests"] == 4
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["slo_attainment_by_slo"] == pytest.approx({"ttft": 0.75, "itl_emission": 0.75, "e2e": 0.75})
    assert s["goodput_rps"] == pytest.approx(1 / span)
    assert s["throughput_rps"] == pytest.approx(4 / span)
    assert s["ttft_s"]["p50"] == pytest.approx(0.1)
    assert s["itl_emission_s"]["p99"] <= 0.05
    assert (tr.num_finished_total, tr.num_met_total) == (4, 1)
    assert tr.num_met_by_slo_total == {"ttft": 3, "itl_emission": 3, "e2e": 3}
    # live, over a window holding every request: the same verdicts, over the window's seconds
    live = tr.live(window_s=10 * span)
    assert live["slo_attainment"] == pytest.approx(0.25) and live["duration_s"] == pytest.approx(span)
    assert live["goodput_rps"] == pytest.approx(1 / span)
    assert live["slo_attainment_by_slo"] == s["slo_attainment_by_slo"]


def test_windowed_summary_uses_the_window_as_duration():
    clock = FakeClock(0.0)
    tr = SLOTracker(GPU_INTERACTIVE, clock=clock)
    for i in range(3):
        tr.on_arrival(f"q{i}")
        clock.advance(0.05)
        tr.on_output(out(f"q{i}", 1, finished=True))
        clock.advance(10.0)
    s = tr.summary(window_s=15.0)  # only the last request finished within 15 s
    assert s["num_requests"] == 1 and s["goodput_rps"] == pytest.approx(1 / 15.0)
    live = tr.live(window_s=15.0)
    assert live["num_requests"] == 1 and live["goodput_rps"] == pytest.approx(1 / 15.0)
    # a window longer than the tracker's life is cut to it
    assert tr.live(window_s=1000.0)["duration_s"] == pytest.approx(clock.t)


def test_verdicts_only_tracker_and_discard():
    """A server's tracker keeps verdicts, not traces; an abandoned request is never judged."""
    clock = FakeClock(0.0)
    tr = SLOTracker(CPU_INTERACTIVE, clock=clock, keep_traces=False)
    tr.on_arrival("kept")
    tr.on_arrival("gone")
    clock.advance(0.1)
    tr.on_emission("gone", 1)
    tr.discard("gone")
    assert tr.on_emission("gone", 1) is None and tr.on_finish("gone") is None
    m = tr.on_output(out("kept", 1, finished=True))
    assert m.met_all and tr.finished() == [] and tr.num_live == 0
    assert tr.live(window_s=60.0)["num_met"] == 1 and tr.num_finished_total == 1


def test_trace_from_engine_request_groups_equal_stamps():
    class Req:  # the fields of runtime.request.Request the tracker reads
        request_id, arrival_time, first_scheduled_time, finished_time = "e", 1.0, 1.01, 1.5
        prompt_token_ids, num_cached_tokens = [1, 2, 3], 0
        token_times = [1.2, 1.25, 1.25, 1.25, 1.3, 1.5, 1.5]
        token_sources = ["target", "draft", "draft", "target", "target", "draft", "target"]
        num_draft_tokens, num_accepted_tokens = 8, 3

    trace = RequestTrace.from_request(Req(), mode="m")
    assert trace.emission_tokens == [1, 3, 1, 2] and trace.tags == {"mode": "m"}
    m = request_metrics(trace, CPU_INTERACTIVE)
    assert m.queue_s == pytest.approx(0.01) and m.ttft_s == pytest.approx(0.2)
    assert m.decode_tokens_per_emission == (3, 1, 2) and m.mean_accepted_len == pytest.approx(2.0)
    assert m.tpot_s == pytest.approx(0.3 / 6)


def test_bad_config_and_empty_requests():
    with pytest.raises(ValueError, match="itl_emission_p99_s"):
        SLOConfig(itl_emission_p99_s=-1.0)
    with pytest.raises(ValueError, match="ttft_s"):
        SLOConfig(ttft_s=0)
    m = request_metrics(RequestTrace("z", 0.0, finished_time=1.0), GPU_INTERACTIVE)
    assert m.ttft_s is None and not m.met_all and m.tpot_s is None


def test_a_request_the_server_did_not_serve_is_a_miss():
    """on_finish(outcome=...): judged a miss whatever its latencies; discard: not judged."""
    clock = FakeClock(0.0)
    tr = SLOTracker(CPU_INTERACTIVE, clock=clock, keep_traces=False)
    for rid in ("served", "timed_out", "shed", "left"):
        tr.on_arrival(rid)
    clock.advance(0.05)
    tr.on_emission("timed_out", 1)  # a first token in time, then past the time limit
    assert tr.on_output(out("served", 1, finished=True)).outcome == "met"
    m = tr.on_finish("timed_out", outcome="timed_out")
    assert not m.met_all and m.outcome == "timed_out" and m.slo_met["ttft"]  # measured, not faked
    assert tr.on_finish("shed", outcome="refused").outcome == "refused"
    assert tr.discard("left") and not tr.discard("left")
    live = tr.live(window_s=60.0)
    assert live["num_requests"] == 3 and live["num_met"] == 1 and live["slo_attainment"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        tr.on_finish("x", outcome="cancelled")  # not a miss: discard it
