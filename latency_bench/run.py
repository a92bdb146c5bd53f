"""One benchmark run, phase by phase, into a report (JSON + Markdown + PNGs) in `cfg.out`.

    measure    read bandwidth, GEMM peak per dtype (in this run, on this machine's current load)
    batch 1    every mode on the same prompts, interleaved (batch1.py) -> issue-2/3 comparisons
    verify     k-token vs 1-token forward cost (verify_cost.py)
    concurrent N requests in one engine vs the same at batch 1 (concurrency.py)
    load       per load mode: closed-loop agents, open loop at a rate, rate sweep (full runs)
    report     JSON (validated against schema.py when jsonschema is installed), Markdown, plots

Its command line is the latency suite's, `prescient bench [latency]` (`cli` below, LATENCY_DOC).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

# the runner modules register themselves in modes.RUNNERS when imported
from prescient.latency_bench import analysis, hf_runner, llamacpp_runner, prescient_runner  # noqa: F401
from prescient.latency_bench.agent_loop import AgentLoadConfig, run_agents
from prescient.latency_bench.batch1 import chat_prompt_ids, run_batch1
from prescient.latency_bench.concurrency import measure_concurrency
from prescient.latency_bench.config import BenchConfig
from prescient.latency_bench.context import DTYPES, BenchContext, EngineKnobs
from prescient.latency_bench.efficiency import BandwidthProbe, machine_info, matmul_params, measure_gemm_flops
from prescient.latency_bench.markdown import render
from prescient.latency_bench.modes import RUNNERS, ModeSpec, Unavailable, default_modes
from prescient.latency_bench.open_loop import best_rate, run_open_loop
from prescient.latency_bench.schema import SCHEMA_VERSION
from prescient.latency_bench.suites import add_shared, suite_parser
from prescient.latency_bench.verify_cost import measure_verify_cost
from prescient.latency_bench.workloads import load_workloads, select
from prescient.runtime.slo import PRESETS, SLOTracker


def _bar(cfg: BenchConfig, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True, leave=True)


_T0 = time.perf_counter()


def _log(cfg: BenchConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig, command: list[str]) -> dict:
    t0 = time.perf_counter()
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not cfg.quick:
        _log(cfg, "full run: every prompt, 2 repetitions, rate sweep; expect well over half an hour on 2 cores")
    notes: list[str] = []

    machine = machine_info()
    _log(cfg, "measuring read bandwidth and GEMM peak")
    bandwidth = BandwidthProbe(cfg.bandwidth_bytes, cfg.max_foreign_cpu)
    bandwidth.sample("start")
    needed = tuple(dict.fromkeys(cfg.dtypes + (cfg.spec_dtype,)))
    machine["gemm_peak_flops"] = {d: measure_gemm_flops(DTYPES[d], cfg.gemm_n) for d in needed}

    ctx = BenchContext(cfg.model, EngineKnobs(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_gb,
                                              cfg.draft_model))
    ctx.llamacpp_model = cfg.llamacpp_model
    all_workloads, wmeta = load_workloads(cfg.workloads)
    selected = select(all_workloads, cfg.prompts_per_kind, cfg.max_tokens_cap)
    wmeta["selected"] = [w.name for w in selected]

    specs = default_modes(cfg.dtypes, cfg.spec_dtype, cfg.peers)
    if cfg.modes:
        specs = [s for s in specs if s.name in cfg.modes]
    _log(cfg, f"loading {ctx.model_path} and building {len(specs)} modes")
    runners, mode_entries = {}, []
    for spec in specs:
        entry = spec.to_dict()
        try:
            runners[spec.name] = RUNNERS[spec.engine](spec, ctx)
            entry.update(available=True, reason=None)
        except Unavailable as e:
            entry.update(available=False, reason=str(e))
        mode_entries.append(entry)
    model_cfg = ctx.model_config

    # ------------------------------------------------------------ batch 1
    _log(cfg, "batch-1 phase")
    bar = _bar(cfg, cfg.reps * len(selected) * len(runners), "batch-1 runs")
    records = run_batch1(runners, selected, ctx.tokenizer, cfg.reps, bar, max_foreign=cfg.max_foreign_cpu,
                         retries=cfg.contention_retries)
    bar.close()
    bandwidth.sample("after batch 1")

    # ------------------------------------------------------------ verify cost
    verify_dtypes = needed if not cfg.quick else (cfg.spec_dtype,)
    verify = []
    for dtype in verify_dtypes:
        _log(cfg, f"verify cost, {dtype}")
        verify.append(measure_verify_cost(ctx.model(dtype), cfg.verify_context, cfg.verify_ks, cfg.verify_reps))

    # ------------------------------------------------------------ concurrency
    _log(cfg, "concurrency")
    short = [chat_prompt_ids(ctx.tokenizer, w) for w in all_workloads if w.kind in ("chat", "tool_call")]
    conc_dtypes = cfg.dtypes if not cfg.quick else (cfg.spec_dtype,)
    concurrency = []
    for dtype in conc_dtypes:
        bar = _bar(cfg, 2 * cfg.concurrent_reps, f"{cfg.num_concurrent} concurrent vs batch 1, {dtype}")
        concurrency.append(measure_concurrency(ctx.engine(dtype, "off"), short, cfg.num_concurrent,
                                               cfg.concurrent_max_tokens, cfg.concurrent_reps, cfg.slo, bar))
        bar.close()

    # ------------------------------------------------------------ load
    bandwidth.sample("after concurrency")
    machine["dram_read_bytes_s"] = bandwidth.value()
    machine["dram_read_samples"] = bandwidth.samples
    modes = analysis.mode_sections(records, runners, model_cfg, machine["dram_read_bytes_s"],
                                   machine["gemm_peak_flops"], cfg.slo)
    comparisons = analysis.comparisons(records, modes, [s for s in specs if s.name in runners], cfg.slo)

    _log(cfg, "load phases")
    load = _load_phases(cfg, ctx, all_workloads, selected, modes, notes)
    _log(cfg, "report")

    # ------------------------------------------------------------ report
    machine["load_avg_end"] = list(os.getloadavg())
    report = {
        "schema_version": SCHEMA_VERSION, "tool": "prescient.latency_bench", "created_utc": created,
        "command": command, "quick": cfg.quick, "wall_s": None, "config": _jsonable(dataclasses.asdict(cfg)),
        "machine": machine,
        "model": {"path": ctx.model_path, "name": model_cfg.name, "architecture": model_cfg.architecture,
                  "num_layers": model_cfg.num_layers, "hidden_size": model_cfg.hidden_size,
                  "vocab_size": model_cfg.vocab_size, "matmul_params": matmul_params(model_cfg),
                  "kv_bytes_per_token": {d: ctx.model(d).kv_bytes_per_token() for d in needed}},
        "workloads": wmeta, "slo": cfg.slo.to_dict(), "modes": mode_entries,
        "batch1": {"reps": cfg.reps, "modes": modes, "runs": analysis.run_rows(records, cfg.slo)},
        "comparisons": comparisons, "verify_cost": verify, "concurrency": concurrency, "load": load,
        "plots": [], "notes": notes + _standard_notes(cfg, specs, runners),
    }
    if cfg.plots:
        from prescient.latency_bench.plots import plot_all

        report["plots"] = plot_all(report, out)
    report["wall_s"] = time.perf_counter() - t0
    validate(report)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(render(report))
    _log(cfg, f"wrote {out / 'report.json'}, {out / 'report.md'} and {len(report['plots'])} plots "
              f"in {report['wall_s'] / 60:.1f} min")
    return report


def _load_phases(cfg: BenchConfig, ctx, all_workloads, selected, modes: dict, notes: list[str]) -> dict:
    load = {"client": cfg.server or "in-process AsyncEngine", "closed_loop": [], "open_loop": [], "sweep": [],
            "max_rate_meeting_slo": {}}
    scripts = [w for w in all_workloads if w.kind == "tool_call"]
    agent_cfg = AgentLoadConfig(cfg.num_agents, cfg.sessions_per_agent, cfg.agent_turns, cfg.tool_latency_s,
                                cfg.agent_max_tokens)
    # a server runs whatever speculation it was started with: one load mode, named "server"
    targets = [("server", "off")] if cfg.server else [
        (ModeSpec("prescient", cfg.spec_dtype, s).name, s) for s in cfg.load_speculate]
    for name, speculate in targets:
        factory = _client_factory(cfg, ctx, speculate)
        # open-loop rates scale with what this mode served at batch 1 (1 / mean E2E)
        b1 = modes.get(name) or modes.get(ModeSpec("prescient", cfg.spec_dtype).name)
        capacity = 1.0 / b1["summary"]["e2e_s"]["mean"] if b1 and b1["summary"]["e2e_s"]["mean"] else 0.1

        try:
            client, tracker = factory()
        except Unavailable as e:
            notes.append(f"load mode {name} skipped: {e}")
            continue
        bar = _bar(cfg, cfg.num_agents * cfg.sessions_per_agent, f"agents {name}")
        agents = run_agents(client, scripts, agent_cfg, f"agent-{name}", bar)
        bar.close()
        if cfg.server:  # this process only ran the clients: the server's CPU time is not visible here
            agents.update(cpu_s=None, cpu_s_per_task=None)
        load["closed_loop"].append({"mode": name, "agents": agents, "latency": tracker.summary(),
                                    "engine": client.engine_stats()})
        client.close()

        rate = cfg.open_rate or cfg.open_rate_factor * capacity
        client, tracker = factory()
        bar = _bar(cfg, cfg.open_requests, f"open loop {name} @ {rate:.2f} req/s")
        info = run_open_loop(client, selected, rate, cfg.open_requests, f"open-{name}", cfg.arrival, cfg.arrival_cv,
                             cfg.seed, bar)
        bar.close()
        load["open_loop"].append({"mode": name, **info, "latency": tracker.summary(), "engine": client.engine_stats()})
        client.close()

        if cfg.sweep:
            points = []
            bar = _bar(cfg, len(cfg.sweep_factors) * cfg.sweep_requests, f"rate sweep {name}")
            for factor in cfg.sweep_factors:
                client, tracker = factory()
                info = run_open_loop(client, selected, capacity * factor, cfg.sweep_requests,
                                     f"sweep-{name}-{factor}", cfg.arrival, cfg.arrival_cv, cfg.seed, bar)
                s = tracker.summary()
                client.close()
                points.append({"mode": name, "rate_rps": info["rate_rps"], "throughput_rps": s["throughput_rps"],
                               "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
                               "ttft_p99_s": s["ttft_s"]["p99"], "itl_emission_p99_s": s["itl_emission_s"]["p99"]})
                if (s["slo_attainment"] or 0) < 0.5:
                    break  # past saturation: higher rates only queue longer
            bar.close()
            load["sweep"] += points
            load["max_rate_meeting_slo"][name] = best_rate(points, cfg.attainment_target)
    return load


def _client_factory(cfg: BenchConfig, ctx, speculate: str):
    """-> () -> (client, tracker), a fresh engine per load run (cold caches); raises Unavailable
    when the speculator does not attach. With --server, the load goes to the running server."""
    if cfg.server:
        from prescient.latency_bench.server_client import ServerClient

        def make_server():
            tracker = SLOTracker(cfg.slo)
            return ServerClient(cfg.server, tracker), tracker

        return make_server
    from prescient.latency_bench.load_client import InProcessClient

    def make():
        engine = ctx.engine(cfg.spec_dtype, speculate)
        if speculate != "off" and engine.speculator is None:
            raise Unavailable(f"speculation {speculate!r} did not attach to the engine")
        tracker = SLOTracker(cfg.slo)
        return InProcessClient(engine, tracker), tracker

    return make


def _standard_notes(cfg: BenchConfig, specs, runners) -> list[str]:
    notes = []
    if not cfg.peers:
        notes.append("Peers not run (transformers, llama.cpp): pass --peers to run them beside prescient's modes.")
    if cfg.quick:
        notes.append("Quick run: a subset of the prompts (first "
                     f"{cfg.prompts_per_kind} per kind), one repetition, short load phases, no rate sweep.")
    if any(s.engine == "hf" for s in specs) and len({s.dtype for s in specs if s.engine == "hf"}) > 1:
        notes.append("transformers loads the GGUF once (dequantized to dense weights by from_pretrained); its "
                     "other dtype is that model cast with .to(dtype), the weights a second load would give.")
    notes.append("Threads: prescient's model picks torch's thread count per forward (one thread beside its "
                 "C GEMV pool for decode-sized batches); transformers and the bandwidth probe run on torch's "
                 "thread count from before the first prescient forward.")
    notes.append("Queue time is first_scheduled_time - arrival_time as the engine stamps them.")
    notes.append(f"Contention: a batch-1 run during which other processes used more than "
                 f"{cfg.max_foreign_cpu:.0%} of the CPUs was retried (up to {cfg.contention_retries} times) and "
                 "the least disturbed attempt kept; 'foreign CPU' is that share for the kept runs.")
    notes.append("TTFT includes tokenized-prompt prefill from a cold prefix cache in batch-1 runs; "
                 "load phases keep the prefix cache on, as a server would.")
    return notes


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def validate(report: dict) -> None:
    """Check the report against the schema when jsonschema is installed (it is in the test extras)."""
    try:
        import jsonschema
    except ImportError:
        return
    from prescient.latency_bench.schema import REPORT_SCHEMA

    jsonschema.validate(report, REPORT_SCHEMA)


# ---------------------------------------------------------------- the latency suite's command line

LATENCY_DOC = """`prescient bench [latency]`: the latency benchmark's command line.

    prescient bench --quick --out DIR        # prescient's own modes, <= 10 minutes on a quiet 2-core CPU
    prescient bench --quick --peers          # ... beside transformers and llama.cpp (longer)
    prescient bench --out DIR                # the full run (every prompt, rate sweep; much longer)
    prescient bench --quick --server http://127.0.0.1:8000   # load phases against `prescient serve`

