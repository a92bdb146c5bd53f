"""SLO tracking: per-request latency metrics on one clock, SLO checks, attainment and goodput.

One monotonic clock, `time.perf_counter`: the engine stamps `Request`/`RequestOutput` times with
it, and the server's /metrics and latency_bench both feed those stamps (or their own
`perf_counter()` readings) into an `SLOTracker`, so every figure is comparable.

A request is a trace of *emissions*: one emission is what one engine step (or one wire frame)
delivered, and with speculation it can carry several accepted tokens at once. Per request:

- queue time = first scheduled - arrival (None when the caller cannot see scheduling)
- TTFT = first emission - arrival
- ITL per emission = gap between consecutive emissions (the stall a reader sees)
- ITL per token = each emission's gap divided evenly among the tokens it carried, one value per
  token (the streaming rate); the first emission's tokens are covered by TTFT, not ITL
- TPOT = (E2E - TTFT) / (n - 1) over all n output tokens; E2E = finish - arrival
- accepted length = tokens per decode emission (emissions after the first); 1.0 for plain
  decoding, 1 + accepted drafts with speculation (the bonus token included)

SLOs (`SLOConfig`): TTFT, ITL p99 (on the per-token or per-emission basis, stated), optionally
TPOT and E2E. A request meets the ITL SLO when the p99 of its own ITL values is within the
bound. Attainment = share of requests that met every SLO; goodput = those requests per second
of the measured span (DistServe's definition).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

CLOCK: Callable[[], float] = time.perf_counter

ITL_BASES = ("token", "emission")


@dataclass(frozen=True)
class SLOConfig:
    """Latency objectives in seconds; None switches one off."""

    name: str = "gpu-interactive"
    ttft_s: float | None = 0.200
    itl_p99_s: float | None = 0.025
    itl_basis: str = "token"  # which ITL the p99 bound applies to: "token" or "emission"
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        if self.itl_basis not in ITL_BASES:
            raise ValueError(f"itl_basis must be one of {ITL_BASES}, got {self.itl_basis!r}")
        for key in ("ttft_s", "itl_p99_s", "tpot_s", "e2e_s"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ValueError(f"{key} must be > 0 or None, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)


# The defaults for an interactive agent on a GPU.
GPU_INTERACTIVE = SLOConfig()
# A 2-core CPU serving SmolLM2-135M (see docs/bench_example): a ~900-token long_edit prompt takes
# most of a second to prefill, and 16 concurrent streams push per-token ITL towards 100 ms, so a
# user-facing bound that a long prompt and a few concurrent agents can meet is 1 s TTFT and
# 100 ms ITL p99. latency_bench reports against these on CPU and says so in every report.
CPU_INTERACTIVE = SLOConfig(name="cpu-interactive", ttft_s=1.0, itl_p99_s=0.100)

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

    def add_emission(self, t: float, num_tokens: int, sources: Iterable[str] = ()) -> None:
        if num_tokens <= 0:
            return  # a text-only or empty frame carries no token timing
        self.emission_times.append(t)
        self.emission_tokens.append(num_tokens)
        self.token_sources.extend(sources)

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
    itl_emission_s: tuple[float, ...]
    itl_token_s: tuple[float, ...]
    decode_tokens_per_emission: tuple[int, ...]  # the accepted-length samples
    mean_accepted_len: float | None
    itl_p99_s: float | None  # on the SLO's basis
    slo_met: dict  # per SLO name -> bool
    met_all: bool

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first emission per second from the first to the last emission (the
        rate a streaming reader sees once output has started)."""
        if not self.decode_s:
            return None
        return sum(self.decode_tokens_per_emission) / self.decode_s


