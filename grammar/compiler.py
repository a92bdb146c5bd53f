"""GrammarCompiler: one per tokenizer; compiles GrammarSpecs in the background, cached by spec.

`submit(spec)` is called when a request arrives and returns at once; the compile runs on a small
thread pool (xgrammar releases the GIL) so it overlaps queueing and prefill, or, with
`CompilerConfig(isolate=True)` (the engine's compiler), in worker processes at low priority
(compile_pool.py). The engine asks `pending.done()` without blocking and calls `pending.result()`
when the request needs its first mask. The time limit runs from submission: a request whose
grammar is not ready by then fails with GrammarError. On the thread pool xgrammar cannot cancel
a compile, so it finishes in the background and its result still lands in the cache (a repeat of
the same spec waits on that same compile); a worker process is killed at the limit instead, and
the refusal is what the cache keeps.

Every JSON schema that reaches xgrammar, tool argument schemas included, is first rewritten into
a form xgrammar enforces exactly (schema/lower.py), passes `check_schema` (schema/check.py:
nothing is silently weakened), then has its declared objects closed (schema/closed_objects.py)
and is converted to EBNF (patterns through pattern.py), rewritten to compile faster in the same
language (open_keys.py, rule_dedupe.py) before xgrammar compiles it.

`CompilerConfig.backend` picks the engine: "xgrammar" (all of the above), "llguidance"
(llg_backend.py: the same prepared schema, compiled in-process on the thread pool in
milliseconds, strict; kinds it cannot translate exactly are refused by name) or "auto" (llguidance
first for JSON schemas and json_object, xgrammar, by its usual path, for whatever llguidance
refuses and for regex, EBNF and tool calls; with worker processes, xgrammar also compiles a
schema llguidance served once it recurs, and serves its later requests). Either way the result is a
CompiledGrammar whose matchers share one interface.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import xgrammar as xgr

from prescient.cache_dir import cache_dir
from prescient.grammar.compile_pool import CompilePool
from prescient.grammar.disk_cache import GrammarDiskCache, fingerprint
from prescient.grammar.errors import GrammarError
from prescient.grammar.forced_bound import forced_spans_safe
from prescient.grammar.llg_backend import (
    BACKENDS,
    LLGGrammar,
    LLGMatcher,
    compile_llguidance,
    layout,
    llg_tokenizer,
    llguidance_available,
)
from prescient.grammar.matcher import Matcher
from prescient.grammar.pattern import (
    check_pattern,
    has_pattern,
    schema_ebnf_with_patterns,
)
from prescient.grammar.open_keys import share_key_tails
from prescient.grammar.rule_dedupe import dedupe_rules
from prescient.grammar.schema.check import check_schema
from prescient.grammar.schema.closed_objects import close_declared_objects
from prescient.grammar.schema.lower import lower_schema
from prescient.grammar.schema_failure import schema_failure
from prescient.grammar.spec import GrammarSpec
from prescient.grammar.tokenizer import GrammarTokenizer
from prescient.grammar.tools import tool_call_structural_tag

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[19:47:55] /project/cpp/x.cc:5082: "


@dataclass(frozen=True)
class CompilerConfig:
    # a compile's own run (isolate: from when a worker takes it, not its wait in the queue;
    # in-process: from submission, since nothing can stop a compile there)
    time_limit_s: float = 10.0
    max_workers: int = 2  # grammars compiled at once
    xgrammar_threads: int = 2  # threads inside one xgrammar compile
    # Compile in `max_workers` worker processes (compile_pool.py: low priority, no shared GIL,
    # killed at the time limit) instead of this process's threads. The engine's compiler does.
    isolate: bool = False
    cache_size: int = 512  # compiled grammars kept, least recently used evicted
    # JSON layout. False fixes it to json.dumps' default (", " and ": ", one line): forced
    # spans then cover whole keys (`{"location": "` is one jump-forward span instead of none)
    # and a small model cannot loop on whitespace. True allows any whitespace between tokens.
    any_whitespace: bool = False
    max_whitespace: int | None = None  # with any_whitespace: cap on one whitespace run
    # Objects that declare properties get additionalProperties: false when unset (see
    # schema/closed_objects.py): ~50x faster compiles, and the model writes only declared keys.
    close_declared_objects: bool = True
    # Worker processes run at this nice value: a heavy compile takes the CPU the engine and the
    # event loop leave over instead of slowing every stream's steps.
    nice: int = 10
    # xgrammar's own cache, in MiB (0: off), per compiling process. It keeps token masks per
    # rule, so a pattern or subschema met in an earlier grammar costs nothing in the next one
    # (a schema repeating another's `^[a-zA-Z0-9_]{1,500}$`: 0.85 s -> 7 ms); ~2-4 MB a grammar.
    xgrammar_cache_mb: int = 128
    # Compiled grammars kept on disk across restarts (grammar/disk_cache.py, cache_dir("grammars"),
    # least recently used evicted past this many MiB; 0: off). Worker-process compiles only.
    disk_cache_mb: int = 0
    # Grammar engine (llg_backend.py): "xgrammar"; "llguidance" (faster compiles, slower masks,
    # refuses what it cannot enforce exactly, tool calls and EBNF included); "auto" (llguidance
    # where it accepts the grammar exactly, else xgrammar).
    backend: str = "xgrammar"

    def __post_init__(self) -> None:
        if (self.time_limit_s <= 0 or self.max_workers < 1 or self.cache_size < 1 or not 0 <= self.nice <= 19
                or self.xgrammar_cache_mb < 0 or self.disk_cache_mb < 0 or self.backend not in BACKENDS):
            raise ValueError(f"invalid CompilerConfig {self}")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    spec: GrammarSpec
    handle: xgr.CompiledGrammar | LLGGrammar
    tokenizer: GrammarTokenizer
    compile_s: float
    # False when the grammar may force runs too long to look up each step (forced_bound.py):
    # its matchers then propose no forced spans.
    forced_spans: bool = True

    @property
    def backend(self) -> str:
        """The engine that compiled it: "xgrammar" or "llguidance"."""
        return "llguidance" if isinstance(self.handle, LLGGrammar) else "xgrammar"

    def matcher(self) -> Matcher:
        if isinstance(self.handle, LLGGrammar):
            return LLGMatcher(self.handle, self.tokenizer, forced_spans=self.forced_spans)
        return Matcher(self.handle, self.tokenizer, forced_spans=self.forced_spans)


class PendingGrammar:
    """A compile in flight (or done); `result()` honors the deadline set at submission (None: the
    worker process enforces the limit on the compile's own run, so the waiter sets none)."""

    def __init__(self, spec: GrammarSpec, future: Future, deadline: float | None, time_limit_s: float):
        self.spec = spec
        self._future = future
        self._deadline = deadline
        self._time_limit_s = time_limit_s

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> CompiledGrammar:
        try:
            return self._future.result(timeout=self._wait_s())
        except FutureTimeout:
            raise self._late() from None

    async def wait(self) -> CompiledGrammar:
        """`result()` for asyncio code, holding no thread while it waits. (Shielded: the compile
        is shared through the cache, so one waiter giving up must not cancel it.)"""
        done = asyncio.wrap_future(self._future)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: no "never retrieved" log
        try:
            await asyncio.wait_for(asyncio.shield(done), self._wait_s())
        except TimeoutError:
            raise self._late() from None
        return self._future.result()

    def _wait_s(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _late(self) -> GrammarError:
        return GrammarError(f"grammar compile exceeded the {self._time_limit_s:g} s time limit",
                            feature="time_limit")


class GrammarCompiler:
    def __init__(self, tokenizer: GrammarTokenizer, config: CompilerConfig = CompilerConfig()):
        self.tokenizer = tokenizer
        self.config = config
        # Ours caches whole grammars by spec, refusals too; xgrammar's, bounded in bytes, is kept
        # for what ours cannot share: masks of rules that recur across different grammars.
        self._xgr = xgr.GrammarCompiler(
            tokenizer.info, max_threads=config.xgrammar_threads,
            cache_enabled=config.xgrammar_cache_mb > 0, cache_limit_bytes=config.xgrammar_cache_mb << 20,
        )
        self._pool = ThreadPoolExecutor(config.max_workers, thread_name_prefix="grammar")
        self.disk = None
        if config.isolate and config.backend != "llguidance" and config.disk_cache_mb > 0:
            self.disk = GrammarDiskCache(cache_dir("grammars"), fingerprint(tokenizer.info.serialize_json(), config),
                                         config.disk_cache_mb << 20)
        # worker processes serve xgrammar compiles only: under "llguidance" none are started
        isolate = config.isolate and config.backend != "llguidance"
        self._procs = CompilePool(tokenizer, config, self._result, self.build, self.disk) if isolate else None
        if config.backend != "xgrammar" and llguidance_available():
            llg_tokenizer(tokenizer)  # its vocabulary scan (~0.6 s) now, not in the first compile
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._upgrading: set[GrammarSpec] = set()  # auto: schemas xgrammar was asked to compile too
        self.hits = 0
        self.misses = 0
        self._builders = {
            "json_schema": self._json_schema,
            "json_object": self._json_object,
            "regex": self._regex,
            "ebnf": self._ebnf,
            "tool_calls": self._tool_calls,
        }

    def submit(self, spec: GrammarSpec) -> PendingGrammar:
        start = time.monotonic()
        fresh = None
        with self._lock:
            future = self._cache.get(spec)
            hit = future is not None
            if hit:
                self.hits += 1
                self._cache.move_to_end(spec)
            else:
                self.misses += 1
                future = self._start(spec)
                self._cache[spec] = future
                if len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
                fresh = future
        if fresh is not None:  # outside the lock: a future already done runs the callback here
            fresh.add_done_callback(lambda f, spec=spec: self._forget_if_timed_out(spec, f))
        if hit and self.config.backend == "auto":
            self._maybe_upgrade(spec, future)
        limit = self.config.time_limit_s
        # in worker processes the limit runs on the compile itself (CompilePool); in-process
        # nothing can stop a compile, so the waiter's limit runs from submission. (An llguidance
        # compile is in-process but bounded by its own limits: under "auto" with worker processes
        # the limit is the xgrammar fallback's.)
        in_process = self._procs is None or self._backend_for(spec) == "llguidance"
        return PendingGrammar(spec, future, start + limit if in_process else None, limit)

    def _backend_for(self, spec: GrammarSpec) -> str:
        """The backend that compiles `spec`: "auto" stays "auto" only where llguidance may serve."""
        backend = self.config.backend
        if backend == "auto" and spec.kind not in ("json_schema", "json_object"):
            # regex / EBNF / tool calls: xgrammar's dialects and structural tags, its own path
            return "xgrammar"
        return backend

    def _xgrammar_future(self, spec: GrammarSpec) -> Future:
        return self._procs.submit(spec) if self._procs is not None else self._pool.submit(self.build, spec)

    def _start(self, spec: GrammarSpec) -> Future:
        backend = self._backend_for(spec)
        if backend == "xgrammar":
            return self._xgrammar_future(spec)
        if backend == "llguidance":
            return self._pool.submit(self.build_llguidance, spec)
        # auto: llguidance (milliseconds, in-process); on its refusal, xgrammar's compile. A
        # schema that recurs is then compiled by xgrammar too (_maybe_upgrade). One xgrammar
        # compiled before (the disk cache) serves at once.
        if self.disk is not None and self.disk.has(spec):
            return self._xgrammar_future(spec)
        outer: Future = Future()

        def copy(done: Future) -> None:
            err = done.exception()
            outer.set_exception(err) if err is not None else outer.set_result(done.result())

        def fall_back(first: Future) -> None:
            err = first.exception()
            if err is None:
                outer.set_result(first.result())
            elif isinstance(err, GrammarError) and err.feature != "llguidance":
                outer.set_exception(err)  # prescient's own lowering refused it: so would xgrammar's path
            else:  # llguidance refused (or crashed): xgrammar decides, its own refusal is the answer
                self._xgrammar_future(spec).add_done_callback(copy)

        self._pool.submit(self.build_llguidance, spec).add_done_callback(fall_back)
        return outer

    def _maybe_upgrade(self, spec: GrammarSpec, served: Future) -> None:
        """Under auto with worker processes, on a cache hit of a grammar llguidance served: the
        schema recurs, so xgrammar compiles it too (nice'd, in a worker) and serves its later
        requests, its masks costing about a quarter of llguidance's (a tenth at p99, `prescient
        bench grammar-backends`). Only while a worker is idle and nothing is queued, so it never
        delays a compile a request waits for; once per schema. Called outside self._lock."""
        if self._procs is None or not served.done() or served.cancelled() or served.exception() is not None:
            return
        if served.result().backend != "llguidance" or not self._procs.idle():
            return
        with self._lock:
            if spec in self._upgrading:
                return
            self._upgrading.add(spec)
        self._procs.submit(spec).add_done_callback(lambda done: self._upgrade(spec, served, done))

    def _upgrade(self, spec: GrammarSpec, served: Future, xgrammar: Future) -> None:
        """xgrammar's compile replaces llguidance's grammar in the cache (later requests only;
        matchers already made keep their engine). Its failure (a refusal, the time limit)
        leaves llguidance's in place, and the schema is not tried again."""
        if xgrammar.cancelled() or xgrammar.exception() is not None:
            return
        with self._lock:
            self._upgrading.discard(spec)  # served by xgrammar from now (or evicted: may try again)
            if self._cache.get(spec) is served:
                self._cache[spec] = xgrammar

    def _forget_if_timed_out(self, spec: GrammarSpec, future: Future) -> None:
        """A compile killed at the time limit is not cached: the schema is not known to be too
        hard (a loaded machine, a cold worker), so the next request for it compiles again.
        Refusals and successes stay cached."""
        err = None if future.cancelled() else future.exception()
        if isinstance(err, GrammarError) and getattr(err, "feature", None) == "time_limit":
            with self._lock:
                if self._cache.get(spec) is future:
                    del self._cache[spec]

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking submit + result."""
        return self.submit(spec).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._procs is not None:
            self._procs.close()

    # --- per-kind builders (run on the pool, or in a worker process) -----------------------

    def build(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` in the calling thread (no cache, no time limit)."""
        start = time.perf_counter()
        try:
            handle = self._builders[spec.kind](spec.source)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            if spec.kind == "json_schema":
                # the schema passed prepare_schema: xgrammar's message is about its own limits
                # (schema_failure.py), not something to show the client as "invalid schema"
                raise self._schema_failure(spec.source, err) from err
            # xgrammar reports an invalid grammar or regex as RuntimeError; keep the
            # message's last line (the first names xgrammar's source file).
            lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            message = _LOG_PREFIX.sub("", lines[-1]) if lines else type(err).__name__
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {message}",
                               feature=spec.kind) from err
        return self._result(spec, handle, time.perf_counter() - start, forced_spans_safe(str(handle.grammar)))

    def build_llguidance(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` with llguidance in the calling thread (GrammarError if it cannot serve
        it exactly). Forced spans are offered: llguidance computes each forced run itself, and
        Matcher caps the text it tokenizes (MAX_FORCED_CHARS)."""
        start = time.perf_counter()
        if not llguidance_available():
            raise GrammarError("the llguidance grammar backend needs llguidance (pip install prescient[llguidance])",
                               feature="llguidance")
        try:
            handle = compile_llguidance(spec, self.tokenizer,
                                        json_options=layout(self.config.any_whitespace, self.config.max_whitespace),
                                        prepare_schema=self.prepare_schema)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as err:
            raise GrammarError(f"llguidance refused the {spec.kind.replace('_', ' ')}: {err}",
                               feature="llguidance") from err
        return CompiledGrammar(spec, handle, self.tokenizer, time.perf_counter() - start)

    def _schema_failure(self, source: str, err: Exception) -> GrammarError:
        try:
            original = json.loads(source)
            prepared = close_declared_objects(lower_schema(original, closing=self.config.close_declared_objects))
        except Exception:  # noqa: BLE001 - it lowered once already; only the location is lost
            original = prepared = None
        return schema_failure(original, prepared, err, self._json_options())

    def _result(self, spec: GrammarSpec, handle: xgr.CompiledGrammar, compile_s: float,
                forced_spans: bool) -> CompiledGrammar:
        return CompiledGrammar(spec, handle, self.tokenizer, compile_s, forced_spans)

    def _json_options(self) -> dict:
        # strict_mode=False keeps JSON Schema's meaning (undeclared keys allowed unless the
        # schema says otherwise); closing declared objects is done on the schema instead.
        return dict(any_whitespace=self.config.any_whitespace, strict_mode=False,
                    max_whitespace_cnt=self.config.max_whitespace)

    def prepare_schema(self, schema: object, narrowed: list[str] | None = None) -> object:
        """The schema xgrammar gets: lowered (schema/lower.py), checked (GrammarError names a
        feature xgrammar would drop), its declared objects closed. `narrowed`, when given,
        gets the names of the narrowing (not exact) rewrites the lowering used."""
        closing = self.config.close_declared_objects
        schema = lower_schema(schema, closing=closing, narrowed=narrowed)
        check_schema(schema)
        return close_declared_objects(schema) if closing else schema

    def _json_schema(self, source: str) -> xgr.CompiledGrammar:
        return self._xgr.compile_grammar(self._schema_grammar(json.loads(source)))

    def _json_object(self, source: str) -> xgr.CompiledGrammar:
        return self._xgr.compile_json_schema('{"type": "object"}', **self._json_options())

    def _regex(self, source: str) -> xgr.CompiledGrammar:
        check_pattern(source)
        return self._xgr.compile_regex(source)

    def _ebnf(self, source: str) -> xgr.CompiledGrammar:
        return self._xgr.compile_grammar(source)

    def _tool_calls(self, source: str) -> xgr.CompiledGrammar:
        return self._xgr.compile_structural_tag(tool_call_structural_tag(source, self._schema_grammar))

    def _schema_grammar(self, schema: object) -> str:
        """EBNF for a JSON schema (a response format's or a tool's arguments): prepared, converted
        by xgrammar, then rewritten to compile faster in the same language: open objects' key
        tries share their free tails (open_keys.py) and repeated rules are merged
        (rule_dedupe.py). Together ~10x on the slowest Github_hard schemas."""
        schema = self.prepare_schema(schema)
        if has_pattern(schema):  # see pattern.py: xgrammar's own pattern FSM over-accepts
            ebnf = schema_ebnf_with_patterns(schema, self._schema_ebnf)
        else:
            ebnf = self._schema_ebnf(json.dumps(schema))
        return dedupe_rules(share_key_tails(ebnf))

    def _schema_ebnf(self, schema_json: str) -> str:
        return str(xgr.Grammar.from_json_schema(schema_json, **self._json_options()))
