"""The agent benchmark's figures, per system and per phase, and its JSON / Markdown / PNG report.

Every latency is runtime/slo.py's: a turn is one request (`request_metrics` over its trace: TTFT,
per-emission and per-token ITL, E2E, the SLO verdict). Per system:

    TTFT p50/p99 of turn 1 and of later turns (later turns re-send a history whose prefix the
        server may still hold: prefix reuse shows as a lower later-turn TTFT)
    ITL p99 per emission (the gap a reader waits) and per token (that gap split over its tokens)
    turn and task end-to-end time; tool-call validity (invalid / all calls)
    settled tasks per minute of the phase's wall time; goodput = settled tasks every turn of
        which met the SLO, per minute
    cost per settled task: CPU-seconds of the server's processes over the phase / settled
        tasks, and that in USD at the configured price per core-hour

Targets (issue 16) compare prescient-ngram-grammar with the peer in the closed-loop phases.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from prescient.runtime.slo import distribution, request_metrics

TARGET_SYSTEM, PEER = "prescient-ngram-grammar", "llamacpp"


def _figures(blocks: list[dict], slo, price_per_core_hour: float) -> dict:
    records = [r for b in blocks for r in b["records"]]
    first, later, turns, task_ok_slo = [], [], [], 0
    per_turn: dict[int, list] = {}
    for rec in records:
        ms = [(i, request_metrics(trace, slo)) for i, _, trace in rec.turn_traces]
        for i, m in ms:
            (first if i == 0 else later).append(m)
            per_turn.setdefault(i, []).append(m)
            turns.append(m)
        if rec.settled and ms and all(m.met_all for _, m in ms):
            task_ok_slo += 1
    calls = [c for r in records for c in r.calls]
    settled = sum(r.settled for r in records)
    wall = sum(b["wall_s"] for b in blocks)
    cpu = sum(b["server_cpu_s"] for b in blocks)
    per_min = (lambda n: 60.0 * n / wall) if wall else (lambda n: None)
    cpu_per = cpu / settled if settled else None
    return {
        "num_tasks": len(records), "num_settled": settled, "verdicts": dict(Counter(r.verdict for r in records)),
        "num_turns": len(turns), "wall_s": wall, "server_cpu_s": cpu,
        "ttft_turn1_s": distribution([m.ttft_s for m in first]),
        "ttft_later_s": distribution([m.ttft_s for m in later]),
        "itl_emission_s": distribution([x for m in turns for x in m.itl_emission_s]),
        "itl_token_s": distribution([x for m in turns for x in m.itl_token_s]),
        "turn_e2e_s": distribution([m.e2e_s for m in turns]),
        "task_e2e_s": distribution([r.end - r.start for r in records]),
        "turn_slo_attainment": sum(m.met_all for m in turns) / len(turns) if turns else None,
        "num_calls": len(calls), "num_invalid_calls": sum(not c.valid for c in calls),
        "call_validity": sum(c.valid for c in calls) / len(calls) if calls else None,
        "settled_per_min": per_min(settled), "goodput_per_min": per_min(task_ok_slo),
        "cpu_s_per_settled": cpu_per,
        "usd_per_settled": cpu_per / 3600.0 * price_per_core_hour if cpu_per is not None else None,
        "per_turn": {str(i): {"ttft_p50_s": distribution([m.ttft_s for m in ms])["p50"],
                              "e2e_p50_s": distribution([m.e2e_s for m in ms])["p50"], "count": len(ms)}
                     for i, ms in sorted(per_turn.items())},
    }


def _samples(blocks: list[dict], slo) -> dict:
    """Raw per-turn samples for the CDF plots."""
    out = {"ttft_s": [], "itl_emission_s": []}
    for b in blocks:
        for rec in b["records"]:
            for _, _, trace in rec.turn_traces:
                m = request_metrics(trace, slo)
                if m.ttft_s is not None:
                    out["ttft_s"].append(m.ttft_s)
                out["itl_emission_s"] += list(m.itl_emission_s)
    return out


def _task_rows(blocks: list[dict]) -> list[dict]:
    rows = []
    for b in blocks:
        for rec in b["records"]:
            rows.append({"system": b["system"], "phase": b["phase"], "task": rec.task.id, "verdict": rec.verdict,
                         "turns": rec.turns, "e2e_s": rec.end - rec.start, "error": rec.error,
                         "missing_calls": rec.missing_calls,
                         "calls": [{"turn": c.turn, "name": c.name, "arguments": c.arguments, "valid": c.valid,
                                    "error": c.error} for c in rec.calls]})
    return rows


def _ratio(a, b):
    return a / b if a is not None and b else None


def targets(phases: dict) -> list[dict]:
    """Issue 16's targets, per closed-loop phase: prescient-ngram-grammar against the peer."""
    rows = []
    for label, by_system in phases.items():
        if not label.startswith("closed") or TARGET_SYSTEM not in by_system:
            continue
        ours, peer = by_system[TARGET_SYSTEM], by_system.get(PEER)
        spm = _ratio(ours["settled_per_min"], peer["settled_per_min"]) if peer else None
        ttft = _ratio(ours["ttft_later_s"]["p50"], peer["ttft_later_s"]["p50"]) if peer else None
        # judged without dividing, so a peer that settled nothing still gives a verdict
        spm_ok = (peer is not None and ours["settled_per_min"] is not None and peer["settled_per_min"] is not None
                  and ours["settled_per_min"] > 0 and ours["settled_per_min"] >= 1.5 * peer["settled_per_min"])
        rows.append({"phase": label,
                     "settled_per_min_ratio": spm, "settled_per_min_ok": spm_ok,
                     "ttft_later_p50_ratio": ttft, "ttft_later_p50_ok": ttft is not None and ttft <= 0.5,
                     "invalid_calls": ours["num_invalid_calls"], "invalid_calls_ok": ours["num_invalid_calls"] == 0,
                     "peer_settled_per_min": peer["settled_per_min"] if peer else None})
    return rows


