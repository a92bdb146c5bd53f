"""Quick check, outside the full report: decode tok/s on the tool_call workloads with grammar +
n-gram speculation + forced spans, n-gram alone, grammar alone, against plain decoding (bf16,
greedy, batch 1; the four modes interleaved per prompt, `--reps` times).

    prescient bench grammar [--reps 2]      # = python -m prescient.latency_bench.grammar_check

The grammar is each prompt's tool-call schema (its declared tools' parameters,
workloads.Workload.constraint). Prints tok/s, the ratio to plain and the forced-token share.
"""

from __future__ import annotations

from prescient.grammar import spec_from_response_format
from prescient.latency_bench.workloads import load_workloads
from prescient.build import EngineSpec, build_engine, load_model
from prescient.runtime.sampling_params import SamplingParams
from prescient.latency_bench.suites import suite_parser


def cli(argv: list[str] | None = None) -> int:
    parser = suite_parser("grammar", __doc__, dtype=True, reps={"default": 2, "help": "passes over the workloads"})
    args = parser.parse_args(argv)
    loaded = load_model(EngineSpec(dtype=args.dtype))
    plain = build_engine(EngineSpec(dtype=args.dtype, speculate="off"), loaded)
    spec = build_engine(EngineSpec(dtype=args.dtype, speculate="ngram", calibrate="now"), loaded)
    modes = (("plain", plain, False), ("ngram", spec, False), ("grammar", plain, True), ("grammar+ngram", spec, True))
    totals = {name: [0, 0.0, 0] for name, _, _ in modes}  # tokens after the first, seconds, forced
    workloads = [w for w in load_workloads()[0] if w.kind == "tool_call"]
    for _ in range(args.reps):
        for w in workloads:
            ids = plain.tokenizer.apply_chat_template(list(w.messages))
            for name, engine, constrained in modes:
                engine.block_manager.reset_prefix_cache()
                grammar = None
                if constrained:
                    grammar = engine.grammar_compiler().submit(spec_from_response_format(
                        {"type": "json_schema", "json_schema": {"schema": w.constraint}}))
                    grammar.result()  # compiled before the clock starts (a server caches it too)
                r = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=w.max_tokens), grammar=grammar)
                while engine.has_unfinished_requests():
                    engine.step()
                acc = totals[name]
                acc[0] += len(r.output_token_ids) - 1
                acc[1] += r.finished_time - r.first_token_time
                acc[2] += r.token_sources.count("forced")
    base = totals["plain"][0] / totals["plain"][1]
    for name, (tokens, seconds, forced) in totals.items():
        print(f"{name}: {tokens / seconds:.1f} tok/s, {tokens / seconds / base:.2f}x plain, "
              f"forced-token share {forced / (tokens + args.reps * len(workloads)):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
