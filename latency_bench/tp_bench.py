"""ms/token of greedy decoding at TP=1 and TP=2 on the same model, interleaved.

    prescient bench tp [--weights native] [--dtype bfloat16] [--tokens 64] [--reps 3] [--outputs]
    (legacy: `prescient bench --tp ...`, `python -m prescient.latency_bench.tp_bench ...`)

Both engines live in this process: TP=1 a plain model on all of this process's cores, TP=2 the
sharded one (this process is rank 0 on half the cores, one spawned worker on the other half).
The threads are switched between the two before each run, so TP=1 is not handicapped. Each rep
runs one request per mode (prefill untimed, speculation off), alternating the order; the figure
is decode ms/token (first to last token), the median over reps (runtime/slo.py's percentile).
Printed as JSON, with the per-collective cost the difference implies (each step makes 2
all-reduces a layer + 2). `--outputs` also decodes every bundled workload greedily (up to
`--tokens` tokens, EOS honoured) at both degrees and reports how many outputs are identical, with
the first differing token of any that are not (TP-invariant sums: they should all be).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from prescient.latency_bench.suites import suite_parser
from prescient.runtime.slo import percentile


def _decode_ms_per_token(engine, ids: list[int], tokens: int) -> float:
    from prescient.runtime.sampling_params import SamplingParams

    req = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == req.request_id and out.new_token_ids:
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) * 1e3 / (len(req.output_token_ids) - 1)


def _greedy(engine, ids: list[int], tokens: int) -> list[int]:
    from prescient.runtime.sampling_params import SamplingParams

    req = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=tokens))
    while engine.has_unfinished_requests():
        engine.step()
    return list(req.output_token_ids)


def _compare_outputs(one, two, tokens: int, set_threads) -> dict:
    """Greedy outputs of every bundled workload at TP=1 and TP=2: how many are identical."""
    from prescient.latency_bench.workloads import load_workloads

    workloads, _ = load_workloads()
    diverged = []
    for w in workloads:
        ids = one.tokenizer.apply_chat_template(list(w.messages))
        outs = []
        for name, engine in (("tp1", one), ("tp2", two)):
            set_threads(name)
            outs.append(_greedy(engine, ids, min(tokens, w.max_tokens)))
        a, b = outs
        if a != b:
            i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            diverged.append({"workload": w.index, "kind": w.kind, "first_difference": i})
        print(f"workload {w.index} ({w.kind}): {len(a)} tokens, {'identical' if a == b else 'DIFFERENT'}",
              file=sys.stderr, flush=True)
    return {"identical": len(workloads) - len(diverged), "of": len(workloads), "diverged": diverged}


def cli(argv: list[str] | None = None) -> int:
    from prescient.build import EngineSpec, build_engine
    from prescient.runtime import tp_worker

    p = suite_parser("tp", __doc__, model=True, weights=True, dtype=True, reps={"help": "runs per mode (median kept)"})
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    p.add_argument("--outputs", action="store_true",
                   help="also compare TP=1 and TP=2 greedy outputs on every bundled workload")
    args = p.parse_args(argv)
    common = dict(model=args.model, dtype=args.dtype, weights=args.weights, speculate="off", calibrate="off",
                  kv_cache_gb=0.25, progress=False)
    full_threads = torch.get_num_threads()
    one = build_engine(EngineSpec(**common))
    two = build_engine(EngineSpec(**common, tp=2))
    half_threads = torch.get_num_threads()  # what launch gave rank 0
    ids = one.tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}])
    runs: dict[str, list[float]] = {"tp1": [], "tp2": []}
    for rep in range(args.reps):
        order = [("tp1", one), ("tp2", two)] if rep % 2 == 0 else [("tp2", two), ("tp1", one)]
        for name, engine in order:
            tp_worker._set_threads(full_threads if name == "tp1" else half_threads)
            runs[name].append(_decode_ms_per_token(engine, ids, args.tokens))
            print(f"rep {rep} {name}: {runs[name][-1]:.2f} ms/token", file=sys.stderr, flush=True)
    tp1, tp2 = percentile(runs["tp1"], 50), percentile(runs["tp2"], 50)
    collectives = 2 * one.model.num_layers + 2

    def set_threads(name: str) -> None:
        tp_worker._set_threads(full_threads if name == "tp1" else half_threads)

    outputs = _compare_outputs(one, two, args.tokens, set_threads) if args.outputs else None
    print(json.dumps({"outputs": outputs, "weights": args.weights, "dtype": args.dtype, "tokens": args.tokens, "reps": args.reps,
                      "threads": {"tp1": full_threads, "tp2_per_rank": half_threads},
                      "ms_per_token": {"tp1": round(tp1, 3), "tp2": round(tp2, 3)}, "runs": runs,
                      "tp2_over_tp1": round(tp2 / tp1, 3),
                      # 2 all-reduces a layer, the logits gather and the step broadcast
                      "collectives_per_step": collectives,
                      "implied_ms_per_collective": round((tp2 - tp1) / collectives, 3)}, indent=1))
    two.model.close()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
