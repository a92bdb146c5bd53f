"""From batch-1 records to report sections: per-mode latency summaries, efficiency, comparisons.

Rates are token-weighted (all decode tokens over all decode seconds of a mode), so a long answer
counts for what it weighs. Decode tok/s excludes the first emission (prefill, measured as TTFT).
% of floor = decode tok/s / (measured read bandwidth / weight bytes per step): the share of the
bandwidth-bound ceiling of one-token-per-forward decoding (speculative modes can exceed 100%:
they emit several tokens per weight read). Speedups compare a speculative mode with the same
engine and dtype decoding plainly on the same prompts; output agreement says whether greedy
outputs stayed token-for-token equal.
"""

from __future__ import annotations

from prescient.latency_bench.batch1 import Batch1Record
from prescient.latency_bench.efficiency import decode_efficiency
from prescient.latency_bench.modes import ModeSpec
from prescient.latency_bench.workloads import KINDS
from prescient.runtime.slo import SLOConfig, percentile, request_metrics, summarize


def _summary(records: list[Batch1Record], slo: SLOConfig) -> dict:
    metrics = [request_metrics(r.result.trace, slo) for r in records]
    # batch 1, one request after another: goodput per second of busy time
    return summarize(metrics, slo, duration_s=sum(m.e2e_s or 0.0 for m in metrics) or None)


def run_rows(records: list[Batch1Record], slo: SLOConfig) -> list[dict]:
    rows = []
    for r in records:
        m = request_metrics(r.result.trace, slo)
        t = r.result.trace
        rows.append({
            "mode": r.mode, "workload": r.workload.kind, "prompt": r.workload.name, "rep": r.rep,
            "num_prompt_tokens": r.num_prompt_tokens, "num_output_tokens": m.num_output_tokens,
            "queue_s": m.queue_s, "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "e2e_s": m.e2e_s,
            "decode_tok_s": m.decode_tok_s, "mean_accepted_len": m.mean_accepted_len,
            "itl_emission_p99_s": m.itl_emission_p99_s,
            "met_all": m.met_all, "foreign_cpu": r.foreign_cpu, "attempts": r.attempts,
            "emission_offsets_s": [round(x - t.arrival_time, 6) for x in t.emission_times],
            "emission_tokens": list(t.emission_tokens),
        })
    return rows


def mode_sections(records: list[Batch1Record], runners: dict, model_cfg, bandwidth: float, peaks: dict,
                  slo: SLOConfig) -> dict:
    out = {}
    for name, runner in runners.items():
        recs = [r for r in records if r.mode == name]
        if not recs:
            continue
        summary = _summary(recs, slo)
        metrics = [request_metrics(r.result.trace, slo) for r in recs]
        decode_s = sum(m.decode_s or 0.0 for m in metrics)
        steps = [s for r in recs for s in r.result.steps]
        eff = decode_efficiency(steps, decode_s, runner.weight_bytes, runner.kv_bytes_per_token, model_cfg,
                                bandwidth, peaks[runner.spec.dtype])
        floor = bandwidth / runner.weight_bytes
        out[name] = {
            "spec": runner.spec.to_dict(),
            "weight_bytes": runner.weight_bytes,
            "floor_tok_s": floor,
            "decode_tok_s": summary["decode_tok_s"],
            # robust to one disturbed run: the median of the runs' own decode rates
            "decode_tok_s_median_run": _median([m.decode_tok_s for m in metrics]),
            "pct_of_floor": 100 * summary["decode_tok_s"] / floor if summary["decode_tok_s"] else None,
            "bandwidth_util": eff["bandwidth_util"],
            "mfu": eff["mfu"],
            "summary": summary,
            "by_workload": {k: _summary([r for r in recs if r.workload.kind == k], slo)
                            for k in KINDS if any(r.workload.kind == k for r in recs)},
            "stats": runner.stats(),
            "foreign_cpu_mean": _mean([r.foreign_cpu for r in recs]),
            "retried_runs": sum(r.attempts > 1 for r in recs),
        }
    return out