def request_metrics(trace: RequestTrace, slo: SLOConfig) -> RequestMetrics:
    times, counts = trace.emission_times, trace.emission_tokens
    n = sum(counts)
    ttft = times[0] - trace.arrival_time if times else None
    end = trace.finished_time if trace.finished_time is not None else (times[-1] if times else None)
    e2e = end - trace.arrival_time if end is not None and times else None
    tpot = (e2e - ttft) / (n - 1) if n > 1 and e2e is not None else None
    itl_emission, itl_token = [], []
    for i in range(1, len(times)):
        gap = times[i] - times[i - 1]
        itl_emission.append(gap)
        itl_token.extend([gap / counts[i]] * counts[i])
    per_emission = tuple(counts[1:])
    queue = (trace.first_scheduled_time - trace.arrival_time
             if trace.first_scheduled_time is not None else None)
    itl_p99 = percentile(itl_token if slo.itl_basis == "token" else itl_emission, 99)
    met = {}
    if slo.ttft_s is not None:
        met["ttft"] = ttft is not None and ttft <= slo.ttft_s
    if slo.itl_p99_s is not None:
        met["itl"] = itl_p99 is None or itl_p99 <= slo.itl_p99_s  # one emission: no gap to miss
    if slo.tpot_s is not None:
        met["tpot"] = tpot is None or tpot <= slo.tpot_s
    if slo.e2e_s is not None:
        met["e2e"] = e2e is not None and e2e <= slo.e2e_s
    return RequestMetrics(
        request_id=trace.request_id, num_output_tokens=n, num_emissions=len(times), queue_s=queue,
        ttft_s=ttft, e2e_s=e2e, tpot_s=tpot, decode_s=times[-1] - times[0] if len(times) > 1 else None,
        itl_emission_s=tuple(itl_emission), itl_token_s=tuple(itl_token),
        decode_tokens_per_emission=per_emission,
        mean_accepted_len=sum(per_emission) / len(per_emission) if per_emission else None,
        itl_p99_s=itl_p99, slo_met=met, met_all=bool(times) and all(met.values()),
    )


def summarize(metrics: Sequence[RequestMetrics], slo: SLOConfig, duration_s: float | None = None,
              span: tuple[float, float] | None = None) -> dict:
    """Aggregate figures over requests. Goodput divides by `duration_s`, or by `span` (first
    arrival, last finish) when the caller passes one; None when neither is known."""
    if duration_s is None and span is not None:
        duration_s = max(span[1] - span[0], 0.0)
    count = len(metrics)
    met = sum(1 for m in metrics if m.met_all)
    itl_token = [x for m in metrics for x in m.itl_token_s]
    itl_emission = [x for m in metrics for x in m.itl_emission_s]
    accepted = [x for m in metrics for x in m.decode_tokens_per_emission]
    decode_tokens = sum(sum(m.decode_tokens_per_emission) for m in metrics)
    decode_s = sum(m.decode_s or 0.0 for m in metrics)
    out_tokens = sum(m.num_output_tokens for m in metrics)
    per_slo = {}
    for name in (metrics[0].slo_met if metrics else {}):
        per_slo[name] = sum(1 for m in metrics if m.slo_met.get(name)) / count
    rate = (lambda x: x / duration_s) if duration_s else (lambda x: None)
    return {
        "num_requests": count,
        "num_output_tokens": out_tokens,
        "duration_s": duration_s,
        "queue_s": distribution([m.queue_s for m in metrics]),
        "ttft_s": distribution([m.ttft_s for m in metrics]),
        "itl_token_s": distribution(itl_token),
        "itl_emission_s": distribution(itl_emission),
        "tpot_s": distribution([m.tpot_s for m in metrics]),
        "e2e_s": distribution([m.e2e_s for m in metrics]),
        "accepted_len": distribution(accepted),
        # token-weighted: all decode tokens over all decode time (each request's own stream rate)
        "decode_tok_s": decode_tokens / decode_s if decode_s else None,
        "output_tok_s": rate(out_tokens),
        "throughput_rps": rate(count),
        "goodput_rps": rate(met),
        "slo_attainment": met / count if count else None,
        "slo_attainment_by_slo": per_slo,
        # the fleet-wide p99 over every ITL sample, against the same bound
        "itl_p99_overall_s": percentile(itl_token if slo.itl_basis == "token" else itl_emission, 99),
    }


