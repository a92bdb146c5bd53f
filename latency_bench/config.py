"""Benchmark configuration: one frozen dataclass, with the --quick and full presets.

--quick fits in at most ten minutes on a quiet 2-core CPU: prescient's own modes only (the
transformers and llama.cpp peers take `--peers`: on a CPU without AVX-512 BF16 transformers in
bf16 alone took most of the old quick run), two prompts per workload kind, one repetition, a
short closed-loop agent run and one open-loop rate per load mode, no rate sweep. The full run
adds the peers, every prompt, two repetitions, longer load phases and the rate sweep; it takes
well over half an hour here and says so when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from prescient.runtime.slo import CPU_INTERACTIVE, SLOConfig


@dataclass(frozen=True)
class BenchConfig:
    out: str = "bench_out"
    quick: bool = True
    model: str | None = None
    workloads: str | None = None
    llamacpp_model: str | None = None
    draft_model: str | None = None
    # batch-1 comparison (issues 2 and 3)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    spec_dtype: str = "bfloat16"
    modes: tuple[str, ...] | None = None  # mode names to keep (None: all default modes)
    peers: bool = False  # transformers and llama.cpp modes beside prescient's own
    prompts_per_kind: int | None = 2
    reps: int = 1
    max_tokens_cap: int | None = None
    max_foreign_cpu: float = 0.2  # retry a batch-1 run when other processes took more of the CPUs
    contention_retries: int = 1
    # verify cost
    verify_ks: tuple[int, ...] = (1, 2, 4, 8, 11, 16)
    verify_context: int = 1024  # about a long_edit prompt plus its answer
    verify_reps: int = 7
    # N concurrent vs batch 1 (issue 2)
    num_concurrent: int = 16
    concurrent_max_tokens: int = 32
    concurrent_reps: int = 1
    # load phases, run on these speculation settings of the spec dtype
    load_speculate: tuple[str, ...] = ("off", "ngram")
    num_agents: int = 2
    sessions_per_agent: int = 1
    agent_turns: int = 3
    tool_latency_s: float = 0.2
    agent_max_tokens: int = 64
    open_rate: float | None = None  # req/s; None: open_rate_factor x the mode's measured batch-1 capacity
    open_rate_factor: float = 2.0  # twice what one-at-a-time serving could keep up with: batching must
    open_requests: int = 6
    arrival: str = "poisson"
    arrival_cv: float = 1.0
    sweep: bool = False
    sweep_factors: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)  # x measured batch-1 capacity
    sweep_requests: int = 16
    attainment_target: float = 0.9
    # engine knobs and measurement sizes
    kv_cache_gb: float = 0.5
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    bandwidth_bytes: int = 1 << 30
    gemm_n: int = 2048
    threads: int | None = None  # torch intra-op threads for the whole run
    slo: SLOConfig = CPU_INTERACTIVE
    server: str | None = None  # URL of a running `prescient serve` for the client load phases
    progress: bool = True
    plots: bool = True
    seed: int = 0


QUICK = BenchConfig()
FULL = replace(QUICK, quick=False, peers=True, prompts_per_kind=None, reps=2, contention_retries=2, verify_reps=11,
               concurrent_max_tokens=64, concurrent_reps=2, load_speculate=("off", "ngram", "draft"), num_agents=4,
               sessions_per_agent=2, agent_turns=4, agent_max_tokens=96, open_requests=16, sweep=True)
