"""GrammarCompiler: background compile, cache by spec, time limit, errors; regex and EBNF."""

from __future__ import annotations

import json
import threading
import time

import pytest

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarError, GrammarSpec
from prescient.grammar.schema.closed_objects import close_declared_objects

from .conftest import accepts_text

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def test_cache_hit_returns_the_same_compile(toy_tokenizer):
    compiler = GrammarCompiler(toy_tokenizer)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    first = compiler.compile(spec)
    second = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert second is first
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(GrammarSpec("regex", "ab"))
    assert (compiler.hits, compiler.misses) == (1, 2)
    compiler.close()


def test_cache_evicts_least_recently_used(toy_tokenizer):
    compiler = GrammarCompiler(toy_tokenizer, CompilerConfig(cache_size=2))
    specs = [GrammarSpec("regex", r) for r in ("a", "b", "c")]
    compiler.compile(specs[0])
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # refresh "a"
    compiler.compile(specs[2])  # evicts "b"
    misses = compiler.misses
    compiler.compile(specs[0])
    assert compiler.misses == misses
    compiler.compile(specs[1])
    assert compiler.misses == misses + 1
    compiler.close()


def test_refusals_are_cached_too(toy_compiler):
    spec = GrammarSpec("json_schema", json.dumps({"type": "array", "not": {"items": {"type": "integer"}}}))
    for _ in range(2):
        with pytest.raises(GrammarError, match="'not'"):
            toy_compiler.compile(spec)


def test_a_compile_killed_at_the_time_limit_is_compiled_again(toy_tokenizer):
    """An isolated compile killed at the limit says nothing about the schema (a loaded machine,
    a cold worker): the next request compiles it again instead of getting the cached failure."""
    from concurrent.futures import Future

    from prescient.grammar.compile_pool import _time_limit

    compiler = GrammarCompiler(toy_tokenizer)
    submitted = []

    class KilledPool:  # stands in for the worker processes: every compile dies at the limit
        def submit(self, spec):
            future = Future()
            submitted.append(spec)
            future.set_exception(_time_limit(compiler.config.time_limit_s))
            return future

        def close(self):
            pass

    compiler._procs = KilledPool()
    spec = GrammarSpec("regex", "ab")
    for attempt in (1, 2):
        with pytest.raises(GrammarError, match="time limit"):
            compiler.compile(spec)
        assert len(submitted) == attempt
    compiler.close()


def test_submit_returns_at_once_and_time_limit_refuses(real_tokenizer):
    # ~50 ms against the 49k vocabulary on a quiet machine (more under load): 25x the limit. The
    # compile is held until the test lets it go, so that it is still running when the test looks
    # (a compile of ~50 ms could otherwise end while a loaded host keeps this thread waiting).
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(time_limit_s=0.002))
    spec = GrammarSpec("regex", "[a-z]{2000,4000}")
    go = threading.Event()
    build = compiler.build
    compiler.build = lambda s: go.wait(30) and build(s)
    start = time.monotonic()
    pending = compiler.submit(spec)
    # not done: submit did not wait for the compile (which cannot end before `go`); the bound only
    # catches a submit that waits on something else, with room for a loaded host
    assert not pending.done()
    assert time.monotonic() - start < 0.5
    with pytest.raises(GrammarError, match="time limit") as info:
        pending.result()
    assert info.value.feature == "time_limit"
    go.set()
    # xgrammar cannot cancel: the compile finishes in the background and lands in the cache.
    again = compiler.submit(spec)
    assert compiler.hits == 1
    while not again.done():
        time.sleep(0.01)
    assert again.result().spec == spec
    compiler.close()


