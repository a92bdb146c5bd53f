"""Decode ITL while a long prompt is prefilled: a prefill/decode split against co-located engines.

    prescient bench pd [--long-tokens 1500] [--decodes 2] [--reps 3]
    prescient bench pd --server      # the same through `prescient serve` (pd_server.py)
    (legacy: `prescient bench --pd-split ...`, `python -m prescient.latency_bench.pd_bench ...`)

Five setups in this process, runs interleaved (the order rotates each rep):
- colocated-1t: one engine on one thread; the long prompt's chunks share its steps with the decodes;
- split: this process decodes on one thread, the prefill worker prefills on the other
  (`--pd-split`, runtime/disaggregated.py): one thread per worker, as co-located-1t;
- colocated-2t: one engine on both threads (the same cores as the split, all in one worker);
- alone-1t, alone-2t: the long prompt alone, the TTFT the others are judged against (same cores).
Each run starts `--decodes` chat requests (greedy, speculation off), lets them decode 8 tokens, then
submits one long prompt (max_tokens 1). The figures: the decodes' emission gaps while the long
prompt is being prefilled (its submission to its first token): p50 / p99 / max; the long prompt's
TTFT, and for the split its parts (prefill, transfer, first decode). The KV caches are made
resident first, as `serve` makes them. Engine-level: the engine's own
emission stamps, the ones /metrics judges (the server adds the same HTTP cost to every setup).
The decodes' tokens must be equal across setups (greedy: the split changes no output).
Percentiles and medians are runtime/slo.py's (linear interpolation), as every other benchmark's.
"""

from __future__ import annotations

import json
import sys
import time

from prescient.latency_bench.suites import add_shared, suite_parser
from prescient.runtime.slo import percentile

ENGINE_DECODE_TOKENS = 160
# through the server the decodes are stopped after the long prompt's first token: room to outlast it
SERVER_DECODE_TOKENS = 1024


def _pct(xs: list[float], q: float) -> float:
    p = percentile(xs, 100 * q)
    return float("nan") if p is None else p


def _median(xs) -> float:
    return percentile(list(xs), 50)


def run_once(engine, chats: list[list[int]], long_ids: list[int], decode_tokens: int) -> dict:
    from prescient.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    engine.step_log.clear()
    decs = [engine.add_request(c, params) for c in chats]
    stamps: dict[str, list[float]] = {r.request_id: [] for r in decs}
    long_req, t_submit, t_first, split = None, None, None, None
    deadline = time.monotonic() + 600
    if not decs:  # alone: nothing to wait for
        long_req, t_submit = engine.add_request(long_ids, SamplingParams(temperature=0.0, max_tokens=1)), time.perf_counter()
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise RuntimeError("pd_bench: a run stalled")
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in stamps and out.new_token_ids:
                stamps[out.request_id].append(out.token_times[-1] if out.token_times else now)
            if long_req is not None and out.request_id == long_req.request_id and out.new_token_ids and t_first is None:
                t_first, split = (out.token_times[-1] if out.token_times else now), out.ttft_split
        if long_req is None and all(len(s) >= 8 for s in stamps.values()):
            long_req = engine.add_request(long_ids, SamplingParams(temperature=0.0, max_tokens=1))
            t_submit = time.perf_counter()
        if not outs:
            time.sleep(0.0005)  # the split waiting for pages: nothing else to run
    gaps = []
    for s in stamps.values():
        gaps += [b - a for a, b in zip(s, s[1:]) if b > t_submit and a < t_first]
    # the steps that carried prefill beside decodes: measured time and the cost model's error
    mixed = [(pred, took) for shape, pred, took in engine.step_log if shape.prefill_tokens and shape.decode_rows]
    return {"gaps_ms": [g * 1e3 for g in gaps], "ttft_ms": (t_first - t_submit) * 1e3, "split": split,
            "tokens": [r.output_token_ids for r in decs],
            "mixed_step_ms": [took * 1e3 for _, took in mixed],
            "mixed_step_ratio": [took / pred for pred, took in mixed if pred > 0]}


def cli(argv: list[str] | None = None) -> int:
    p = suite_parser("pd", __doc__, model=True, weights=True, dtype=True)
    p.add_argument("--long-tokens", type=int, default=1500, help="tokens of the long prompt")
    p.add_argument("--decodes", type=int, default=2, help="chat requests decoding beside it")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help=f"max_tokens of each decode (default: {ENGINE_DECODE_TOKENS}, --server {SERVER_DECODE_TOKENS})")
    add_shared(p, reps={"help": "runs per setup (their order rotates each rep)"})
    p.add_argument("--server", action="store_true", help="through `prescient serve` over HTTP: co-located vs "
                   "--pd-split, each with the long prompt's TTFT alone (pd_server.py)")
    add_shared(p, out={"help": "also write the JSON here (unset: stdout only)"})
    args = p.parse_args(argv)
    if args.server:
        from prescient.latency_bench.pd_server import run_server_mode

        args.decode_tokens = args.decode_tokens or SERVER_DECODE_TOKENS
        return _emit(run_server_mode(args), args.out)
    args.decode_tokens = args.decode_tokens or ENGINE_DECODE_TOKENS
    return _engine_mode(args)


