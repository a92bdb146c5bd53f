"""The load benchmark's Markdown report, rendered from its JSON alone."""

from __future__ import annotations

from prescient.latency_bench.agent_markdown import fmt_ms, fmt_num


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _target_value(t: dict) -> str:
    v = t["value"]
    if v is None:
        return "-"
    if "ITL" in t["target"]:
        return f"{fmt_ms(v)} ms"
    if "goodput" in t["target"]:
        return f"{fmt_num(v)}/min (peer {fmt_num(t.get('peer'))}/min)"
    return f"{100 * v:.0f}%"


def render(report: dict) -> str:
    slo, long = report["slo"], report["long_prompt"]
    period = long.get("period_s")
    lines = ["# prescient load benchmark", "",
             f"Created {report.get('created_utc')}, wall {fmt_num(report.get('wall_s'), '{:.0f}')} s "
             f"({'quick' if report['quick'] else 'full'} run). Closed-loop clients streaming the shared "
             f"workloads (`{report['workloads']['path']}`, sha256 {report['workloads']['sha256'][:12]}), "
             f"{fmt_num(report['config']['duration_s'], '{:g}')} s per N, every prompt cold; a long prompt of "
             f"{long.get('tokens')} tokens "
             + (f"every {period:g} s." if period else "never (injector off).")
             + f" SLO: TTFT <= {fmt_ms(slo.get('ttft_s'))} ms and the request's per-emission ITL p99 <= "
             f"{fmt_ms(slo.get('itl_emission_p99_s'))} ms.", "", "## Systems", ""]
    for name, info in report["systems"].items():
        lines.append(f"- **{name}**: {info['server']}")
    for name, why in report["not_run"].items():
        lines.append(f"- **{name}**: not run: {why.splitlines()[0] if why else ''}")
    lines += ["", "## Per system and concurrency", "",
              "| system | N | requests in SLO | goodput/min | TTFT p50 / p99 | ITL p50 / p99 / max | "
              "long prompt TTFT p50 / max | failed |", "|" + "---|" * 8]
    for r in report["summary_table"]:
        share = f" ({100 * r['slo_attainment']:.0f}%)" if r["slo_attainment"] is not None else ""
        lines.append(f"| {r['system']} | {r['clients']} | {r['num_met_slo']}/{r['num_requests']}{share} | "
                     f"{fmt_num(r['goodput_per_min'])} | {fmt_ms(r['ttft_p50_s'])} / {fmt_ms(r['ttft_p99_s'])} ms | "
                     f"{fmt_ms(r['itl_p50_s'])} / {fmt_ms(r['itl_p99_s'])} / {fmt_ms(r['itl_max_s'])} ms | "
                     f"{_s(r['long_ttft_p50_s'])} / {_s(r['long_ttft_max_s'])} | {r['num_failed']} |")
    lines += ["", "ITL is per emission (the gap a reader waits), pooled over the phase's requests; the SLO judges "
              "each request's own p99. Failed and unfinished requests count as misses.", "",
              "## By workload kind", "", "| system | N | kind | in SLO / finished | TTFT p50 / p99 |",
              "|---|---|---|---|---|"]
    for r in report["phases"]:
        for kind, k in sorted(r["by_kind"].items()):
            lines.append(f"| {r['system']} | {r['clients']} | {kind} | {k['num_met_slo']}/{k['num_finished']} | "
                         f"{fmt_ms(k['ttft_s']['p50'])} / {fmt_ms(k['ttft_s']['p99'])} ms |")
    spec = [r for r in report["phases"] if r.get("speculation") is not None]
    if spec:
        lines += ["", "## Draft work per phase (the server's speculation counters)", "",
                  "| system | N | draft tokens verified | accepted | acceptance | grammar-forced verified / accepted |",
                  "|---|---|---|---|---|---|"]
        for r in spec:
            s = r["speculation"]
            rate = "-" if s["acceptance"] is None else f"{100 * s['acceptance']:.0f}%"
            lines.append(f"| {r['system']} | {r['clients']} | {s['draft_tokens']:.0f} | {s['accepted_tokens']:.0f} | "
                         f"{rate} | {s['forced_tokens_proposed']:.0f} / {s['forced_tokens_accepted']:.0f} |")
    if report["targets"]:
        lines += ["", "## Targets (issue 25, prescient)", "", "| N | target | value | met |", "|---|---|---|---|"]
        for t in report["targets"]:
            ok = "n/a" if t["ok"] is None else ("yes" if t["ok"] else "**no**")
            lines.append(f"| {t['clients']} | {t['target']} | {_target_value(t)} | {ok} |")
    errors = [(r["system"], r["clients"], e) for r in report["phases"] for e in r["errors"]]
    if errors:
        lines += ["", "## Errors (first of each phase)", ""] + [f"- {s} N={n}: `{e}`" for s, n, e in errors[:10]]
    if report["plots"]:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in report["plots"]]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"