@pytest.mark.parametrize("kind,source,match", [
    ("regex", "a(b", "invalid regex"),
    ("regex", "^(?=a)a$", "lookaround"),
    ("ebnf", 'root ::= "a" undefined_rule', "invalid ebnf"),
    ("json_schema", '{"type": "integer", "minimum": "1"}', "invalid JSON schema: '1' is not of type"),
])
def test_invalid_grammars_raise_grammar_error(toy_compiler, kind, source, match):
    with pytest.raises(GrammarError, match=match):
        toy_compiler.compile(GrammarSpec(kind, source))


def test_regex_is_full_match(toy_compiler, toy_tokenizer):
    grammar = toy_compiler.compile(GrammarSpec("regex", "(ab|c)+x?"))
    for text in ["ab", "abcab", "cx"]:
        assert accepts_text(grammar.matcher(), toy_tokenizer, text), text
    for text in ["a", "abx c", "xab"]:
        assert not accepts_text(grammar.matcher(), toy_tokenizer, text), text


def test_ebnf(toy_compiler, toy_tokenizer):
    grammar = toy_compiler.compile(GrammarSpec("ebnf", 'root ::= "[" item ("," item)* "]"\n'
                                                       'item ::= "1" | "2" | "x"'))
    assert accepts_text(grammar.matcher(), toy_tokenizer, "[1,x,2]")
    assert not accepts_text(grammar.matcher(), toy_tokenizer, "[1,]")
    assert not accepts_text(grammar.matcher(), toy_tokenizer, "[1")


def test_json_object_allows_any_object_only(toy_compiler, toy_tokenizer):
    grammar = toy_compiler.compile(GrammarSpec("json_object", ""))
    assert accepts_text(grammar.matcher(), toy_tokenizer, '{"a": [1, {"b": null}]}')
    assert not accepts_text(grammar.matcher(), toy_tokenizer, "[1]")


def test_declared_objects_are_closed_by_default(toy_compiler, toy_tokenizer):
    """additionalProperties unset next to declared properties -> no undeclared keys (stricter
    than JSON Schema, still valid); free-form objects and explicit opt-ins stay open."""
    cases = [
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, False),
        ({"type": "object", "properties": {"a": {"type": "integer"}},
          "additionalProperties": True}, True),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2}, True),
        ({"type": "object"}, True),
    ]
    for schema, open_ in cases:
        grammar = toy_compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
        assert accepts_text(grammar.matcher(), toy_tokenizer, '{"a": 1, "b": 2}') == open_, schema
    grammar = toy_compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert not accepts_text(grammar.matcher(), toy_tokenizer, '{"a": 1, "b": 2}')


def test_open_objects_when_configured(toy_tokenizer):
    compiler = GrammarCompiler(toy_tokenizer, CompilerConfig(close_declared_objects=False))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert accepts_text(grammar.matcher(), toy_tokenizer, '{"a": 1, "b": 2}')
    compiler.close()


def test_close_declared_objects_touches_only_schema_positions():
    schema = {"type": "object",
              "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                             "e": {"enum": [{"properties": {"y": 1}}]}},
              "$defs": {"d": {"properties": {"z": {}}}},
              "anyOf": [{"type": "object", "properties": {"q": {}},
                         "unevaluatedProperties": True}]}
    closed = close_declared_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["e"] == schema["properties"]["e"]  # enum values untouched
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["anyOf"][0]
    assert "additionalProperties" not in schema  # input not modified


def test_valid_schema_the_engine_cannot_compile_is_named_with_its_place(toy_compiler, caplog):
    """JSON Schema accepts it; xgrammar refuses it (its own assertion): the client gets the
    feature and the pointer, not "invalid schema", and the raw message goes to the log."""
    schema = {"type": "object", "properties": {
        "box": {"properties": {"a": {}}, "additionalProperties": False, "minProperties": 2}}}
    with caplog.at_level("WARNING", logger="prescient.grammar.schema_failure"):
        with pytest.raises(GrammarError) as info:
            toy_compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert info.value.feature == "xgrammar" and info.value.path == "#/properties/box"
    assert "invalid" not in str(info.value)
    assert "minProperties" in caplog.text
