"""PNG plots of a report, drawn from its JSON alone (so any saved report can be re-plotted).

ttft_cdf.png / itl_cdf.png: CDFs per mode of the batch-1 runs (ITL per token, solid, and per
emission, dashed). itl_timeline.png: per-emission gaps along a few requests' outputs, marker
area = tokens carried, so bursts of accepted drafts show as big dots after longer gaps.
accept_hist.png: tokens per decode step for the speculative modes. verify_cost.png: k-token
forward cost over a 1-token step. goodput_vs_rate.png: only when a rate sweep ran.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from prescient.runtime.slo import Emission, delivery  # noqa: E402


def _cdf(ax, values, label, **kw):
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, **kw)


def _runs(report, mode):
    return [r for r in report["batch1"]["runs"] if r["mode"] == mode]


def _gaps(run) -> list[Emission]:
    """The run's emissions after the first, by runtime/slo.py's `delivery` (the reports' ITL)."""
    t, k = run["emission_offsets_s"], run["emission_tokens"]
    return [delivery(0.0, t[i - 1], t[i], k[i]) for i in range(1, len(t))]


def plot_all(report: dict, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    modes = list(report["batch1"]["modes"])
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in modes:
        _cdf(ax, [1e3 * r["ttft_s"] for r in _runs(report, m) if r["ttft_s"] is not None], m)
    ax.axvline(1e3 * (report["slo"]["ttft_s"] or 0), color="grey", ls=":", label="TTFT SLO")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT, batch 1", xscale="log")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(modes):
        gaps = [g for r in _runs(report, m) for g in _gaps(r)]
        c = colors[i % len(colors)]
        _cdf(ax, [1e3 * x for g in gaps for x in g.itl_token_s], f"{m} per token", color=c)
        if any(g.num_tokens > 1 for g in gaps):
            _cdf(ax, [1e3 * g.itl_emission_s for g in gaps], f"{m} per emission", color=c, ls="--")
    ax.axvline(1e3 * (report["slo"]["itl_emission_p99_s"] or 0), color="grey", ls=":",
               label="per-emission ITL p99 SLO")
    ax.set(xlabel="inter-token latency (ms)", ylabel="fraction", title="ITL, batch 1", xscale="log")
    ax.legend(fontsize=6)
    written.append(_save(fig, out / "itl_cdf.png"))

    written.append(_timeline(report, modes, out / "itl_timeline.png"))

    spec_modes = [m for m in modes if report["batch1"]["modes"][m]["spec"]["speculate"] != "off"
                  or report["batch1"]["modes"][m]["spec"]["prompt_lookup_num_tokens"]]
    if spec_modes:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        top = max((n for m in spec_modes for r in _runs(report, m) for n in r["emission_tokens"][1:]), default=1)
        bins = [b - 0.5 for b in range(1, top + 2)]
        ax.hist([[n for r in _runs(report, m) for n in r["emission_tokens"][1:]] for m in spec_modes],
                bins=bins, label=spec_modes, density=True)
        ax.set(xlabel="tokens per decode step (accepted drafts + 1)", ylabel="fraction of steps",
               title="Acceptance length")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "accept_hist.png"))

    if report["verify_cost"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for vc in report["verify_cost"]:
            ax.plot([r["k"] for r in vc["rows"]], [r["ratio_vs_1"] for r in vc["rows"]], "o-",
                    label=f"{vc['dtype']}, context {vc['context_len']}")
        ax.plot([1, max(r["k"] for r in report["verify_cost"][0]["rows"])],
                [1, max(r["k"] for r in report["verify_cost"][0]["rows"])], color="grey", ls=":", label="k x 1-token")
        ax.set(xlabel="tokens verified in one forward (k)", ylabel="cost / 1-token step", title="Verify cost")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "verify_cost.png"))

    if report["load"]["sweep"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in sorted({p["mode"] for p in report["load"]["sweep"]}):
            pts = sorted((p for p in report["load"]["sweep"] if p["mode"] == m), key=lambda p: p["rate_rps"])
            (line,) = ax.plot([p["rate_rps"] for p in pts], [p["goodput_rps"] or 0 for p in pts], "o-",
                              label=f"{m} goodput")
            ax.plot([p["rate_rps"] for p in pts], [p["throughput_rps"] or 0 for p in pts], ":",
                    color=line.get_color(), label=f"{m} throughput")
        ax.set(xlabel="offered rate (req/s)", ylabel="req/s", title="Goodput vs offered rate")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "goodput_vs_rate.png"))
    return [w for w in written if w]


def _timeline(report: dict, modes: list[str], path: Path) -> str | None:
    """One prompt (the first long_edit, else the longest output), every mode, rep 0."""
    runs = report["batch1"]["runs"]
    if not runs:
        return None
    long = [r for r in runs if r["workload"] == "long_edit" and r["rep"] == 0]
    prompt = (long[0] if long else max(runs, key=lambda r: r["num_output_tokens"]))["prompt"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for m in modes:
        run = next((r for r in runs if r["mode"] == m and r["prompt"] == prompt and r["rep"] == 0), None)
        if run is None:
            continue
        xs, ys, sizes, tok = [], [], [], run["emission_tokens"][0]
        for g in _gaps(run):
            tok += g.num_tokens
            xs.append(tok)
            ys.append(1e3 * g.itl_emission_s)
            sizes.append(8 * g.num_tokens)
        (line,) = ax.plot(xs, ys, lw=0.6, alpha=0.6)
        ax.scatter(xs, ys, s=sizes, label=m, alpha=0.7, color=line.get_color())
    ax.set(xlabel="output token index", ylabel="gap before emission (ms)", yscale="log",
           title=f"Per-emission ITL along {prompt} (marker area = tokens in the emission)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