Writes DIR/report.json (stable field names, schema in schema.py), DIR/report.md and PNG plots.
The other suites: `prescient bench list`.
"""


def _preset(field: str, scale: float = 1.0, unit: str = "") -> str:
    """'(default: X)' or '(default: quick X, full Y)' from the presets in config.py, so the help
    states the value each preset really uses."""
    from prescient.latency_bench.config import FULL, QUICK

    def show(v):
        if isinstance(v, tuple):
            return ",".join(map(str, v)) or "none"
        if v is None:
            return "none"
        if isinstance(v, float) or scale != 1.0:
            v = round(v * scale, 6)
        return f"{v}{unit}"

    quick, full = show(getattr(QUICK, field)), show(getattr(FULL, field))
    return f"(default: {quick})" if quick == full else f"(default: quick {quick}, full {full})"


def _parser() -> argparse.ArgumentParser:
    p = suite_parser("latency", LATENCY_DOC,
                     quick={"help": "the <= 10 minute subset (no rate sweep); unset = the full run"},
                     out={"default": "bench_out"}, model=True, workloads=True)
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes for prescient vs transformers "
                   + _preset("dtypes"))
    p.add_argument("--spec-dtype", default=None, help="dtype of the speculation comparison and load phases "
                   + _preset("spec_dtype"))
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                   help="run the transformers and llama.cpp peers beside prescient's modes " + _preset("peers"))
    p.add_argument("--modes", default=None, help="comma-separated mode names to keep, e.g. "
                   "prescient-bf16,prescient-bf16-ngram,hf-bf16 (default: all)")
    p.add_argument("--draft-model", default=None,
                   help="draft model for the draft mode (default: early-exit self-draft)")
    p.add_argument("--llamacpp-model", default=None, help="GGUF for the llama.cpp peer (default: --model)")
    p.add_argument("--prompts-per-kind", type=int, default=None, help="prompts per workload kind, 0 = all "
                   + _preset("prompts_per_kind").replace("none", "all"))
    p.add_argument("--reps", type=int, default=None, help="repetitions of the batch-1 phase " + _preset("reps"))
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap each workload's max_tokens (default: none)")
    p.add_argument("--concurrent", type=int, default=None, help="concurrent requests vs batch 1 "
                   + _preset("num_concurrent"))
    p.add_argument("--concurrent-max-tokens", type=int, default=None,
                   help="max_tokens of each concurrent request " + _preset("concurrent_max_tokens"))
    p.add_argument("--agents", type=int, default=None, help="closed-loop concurrent agents " + _preset("num_agents"))
    p.add_argument("--sessions-per-agent", type=int, default=None,
                   help="sessions each agent runs " + _preset("sessions_per_agent"))
    p.add_argument("--turns", type=int, default=None, help="turns per agent session " + _preset("agent_turns"))
    p.add_argument("--tool-latency", type=float, default=None, help="simulated tool latency, seconds "
                   + _preset("tool_latency_s"))
    p.add_argument("--agent-max-tokens", type=int, default=None, help="max_tokens of each agent turn "
                   + _preset("agent_max_tokens"))
    p.add_argument("--rate", type=float, default=None,
                   help="open-loop rate, req/s (default: 2x the measured batch-1 capacity)")
    p.add_argument("--open-requests", type=int, default=None, help="requests of the open-loop phase "
                   + _preset("open_requests"))
    p.add_argument("--arrival", choices=["poisson", "gamma"], default=None, help="open-loop arrival process "
                   + _preset("arrival"))
    p.add_argument("--arrival-cv", type=float, default=None, help="gamma arrivals' coefficient of variation "
                   + _preset("arrival_cv"))
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="run the rate sweep " + _preset("sweep"))
    p.add_argument("--sweep-requests", type=int, default=None, help="requests per swept rate "
                   + _preset("sweep_requests"))
    p.add_argument("--load-speculate", default=None, help="comma-separated speculation settings for the load "
                   "phases (off,ngram,draft); empty string = no load phases " + _preset("load_speculate"))
    p.add_argument("--slo", choices=sorted(PRESETS), default="cpu-interactive", help="SLO preset")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="TTFT bound, ms (default: the preset's)")
    p.add_argument("--itl-slo-ms", type=float, default=None, help="bound on the p99 of each request's "
                   "per-emission ITL (gaps between deliveries), ms (default: the preset's)")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="TPOT bound, ms (default: the preset's)")
    p.add_argument("--e2e-slo-s", type=float, default=None, help="end-to-end bound, s (default: the preset's)")
    p.add_argument("--server", default=None, help="base URL of a running `prescient serve` for the load phases "
                   "(default: an in-process server)")
    p.add_argument("--max-foreign-cpu", type=float, default=None, help="retry a batch-1 run when other "
                   "processes used more than this share of the CPUs during it " + _preset("max_foreign_cpu"))
    p.add_argument("--retries", type=int, default=None, help="most retries of a disturbed batch-1 run "
                   + _preset("contention_retries"))
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache of each engine, GiB "
                   + _preset("kv_cache_gb"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--verify-context", type=int, default=None, help="cached tokens of the verify-cost "
                   "measurement " + _preset("verify_context"))
    p.add_argument("--bandwidth-mb", type=int, default=None, help="buffer for the read-bandwidth measure, MiB "
                   + _preset("bandwidth_bytes", 1 / (1 << 20)).replace(".0", ""))
    p.add_argument("--gemm-n", type=int, default=None, help="matrix size of the GEMM peak measure "
                   + _preset("gemm_n"))
    add_shared(p, no_plots=True, no_progress={"help": "no progress bars on stderr"})
    return p


def split(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def config_from_args(args: argparse.Namespace):
    from prescient.latency_bench.config import FULL, QUICK

    base = QUICK if args.quick else FULL
    slo = PRESETS[args.slo]
    slo_over = {k: v for k, v in {
        "ttft_s": args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else None,
        "itl_emission_p99_s": args.itl_slo_ms / 1e3 if args.itl_slo_ms else None,
        "tpot_s": args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None,
        "e2e_s": args.e2e_slo_s}.items() if v is not None}
    if slo_over:
        slo = dataclasses.replace(slo, name=f"{slo.name}+custom", **slo_over)
    over = {
        "out": args.out, "model": args.model, "workloads": args.workloads, "draft_model": args.draft_model,
        "llamacpp_model": args.llamacpp_model, "slo": slo, "server": args.server,
        "dtypes": split(args.dtypes) if args.dtypes else None, "spec_dtype": args.spec_dtype,
        "modes": split(args.modes) if args.modes else None, "peers": args.peers,
        "prompts_per_kind": args.prompts_per_kind,
        "reps": args.reps, "max_tokens_cap": args.max_tokens_cap, "num_concurrent": args.concurrent,
        "concurrent_max_tokens": args.concurrent_max_tokens, "num_agents": args.agents,
        "sessions_per_agent": args.sessions_per_agent, "agent_turns": args.turns, "tool_latency_s": args.tool_latency,
        "agent_max_tokens": args.agent_max_tokens,
        "open_rate": args.rate, "open_requests": args.open_requests, "arrival": args.arrival,
        "arrival_cv": args.arrival_cv, "sweep": args.sweep, "sweep_requests": args.sweep_requests,
        "load_speculate": split(args.load_speculate) if args.load_speculate is not None else None,
        "max_foreign_cpu": args.max_foreign_cpu, "contention_retries": args.retries,
        "kv_cache_gb": args.kv_cache_gb, "threads": args.threads, "verify_context": args.verify_context,
        "bandwidth_bytes": args.bandwidth_mb * (1 << 20) if args.bandwidth_mb else None, "gemm_n": args.gemm_n,
    }
    cfg = dataclasses.replace(base, **{k: v for k, v in over.items() if v is not None})
    if args.prompts_per_kind == 0:
        cfg = dataclasses.replace(cfg, prompts_per_kind=None)
    return dataclasses.replace(cfg, plots=not args.no_plots, progress=not args.no_progress)


def cli(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_bench(config_from_args(_parser().parse_args(argv)), ["prescient", "bench", *argv])
    return 0
