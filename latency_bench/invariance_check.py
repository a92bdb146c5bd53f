"""Batch invariance of the real model, end to end: greedy output with n-gram speculation against
plain decoding, and each request alone against the same request inside a batch, on the shared
workloads, per weights format and ISA tier.

    prescient bench invariance [--weights native,bfloat16] [--isa all|avx2,...] [--max-tokens N] [--batch 32]
    (= python -m prescient.latency_bench.invariance_check ...)

Prints one line per (weights, tier): how many workloads gave identical tokens with speculation,
how many of the batch's requests gave the same tokens as alone, and how many workloads gave
them again through the prefix cache (each prompt run twice on an engine with prefix caching
and the default 512-token chunks: cold, then its cached blocks and a recomputed tail), with
the first divergence of any that did not. The reference runs prefill each prompt whole (prefix
caching off, a large token budget). Exit status 1 if anything differed.
tests/runtime/test_batch_invariance_real.py runs it with fewer tokens.
"""

from __future__ import annotations

import sys
import time

from prescient.build import EngineSpec, build_engine, load_model
from prescient.kernels import cpu_linear
from prescient.runtime.sampling_params import SamplingParams
from prescient.latency_bench.suites import suite_parser


def _requests(engine, prompts: list[list[int]], max_tokens: list[int]) -> list:
    """The finished requests of the prompts, all submitted at once (one batch), greedy."""
    reqs = [engine.add_request(ids, SamplingParams(temperature=0, max_tokens=n)) for ids, n in zip(prompts, max_tokens)]
    while engine.has_unfinished_requests():
        engine.step()
    return reqs


def _run(engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy outputs of the prompts, all submitted at once (one batch)."""
    return [list(r.output_token_ids) for r in _requests(engine, prompts, max_tokens)]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check(weights: str, tiers: list[str], max_tokens: int | None, batch: int, dtype: str = "bfloat16",
          workloads: list | None = None, out=sys.stdout) -> list[dict]:
    """The rows of the report (one per tier) for one weights format; see the module docstring."""
    from prescient.latency_bench.workloads import load_workloads

    workloads = workloads if workloads is not None else load_workloads()[0]
    loaded = load_model(EngineSpec(dtype=dtype, weights=weights, progress=False))
    # The reference: every prompt prefilled in one chunk, never from cached blocks. `cached`
    # chunks prompts by default and serves the second run of each from its prefix cache.
    knobs = dict(dtype=dtype, weights=weights, progress=False, enable_prefix_caching=False,
                 max_num_batched_tokens=1 << 15)
    plain = build_engine(EngineSpec(speculate="off", **knobs), loaded)
    spec = build_engine(EngineSpec(speculate="ngram", calibrate="off", **knobs), loaded)
    cached = build_engine(EngineSpec(speculate="off", dtype=dtype, weights=weights, progress=False), loaded)
    prompts = [plain.tokenizer.apply_chat_template(list(w.messages)) for w in workloads]
    budgets = [min(w.max_tokens, max_tokens or w.max_tokens) for w in workloads]
    rows = []
    try:
        for tier in tiers:
            cpu_linear._set_isa_cap(tier)
            t0 = time.perf_counter()
            alone = [_run(plain, [p], [n])[0] for p, n in zip(prompts, budgets)]
            speculated = [_run(spec, [p], [n])[0] for p, n in zip(prompts, budgets)]
            spec_diff = [(w.name, _first_diff(a, s)) for w, a, s in zip(workloads, alone, speculated)
                         if a != s]
            # a batch of `batch` requests cycling through the workloads, submitted together
            idx = [i % len(prompts) for i in range(batch)]
            together = _run(plain, [prompts[i] for i in idx], [budgets[i] for i in idx])
            batch_diff = [(workloads[i].name, _first_diff(alone[i], t)) for i, t in zip(idx, together)
                          if t != alone[i]]
            cached.block_manager.reset_prefix_cache()  # nothing from another tier's run
            cache_diff = []
            for w, p, n, a in zip(workloads, prompts, budgets, alone):
                hits = []  # prompt tokens each run read from the cache (cold: a shared prefix at most)
                for run in ("cold", "cached"):
                    req = _requests(cached, [p], [n])[0]
                    hits.append(req.num_cached_tokens)
                    got = list(req.output_token_ids)
                    if got != a:
                        cache_diff.append((w.name, run, _first_diff(a, got)))
                if not hits[1] > hits[0]:
                    raise RuntimeError(f"{w.name}: the second run did not hit the prefix cache ({hits})")
            row = {"weights": loaded.model.weights_description(), "tier": cpu_linear.kernel_info().get("isa"),
                   "workloads": len(prompts), "spec_identical": len(prompts) - len(spec_diff),
                   "batch": batch, "batch_identical": batch - len(batch_diff),
                   "cache_identical": len(prompts) - len({d[0] for d in cache_diff}),
                   "spec_diffs": spec_diff, "batch_diffs": batch_diff, "cache_diffs": cache_diff,
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(f"{row['weights']:<28} {row['tier']:<12} speculation identical {row['spec_identical']}/"
                  f"{row['workloads']}, batch of {batch} identical {row['batch_identical']}/{batch}, "
                  f"through the prefix cache {row['cache_identical']}/{row['workloads']}"
                  f" ({row['seconds']} s)" + (f"; spec diverged at {spec_diff}" if spec_diff else "")
                  + (f"; batch diverged at {batch_diff[:4]}" if batch_diff else "")
                  + (f"; cached runs diverged at {cache_diff[:4]}" if cache_diff else ""),
                  file=out, flush=True)
    finally:
        cpu_linear._set_isa_cap(99)
    return rows


def cli(argv: list[str] | None = None) -> int:
    p = suite_parser("invariance", __doc__, full_doc=True)
    p.add_argument("--weights", default="native,bfloat16", help="comma-separated --weights modes")
    p.add_argument("--isa", default="all", help="'all' (every tier this CPU runs) or comma-separated tiers")
    p.add_argument("--max-tokens", type=int, default=None, help="cap each workload's max_tokens (unset: no cap)")
    p.add_argument("--batch", type=int, default=32, help="requests in the batched run")
    args = p.parse_args(argv)
    tiers = cpu_linear.machine_tiers() if args.isa == "all" else args.isa.split(",")
    print(f"CPU tiers: {', '.join(cpu_linear.machine_tiers())}; checking {', '.join(tiers)}", flush=True)
    ok = True
    for weights in args.weights.split(","):
        for row in check(weights, tiers, args.max_tokens, args.batch):
            ok &= (row["spec_identical"] == row["workloads"] == row["cache_identical"]
                   and row["batch_identical"] == row["batch"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(cli())
