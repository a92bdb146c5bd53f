"""The agent benchmark's Markdown report, rendered from its JSON alone (`fmt_ms` / `fmt_num` format the
load report's cells too)."""

from __future__ import annotations


def fmt_ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def fmt_num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ok(flag: bool, value) -> str:
    return "n/a" if value is None else ("yes" if flag else "**no**")


def render(report: dict) -> str:
    slo = report["slo"]
    lines = ["# prescient agent-loop benchmark", "",
             f"Created {report.get('created_utc')}, wall {fmt_num(report.get('wall_s'), '{:.0f}')} s "
             f"({'quick' if report['quick'] else 'full'} run). Tasks: {report['tasks']['num_tasks']} in "
             f"`{report['tasks']['path']}` (sha256 {report['tasks']['sha256'][:12]}). SLO: TTFT <= "
             f"{fmt_ms(slo.get('ttft_s'))} ms and per-turn p99 ITL per emission <= "
             f"{fmt_ms(slo.get('itl_emission_p99_s'))} ms.", "", "## Systems", ""]
    for name, info in report["systems"].items():
        lines.append(f"- **{name}**: {info['server']}, {info['transport']}, tool format `{info['tool_format']}`")
    for name, why in report["not_run"].items():
        lines.append(f"- **{name}**: not run: {why.splitlines()[0] if why else ''}")
    lines += ["", "## Per phase", "",
              "| phase | system | settled / tasks | settled/min | goodput/min | invalid calls | TTFT t1 p50 | "
              "TTFT t2+ p50 | TTFT t2+ p99 | ITL/emission p99 | ITL/token p99 | task E2E p50 | CPU-s/settled | "
              "USD/1k settled |", "|" + "---|" * 14]
    for r in report["summary_table"]:
        usd = r["usd_per_settled"] * 1e3 if r["usd_per_settled"] is not None else None
        lines.append(f"| {r['phase']} | {r['system']} | {r['num_settled']}/{r['num_tasks']} | "
                     f"{fmt_num(r['settled_per_min'])} | {fmt_num(r['goodput_per_min'])} | {r['num_invalid_calls']} | "
                     f"{fmt_ms(r['ttft_turn1_p50_s'])} | {fmt_ms(r['ttft_later_p50_s'])} | {fmt_ms(r['ttft_later_p99_s'])} | "
                     f"{fmt_ms(r['itl_emission_p99_s'])} | {fmt_ms(r['itl_token_p99_s'])} | "
                     f"{fmt_num(r['task_e2e_p50_s'], '{:.1f}')} s | {fmt_num(r['cpu_s_per_settled'], '{:.1f}')} | "
                     f"{fmt_num(usd, '{:.4f}')} |")
    lines += ["", "Times in ms unless marked. TTFT t1 = the first turn, t2+ = later turns (history re-sent; "
              "prefix reuse). ITL per emission is the gap a reader waits; per token is that gap split over "
              "the tokens it carried.", "", "## All phases", "",
              "| system | settled / tasks | verdicts | calls (invalid) | turn E2E p50 / p99 | turn SLO attainment |",
              "|---|---|---|---|---|---|"]
    for s, f in report["overall"].items():
        verdicts = ", ".join(f"{k} {v}" for k, v in sorted(f["verdicts"].items()))
        lines.append(f"| {s} | {f['num_settled']}/{f['num_tasks']} | {verdicts} | {f['num_calls']} "
                     f"({f['num_invalid_calls']}) | {fmt_ms(f['turn_e2e_s']['p50'])} / {fmt_ms(f['turn_e2e_s']['p99'])} | "
                     f"{fmt_num(f['turn_slo_attainment'])} |")
    if report["targets"]:
        lines += ["", "## Targets (prescient-ngram-grammar vs llamacpp, closed loop, HTTP)", "",
                  "| phase | settled/min ratio (>= 1.5) | TTFT t2+ p50 ratio (<= 0.5) | invalid calls (0) |",
                  "|---|---|---|---|"]
        for t in report["targets"]:
            spm = fmt_num(t["settled_per_min_ratio"]) if t["settled_per_min_ratio"] is not None else \
                f"(peer {fmt_num(t['peer_settled_per_min'])}/min)"
            lines.append(f"| {t['phase']} | {spm} {'yes' if t['settled_per_min_ok'] else '**no**'} | "
                         f"{fmt_num(t['ttft_later_p50_ratio'])} {_ok(t['ttft_later_p50_ok'], t['ttft_later_p50_ratio'])}"
                         f" | {t['invalid_calls']} {_ok(t['invalid_calls_ok'], t['invalid_calls'])} |")
    if report["rate_sweep"]:
        lines += ["", "## Open loop", "", "| system | arrivals/min | settled/min | goodput/min |", "|---|---|---|---|"]
        for p in report["rate_sweep"]:
            lines.append(f"| {p['system']} | {p['rate_per_min']:g} | {fmt_num(p['settled_per_min'])} | "
                         f"{fmt_num(p['goodput_per_min'])} |")
    if report["plots"]:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in report["plots"]]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"
