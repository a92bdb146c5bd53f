"""PNG plots of an agent-benchmark report, drawn from its JSON alone.

agent_ttft_cdf.png / agent_itl_cdf.png: per-turn TTFT and per-emission ITL CDFs per system (all
phases). agent_turn_latency.png: TTFT p50 by turn index per system (turn 1 pays the cold prompt,
later turns show prefix reuse). agent_goodput_vs_rate.png: goodput against open-loop arrival
rate, when the run had open-loop phases. `cdf` / `cdf_panels` draw the load benchmark's CDFs too
(load_report.py), so every benchmark's CDF is drawn the same way.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402


def cdf(ax, values, label) -> None:
    """The empirical CDF of `values` (seconds) as a step curve in ms."""
    xs = sorted(values)
    if xs:
        ax.step([1e3 * x for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def cdf_panels(panels: dict[str, dict[str, list]], path: Path, title: str, bound: float | None) -> None:
    """One CDF panel per key of `panels` ({panel title: {curve label: seconds}}), side by side on
    shared axes, the SLO bound dotted: the load benchmark's plots (a panel per concurrency)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1, 4.5), sharey=True, squeeze=False)
    for ax, (name, curves) in zip(axes[0], panels.items()):
        for label, values in curves.items():
            cdf(ax, values, label)
        if bound:
            ax.axvline(1e3 * bound, color="grey", ls=":", label="SLO bound")
        ax.set_xscale("log")
        ax.set(xlabel="ms", title=name)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("fraction")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(report: dict, out: Path) -> list[str]:
    written = []
    samples, slo = report["samples"], report["slo"]
    for key, fname, title, bound in (("ttft_s", "agent_ttft_cdf.png", "per-turn TTFT", slo.get("ttft_s")),
                                     ("itl_emission_s", "agent_itl_cdf.png", "ITL per emission",
                                      slo.get("itl_emission_p99_s"))):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for system, s in samples.items():
            cdf(ax, s[key], system)
        if bound:
            ax.axvline(1e3 * bound, color="grey", ls=":", label="SLO bound")
        ax.set_xscale("log")
        ax.set(xlabel="ms", ylabel="fraction", title=f"{title} (all agent phases)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(fname)

    overall = report["overall"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    systems = list(overall)
    turns = sorted({int(t) for f in overall.values() for t in f["per_turn"]})
    width = 0.8 / max(len(systems), 1)
    for j, system in enumerate(systems):
        per = overall[system]["per_turn"]
        xs = [t + j * width for t in turns if str(t) in per]
        ys = [1e3 * (per[str(t)]["ttft_p50_s"] or 0) for t in turns if str(t) in per]
        ax.bar(xs, ys, width, label=system)
    ax.set_xticks([t + 0.4 - width / 2 for t in turns], [f"turn {t + 1}" for t in turns])
    ax.set(ylabel="TTFT p50, ms", title="TTFT by turn (later turns re-send a cached prefix)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "agent_turn_latency.png", dpi=110)
    plt.close(fig)
    written.append("agent_turn_latency.png")

    sweep = report["rate_sweep"]
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for system in dict.fromkeys(p["system"] for p in sweep):
            pts = sorted((p["rate_per_min"], p["goodput_per_min"] or 0) for p in sweep if p["system"] == system)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=system)
        lim = max(p["rate_per_min"] for p in sweep)
        ax.plot([0, lim], [0, lim], color="grey", ls=":", label="offered")
        ax.set(xlabel="task arrivals per minute", ylabel="goodput, settled tasks meeting the SLO per minute",
               title="goodput against arrival rate")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "agent_goodput_vs_rate.png", dpi=110)
        plt.close(fig)
        written.append("agent_goodput_vs_rate.png")
    return written
