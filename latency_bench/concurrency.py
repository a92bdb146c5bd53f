"""Aggregate throughput: N concurrent requests in one engine vs the same requests at batch 1.

Continuous batching turns N matrix-vector products per weight into one small GEMM, so on a
bandwidth-bound CPU N streams should cost little more than one. Both arms run the same N
requests (short prompts cycled from the workloads, `max_tokens` fixed and EOS ignored so both
arms generate exactly the same number of tokens) on one plain engine; the arms alternate within
each repetition. The prefix cache is cleared at the start of each arm and left on within it, so
both arms get the same reuse of shared system prompts. Two ratios: aggregate (prefill included)
and decode only (batch 1: each stream's rate after its first token; N at once: the steady state
while all N are decoding). Aggregate tok/s = output tokens / wall time from first submission to last
finish, prefill included.
"""

from __future__ import annotations

import time

from prescient.latency_bench.contention import CpuMeter
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.slo import RequestTrace, request_metrics, summarize


def _drive(engine, prompts: list[list[int]], params: SamplingParams, concurrent: bool, tag: str):
    engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    requests = []
    if concurrent:
        requests = [engine.add_request(p, params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests():
            engine.step()
    else:
        for i, p in enumerate(prompts):
            r = engine.add_request(p, params, request_id=f"{tag}-{i}")
            while r.finish_reason is None:
                engine.step()
            requests.append(r)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_token_ids) for r in requests)
    return wall, tokens, [RequestTrace.from_request(r) for r in requests]


def measure_concurrency(engine, prompts: list[list[int]], num_concurrent: int, max_tokens: int, reps: int,
                        slo, progress=None) -> dict:
    batch = [prompts[i % len(prompts)] for i in range(num_concurrent)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _drive(engine, batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), True, "warm")
    arms = {"batch1": [], "concurrent": []}
    traces = {"batch1": [], "concurrent": []}
    foreign = {"batch1": [], "concurrent": []}
    for rep in range(reps):
        order = ["batch1", "concurrent"] if rep % 2 == 0 else ["concurrent", "batch1"]
        for arm in order:
            with CpuMeter() as meter:
                wall, tokens, tr = _drive(engine, batch, params, arm == "concurrent", f"{arm}-r{rep}")
            arms[arm].append((wall, tokens))
            foreign[arm].append(meter.foreign_share)
            traces[arm].extend(tr)
            if progress is not None:
                progress.update(1)
    out = {"num_concurrent": num_concurrent, "max_tokens": max_tokens, "reps": reps,
           "dtype": str(engine.model.dtype).replace("torch.", "")}
    for arm, runs in arms.items():
        wall = sum(w for w, _ in runs)
        tokens = sum(t for _, t in runs)
        metrics = [request_metrics(t, slo) for t in traces[arm]]
        shares = [f for f in foreign[arm] if f is not None]
        out[arm] = {"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens,
                    "foreign_cpu": sum(shares) / len(shares) if shares else None,
                    "latency": summarize(metrics, slo, duration_s=wall)}
    out["ratio"] = out["concurrent"]["tok_s"] / out["batch1"]["tok_s"]
    out["batch1"]["decode_tok_s"] = _stream_decode_rate(traces["batch1"])
    out["concurrent"]["decode_tok_s"] = _steady_decode_rate(traces["concurrent"], num_concurrent)
    b, c = out["batch1"]["decode_tok_s"], out["concurrent"]["decode_tok_s"]
    out["decode_ratio"] = c / b if b and c else None
    return out


def _stream_decode_rate(traces: list) -> float | None:
    """Batch 1: tokens after the first over the time from first to last token, all requests."""
    tokens = sum(t.num_output_tokens - t.emission_tokens[0] for t in traces if t.emission_times)
    seconds = sum(t.emission_times[-1] - t.emission_times[0] for t in traces if t.emission_times)
    return tokens / seconds if seconds else None


def _steady_decode_rate(traces: list, group: int) -> float | None:
    """N at once: tokens per second while all N of a repetition were decoding (from the last one's
    first token to the first one's last token), so prefill is left out as in the batch-1 rate."""
    tokens = seconds = 0.0
    for i in range(0, len(traces), group):
        rep = [t for t in traces[i:i + group] if t.emission_times]
        start = max(t.emission_times[0] for t in rep)
        end = min(t.emission_times[-1] for t in rep)
        if end <= start:
            continue
        seconds += end - start
        tokens += sum(n for t in rep for ts, n in zip(t.emission_times, t.emission_tokens) if start < ts <= end)
    return tokens / seconds if seconds else None