def build_report(cfg, blocks: list[dict], info: dict, not_run: dict, tmeta: dict) -> dict:
    slo = cfg.slo
    systems = list(dict.fromkeys(b["system"] for b in blocks))
    labels = list(dict.fromkeys(b["phase"] for b in blocks))
    phases = {label: {s: _figures([b for b in blocks if b["system"] == s and b["phase"] == label], slo,
                                  cfg.price_per_core_hour) for s in systems} for label in labels}
    overall = {s: _figures([b for b in blocks if b["system"] == s], slo, cfg.price_per_core_hour) for s in systems}
    table = [{"system": s, "phase": label, **{k: f[k] for k in (
        "num_tasks", "num_settled", "settled_per_min", "goodput_per_min", "num_invalid_calls")},
        "ttft_turn1_p50_s": f["ttft_turn1_s"]["p50"], "ttft_later_p50_s": f["ttft_later_s"]["p50"],
        "ttft_later_p99_s": f["ttft_later_s"]["p99"], "itl_emission_p99_s": f["itl_emission_s"]["p99"],
        "itl_token_p99_s": f["itl_token_s"]["p99"], "task_e2e_p50_s": f["task_e2e_s"]["p50"],
        "cpu_s_per_settled": f["cpu_s_per_settled"], "usd_per_settled": f["usd_per_settled"]}
        for label in labels for s, f in phases[label].items()]
    sweep = [{"system": s, "rate_per_min": b_param, "goodput_per_min": phases[label][s]["goodput_per_min"],
              "settled_per_min": phases[label][s]["settled_per_min"]}
             for label in labels if label.startswith("open")
             for s in systems for b_param in [next(b["param"] for b in blocks if b["phase"] == label)]]
    notes = []
    peer = info.get(PEER)
    if peer and peer["tool_format"] == "hermes":
        notes.append(f"The peer ({peer['server']}) could not stream tool calls with its function-calling chat "
                     f"format ({peer['tool_stream_problem']}); it ran with plain ChatML, the tools rendered into "
                     "the system message in the hermes format prescient's server uses, and calls parsed client-side. "
                     "Without a grammar, `tool_choice` is not enforced for it.")
    notes.append("prescient-off and prescient-ngram send the tools with tool_choice 'none' (the server renders the "
                 "same tool prompt but applies no grammar) and calls are parsed client-side from the hermes markup.")
    notes.append(f"Cost: CPU-seconds of each server's process tree during its blocks, at "
                 f"{cfg.price_per_core_hour} USD per core-hour.")
    return {
        "tool": "prescient.latency_bench.agent_bench", "quick": cfg.quick, "tasks": tmeta,
        "slo": slo.to_dict(), "systems": info, "not_run": not_run, "phases": phases, "overall": overall,
        "summary_table": table, "rate_sweep": sweep, "targets": targets(phases), "task_runs": _task_rows(blocks),
        "samples": {s: _samples([b for b in blocks if b["system"] == s], slo) for s in systems},
        "notes": notes, "plots": [],
    }


def write_report(report: dict, out: Path, plots: bool, stem: str = "agent_report", render=None,
                 plot_all=None) -> None:
    """OUT/{stem}.json and .md and the PNGs: the writer of every server benchmark's report (the
    load benchmark passes its own `render` and `plot_all`; the defaults are the agent report's)."""
    if render is None:
        from prescient.latency_bench.agent_markdown import render
    if plots:
        try:
            if plot_all is None:
                from prescient.latency_bench.agent_plots import plot_all

            report["plots"] = plot_all(report, out)
        except ImportError as e:
            report["notes"].append(f"no plots: {e}")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(render(report))
