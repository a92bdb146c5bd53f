"""`python -m prescient.latency_bench` / `prescient bench`: the latency benchmark's command line.

    prescient bench --quick --out DIR        # prescient's own modes, <= 10 minutes on a quiet 2-core CPU
    prescient bench --quick --peers          # ... beside transformers and llama.cpp (longer)
    prescient bench --out DIR                # the full run (every prompt, rate sweep; much longer)
    prescient bench --quick --server http://127.0.0.1:8000   # load phases against `prescient serve`
    prescient bench --load --quick --out DIR  # the load suite (load_bench.py): its own options after --load

Writes DIR/report.json (stable field names, schema in schema.py), DIR/report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from prescient.help_format import DefaultsHelpFormatter
from prescient.runtime.slo import PRESETS


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


# Suites with their own command line, chosen by a flag in the subcommand's place (the first
# argument), so no option of this parser is ever read as one of theirs: {flag: module, help}.
SUITES = {"--load": ("prescient.latency_bench.load_bench",
                     "the load suite: closed-loop clients with cold prompts and a long-prompt injector through "
                     "prescient's server and llama.cpp's (`prescient bench --load --help` for its options)")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prescient bench", description=__doc__.splitlines()[0],
                                formatter_class=DefaultsHelpFormatter)
    for flag, (_, text) in SUITES.items():
        p.add_argument(flag, action="store_true", help=f"{text}; must be the first argument")
    p.add_argument("--quick", action="store_true", help="the <= 10 minute subset (no rate sweep); unset = the full run")
    p.add_argument("--out", default="bench_out", help="report folder")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", default=None, help="workloads.jsonl (default: the one bundled with the package)")
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
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUITES:
        import importlib

        return importlib.import_module(SUITES[argv[0]][0]).main(argv[1:]) or 0
    parser = _parser()
    args = parser.parse_args(argv)
    for flag in SUITES:
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            parser.error(f"{flag} selects a suite with its own options: put it first (prescient bench {flag} ...)")
    cfg = config_from_args(args)
    from prescient.latency_bench.run import run_bench

    run_bench(cfg, ["prescient", "bench", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