def _agreement(records: list[Batch1Record], a: str, b: str) -> dict | None:
    ref = {(r.workload.index, r.rep): r.result.output_ids for r in records if r.mode == b}
    pairs = [(r.result.output_ids, ref[(r.workload.index, r.rep)]) for r in records
             if r.mode == a and (r.workload.index, r.rep) in ref]
    if not pairs:
        return None

    def prefix(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n / max(len(x), len(y), 1)

    return {"mode": a, "reference": b, "num_prompts": len(pairs),
            "identical": sum(x == y for x, y in pairs) / len(pairs),
            "mean_common_prefix": sum(prefix(x, y) for x, y in pairs) / len(pairs)}


def comparisons(records: list[Batch1Record], modes: dict, specs: list[ModeSpec], slo: SLOConfig) -> dict:
    names = set(modes)
    issue2 = []
    for dtype in sorted({s.dtype for s in specs}):
        p, h = ModeSpec("prescient", dtype).name, ModeSpec("hf", dtype).name
        if p in names and h in names:
            pm, hm = modes[p], modes[h]
            issue2.append({
                "dtype": dtype, "prescient_mode": p, "hf_mode": h,
                "prescient_tok_s": pm["decode_tok_s"], "hf_tok_s": hm["decode_tok_s"],
                "tok_s_ratio": _ratio(pm["decode_tok_s"], hm["decode_tok_s"]),
                "prescient_ttft_p50_s": pm["summary"]["ttft_s"]["p50"], "hf_ttft_p50_s": hm["summary"]["ttft_s"]["p50"],
                "ttft_ratio": _ratio(pm["summary"]["ttft_s"]["p50"], hm["summary"]["ttft_s"]["p50"]),
                "floor_tok_s": pm["floor_tok_s"],
                "prescient_pct_of_floor": pm["pct_of_floor"], "hf_pct_of_floor": hm["pct_of_floor"],
            })
    speculation = [row for s in specs if s.speculative and s.name in names and s.plain_name in names
                   for row in _speedups(records, s.name, s.plain_name, slo)]
    grammar = [row for s in specs if s.grammar and s.name in names and s.unconstrained_name in names
               for row in _speedups(records, s.name, s.unconstrained_name, slo)]
    agreement = []
    for s in specs:
        if s.name in names and s.speculative and not s.grammar and s.plain_name in names:
            agreement.append(_agreement(records, s.name, s.plain_name))
        if s.engine == "prescient" and not s.speculative and not s.grammar and ModeSpec("hf", s.dtype).name in names:
            agreement.append(_agreement(records, s.name, ModeSpec("hf", s.dtype).name))
    return {"issue2": issue2, "speculation": speculation, "grammar": grammar,
            "agreement": [a for a in agreement if a]}


def _speedups(records: list[Batch1Record], mode: str, baseline: str, slo: SLOConfig) -> list[dict]:
    """`mode` over `baseline` on the same prompts, overall and per workload kind."""
    rows = []
    for kind in ("all",) + KINDS:
        pick = (lambda r, m: r.mode == m and (kind == "all" or r.workload.kind == kind))
        base = [r for r in records if pick(r, baseline)]
        test = [r for r in records if pick(r, mode)]
        if not base or not test:
            continue
        bs, ts = _summary(base, slo), _summary(test, slo)
        rows.append({
            "mode": mode, "baseline": baseline, "workload": kind,
            "plain_tok_s": bs["decode_tok_s"], "spec_tok_s": ts["decode_tok_s"],
            "speedup": _ratio(ts["decode_tok_s"], bs["decode_tok_s"]),
            "e2e_speedup": _ratio(sum(_e2e(base, slo)), sum(_e2e(test, slo))),
            "mean_accepted_len": ts["accepted_len"]["mean"],
            "plain_ttft_p50_s": bs["ttft_s"]["p50"], "spec_ttft_p50_s": ts["ttft_s"]["p50"],
            # share of the mode's output tokens that grammar-forced spans gave for free
            "forced_share": _ratio(sum(r.result.trace.token_sources.count("forced") for r in test),
                                   sum(r.result.trace.num_output_tokens for r in test)),
        })
    return rows


def _e2e(records: list[Batch1Record], slo: SLOConfig) -> list[float]:
    return [request_metrics(r.result.trace, slo).e2e_s or 0.0 for r in records]


def _median(xs):
    return percentile([x for x in xs if x is not None], 50)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None