def _emit(report: dict, out_path: str | None) -> int:
    out = json.dumps(report, indent=1)
    print(out)
    if out_path:
        with open(out_path, "w") as f:
            f.write(out + "\n")
    return 0


def _engine_mode(args) -> int:
    from dataclasses import replace

    import torch

    from prescient.build import EngineSpec, build_engine, load_model
    from prescient.latency_bench.workloads import filler_text, load_workloads
    from prescient.runtime.tp_worker import _set_threads

    spec = EngineSpec(model=args.model, dtype=args.dtype, weights=args.weights, speculate="off", calibrate="off",
                      kv_cache_gb=0.5, progress=False, enable_prefix_caching=False)
    full = torch.get_num_threads()
    loaded = load_model(spec)
    colocated = build_engine(spec, loaded)
    split = build_engine(replace(spec, pd_split=True), loaded)  # this process now on one thread
    for engine in (colocated, split):  # resident, as `serve` makes them (runtime/memory.py)
        engine.prefault_kv().join()
    tok = loaded.tokenizer
    workloads, _ = load_workloads()
    chats = [tok.apply_chat_template(list(w.messages)) for w in workloads[:args.decodes]]
    filler = tok.encode(filler_text(workloads))
    long_ids = (filler * (args.long_tokens // max(1, len(filler)) + 1))[:args.long_tokens]
    # alone-*: the long prompt with nothing else running, the TTFT it is judged by under load
    setups = {"colocated-1t": (colocated, 1), "split": (split, 1), "colocated-2t": (colocated, full),
              "alone-1t": (colocated, 1), "alone-2t": (colocated, full)}
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    names = list(setups)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            engine, threads = setups[name]
            _set_threads(threads)
            r = run_once(engine, [] if name.startswith("alone") else chats, long_ids, args.decode_tokens)
            runs[name].append(r)
            print(f"rep {rep} {name}: gap p99 {_pct(r['gaps_ms'], 0.99):.1f} ms, long TTFT {r['ttft_ms']:.0f} ms",
                  file=sys.stderr, flush=True)
    ref = runs["colocated-1t"][0]["tokens"]
    alone = {n: _median(r["ttft_ms"] for r in runs.pop(n)) for n in ("alone-1t", "alone-2t")}
    # what each setup's long TTFT is judged against: alone on the same cores
    same_cores = {"colocated-1t": "alone-1t", "split": "alone-2t", "colocated-2t": "alone-2t"}
    report = {"model": args.model or "default", "weights": args.weights, "dtype": args.dtype,
              "long_prompt_tokens": len(long_ids), "decodes": args.decodes, "reps": args.reps,
              "threads": {"colocated-1t": 1, "split": "1 + 1 (prefill worker)", "colocated-2t": full},
              "outputs_equal": all(r["tokens"] == ref for rs in runs.values() for r in rs), "setups": {},
              "long_ttft_alone_ms": {n: round(t, 1) for n, t in alone.items()}}
    for name, rs in runs.items():
        gaps = [g for r in rs for g in r["gaps_ms"]]
        entry = {"gaps": len(gaps), "itl_p50_ms": round(_pct(gaps, 0.5), 1), "itl_p99_ms": round(_pct(gaps, 0.99), 1),
                 "itl_max_ms": round(max(gaps), 1) if gaps else None,
                 "long_ttft_ms": round(_median(r["ttft_ms"] for r in rs), 1)}
        steps = [t for r in rs for t in r["mixed_step_ms"]]
        ratios = [x for r in rs for x in r["mixed_step_ratio"]]
        if steps:  # steps with prefill beside decodes: their time, and measured / predicted
            entry["mixed_steps"] = {"n": len(steps), "p50_ms": round(_pct(steps, 0.5), 1),
                                    "p99_ms": round(_pct(steps, 0.99), 1), "max_ms": round(max(steps), 1),
                                    "measured_over_predicted_p50": round(_pct(ratios, 0.5), 2),
                                    "measured_over_predicted_p99": round(_pct(ratios, 0.99), 2)}
        if rs[0]["split"]:
            entry["long_ttft_split_ms"] = {k.removesuffix("_s"): round(1e3 * _median(r["split"][k] for r in rs), 1)
                                           for k in rs[0]["split"]}
        entry["long_ttft_vs_alone"] = round(entry["long_ttft_ms"] / alone[same_cores[name]], 2)
        report["setups"][name] = entry
    kv = loaded.model.kv_bytes_per_token()
    report["kv_bytes_per_token"] = kv
    sp = report["setups"]["split"].get("long_ttft_split_ms", {})
    if sp.get("transfer"):
        report["transfer_us_per_token"] = round(1e3 * sp["transfer"] / len(long_ids), 2)
    split.remote_prefill.close()
    return _emit(report, args.out)


if __name__ == "__main__":
    sys.exit(cli())
