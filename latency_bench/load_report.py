"""The load benchmark's figures per system and concurrency, and its JSON / Markdown / PNG report.

Every latency is runtime/slo.py's (the phase's `SLOTracker.summary()` and `request_metrics`
verdicts); this module only counts and arranges. Per (system, N):

    requests      every request a client sent: finished + failed + unfinished (cancelled at the
                  drain limit); failed and unfinished ones count as misses
    in SLO        finished requests whose TTFT and own per-emission ITL p99 met the bounds
    TTFT, ITL     distributions over the finished client requests (ITL: every emission gap,
                  pooled; the SLO judges each request's own p99)
    goodput/min   requests in SLO per minute of the phase's span (first arrival to last finish)
    long prompt   the injector's requests: their TTFT apart (not in the clients' figures)

Written as DIR/load_report.{json,md} and load_itl_cdf.png / load_ttft_cdf.png by the agent
benchmark's writer (agent_report.write_report) and CDF helper (agent_plots).
"""

from __future__ import annotations

from pathlib import Path

from prescient.latency_bench.load_driver import LoadRun
from prescient.runtime.slo import distribution

TARGET_SYSTEM, PEER = "prescient", "llamacpp"


def _per_min(x: float | None) -> float | None:
    return 60.0 * x if x is not None else None


def phase_figures(run: LoadRun) -> dict:
    s = run.clients.summary()
    finished = run.clients.num_finished_total
    failed, unfinished = run.count(run.failed, long=False), run.count(run.unfinished, long=False)
    requests = finished + failed + unfinished
    met = run.clients.num_met_total
    by_kind: dict[str, dict] = {}
    for trace, m in run.clients.finished():
        k = by_kind.setdefault(trace.tags.get("workload", "?"), {"num_finished": 0, "num_met_slo": 0, "ttft": []})
        k["num_finished"] += 1
        k["num_met_slo"] += m.met_all
        k["ttft"].append(m.ttft_s)
    for k in by_kind.values():
        k["ttft_s"] = distribution(k.pop("ttft"))
    longs = run.long.finished()
    return {
        "num_requests": requests, "num_finished": finished, "num_failed": failed, "num_unfinished": unfinished,
        # finished without streaming a token (all of its output special tokens, which carry no
        # text): no TTFT to measure, and a miss
        "num_without_output": sum(m.ttft_s is None for _, m in run.clients.finished()),
        "num_met_slo": met, "slo_attainment": met / requests if requests else None,
        "slo_met_by_objective": {name: sum(m.slo_met.get(name, False) for _, m in run.clients.finished())
                                 for name in run.clients.slo.bounds()},
        "ttft_s": s["ttft_s"], "itl_emission_s": s["itl_emission_s"], "itl_token_s": s["itl_token_s"],
        "e2e_s": s["e2e_s"], "num_output_tokens": s["num_output_tokens"], "output_tok_s": s["output_tok_s"],
        "span_s": s["duration_s"], "throughput_per_min": _per_min(s["throughput_rps"]),
        "goodput_per_min": _per_min(s["goodput_rps"]), "by_kind": by_kind,
        "long": {"num_sent": len(run.long_offsets), "num_finished": run.long.num_finished_total,
                 "num_failed": run.count(run.failed, long=True),
                 "num_unfinished": run.count(run.unfinished, long=True),
                 "ttft_s": run.long.summary()["ttft_s"],
                 "runs": [{"request_id": t.request_id, "sent_at_s": run.long_offsets.get(t.request_id),
                           "ttft_s": m.ttft_s} for t, m in longs]},
        "errors": [f["error"] for f in run.failed[:5]],
    }


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """The draft work of one phase from the server's speculation counters before and after it:
    draft tokens verified and accepted (grammar-forced ones apart), the acceptance; None for a
    server without the counters."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    drafted = d.get("draft_tokens", 0.0)
    d["acceptance"] = d.get("accepted_tokens", 0.0) / drafted if drafted else None
    return d


def phase_samples(run: LoadRun) -> dict:
    """Raw client samples for the CDF plots (microsecond precision keeps the JSON small)."""
    items = run.clients.finished()
    return {"ttft_s": [round(m.ttft_s, 6) for _, m in items if m.ttft_s is not None],
            "itl_emission_s": [round(x, 6) for _, m in items for x in m.itl_emission_s]}


def targets(rows: list[dict]) -> list[dict]:
    """Issue 25's load targets: N = 1, >= 90% of requests in SLO; N = 8, ITL p99 <= 100 ms, >= 50%
    in SLO and goodput >= 2x the peer's at the same N."""
    out = []
    ours = {r["clients"]: r for r in rows if r["system"] == TARGET_SYSTEM}
    peer = {r["clients"]: r for r in rows if r["system"] == PEER}
    if 1 in ours:
        a = ours[1]["slo_attainment"]
        out.append({"clients": 1, "target": "requests in SLO >= 90%", "value": a, "ok": a is not None and a >= 0.9})
    if 8 in ours:
        r = ours[8]
        p99, a, g = r["itl_emission_s"]["p99"], r["slo_attainment"], r["goodput_per_min"]
        out.append({"clients": 8, "target": "ITL p99 <= 100 ms", "value": p99, "ok": p99 is not None and p99 <= 0.1})
        out.append({"clients": 8, "target": "requests in SLO >= 50%", "value": a, "ok": a is not None and a >= 0.5})
        pg = peer[8]["goodput_per_min"] if 8 in peer else None
        # judged without dividing, so a peer with no goodput at all still gives a verdict
        out.append({"clients": 8, "target": "goodput >= 2x llama.cpp's", "value": g, "peer": pg,
                    "ok": None if pg is None or g is None else g > 0 and g >= 2 * pg})
    return out


