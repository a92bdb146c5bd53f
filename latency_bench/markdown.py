"""The human-readable report (`report.md`), rendered from the JSON report alone."""

from __future__ import annotations


def _f(x, digits=1, scale=1.0, suffix=""):
    return "–" if x is None else f"{x * scale:.{digits}f}{suffix}"


def _ms(x, digits=1):
    return _f(x, digits, 1e3)


def _pct(x, digits=0):
    return _f(x, digits, 100.0, "%")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows] + [""])


def render(report: dict) -> str:
    m, slo, cmp = report["machine"], report["slo"], report["comparisons"]
    lines = [
        "# prescient latency report",
        "",
        f"`{' '.join(report['command'])}` — {'quick' if report['quick'] else 'full'} run, "
        f"{report['created_utc']}, {report['wall_s'] / 60:.1f} min.",
        "",
        f"Machine: {m['cpu']}, {m['num_cpus']} CPUs, torch {m.get('torch')} with {m['torch_threads']} threads, "
        f"transformers {m.get('transformers')}. Load average at start / end: "
        f"{', '.join(f'{x:.1f}' for x in m.get('load_avg_start', []))} / "
        f"{', '.join(f'{x:.1f}' for x in m.get('load_avg_end', []))} "
        "(a shared machine: modes are interleaved, compare ratios rather than absolute figures).",
        f"Measured here: DRAM read bandwidth {m['dram_read_bytes_s'] / 1e9:.1f} GB/s (torch.sum over 1 GiB, "
        f"{m['torch_threads']} threads; median of the undisturbed samples "
        + ", ".join(f"{x['bytes_s'] / 1e9:.0f}" for x in m.get("dram_read_samples", [])) + " GB/s); "
        "GEMM peak " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in m["gemm_peak_flops"].items())
        + " (torch.mm 2048³, the 'peak' of MFU).",
        f"Model: {report['model']['name']} ({report['model']['path']}). Workloads: {report['workloads']['path']} "
        f"(sha256 {report['workloads']['sha256'][:12]}…), prompts: {', '.join(report['workloads']['selected'])}.",
        "",
        f"SLOs used (`{slo['name']}`): TTFT ≤ {_ms(slo['ttft_s'], 0)} ms, per-emission ITL p99 ≤ "
        f"{_ms(slo['itl_emission_p99_s'], 0)} ms" + (f", TPOT ≤ {_ms(slo['tpot_s'], 0)} ms" if slo["tpot_s"] else "")
        + (f", E2E ≤ {_f(slo['e2e_s'], 1)} s" if slo["e2e_s"] else "")
        + ". A request meets the ITL SLO when the p99 of its own per-emission ITLs (the gaps between deliveries, "
        "whatever number of tokens each carried) is within the bound; ITL/token (each gap split over the tokens "
        "it carried) is reported but judges nothing, as splitting flatters speculation. runtime/slo.py defines "
        "every figure, and the server's /metrics computes them with the same code.",
        "",
    ]
    unavailable = [x for x in report["modes"] if not x.get("available", True)]
    if unavailable:
        lines += ["Modes not run: " + "; ".join(f"`{x['name']}` ({x['reason']})" for x in unavailable) + ".", ""]

    if cmp["issue2"]:
        lines += ["## Batch-1 greedy decode: prescient vs transformers (same model, same dtype)", ""]
        lines += _table(
            ["dtype", "prescient tok/s", "transformers tok/s", "ratio", "prescient TTFT p50 ms",
             "transformers TTFT p50 ms", "floor tok/s", "prescient % of floor", "transformers % of floor"],
            [[r["dtype"], _f(r["prescient_tok_s"]), _f(r["hf_tok_s"]), _f(r["tok_s_ratio"], 2, suffix="x"),
              _ms(r["prescient_ttft_p50_s"], 0), _ms(r["hf_ttft_p50_s"], 0), _f(r["floor_tok_s"]),
              _f(r["prescient_pct_of_floor"], 0, suffix="%"), _f(r["hf_pct_of_floor"], 0, suffix="%")]
             for r in cmp["issue2"]])
        lines += ["Floor = measured read bandwidth / weight bytes read per step (one token per forward).", ""]

    if report["concurrency"]:
        lines += ["## Concurrent requests vs batch 1 (plain decoding, same requests)", ""]
        lines += _table(["dtype", "requests", "max_tokens", "batch-1 tok/s", "concurrent tok/s", "ratio",
                         "batch-1 decode tok/s", "concurrent decode tok/s", "decode ratio",
                         "concurrent TTFT p50 ms", "concurrent ITL/emission p99 ms"],
                        [[c["dtype"], str(c["num_concurrent"]), str(c["max_tokens"]), _f(c["batch1"]["tok_s"]),
                          _f(c["concurrent"]["tok_s"]), _f(c["ratio"], 2, suffix="x"),
                          _f(c["batch1"]["decode_tok_s"]), _f(c["concurrent"]["decode_tok_s"]),
                          _f(c["decode_ratio"], 2, suffix="x"),
                          _ms(c["concurrent"]["latency"]["ttft_s"]["p50"], 0),
                          _ms(c["concurrent"]["latency"]["itl_emission_s"]["p99"], 1)] for c in report["concurrency"]])
        lines += ["tok/s = all output tokens / wall time, prefill included; decode tok/s leaves prefill out "
                  "(batch 1: each stream after its first token; concurrent: while all requests are decoding).", ""]

    if cmp["speculation"]:
        lines += ["## Speculation speedup over plain decoding (batch 1, greedy)", ""]
        lines += _table(["mode", "baseline", "workload", "plain tok/s", "spec tok/s", "decode speedup",
                         "E2E speedup", "mean accepted length"],
                        [[r["mode"], r["baseline"], r["workload"], _f(r["plain_tok_s"]), _f(r["spec_tok_s"]),
                          _f(r["speedup"], 2, suffix="x"), _f(r["e2e_speedup"], 2, suffix="x"),
                          _f(r["mean_accepted_len"], 2)] for r in cmp["speculation"]])
        lines += ["Accepted length = tokens per decode step, the bonus token included (1.0 = no draft accepted).", ""]

    if cmp["grammar"]:
        lines += ["## Output grammar on vs off (same decoding otherwise)", ""]
        lines += _table(["mode", "baseline", "workload", "baseline tok/s", "grammar tok/s", "decode speedup",
                         "E2E speedup", "mean accepted length", "forced-token share"],
                        [[r["mode"], r["baseline"], r["workload"], _f(r["plain_tok_s"]), _f(r["spec_tok_s"]),
                          _f(r["speedup"], 2, suffix="x"), _f(r["e2e_speedup"], 2, suffix="x"),
                          _f(r["mean_accepted_len"], 2), _f(r.get("forced_share"), 2)] for r in cmp["grammar"]])
        lines += ["The grammar constrains tool_call replies to a {name, arguments} call of a declared tool (its "
                  "parameters schema) and long_edit replies to a JSON array (chat is unconstrained); grammar-forced "
                  "spans are verified like drafts, so they count in the accepted length (forced-token share: "
                  "output tokens that came from forced spans). Outputs differ from unconstrained ones by design; "
                  "the speculation table above has the grammar modes against plain decoding too.", ""]

    if report["verify_cost"]:
        lines += ["## Cost of a k-token verify forward vs a 1-token step", ""]
        for vc in report["verify_cost"]:
            lines += [f"{vc['dtype']}, context {vc['context_len']} tokens, median of {vc['reps']}:", ""]
            lines += _table(["k", "ms", "x 1-token step", "ms per token"],
                            [[str(r["k"]), _f(r["ms"], 2), _f(r["ratio_vs_1"], 2), _f(r["ms_per_token"], 2)]
                             for r in vc["rows"]])

    lines += ["## Per mode (batch 1)", ""]
    rows = []
    for name, x in report["batch1"]["modes"].items():
        s = x["summary"]
        rows.append([name, str(s["num_requests"]), _f(x["decode_tok_s"]), _f(x["decode_tok_s_median_run"]),
                     _ms(s["ttft_s"]["p50"], 0),
                     _ms(s["ttft_s"]["p90"], 0), _ms(s["ttft_s"]["p99"], 0), _ms(s["itl_token_s"]["p50"]),
                     _ms(s["itl_token_s"]["p99"]), _ms(s["itl_emission_s"]["p99"]), _ms(s["tpot_s"]["p50"]),
                     _f(s["e2e_s"]["p50"], 2), _f(s["e2e_s"]["p99"], 2), _f(s["accepted_len"]["mean"], 2),
                     _pct(s["slo_attainment"]), _f(x["pct_of_floor"], 0, suffix="%"), _pct(x["bandwidth_util"]),
                     _pct(x["mfu"], 1), _pct(x["foreign_cpu_mean"]), str(x["retried_runs"])])
    lines += _table(["mode", "n", "decode tok/s", "median run tok/s", "TTFT p50", "p90", "p99", "ITL/token p50", "p99",
                     "ITL/emission p99", "TPOT p50", "E2E p50 s", "p99 s", "accepted len", "SLO met",
                     "% floor", "BW util", "MFU", "foreign CPU", "retried"], rows)
    lines += ["Times in ms unless marked. Decode tok/s is token-weighted over all runs; the median run's rate is "
              "robust to one disturbed run. BW util = (weight + KV bytes read per step) x steps / decode time / "
              "measured bandwidth; MFU = model FLOPs per second / measured GEMM peak.", ""]

    lines += ["### Per workload kind", ""]
    rows = []
    for name, x in report["batch1"]["modes"].items():
        for kind, s in x["by_workload"].items():
            rows.append([name, kind, str(s["num_requests"]), _f(s["decode_tok_s"]), _ms(s["ttft_s"]["p50"], 0),
                         _ms(s["itl_token_s"]["p99"]), _ms(s["itl_emission_s"]["p99"]), _ms(s["tpot_s"]["p50"]),
                         _f(s["e2e_s"]["p50"], 2), _f(s["accepted_len"]["mean"], 2), _pct(s["slo_attainment"])])
    lines += _table(["mode", "workload", "n", "decode tok/s", "TTFT p50", "ITL/token p99", "ITL/emission p99",
                     "TPOT p50", "E2E p50 s", "accepted len", "SLO met"], rows)

    if cmp["agreement"]:
        lines += ["### Greedy output agreement", ""]
        lines += _table(["mode", "reference", "prompts", "identical outputs", "mean common prefix"],
                        [[a["mode"], a["reference"], str(a["num_prompts"]), _pct(a["identical"]),
                          _pct(a["mean_common_prefix"])] for a in cmp["agreement"]])

    load = report["load"]
    if load["closed_loop"] or load["open_loop"]:
        lines += [f"## Load ({load['client']})", ""]
    if load["closed_loop"]:
        lines += ["Closed loop: concurrent agents, multi-turn tool-calling sessions (same session id across "
                  "turns).", ""]
        lines += _table(["mode", "agents", "turns", "tool latency s", "tasks", "CPU-s per task", "task latency p50 s",
                         "TTFT p50", "TTFT p99", "ITL/token p99", "ITL/emission p99", "accepted len", "SLO met",
                         "goodput req/s"],
                        [[c["mode"], str(c["agents"]["num_agents"]), str(c["agents"]["turns"]),
                          _f(c["agents"]["tool_latency_s"], 2), str(c["agents"]["completed_tasks"]),
                          _f(c["agents"]["cpu_s_per_task"], 1), _f(c["agents"]["task_latency_s"]["p50"], 1),
                          _ms(c["latency"]["ttft_s"]["p50"], 0), _ms(c["latency"]["ttft_s"]["p99"], 0),
                          _ms(c["latency"]["itl_token_s"]["p99"]), _ms(c["latency"]["itl_emission_s"]["p99"]),
                          _f(c["latency"]["accepted_len"]["mean"], 2),
                          _pct(c["latency"]["slo_attainment"]), _f(c["latency"]["goodput_rps"], 3)]
                         for c in load["closed_loop"]])
    if load["open_loop"]:
        lines += ["Open loop: single-turn requests from the workload mix at a fixed offered rate.", ""]
        lines += _table(["mode", "arrivals", "rate req/s", "requests", "TTFT p50", "TTFT p99", "queue p50",
                         "ITL/token p99", "ITL/emission p99", "TPOT p50", "SLO met", "goodput req/s"],
                        [[o["mode"], o["process"], _f(o["rate_rps"], 3), str(o["num_requests"]),
                          _ms(o["latency"]["ttft_s"]["p50"], 0), _ms(o["latency"]["ttft_s"]["p99"], 0),
                          _ms(o["latency"]["queue_s"]["p50"], 0), _ms(o["latency"]["itl_token_s"]["p99"]),
                          _ms(o["latency"]["itl_emission_s"]["p99"]),
                          _ms(o["latency"]["tpot_s"]["p50"]), _pct(o["latency"]["slo_attainment"]),
                          _f(o["latency"]["goodput_rps"], 3)] for o in load["open_loop"]])
    if load["sweep"]:
        lines += ["Rate sweep:", ""]
        lines += _table(["mode", "rate req/s", "throughput req/s", "goodput req/s", "SLO met"],
                        [[p["mode"], _f(p["rate_rps"], 3), _f(p["throughput_rps"], 3), _f(p["goodput_rps"], 3),
                          _pct(p["slo_attainment"])] for p in load["sweep"]])
        lines += ["Highest swept rate meeting the SLOs (attainment ≥ "
                  f"{report['config'].get('attainment_target', 0.9):.0%}): "
                  + ", ".join(f"{k}: {_f(v, 3)} req/s" for k, v in load["max_rate_meeting_slo"].items()), ""]

    if report["plots"]:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in report["plots"]] + [""]
    if report["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(lines)
