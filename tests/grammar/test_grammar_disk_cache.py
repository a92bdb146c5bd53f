"""Compiled grammars on disk across restarts (grammar/disk_cache.py): what one compiler process
compiled, the next one loads instead of compiling; entries are keyed by everything that shapes a
grammar (not by time limits or worker counts), bounded in bytes least recently used first, and a
damaged entry is a miss that is compiled again."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarSpec
from prescient.grammar.disk_cache import GrammarDiskCache, fingerprint

from .conftest import accepts_text

SPEC = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                              "required": ["n"]}))


def test_entries_round_trip_and_the_oldest_go_first_past_the_byte_bound(tmp_path):
    cache = GrammarDiskCache(tmp_path, "fp", limit_bytes=2500)
    specs = [GrammarSpec("regex", f"a{i}") for i in range(4)]
    for i, spec in enumerate(specs):
        cache.store(spec, "x" * 1000, 0.5, True)
        used = time.time() - 100 + i  # a clear order of use, all before any write to come
        os.utime(cache._path(spec), (used, used))
    assert cache.load(specs[3]) == ("x" * 1000, 0.5, True)
    assert cache.load(specs[0]) is None  # the least recently used went when the folder passed 2500 bytes
    assert sum(p.stat().st_size for p in tmp_path.glob("*.json")) <= 2500


def test_a_damaged_entry_is_a_miss_and_is_removed(tmp_path):
    cache = GrammarDiskCache(tmp_path, "fp", limit_bytes=1 << 20)
    cache.store(SPEC, "{}", 0.1, False)
    cache._path(SPEC).write_text("{not json")
    assert cache.load(SPEC) is None and not cache._path(SPEC).exists()


def test_the_key_follows_what_shapes_a_grammar_and_nothing_else():
    base = CompilerConfig()
    assert fingerprint("tok", base) == fingerprint("tok", replace(base, time_limit_s=1.0, max_workers=5))
    assert fingerprint("tok", base) != fingerprint("tok", replace(base, any_whitespace=True))
    assert fingerprint("tok", base) != fingerprint("other tokenizer", base)


def test_a_second_compiler_process_loads_what_the_first_compiled(real_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path))
    config = CompilerConfig(isolate=True, max_workers=1, time_limit_s=60, disk_cache_mb=16)
    first = GrammarCompiler(real_tokenizer, config)
    try:
        assert accepts_text(first.compile(SPEC).matcher(), real_tokenizer, '{"n": 3}')
        assert first.disk.misses == 1 and list((tmp_path / "grammars").glob("*.json"))
    finally:
        first.close()
    second = GrammarCompiler(real_tokenizer, config)  # as after a restart: an empty memory cache
    try:
        compiled = second.compile(SPEC)
        assert second.disk.hits == 1
        assert accepts_text(compiled.matcher(), real_tokenizer, '{"n": 3}')
        assert not accepts_text(compiled.matcher(), real_tokenizer, '{"n": "x"}')
    finally:
        second.close()
