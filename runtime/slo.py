"""The one latency model: per-request latencies, SLO checks, attainment and goodput, on one clock.

Both consumers run this module's code, so their figures are the same numbers: the server's
/metrics (server/metrics.py feeds every engine output into an `SLOTracker` and exports the
samples it returns, its counters and its windowed attainment / goodput) and latency_bench's
reports (`request_metrics` + `summarize` over traces, or an `SLOTracker` in the load clients).
The clock is `time.perf_counter`: the engine stamps `Request`/`RequestOutput` times with it.

A request is a trace of *emissions* (deliveries): one emission is what one engine output for the
request (or one wire frame) delivered, and with speculation it carries several accepted tokens at
once. Emissions that carried no token (text-only or empty frames) are not emissions. For a
request that arrived at `a` and got emissions at t_0 < ... < t_{m-1} carrying k_i >= 1 tokens
(n = sum k_i), finishing at `f` (the engine's finish stamp, else the last emission):

- queue time = first scheduled - a (None when the caller cannot see scheduling)
- TTFT = t_0 - a
- ITL per emission (`itl_emission_s`): g_i = t_i - t_{i-1} for i >= 1, one sample per emission
  after the first: the stall a reader sees between deliveries
- ITL per token (`itl_token_s`): each g_i split evenly over the k_i tokens it carried, k_i
  samples of g_i / k_i (the streaming rate); the first emission's tokens are covered by TTFT
- TPOT = (E2E - TTFT) / (n - 1), E2E = f - a
- accepted length = k_i for i >= 1; 1.0 for plain decoding, 1 + accepted drafts with
  speculation (the bonus token included)

`delivery` computes one emission's samples; `request_metrics` runs it over a finished trace and
`SLOTracker.on_emission` runs it live, so the two cannot disagree.

SLO (`SLOConfig`; a bound of None switches that objective off). A request meets the SLO when it
delivered at least one token and meets every objective that is on:

- "ttft": TTFT <= `ttft_s`
- "itl_emission": the p99 (linear interpolation) of the request's own per-emission gaps <=
  `itl_emission_p99_s`; met trivially with fewer than two emissions (no gap). With fewer than
  100 gaps this p99 lies within 1% of the way from the second-largest gap to the largest, i.e.
  about the worst stall; a long request may have 1% of its gaps above the bound. The bound is
  on the per-emission gap, never the per-token split: splitting a 3-token step's 60 ms into
  three 20 ms tokens would flatter speculation, while the reader still waited 60 ms.
- "tpot": TPOT <= `tpot_s` (the average reading speed; met trivially with one token)
- "e2e": E2E <= `e2e_s`

Outcomes (`OUTCOMES`, each judged request's `RequestMetrics.outcome`). A request that finished
is "met" or "missed" by the rules above. A request the server accepted and then did not serve is
a miss whatever its latencies were (`MISS_OUTCOMES`, `SLOTracker.on_finish(..., outcome=...)`):
"refused" (overloaded: the queue filled after it was accepted), "expired" (it waited past the
queue-wait limit without starting), "timed_out" (past the request time limit), "failed" (an
engine error, a shutdown). Counting those as misses is what keeps attainment and goodput honest
under overload: shedding load must not raise attainment. `APART_OUTCOMES` are not judged at all
(`SLOTracker.discard`): "cancelled" (the client aborted or disconnected: its latency is not the
server's to answer for), "invalid" (refused for its own input: a 4xx), "rejected" (refused at
admission, before it was accepted; a 429 the client retries).

Attainment = SLO-meeting requests / judged requests. Goodput = SLO-meeting requests per second
of the measured span (DistServe's definition): a report's span is first arrival to last finish
(or the busy time it names); live, the span is the last `window_s` seconds (or the time since the
tracker started, if shorter), counting the requests that finished (or missed) in it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

CLOCK: Callable[[], float] = time.perf_counter

# The objectives a request is judged on, in `RequestMetrics.slo_met` and the reports' keys.
OBJECTIVES = ("ttft", "itl_emission", "tpot", "e2e")
# How a request ended (the module docstring): judged ones first, the misses the server caused,
# then the ones not judged.
MISS_OUTCOMES = ("refused", "expired", "timed_out", "failed")
APART_OUTCOMES = ("cancelled", "invalid", "rejected")
OUTCOMES = ("met", "missed", *MISS_OUTCOMES, *APART_OUTCOMES)


@dataclass(frozen=True)
class SLOConfig:
    """Latency objectives in seconds; None switches one off. The ITL bound applies to the p99 of a
    request's per-emission gaps (see the module docstring for why not the per-token split)."""

    name: str = "gpu-interactive"
    ttft_s: float | None = 0.200
    itl_emission_p99_s: float | None = 0.025
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for key in ("ttft_s", "itl_emission_p99_s", "tpot_s", "e2e_s"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ValueError(f"{key} must be > 0 or None, got {v!r}")

    def bounds(self) -> dict[str, float]:
        """{objective: bound seconds} for the objectives that are on."""
        keys = dict(zip(OBJECTIVES, ("ttft_s", "itl_emission_p99_s", "tpot_s", "e2e_s")))
        return {name: getattr(self, key) for name, key in keys.items() if getattr(self, key) is not None}

    def to_dict(self) -> dict:
        return asdict(self)


# The defaults for an interactive agent on a GPU: a speculative verify step costs about
# what a plain step does there (memory-bound), so 25 ms per emission is the per-token target too.
GPU_INTERACTIVE = SLOConfig()
# A 2-core CPU serving SmolLM2-135M (see docs/bench_example): a ~900-token long_edit prompt takes
# most of a second to prefill, batch-1 per-emission gaps are 12-31 ms (speculative verify steps
# the longest) and 16 concurrent streams push them towards 100 ms, so a user-facing bound that a
# long prompt and a few concurrent agents can meet is 1 s TTFT and 100 ms per-emission ITL p99.
# latency_bench reports against these on CPU and says so in every report; the server's defaults
# (server/context.py) are the same figures.
CPU_INTERACTIVE = SLOConfig(name="cpu-interactive", ttft_s=1.0, itl_emission_p99_s=0.100)

PRESETS = {"gpu-interactive": GPU_INTERACTIVE, "cpu-interactive": CPU_INTERACTIVE}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict:
    """{count, mean, p50, p90, p99, max}: the shape every latency figure is reported in."""
    vals = [v for v in values if v is not None]
    return {
        "count": len(vals),
        "mean": sum(vals) / len(vals) if vals else None,
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
        "max": max(vals) if vals else None,
    }


@dataclass(frozen=True)
class Emission:
    """One delivery's latency samples: TTFT for a request's first emission, else its ITL gap."""

    num_tokens: int
    ttft_s: float | None  # the first emission only
    itl_emission_s: float | None  # later emissions: the gap since the previous one

    @property
    def itl_token_s(self) -> tuple[float, ...]:
        """The gap split evenly over the tokens it carried (empty for the first emission)."""
        if self.itl_emission_s is None:
            return ()
        return (self.itl_emission_s / self.num_tokens,) * self.num_tokens


def delivery(arrival_time: float, previous_time: float | None, t: float, num_tokens: int) -> Emission:
    """The samples of an emission at `t` carrying `num_tokens` (>= 1), after one at `previous_time`
    (None: this is the request's first). The only place either ITL basis is computed."""
    if previous_time is None:
        return Emission(num_tokens, t - arrival_time, None)
    return Emission(num_tokens, None, t - previous_time)


@dataclass
class RequestTrace:
    """The raw timeline of one request (engine clock seconds)."""

    request_id: str
    arrival_time: float
    first_scheduled_time: float | None = None
    emission_times: list[float] = field(default_factory=list)
    emission_tokens: list[int] = field(default_factory=list)  # tokens carried by each emission
    token_sources: list[str] = field(default_factory=list)  # target / draft / forced, per token
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # engine speculation counters when the caller has them (in-process); 0 otherwise
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    tags: dict = field(default_factory=dict)  # mode, workload, session... (reporting only)

    def add_emission(self, t: float, num_tokens: int, sources: Iterable[str] = ()) -> Emission | None:
        if num_tokens <= 0:
            return None  # a text-only or empty frame carries no token timing
        sample = delivery(self.arrival_time, self.emission_times[-1] if self.emission_times else None, t,
                          num_tokens)
        self.emission_times.append(t)
        self.emission_tokens.append(num_tokens)
        self.token_sources.extend(sources)
        return sample

    def emissions(self) -> list[Emission]:
        """Every emission's samples, by `delivery` (what a live tracker returned one by one)."""
        out, previous = [], None
        for t, k in zip(self.emission_times, self.emission_tokens):
            out.append(delivery(self.arrival_time, previous, t, k))
            previous = t
        return out

    @property
    def num_output_tokens(self) -> int:
        return sum(self.emission_tokens)

    @classmethod
    def from_request(cls, request, **tags) -> "RequestTrace":
        """From an engine `Request`: tokens committed in one step share one `token_times` stamp,
        so runs of equal stamps are one emission."""
        trace = cls(request.request_id, request.arrival_time, request.first_scheduled_time,
                    finished_time=request.finished_time, num_prompt_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=request.num_cached_tokens,
                    num_draft_tokens=getattr(request, "num_draft_tokens", 0),
                    num_accepted_tokens=getattr(request, "num_accepted_tokens", 0), tags=dict(tags))
        for t in request.token_times:
            if trace.emission_times and trace.emission_times[-1] == t:
                trace.emission_tokens[-1] += 1
            else:
                trace.emission_times.append(t)
                trace.emission_tokens.append(1)
        trace.token_sources = list(request.token_sources)
        return trace


@dataclass(frozen=True)
class RequestMetrics:
    request_id: str
    num_output_tokens: int
    num_emissions: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    decode_s: float | None  # first to last emission
    itl_emission_s: tuple[float, ...]  # one per emission after the first
    itl_token_s: tuple[float, ...]  # one per token after the first emission's
    decode_tokens_per_emission: tuple[int, ...]  # the accepted-length samples
    mean_accepted_len: float | None
    itl_emission_p99_s: float | None  # the p99 of this request's per-emission gaps (the ITL objective)
    slo_met: dict  # objective -> bool, for the objectives the SLO has on
    met_all: bool
    outcome: str = "met"  # "met", "missed", or one of MISS_OUTCOMES (then met_all is False)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first emission per second from the first to the last emission (the
        rate a streaming reader sees once output has started)."""
        if not self.decode_s:
            return None
        return sum(self.decode_tokens_per_emission) / self.decode_s


def request_metrics(trace: RequestTrace, slo: SLOConfig) -> RequestMetrics:
    """A finished trace's latencies and its SLO verdict (the module docstring defines both)."""
    times, counts = trace.emission_times, trace.emission_tokens
    samples = trace.emissions()
    n = sum(counts)
    ttft = samples[0].ttft_s if samples else None
    end = trace.finished_time if trace.finished_time is not None else (times[-1] if times else None)
    e2e = end - trace.arrival_time if end is not None and times else None
    tpot = (e2e - ttft) / (n - 1) if n > 1 and e2e is not None else None
    itl_emission = tuple(s.itl_emission_s for s in samples[1:])
    itl_token = tuple(x for s in samples[1:] for x in s.itl_token_s)
    per_emission = tuple(counts[1:])
    queue = (trace.first_scheduled_time - trace.arrival_time
             if trace.first_scheduled_time is not None else None)
    itl_p99 = percentile(itl_emission, 99)
    bounds = slo.bounds()
    values = {"ttft": ttft, "itl_emission": itl_p99, "tpot": tpot, "e2e": e2e}
    # no gap / one token cannot miss an ITL / TPOT bound; no token at all misses TTFT and E2E
    vacuous = {"ttft": False, "itl_emission": True, "tpot": True, "e2e": False}
    met = {name: vacuous[name] if values[name] is None else values[name] <= bound
           for name, bound in bounds.items()}
    return RequestMetrics(
        request_id=trace.request_id, num_output_tokens=n, num_emissions=len(times), queue_s=queue,
        ttft_s=ttft, e2e_s=e2e, tpot_s=tpot, decode_s=times[-1] - times[0] if len(times) > 1 else None,
        itl_emission_s=itl_emission, itl_token_s=itl_token, decode_tokens_per_emission=per_emission,
        mean_accepted_len=sum(per_emission) / len(per_emission) if per_emission else None,
        itl_emission_p99_s=itl_p99, slo_met=met, met_all=bool(times) and all(met.values()),
        outcome="met" if times and all(met.values()) else "missed",
    )