def build_report(cfg, rows: list[dict], samples: dict, info: dict, not_run: dict, extra: dict) -> dict:
    """`rows`: one per (system, N) phase, `phase_figures` plus system / clients / order / wall and
    CPU times; `samples`: {system: {N: phase_samples}}."""
    notes = [
        "Every request carries a fresh prefix, so no server can reuse a cached prompt: every prefill is cold.",
        "The long prompts come from an open-loop injector beside the clients; their TTFT is reported apart and "
        "they are not among the clients' requests or ITL samples.",
        "Requests that failed or were still running at the drain limit count as requests that missed the SLO.",
        "The clients run in this process on the same cores as the server under test (the same client for every "
        "system), so the client's own CPU cost falls on every system alike.",
        "Goodput: requests in SLO per minute of the phase's span, first arrival to last finish.",
    ]
    return {
        "tool": "prescient.latency_bench.load_bench", "quick": cfg.quick, "slo": cfg.slo.to_dict(),
        "systems": info, "not_run": not_run, **extra, "phases": rows,
        "summary_table": [{k: r[k] for k in ("system", "clients", "num_requests", "num_met_slo", "slo_attainment",
                                             "goodput_per_min", "num_failed")}
                          | {"ttft_p50_s": r["ttft_s"]["p50"], "ttft_p99_s": r["ttft_s"]["p99"],
                             "itl_p50_s": r["itl_emission_s"]["p50"], "itl_p99_s": r["itl_emission_s"]["p99"],
                             "itl_max_s": r["itl_emission_s"]["max"], "long_ttft_p50_s": r["long"]["ttft_s"]["p50"],
                             "long_ttft_max_s": r["long"]["ttft_s"]["max"]} for r in rows],
        "targets": targets(rows), "samples": samples, "notes": notes, "plots": [],
    }


def plot_all(report: dict, out: Path) -> list[str]:
    """load_itl_cdf.png / load_ttft_cdf.png: one panel per N, one curve per system."""
    from prescient.latency_bench.agent_plots import cdf_panels

    slo, samples = report["slo"], report["samples"]
    written = []
    for key, fname, title, bound in (("itl_emission_s", "load_itl_cdf.png", "ITL per emission",
                                      slo.get("itl_emission_p99_s")),
                                     ("ttft_s", "load_ttft_cdf.png", "TTFT", slo.get("ttft_s"))):
        panels = {}
        for system, by_n in samples.items():
            for n, s in by_n.items():
                panels.setdefault(f"N = {n}", {})[system] = s[key]
        if panels:
            cdf_panels(panels, out / fname, f"{title}, clients' requests (long-prompt injector on)", bound)
            written.append(fname)
    return written


def write(report: dict, out: Path, plots: bool) -> None:
    from prescient.latency_bench.agent_report import write_report
    from prescient.latency_bench.load_markdown import render

    write_report(report, out, plots, stem="load_report", render=render, plot_all=plot_all)
