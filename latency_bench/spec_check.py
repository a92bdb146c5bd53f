"""Quick check, outside the full report: batch-1 greedy decode tok/s of the default model and
the speculation speedup per workload kind, plain and speculative interleaved per prompt.

    prescient bench spec-check [--dtype bfloat16]      # = python -m prescient.latency_bench.spec_check
    prescient bench spec-check --speculate ngram,eagle --kinds chat
    prescient bench spec-check --speculate draft --weights bfloat16
        --draft-model self-int4,self-int8,early-exit --kinds chat --repeats 2 [--force-draft]

Several drafts are each interleaved with plain decoding, prompt by prompt (a shared machine's
load then hits every mode alike; the ratios are still noisy).

Prints the measured verify-cost table, per-kind decode tok/s (tokens after the first / time
after the first), the speedup, the mean accepted length, and the greedy match rate of the
speculative outputs against the plain ones (in bf16 a k-token verify rounds differently from a
1-token step, so near-ties can flip; in fp32 they must all match).
"""

from __future__ import annotations

import dataclasses

from prescient.latency_bench.workloads import load_workloads
from prescient.build import EngineSpec, build_engine, load_model
from prescient.latency_bench.suites import suite_parser


def decode_interleaved(engines: dict, tokenizer, workloads, temperature: float = 0.0,
                       totals: dict | None = None, alternate: bool = False) -> list[dict]:
    """Each workload through every engine in turn, batch 1 (a shared machine's load then hits
    every engine alike; `alternate` reverses the order every other workload); per workload
    {engine name: output ids}. Adds to `totals[(kind, name)]` [tokens after the first, seconds
    from the first token to the last]: decode tok/s = their ratio. Sampled runs are seeded per
    workload, the same seed for every engine."""
    from prescient.runtime.sampling_params import SamplingParams

    totals = {} if totals is None else totals
    all_outputs = []
    for n, w in enumerate(workloads):
        ids = tokenizer.apply_chat_template(list(w.messages))
        names = list(engines)[::-1] if alternate and n % 2 else list(engines)
        outputs = {}
        for name in names:
            engine = engines[name]
            params = SamplingParams(temperature=temperature, max_tokens=w.max_tokens,
                                    seed=n if temperature > 0 else None)
            r = engine.add_request(ids, params)
            while engine.has_unfinished_requests():
                engine.step()
            outputs[name] = r.output_token_ids
            acc = totals.setdefault((w.kind, name), [0, 0.0])
            if len(r.output_token_ids) > 1:
                acc[0] += len(r.output_token_ids) - 1
                acc[1] += r.finished_time - r.first_token_time
        all_outputs.append(outputs)
    return all_outputs


def cli(argv: list[str] | None = None) -> int:
    parser = suite_parser("spec-check", __doc__, full_doc=True, dtype=True,
                          weights={"help": "the target's weights mode (EngineSpec.weights)"})
    parser.add_argument("--speculate", default="ngram",
                        help="the proposers, comma-separated (ngram, eagle, draft), each interleaved with plain")
    parser.add_argument("--draft-model", default=None,
                        help="for --speculate draft (EngineSpec.draft_model); comma-separated: several drafts, "
                        "each interleaved with plain decoding; 'early-exit' = none given")
    parser.add_argument("--force-draft", action="store_true", help="measure a draft the gate refuses")
    parser.add_argument("--kinds", default=None, help="comma-separated workload kinds (default: all)")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the workloads")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (0 = greedy; else seeded per prompt, the same seed in every mode)")
    parser.add_argument("--calibrate", default="now", choices=("now", "fresh"),
                        help="the speculators' cost tables (and a draft's acceptance): cached or measured now")
    args = parser.parse_args(argv)
    base = EngineSpec(dtype=args.dtype, weights=args.weights)
    loaded = load_model(base)
    plain = build_engine(dataclasses.replace(base, speculate="off"), loaded)
    runs = []  # (name, proposer, draft model)
    for method in args.speculate.split(","):
        if method != "draft":
            runs.append((method, method, None))
            continue
        drafts = [None] if args.draft_model is None else [
            None if d == "early-exit" else d for d in args.draft_model.split(",")]
        runs += [(draft or "early-exit", "draft", draft) for draft in drafts]
    engines = {}
    for name, method, draft in runs:
        spec = dataclasses.replace(base, speculate=method, draft_model=draft, force_draft=args.force_draft,
                                   calibrate=args.calibrate)
        engines[name] = build_engine(spec, loaded)
    import numpy as np

    from prescient.speculative.verify_cost import LONG_CONTEXT, SHORT_CONTEXT

    for name, spec in engines.items():
        for context in (SHORT_CONTEXT, LONG_CONTEXT):
            sizes = (1, 2, 4, 8, 16, 32)
            costs = spec.speculator.adaptive.cost_many(np.array(sizes), context)
            print(f"{name}: verify cost at {context} cached tokens:",
                  {t: round(float(c), 2) for t, c in zip(sizes, costs)}, flush=True)
    totals: dict[tuple[str, str], list[float]] = {}  # (kind, engine) -> [tokens after the first, seconds]
    workloads, _ = load_workloads()
    if args.kinds:
        workloads = [w for w in workloads if w.kind in args.kinds.split(",")]
    workloads = workloads * args.repeats
    match = {name: [0, 0, 0] for name in engines}  # identical outputs, tokens before divergence, plain tokens
    all_outputs = decode_interleaved({"plain": plain, **engines}, plain.tokenizer, workloads, args.temperature,
                                     totals)
    for outputs in all_outputs:
        a = outputs["plain"]
        for name in engines:
            b = outputs[name]
            m = match[name]
            m[0] += a == b
            m[1] += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            m[2] += len(a)
    for kind in sorted({k for k, _ in totals}):
        rate = {name: totals[(kind, name)][0] / totals[(kind, name)][1] for name in ("plain", *engines)}
        print(f"{kind}: plain {rate['plain']:.1f} tok/s, " + ", ".join(
            f"{name} {rate[name]:.1f} tok/s (speedup {rate[name] / rate['plain']:.2f}x)" for name in engines),
            flush=True)
    for name, spec in engines.items():
        stats = spec.speculator.stats
        identical, matched, total = match[name]
        drafting = 1e3 * stats.draft_seconds / max(1, spec.num_steps)
        print(f"{name}: mean accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.2f}, "
              f"drafting {drafting:.2f} ms a step; "
              f"greedy match ({args.dtype}): {identical}/{len(workloads)} outputs identical, "
              f"{matched}/{total} plain tokens before the first divergence")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