def attainment(verdicts: Sequence, slo: SLOConfig, duration_s: float | None) -> dict:
    """Attainment and goodput over requests judged against `slo` (anything with `met_all` and
    `slo_met`: `RequestMetrics`, `Outcome`) over `duration_s` seconds (rates None without one)."""
    count = len(verdicts)
    met = sum(1 for v in verdicts if v.met_all)
    names = list(slo.bounds()) if count else []
    rate = (lambda x: x / duration_s) if duration_s else (lambda x: None)
    return {
        "num_requests": count,
        "num_met": met,
        "duration_s": duration_s,
        "throughput_rps": rate(count),
        "goodput_rps": rate(met),
        "slo_attainment": met / count if count else None,
        "slo_attainment_by_slo": {name: sum(1 for v in verdicts if v.slo_met.get(name)) / count for name in names},
    }


def summarize(metrics: Sequence[RequestMetrics], slo: SLOConfig, duration_s: float | None = None,
              span: tuple[float, float] | None = None) -> dict:
    """Aggregate figures over requests. Goodput divides by `duration_s`, or by `span` (first
    arrival, last finish) when the caller passes one; None when neither is known."""
    if duration_s is None and span is not None:
        duration_s = max(span[1] - span[0], 0.0)
    judged = attainment(metrics, slo, duration_s)
    accepted = [x for m in metrics for x in m.decode_tokens_per_emission]
    decode_tokens = sum(sum(m.decode_tokens_per_emission) for m in metrics)
    decode_s = sum(m.decode_s or 0.0 for m in metrics)
    out_tokens = sum(m.num_output_tokens for m in metrics)
    return {
        "num_requests": judged["num_requests"],
        "num_output_tokens": out_tokens,
        "duration_s": duration_s,
        "queue_s": distribution([m.queue_s for m in metrics]),
        "ttft_s": distribution([m.ttft_s for m in metrics]),
        "itl_token_s": distribution([x for m in metrics for x in m.itl_token_s]),
        "itl_emission_s": distribution([x for m in metrics for x in m.itl_emission_s]),
        "tpot_s": distribution([m.tpot_s for m in metrics]),
        "e2e_s": distribution([m.e2e_s for m in metrics]),
        "accepted_len": distribution(accepted),
        # token-weighted: all decode tokens over all decode time (each request's own stream rate)
        "decode_tok_s": decode_tokens / decode_s if decode_s else None,
        "output_tok_s": out_tokens / duration_s if duration_s else None,
        "throughput_rps": judged["throughput_rps"],
        "goodput_rps": judged["goodput_rps"],
        "slo_attainment": judged["slo_attainment"],
        "slo_attainment_by_slo": judged["slo_attainment_by_slo"],
    }


