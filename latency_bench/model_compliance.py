"""Schema compliance of real constrained generation on JSONSchemaBench (the default model).

For each schema of each file: refused by `prepare_schema` (a feature xgrammar would drop) or
failing to compile counts against declared coverage; every other schema gets one constrained
request (the schema in the system prompt, `response_format` json_schema, greedy unless told)
and its output must parse and validate with `jsonschema`. Requests run `--concurrency` at a
time through one engine (continuous batching), optionally with n-gram speculation.

Figures per file:
- declared coverage = compiled / schemas;
- empirical coverage = valid outputs / schemas, and over the satisfiable ones (schemas that
  grammar/schema/lower.py proves unsatisfiable are refused with feature "unsatisfiable" and listed);
- compliance = valid / compiled;
- unfinished = outputs cut by max_tokens (inside a long string or array; not a grammar fault,
  counted as not valid and listed);
- oneOf overlap = schemas whose every failure is a `oneOf` that the instance matched more than
  once (xgrammar, like every engine, treats oneOf as anyOf; where the branches overlap no grammar
  can force exactly one match): listed, and reported apart rather than against the engine.
Also: mask fill time per row (p50/p99 µs) and its share of the engine's step time, compile time.

The files default to the sample bundled with the package (latency_bench/jsonschemabench-sample,
see its README.md); `--data DIR` reads the full JSONSchemaBench files from DIR instead.

    python -m prescient.latency_bench.model_compliance --files Glaiveai2K.jsonl --limit 100
    python -m prescient.latency_bench.model_compliance --data path/to/jsonschemabench
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import jsonschema

from prescient.grammar import GrammarError, spec_from_response_format
from prescient.latency_bench.grammar_compliance import ComplianceConfig, _percentiles
from prescient.build import EngineSpec, build_engine
from prescient.runtime.engine import Engine
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.slo import percentile
from prescient.latency_bench.suites import add_shared, suite_parser

FILES = ("Glaiveai2K.jsonl", "Github_trivial.jsonl", "Github_easy.jsonl", "Github_medium.jsonl",
         "Github_hard.jsonl")
SYSTEM = "You answer with one JSON value that follows this JSON schema:\n"
USER = "Write a realistic example instance of the schema. Reply with the JSON only."


def _prompt(engine: Engine, schema: dict) -> list[int]:
    return engine.tokenizer.apply_chat_template([
        {"role": "system", "content": SYSTEM + json.dumps(schema)},
        {"role": "user", "content": USER}])


def classify(schema: dict, text: str) -> tuple[str, str | None]:
    """('valid' | 'invalid' | 'oneof_overlap', first error message)."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as err:
        return "invalid", f"not JSON: {err}"
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = list(validator.iter_errors(instance))
    if not errors:
        return "valid", None
    # "is valid under each of": the instance matched several oneOf branches (overlapping branches)
    overlap = all(e.validator == "oneOf" and "is valid under each of" in e.message for e in errors)
    return ("oneof_overlap" if overlap else "invalid"), f"{errors[0].validator}: {errors[0].message[:200]}"


