"""Quick check, outside the full report: batch-1 greedy decode tok/s of the default model and
the n-gram speculation speedup per workload kind, plain and speculative interleaved per prompt.

    .venv/bin/python -m prescient.latency_bench.spec_check [--dtype bfloat16]

Prints the measured verify-cost table, per-kind decode tok/s (tokens after the first / time
after the first), the speedup, the mean accepted length, and the greedy match rate of the
speculative outputs against the plain ones (in bf16 a k-token verify rounds differently from a
1-token step, so near-ties can flip; in fp32 they must all match).
"""

from __future__ import annotations

import argparse

from prescient.latency_bench.workloads import load_workloads
from prescient.build import EngineSpec, build_engine, load_model
from prescient.runtime.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    loaded = load_model(EngineSpec(dtype=args.dtype))
    plain = build_engine(EngineSpec(dtype=args.dtype, speculate="off"), loaded)
    spec = build_engine(EngineSpec(dtype=args.dtype, speculate="ngram", calibrate="now"), loaded)
    import numpy as np

    from prescient.speculative.verify_cost import LONG_CONTEXT, SHORT_CONTEXT

    for context in (SHORT_CONTEXT, LONG_CONTEXT):
        sizes = (1, 2, 4, 8, 16, 32)
        costs = spec.speculator.adaptive.cost_many(np.array(sizes), context)
        print(f"verify cost at {context} cached tokens:", {t: round(float(c), 2) for t, c in zip(sizes, costs)}, flush=True)
    totals: dict[tuple[str, str], list[float]] = {}
    workloads, _ = load_workloads()
    identical, matched, total = 0, 0, 0
    for w in workloads:
        ids = plain.tokenizer.apply_chat_template(list(w.messages))
        kind = w.kind
        outputs = []
        for engine, name in ((plain, "plain"), (spec, "ngram")):
            r = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=w.max_tokens))
            while engine.has_unfinished_requests():
                engine.step()
            outputs.append(r.output_token_ids)
            acc = totals.setdefault((kind, name), [0, 0.0])
            acc[0] += len(r.output_token_ids) - 1
            acc[1] += r.finished_time - r.first_token_time
        a, b = outputs
        identical += a == b
        matched += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        total += len(a)
    for kind in sorted({k for k, _ in totals}):
        rate = {name: totals[(kind, name)][0] / totals[(kind, name)][1] for name in ("plain", "ngram")}
        print(f"{kind}: plain {rate['plain']:.1f} tok/s, ngram {rate['ngram']:.1f} tok/s, "
              f"speedup {rate['ngram'] / rate['plain']:.2f}x", flush=True)
    stats = spec.speculator.stats
    print(f"mean accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.2f}")
    print(f"greedy match ({args.dtype}): {identical}/{len(workloads)} outputs identical, "
          f"{matched}/{total} plain tokens before the first divergence")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