class SLOTracker:
    """Live per-request tracking for the server's /metrics and the benchmark's clients.

    Feed it arrivals, outputs and finishes as they happen (from any thread); `summary()` gives the
    aggregate over the finished requests kept (the last `max_finished`, optionally only those
    finished in the last `window_s` seconds)."""

    def __init__(self, slo: SLOConfig = GPU_INTERACTIVE, clock: Callable[[], float] = CLOCK,
                 max_finished: int = 10000):
        self.slo = slo
        self.clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, RequestTrace] = {}
        self._finished: deque[tuple[RequestTrace, RequestMetrics]] = deque(maxlen=max_finished)
        self.num_finished_total = 0
        self.num_met_total = 0

    def on_arrival(self, request_id: str, t: float | None = None, num_prompt_tokens: int = 0, **tags) -> None:
        with self._lock:
            self._live[request_id] = RequestTrace(request_id, self.clock() if t is None else t,
                                                  num_prompt_tokens=num_prompt_tokens, tags=tags)

    def on_scheduled(self, request_id: str, t: float | None = None) -> None:
        with self._lock:
            trace = self._live.get(request_id)
            if trace is not None and trace.first_scheduled_time is None:
                trace.first_scheduled_time = self.clock() if t is None else t

    def on_emission(self, request_id: str, num_tokens: int, t: float | None = None,
                    sources: Iterable[str] = ()) -> None:
        with self._lock:
            trace = self._live.get(request_id)
            if trace is not None:
                trace.add_emission(self.clock() if t is None else t, num_tokens, sources)

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

    def on_finish(self, request_id: str, t: float | None = None) -> RequestMetrics | None:
        with self._lock:
            trace = self._live.pop(request_id, None)
            if trace is None:
                return None
            trace.finished_time = self.clock() if t is None else t
            return self._add(trace)

    def add_trace(self, trace: RequestTrace) -> RequestMetrics:
        """A finished trace built elsewhere (e.g. `RequestTrace.from_request`)."""
        with self._lock:
            return self._add(trace)

    def _add(self, trace: RequestTrace) -> RequestMetrics:
        m = request_metrics(trace, self.slo)
        self._finished.append((trace, m))
        self.num_finished_total += 1
        self.num_met_total += m.met_all
        return m

    @property
    def num_live(self) -> int:
        return len(self._live)

    def finished(self, window_s: float | None = None) -> list[tuple[RequestTrace, RequestMetrics]]:
        with self._lock:
            items = list(self._finished)
        if window_s is None:
            return items
        since = self.clock() - window_s
        return [(t, m) for t, m in items if t.finished_time is not None and t.finished_time >= since]

    def summary(self, window_s: float | None = None) -> dict:
        items = self.finished(window_s)
        if window_s is not None:
            duration = window_s
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

    def prometheus_text(self, prefix: str = "prescient", window_s: float | None = None) -> str:
        """The summary in Prometheus text exposition format (quantiles as labels)."""
        s = self.summary(window_s)
        lines = []
        for key in ("queue_s", "ttft_s", "itl_token_s", "itl_emission_s", "tpot_s", "e2e_s"):
            name = f"{prefix}_{key[:-2]}_seconds"
            lines.append(f"# TYPE {name} summary")
            for q in ("p50", "p90", "p99"):
                if s[key][q] is not None:
                    lines.append(f'{name}{{quantile="0.{q[1:]}"}} {s[key][q]:.6f}')
            lines.append(f"{name}_count {s[key]['count']}")
        gauges = {"slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
                  "accepted_len_mean": s["accepted_len"]["mean"], "requests_live": s["num_live"]}
        for key, v in gauges.items():
            lines.append(f"# TYPE {prefix}_{key} gauge")
            lines.append(f"{prefix}_{key} {v if v is not None else 'NaN'}")
        lines.append(f"# TYPE {prefix}_requests_finished_total counter")
        lines.append(f"{prefix}_requests_finished_total {s['num_finished_total']}")
        lines.append(f"# TYPE {prefix}_requests_slo_met_total counter")
        lines.append(f"{prefix}_requests_slo_met_total {s['num_met_total']}")
        return "\n".join(lines) + "\n"
