"""`python -m prescient.latency_bench` / `prescient bench`: the latency benchmark's command line.

    prescient bench --quick --out DIR        # <= 10 minutes on a quiet 2-core CPU
    prescient bench --out DIR                # the full run (every prompt, rate sweep; much longer)
    prescient bench --quick --server http://127.0.0.1:8000   # load phases against `prescient serve`

Writes DIR/report.json (stable field names, schema in schema.py), DIR/report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from prescient.runtime.slo import PRESETS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prescient bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the <= 10 minute subset (no rate sweep)")
    p.add_argument("--out", default="bench_out", help="report folder")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", default=None, help="workloads.jsonl (default: ../shared/workloads, else bundled)")
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes for prescient vs transformers "
                   "(default float32,bfloat16)")
    p.add_argument("--spec-dtype", default=None, help="dtype of the speculation comparison and load phases "
                   "(default bfloat16)")
    p.add_argument("--modes", default=None, help="comma-separated mode names to keep, e.g. "
                   "prescient-bf16,prescient-bf16-ngram,hf-bf16 (default: all)")
    p.add_argument("--draft-model", default=None,
                   help="draft model for the draft mode (default: early-exit self-draft)")
    p.add_argument("--llamacpp-model", default=None, help="GGUF for the llama.cpp peer (default: --model)")
    p.add_argument("--prompts-per-kind", type=int, default=None, help="prompts per workload kind (0 = all)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of the batch-1 phase")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap each workload's max_tokens")
    p.add_argument("--concurrent", type=int, default=None, help="concurrent requests vs batch 1 (default 16)")
    p.add_argument("--concurrent-max-tokens", type=int, default=None)
    p.add_argument("--agents", type=int, default=None, help="closed-loop concurrent agents")
    p.add_argument("--sessions-per-agent", type=int, default=None)
    p.add_argument("--turns", type=int, default=None, help="turns per agent session")
    p.add_argument("--tool-latency", type=float, default=None, help="simulated tool latency, seconds")
    p.add_argument("--agent-max-tokens", type=int, default=None, help="max_tokens of each agent turn")
    p.add_argument("--rate", type=float, default=None,
                   help="open-loop rate, req/s (default: 2x the measured batch-1 capacity)")
    p.add_argument("--open-requests", type=int, default=None)
    p.add_argument("--arrival", choices=["poisson", "gamma"], default=None)
    p.add_argument("--arrival-cv", type=float, default=None, help="gamma arrivals' coefficient of variation")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None, help="run the rate sweep")
    p.add_argument("--sweep-requests", type=int, default=None, help="requests per swept rate (16)")
    p.add_argument("--load-speculate", default=None, help="comma-separated speculation settings for the load "
                   "phases (off,ngram,draft); empty string = no load phases")
    p.add_argument("--slo", choices=sorted(PRESETS), default="cpu-interactive", help="SLO preset")
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--itl-slo-ms", type=float, default=None, help="ITL p99 bound")
    p.add_argument("--itl-basis", choices=["token", "emission"], default=None)
    p.add_argument("--tpot-slo-ms", type=float, default=None)
    p.add_argument("--e2e-slo-s", type=float, default=None)
    p.add_argument("--server", default=None, help="base URL of a running `prescient serve` for the load phases")
    p.add_argument("--max-foreign-cpu", type=float, default=None, help="retry a batch-1 run when other "
                   "processes used more than this share of the CPUs during it (0.2)")
    p.add_argument("--retries", type=int, default=None, help="most retries of a disturbed batch-1 run (2)")
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--verify-context", type=int, default=None)
    p.add_argument("--bandwidth-mb", type=int, default=None, help="buffer for the read-bandwidth measure (1024)")
    p.add_argument("--gemm-n", type=int, default=None, help="matrix size of the GEMM peak measure (2048)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def split(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def config_from_args(args: argparse.Namespace):
    from prescient.latency_bench.config import FULL, QUICK

    base = QUICK if args.quick else FULL
    slo = PRESETS[args.slo]
    slo_over = {k: v for k, v in {
        "ttft_s": args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else None,
        "itl_p99_s": args.itl_slo_ms / 1e3 if args.itl_slo_ms else None,
        "itl_basis": args.itl_basis, "tpot_s": args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None,
        "e2e_s": args.e2e_slo_s}.items() if v is not None}
    if slo_over:
        slo = dataclasses.replace(slo, name=f"{slo.name}+custom", **slo_over)
    over = {
        "out": args.out, "model": args.model, "workloads": args.workloads, "draft_model": args.draft_model,
        "llamacpp_model": args.llamacpp_model, "slo": slo, "server": args.server,
        "dtypes": split(args.dtypes) if args.dtypes else None, "spec_dtype": args.spec_dtype,
        "modes": split(args.modes) if args.modes else None,
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
    args = _parser().parse_args(argv)
    cfg = config_from_args(args)
    from prescient.latency_bench.run import run_bench

    run_bench(cfg, ["prescient", "bench", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