def run_file(engine: Engine, path: pathlib.Path, limit: int | None, max_tokens: int,
             concurrency: int, temperature: float, progress: bool = True, sample: int | None = None,
             seed: int = 0, **penalties) -> dict:
    """`limit`: the file's first rows; `sample`: a seeded uniform draw of that many rows instead
    (an estimate of the whole split, whose rows are not in random order)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if sample:
        import random

        picked = sorted(random.Random(seed).sample(range(len(rows)), min(sample, len(rows))))
        rows = [rows[i] for i in picked]
    rows = rows[:limit] if limit else rows
    compiler = engine.grammar_compiler()
    refused: dict[str, int] = {}
    compile_errors: list[str] = []
    compile_s: list[float] = []
    unsatisfiable: list[str] = []  # proved by grammar/schema/lower.py: no instance validates
    pending: list[tuple[dict, object]] = []  # (row, PendingGrammar)
    narrowed_ids: set[str] = set()
    narrowed_by_rule: dict[str, int] = {}
    for row in rows:
        rules: list[str] = []
        try:
            compiler.prepare_schema(row["schema"], narrowed=rules)
            if rules:
                narrowed_ids.add(row["id"])
                for rule in rules:
                    narrowed_by_rule[rule] = narrowed_by_rule.get(rule, 0) + 1
        except GrammarError as err:
            refused[err.feature] = refused.get(err.feature, 0) + 1
            if err.feature == "unsatisfiable":
                unsatisfiable.append(row["id"])
            continue
        spec = spec_from_response_format({"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": row["schema"]}})
        try:
            compiled = compiler.submit(spec).result()
        except GrammarError as err:
            compile_errors.append(f"{row['id']}: {err}")
            continue
        compile_s.append(compiled.compile_s)
        pending.append((row, compiled))

    outcomes: dict[str, list] = {"valid": [], "invalid": [], "oneof_overlap": [], "unfinished": [],
                                 "engine_error": []}
    in_flight: dict[str, tuple[dict, object]] = {}
    queue = list(pending)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0, **penalties)
    start, done = time.perf_counter(), 0
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            row, compiled = queue.pop(0)
            request = engine.add_request(_prompt(engine, row["schema"]), params, grammar=compiled)
            in_flight[request.request_id] = (row, request)
        for out in engine.step():
            if not out.finished:
                continue
            row, request = in_flight.pop(out.request_id)
            text = engine.tokenizer.decode(request.output_token_ids)
            if out.error:  # the engine ended it (overload, ...): no output for the grammar to answer for
                outcomes["engine_error"].append({"id": row["id"], "error": f"engine: {out.error}"})
            elif request.finish_reason == "length":
                outcomes["unfinished"].append({"id": row["id"], "tokens": len(request.output_token_ids)})
            else:
                kind, error = classify(row["schema"], text)
                outcomes[kind].append({"id": row["id"], "error": error, "output": text[:300]}
                                      if error else {"id": row["id"]})
            done += 1
            if progress and done % 25 == 0:
                rate = done / (time.perf_counter() - start)
                print(f"  {path.name}: {done}/{len(pending)} ({rate:.2f} schemas/s)", file=sys.stderr, flush=True)
    n, compiled_n = len(rows), len(pending)
    valid = len(outcomes["valid"])
    overlap = len(outcomes["oneof_overlap"])
    satisfiable_n = n - len(unsatisfiable) - overlap
    return {
        "schemas": n,
        "refused": sum(refused.values()),
        "refused_by_feature": dict(sorted(refused.items(), key=lambda kv: -kv[1])),
        "compile_errors": len(compile_errors),
        "compile_error_examples": compile_errors[:5],
        "compiled": compiled_n,
        # exact: the lowered schema means the original; narrowed: a narrowing rule ran
        "narrowed": sum(1 for row, _ in pending if row["id"] in narrowed_ids),
        "exact": sum(1 for row, _ in pending if row["id"] not in narrowed_ids),
        "narrowed_by_rule": dict(sorted(narrowed_by_rule.items(), key=lambda kv: -kv[1])),
        "valid_narrowed": sum(1 for o in outcomes["valid"] if o["id"] in narrowed_ids),
        "declared_coverage": compiled_n / n if n else None,
        "valid": valid,
        "invalid": len(outcomes["invalid"]),
        "unfinished": len(outcomes["unfinished"]),
        "engine_errors": len(outcomes["engine_error"]),
        "engine_error_examples": outcomes["engine_error"][:5],
        "unsatisfiable_oneof": overlap,
        "empirical_coverage": valid / n if n else None,
        "unsatisfiable_refused": len(unsatisfiable),
        "empirical_coverage_satisfiable": valid / satisfiable_n if satisfiable_n else None,
        "compliance": valid / compiled_n if compiled_n else None,
        # schemas no grammar can satisfy exactly (overlapping oneOf) left out of both counts
        "compliance_satisfiable": valid / (compiled_n - overlap) if compiled_n > overlap else None,
        "compile_time": _percentiles(compile_s),
        "seconds": time.perf_counter() - start,
        "invalid_examples": outcomes["invalid"][:20],
        "unfinished_ids": [u["id"] for u in outcomes["unfinished"]],
        "unsatisfiable_ids": [u["id"] for u in outcomes["oneof_overlap"]],
        "unsatisfiable_refused_ids": unsatisfiable,
    }


def mask_figures(engine: Engine, step_seconds: float) -> dict:
    per_row = list(engine.grammar_step.stats.mask_seconds_per_row)
    if not per_row:
        return {}
    return {"mask_us_per_row_p50": 1e6 * percentile(per_row, 50),
            "mask_us_per_row_p99": 1e6 * percentile(per_row, 99),
            "mask_share_of_step_time": engine.grammar_step.stats.mask_seconds / step_seconds if step_seconds else None}


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"Model {cfg.get('model', 'the default')} ({cfg['dtype']}), "
             f"max_tokens {cfg['max_tokens']}, temperature {cfg['temperature']}, presence / frequency penalty "
             f"{cfg['presence_penalty']} / {cfg['frequency_penalty']}, speculation "
             f"{cfg['speculate']}, {cfg['concurrency']} requests at a time, {report['seconds']:.0f} s.", "",
             "| file | schemas | refused | of them unsatisfiable | compile errors | declared coverage "
             "| exact / narrowed | valid | invalid | unfinished | oneOf overlap | empirical coverage "
             "| empirical coverage (satisfiable) | compliance | compliance (satisfiable) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    for name, r in report["files"].items():
        lines.append(f"| {name} | {r['schemas']} | {r['refused']} | {r.get('unsatisfiable_refused', 0)} "
                     f"| {r['compile_errors']} | {pct(r['declared_coverage'])} "
                     f"| {r.get('exact', '-')} / {r.get('narrowed', '-')} | {r['valid']} | {r['invalid']} "
                     f"| {r['unfinished']} | {r['unsatisfiable_oneof']} | {pct(r['empirical_coverage'])} "
                     f"| {pct(r.get('empirical_coverage_satisfiable'))} | {pct(r['compliance'])} "
                     f"| {pct(r['compliance_satisfiable'])} |")
    errors = {name: r.get("engine_errors", 0) for name, r in report["files"].items() if r.get("engine_errors")}
    if errors:  # ended by the engine (overload, ...): neither valid nor a grammar's fault
        lines += ["", "Engine errors (not counted as invalid): " + ", ".join(f"{k} {v}" for k, v in errors.items())]
    m = report.get("mask", {})
    if m:
        lines += ["", f"Mask fill per row: p50 {m['mask_us_per_row_p50']:.0f} µs, p99 {m['mask_us_per_row_p99']:.0f} µs; "
                  f"{100 * (m['mask_share_of_step_time'] or 0):.1f}% of engine step time."]
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    parser = suite_parser("model-compliance", __doc__)
    parser.add_argument("--data", default=ComplianceConfig.data_dir,
                        help="folder of JSONSchemaBench .jsonl files (default: the bundled sample)")
    parser.add_argument("--files", default=",".join(FILES), help="comma-separated .jsonl files in --data")
    parser.add_argument("--limit", type=int, default=None, help="schemas per file (default: all)")
    parser.add_argument("--max-tokens", type=int, default=512, help="max_tokens of each request")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty")
    # The 135M default model loops under greedy decoding in unbounded arrays and strings until
    # max_tokens; a frequency penalty ends the loops (GlaiveAI: 102 outputs cut at 512 tokens
    # with presence 1.5, 7 with frequency 1.0). Stated in every report.
    parser.add_argument("--frequency-penalty", type=float, default=1.0, help="frequency penalty")
    parser.add_argument("--speculate", default="off", choices=["off", "ngram"], help="speculative decoding")
    add_shared(parser, dtype=True)
    parser.add_argument("--sample", type=int, default=None,
                        help="a seeded uniform draw of this many schemas per file (instead of the first ones)")
    parser.add_argument("--seed", type=int, default=0, help="the --sample draw's seed")
    add_shared(parser, out={"help": "write the JSON report (and its .md) here (unset: Markdown on stdout only)"})
    args = parser.parse_args(argv)
    # A batch job, not a server: a request queued behind long prompts' KV waits its turn instead
    # of being refused as overloaded at the server's 30 s (a 100-schema Github_hard draw lost 8)
    engine = build_engine(EngineSpec(dtype=args.dtype, speculate=args.speculate, calibrate="now",
                                     max_queue_wait_s=float("inf")))
    report = {"config": {"max_tokens": args.max_tokens, "temperature": args.temperature,
                         "speculate": args.speculate, "concurrency": args.concurrency, "limit": args.limit,
                         "sample": args.sample, "seed": args.seed,
                         "dtype": args.dtype, "presence_penalty": args.presence_penalty,
                         "frequency_penalty": args.frequency_penalty,
                         "model": "SmolLM2-135M-Instruct Q4_1 GGUF (the default)"}, "files": {}}
    start = time.perf_counter()
    step_seconds = 0.0
    for name in args.files.split(","):
        t0 = time.perf_counter()
        report["files"][name] = run_file(engine, pathlib.Path(args.data) / name, args.limit, args.max_tokens,
                                         args.concurrency, args.temperature, sample=args.sample, seed=args.seed,
                                         presence_penalty=args.presence_penalty,
                                         frequency_penalty=args.frequency_penalty)
        step_seconds += time.perf_counter() - t0
        print(f"{name}: {json.dumps({k: v for k, v in report['files'][name].items() if not k.endswith(('ids', 'examples'))})}",
              file=sys.stderr, flush=True)
        if args.out:  # keep partial results of a long run
            pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    report["seconds"] = time.perf_counter() - start
    report["mask"] = mask_figures(engine, step_seconds)
    print(markdown(report))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
        pathlib.Path(os.path.splitext(args.out)[0] + ".md").write_text(markdown(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
