"""`prescient train-head`: train the EAGLE draft head of a model on its own outputs.

The command line over speculative/head_train.py's phases (its docstring has the pipeline):
load the target, generate its greedy and sampled replies to the bundled prompts, take their
features, fit the head and write it where `--speculate auto|eagle` looks for it
(speculative/eagle_head.default_head_path); then measure it beside n-gram and write the verdict
`--speculate auto` reads (speculative/head_verdict.py; `--verdict-only` measures an existing
head). Here rather than in speculative/ because it builds engines (prescient/build.py), which the
layers below may not import.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from prescient.speculative.eagle import fingerprint as target_id, lm_head_rows
from prescient.speculative.eagle_head import EagleHead, default_head_path
from prescient.speculative.head_verdict import kernel_tier
from prescient.speculative.head_train import (PROMPTS, Seq, _log, collect_features, draft_vocab, embedder,
                                               fit_branch_scale, generate_outputs, init_head, load_data,
                                               load_prompts, render_prompts, save_data, split_holdout, train_head)

PROG = "prescient train-head"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG,
                                description="Train an EAGLE draft head on the target's own outputs.")
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", help="the target's activations, as the server runs it")
    p.add_argument("--prompts", default=str(PROMPTS), help="JSONL of {'messages': [...]} (default: the bundled set)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    # the defaults: ~230k generated tokens, ~35 minutes on a 2-core Zen 4 (four times the data of
    # one sample at 128 tokens, which held out acc@1 0.36 and drafted 0.86x n-gram's speed; these 0.39
    # and 0.96x, docs/CPU_PERFORMANCE.md)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled outputs (the other is greedy)")
    p.add_argument("--samples", type=int, default=3, help="sampled outputs per prompt, beside the greedy one")
    p.add_argument("--max-num-seqs", type=int, default=16, help="generation batch")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--minutes", type=float, default=40.0, help="training time limit")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded rows per minibatch")
    p.add_argument("--noise", type=float, default=0.1, help="input-feature noise, in units of each dimension's std")
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of prompts held out for acc@1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads while training")
    p.add_argument("--out", default=None, help="the head file (default: where the runtime looks for this target's)")
    p.add_argument("--save-data", default=None, metavar="PATH", help="keep the generated tokens and features here")
    p.add_argument("--load-data", default=None, metavar="PATH", help="train on tokens and features saved before")
    p.add_argument("--no-verdict", action="store_true",
                   help="skip measuring the head beside n-gram after training (auto then leaves it to "
                   "--speculate eagle)")
    p.add_argument("--verdict-only", action="store_true",
                   help="train nothing: measure the head already where the runtime looks for it beside n-gram "
                   "and write its verdict (after a kernel change, or for a shipped head)")
    p.add_argument("--verdict-workloads", type=int, default=None, metavar="N",
                   help="measure on the first N bundled workloads (default: all 11)")
    return p


def measure_verdict(args, loaded, head_path: str) -> dict:
    """The head beside n-gram as `--speculate auto` would run them: greedy batch-1 decoding of the
    bundled workloads (latency_bench/workloads.jsonl: chat, tool_call, long_edit), each prompt
    through both engines, the order alternating (spec-check's `decode_interleaved`), decode tok/s
    over all of them (tokens after the first / time after the first). Both are lossless, so their
    outputs must be equal; the verdict says the head pays when its tok/s is at least PAYS_RATIO
    times n-gram's on this kernel tier."""
    import dataclasses

    from prescient.build import EngineSpec, build_engine
    from prescient.latency_bench.spec_check import decode_interleaved
    from prescient.latency_bench.workloads import load_workloads
    from prescient.speculative.head_verdict import PAYS_RATIO, file_sha256

    base = EngineSpec(model=args.model, dtype=args.dtype, calibrate="now")
    engines = {m: build_engine(dataclasses.replace(base, speculate=m), loaded) for m in ("ngram", "eagle")}
    workloads, _ = load_workloads()
    workloads = workloads[:args.verdict_workloads] if args.verdict_workloads else workloads
    totals: dict = {}
    outputs = decode_interleaved(engines, loaded.tokenizer, workloads, 0.0, totals, alternate=True)
    identical = sum(o["ngram"] == o["eagle"] for o in outputs)
    rate = {}
    for m in engines:
        tokens = sum(v[0] for (_, name), v in totals.items() if name == m)
        secs = sum(v[1] for (_, name), v in totals.items() if name == m)
        rate[m] = tokens / secs if secs > 0 else 0.0
    ratio = rate["eagle"] / rate["ngram"] if rate["ngram"] > 0 else 0.0
    return {"tier": kernel_tier(), "head_sha256": file_sha256(head_path), "workloads": len(workloads),
            "ngram_tok_s": round(rate["ngram"], 2), "eagle_tok_s": round(rate["eagle"], 2),
            "eagle_over_ngram": round(ratio, 3), "pays": ratio >= PAYS_RATIO,
            "identical_outputs": identical, "dtype": args.dtype,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _write_verdict(args, loaded, head_path: str) -> None:
    from prescient.speculative.head_verdict import write_verdict

    _log("measuring the head beside n-gram (greedy, the bundled workloads, interleaved) ...")
    verdict = measure_verdict(args, loaded, head_path)
    path = write_verdict(head_path, verdict)
    _log(f"verdict: eagle {verdict['eagle_tok_s']} tok/s vs ngram {verdict['ngram_tok_s']} "
         f"({verdict['eagle_over_ngram']}x, outputs identical {verdict['identical_outputs']}/{verdict['workloads']}) "
         f"on tier {verdict['tier']}: --speculate auto {'takes' if verdict['pays'] else 'does not take'} "
         f"the head ({path})")


def _make_data(args, loaded, fingerprint: str, data_meta: dict, timings: dict) -> list[Seq]:
    """Generate the outputs and their features (the target's part of the work)."""
    from prescient.build import EngineSpec, build_engine

    chats = load_prompts(args.prompts, args.limit)
    prompts = render_prompts(loaded.tokenizer, chats)
    # an offline batch: no latency bound shapes its steps, and no request is shed for waiting
    # (a step of 16 prefills can take many seconds on a loaded machine)
    spec = EngineSpec(model=args.model, dtype=args.dtype, speculate="off", calibrate="off",
                      max_num_seqs=args.max_num_seqs, kv_cache_gb=0.5, itl_target_ms=None,
                      max_queue_wait_s=float("inf"))
    engine = build_engine(spec, loaded)
    t = time.perf_counter()
    _log(f"generating: {len(prompts)} prompts x (greedy, {args.samples} sampled at T={args.temperature}), "
         f"up to {args.max_new_tokens} tokens each")
    samples = generate_outputs(engine, prompts, args.max_new_tokens, args.temperature, args.seed,
                               samples=args.samples)
    timings["generate_s"] = time.perf_counter() - t
    del engine  # its KV cache
    t = time.perf_counter()
    seqs = collect_features(loaded.model, samples)
    timings["features_s"] = time.perf_counter() - t
    if args.save_data:
        save_data(args.save_data, seqs, fingerprint, data_meta)
        _log(f"data saved to {args.save_data}")
    return seqs


def _fit(args, model, seqs: list[Seq], fingerprint: str, eos: Sequence[int]):
    """The draft vocab, the head and its training. -> (head, history, init branch scale)."""
    ids = draft_vocab((s.tokens[s.prompt_len:].tolist() for s in seqs), args.draft_vocab, model.config.vocab_size, eos)
    train, held = split_holdout(seqs, args.holdout, args.seed)
    _log(f"{len(seqs)} sequences ({sum(len(s.tokens) for s in seqs)} tokens, "
         f"{sum(len(s.tokens) - s.prompt_len for s in seqs)} generated), {len(held)} held out; draft vocab {len(ids)}")
    torch.set_num_threads(max(1, args.threads))  # the model's forwards may have left it at 1
    embed, w_d = embedder(model), lm_head_rows(model, ids)
    head = init_head(model, ids, fingerprint, args.seed)
    scale = fit_branch_scale(head, w_d, train, embed)
    _log(f"the head's layer starts as the target's last, its branches scaled by {scale:g}")
    history = train_head(head, w_d, train, held, embed, epochs=args.epochs, minutes=args.minutes, lr=args.lr,
                         batch_tokens=args.batch_tokens, noise=args.noise, seed=args.seed)
    return head, history, scale


def _meta(args, argv, head: EagleHead, seqs: list[Seq], data_meta: dict, history: list[dict], scale: float,
          timings: dict) -> dict:
    """What the head file says about how it was made."""
    last = history[-1] if history else {}
    return {
        "command": " ".join([PROG] + list(sys.argv[1:] if argv is None else argv)),
        "model": args.model or "default", "prompts": len({s.prompt_index for s in seqs}), "sequences": len(seqs),
        "tokens": sum(len(s.tokens) for s in seqs), "generated_tokens": sum(len(s.tokens) - s.prompt_len for s in seqs),
        "data": data_meta, "init_branch_scale": scale, "draft_vocab": head.cfg.draft_vocab, "epochs": len(history),
        "minutes": round(last.get("minutes", 0.0), 2), "train_loss": last.get("train_loss"),
        "held_acc1": last.get("held_acc1"), "held_in_vocab": last.get("held_in_vocab"),
        "cpu_isa": kernel_tier(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from prescient.build import EngineSpec, load_model

    timings: dict[str, float] = {}
    t = time.perf_counter()
    loaded = load_model(EngineSpec(model=args.model, dtype=args.dtype, speculate="off", calibrate="off"))
    fingerprint = target_id(loaded.model)
    timings["load_s"] = time.perf_counter() - t
    if args.verdict_only:
        from prescient.speculative.eagle import head_path_for

        head_path = head_path_for(loaded.model)
        if not os.path.exists(head_path):
            _log(f"no head at {head_path}: train one first")
            return 1
        _write_verdict(args, loaded, head_path)
        return 0
    data_meta = {"prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                 "temperature": args.temperature, "samples": args.samples}
    if args.load_data:
        seqs, data_meta = load_data(args.load_data, fingerprint)
        _log(f"{len(seqs)} sequences loaded from {args.load_data}")
    else:
        seqs = _make_data(args, loaded, fingerprint, data_meta, timings)
    if not seqs:
        _log("no sequences to train on")
        return 1
    t = time.perf_counter()
    eos = tuple(loaded.eos_token_ids) or tuple(getattr(loaded.tokenizer, "eos_token_ids", ()))
    head, history, scale = _fit(args, loaded.model, seqs, fingerprint, eos)
    timings["train_s"] = time.perf_counter() - t
    out = Path(args.out) if args.out else default_head_path(fingerprint)
    from prescient.speculative.head_verdict import verdict_path

    verdict_path(str(out)).unlink(missing_ok=True)  # the old head's measurement is not this one's
    head.save(str(out), _meta(args, argv, head, seqs, data_meta, history, scale, timings))
    _log(f"head saved to {out} ({', '.join(f'{k} {v:.1f} s' for k, v in timings.items())})")
    if args.no_verdict:
        return 0
    if out != default_head_path(fingerprint):
        _log("no verdict: the head is not where the runtime looks for it (--out); "
             "measure it there with --verdict-only")
        return 0
    _write_verdict(args, loaded, str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