@dataclass(frozen=True)
class Outcome:
    """What a tracker keeps of every finished request for the live attainment / goodput."""

    finished_time: float
    met_all: bool
    slo_met: dict


class SLOTracker:
    """Live per-request tracking: the engine of the server's /metrics and of latency_bench's clients.

    Feed it arrivals, emissions and finishes as they happen (from any thread). `on_emission`
    returns the emission's samples (server/metrics.py observes them into its ITL histograms),
    `on_finish` the request's `RequestMetrics` with its SLO verdict (TTFT / TPOT / E2E histograms,
    the SLO counters). `live(window_s)` is the attainment and goodput of the requests that
    finished in the last `window_s` seconds (the /metrics gauges); `summary()` the full report
    aggregate over the finished requests kept (the last `max_finished`; `keep_traces=False`
    keeps only their verdicts, which is all `live` needs: what a long-running server wants)."""

    def __init__(self, slo: SLOConfig = GPU_INTERACTIVE, clock: Callable[[], float] = CLOCK,
                 max_finished: int = 10000, keep_traces: bool = True, max_live: int = 1 << 16):
        self.slo = slo
        self.clock = clock
        self.keep_traces = keep_traces
        self.max_live = max_live  # requests followed at once; the oldest is dropped beyond it
        self.started = clock()
        self._lock = threading.Lock()
        self._live: dict[str, RequestTrace] = {}
        self._finished: deque[tuple[RequestTrace, RequestMetrics]] = deque(maxlen=max_finished)
        self._outcomes: deque[Outcome] = deque(maxlen=max_finished)
        self.num_finished_total = 0
        self.num_met_total = 0
        self.num_met_by_slo_total = {name: 0 for name in slo.bounds()}

    def on_arrival(self, request_id: str, t: float | None = None, num_prompt_tokens: int = 0, **tags) -> None:
        with self._lock:
            self._live[request_id] = RequestTrace(request_id, self.clock() if t is None else t,
                                                  num_prompt_tokens=num_prompt_tokens, tags=tags)
            if len(self._live) > self.max_live:  # a caller that never finished its requests
                self._live.pop(next(iter(self._live)))

    def on_scheduled(self, request_id: str, t: float | None = None) -> None:
        with self._lock:
            trace = self._live.get(request_id)
            if trace is not None and trace.first_scheduled_time is None:
                trace.first_scheduled_time = self.clock() if t is None else t

    def on_emission(self, request_id: str, num_tokens: int, t: float | None = None,
                    sources: Iterable[str] = ()) -> Emission | None:
        """One delivery of `num_tokens`; its samples, or None (no token, or an unknown request)."""
        with self._lock:
            trace = self._live.get(request_id)
            if trace is None:
                return None
            return trace.add_emission(self.clock() if t is None else t, num_tokens, sources)

    def on_output(self, out, t: float | None = None) -> RequestMetrics | None:
        """One `RequestOutput` (engine stamps in `out.token_times` win over `t`/the clock); it
        finishes the request when `out.finished`, returning its metrics then."""
        stamp = out.token_times[0] if getattr(out, "token_times", None) else t
        self.on_emission(out.request_id, len(out.new_token_ids), stamp, getattr(out, "token_sources", ()))
        with self._lock:
            trace = self._live.get(out.request_id)
            if trace is not None:
                trace.num_cached_tokens = getattr(out, "num_cached_tokens", trace.num_cached_tokens)
                trace.num_prompt_tokens = getattr(out, "num_prompt_tokens", 0) or trace.num_prompt_tokens
        if out.finished:
            return self.on_finish(out.request_id, stamp)
        return None

    def on_finish(self, request_id: str, t: float | None = None, outcome: str | None = None) -> RequestMetrics | None:
        """Judge the request, finished at `t`; None if it is not followed (never arrived, or
        already judged / discarded). `outcome` one of MISS_OUTCOMES: the server accepted it and
        did not serve it, a miss whatever its latencies (its per-objective verdicts stay as
        measured: a timed-out request may have had its first token in time)."""
        if outcome is not None and outcome not in MISS_OUTCOMES:
            raise ValueError(f"outcome must be one of {MISS_OUTCOMES} (or None), got {outcome!r}")
        with self._lock:
            trace = self._live.pop(request_id, None)
            if trace is None:
                return None
            trace.finished_time = self.clock() if t is None else t
            return self._add(trace, outcome)

    def discard(self, request_id: str) -> bool:
        """Stop following a request without judging it (its caller stopped reading it, or it
        was refused for its own input); whether it was followed until now."""
        with self._lock:
            return self._live.pop(request_id, None) is not None

    def add_trace(self, trace: RequestTrace) -> RequestMetrics:
        """A finished trace built elsewhere (e.g. `RequestTrace.from_request`)."""
        with self._lock:
            return self._add(trace)

    def _add(self, trace: RequestTrace, outcome: str | None = None) -> RequestMetrics:
        m = request_metrics(trace, self.slo)
        if outcome is not None:
            m = replace(m, met_all=False, outcome=outcome)
        if self.keep_traces:
            self._finished.append((trace, m))
        self._outcomes.append(Outcome(trace.finished_time, m.met_all, m.slo_met))
        self.num_finished_total += 1
        self.num_met_total += m.met_all
        for name, ok in m.slo_met.items():
            self.num_met_by_slo_total[name] = self.num_met_by_slo_total.get(name, 0) + ok
        return m

    @property
    def num_live(self) -> int:
        return len(self._live)

    def is_live(self, request_id: str) -> bool:
        """Whether the request is followed (arrived, not yet judged or discarded)."""
        with self._lock:
            return request_id in self._live

    def _window(self, window_s: float) -> tuple[float, float]:
        """(since, duration) of the last `window_s` seconds, cut to the tracker's lifetime."""
        now = self.clock()
        return now - window_s, min(window_s, max(now - self.started, 0.0))

    def finished(self, window_s: float | None = None) -> list[tuple[RequestTrace, RequestMetrics]]:
        with self._lock:
            items = list(self._finished)
        if window_s is None:
            return items
        since, _ = self._window(window_s)
        return [(t, m) for t, m in items if t.finished_time is not None and t.finished_time >= since]

    def live(self, window_s: float) -> dict:
        """`attainment` over the requests finished in the last `window_s` seconds (or since the
        tracker started, if shorter): what /metrics exports as attainment and goodput."""
        since, duration = self._window(window_s)
        with self._lock:
            recent = [o for o in self._outcomes if o.finished_time >= since]
        return attainment(recent, self.slo, duration)

    def summary(self, window_s: float | None = None) -> dict:
        items = self.finished(window_s)
        if window_s is not None:
            duration = self._window(window_s)[1]
            span = None
        else:
            duration = None
            span = ((min(t.arrival_time for t, _ in items), max(t.finished_time for t, _ in items))
                    if items else None)
        out = summarize([m for _, m in items], self.slo, duration, span)
        out["slo"] = self.slo.to_dict()
        out["num_live"] = self.num_live
        out["num_finished_total"] = self.num_finished_total
        out["num_met_total"] = self.num_met_total
        return out
