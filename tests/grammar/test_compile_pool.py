"""CompilerConfig(isolate=True): compiles in low-priority worker processes, results and refusals
as in-process, a compile past the time limit killed (and tried afresh next time: a busy machine
is not the schema's fault), the limit counted from when a worker takes the compile."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarError, GrammarSpec
from prescient.grammar.compile_pool import STARVED_WALL_FACTOR

from .conftest import accepts_text

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# A schema from the bundled jsonschemabench sample that takes ~1-2 s to compile on 2 cores (its
# patterns' bounded repeats; o6290, an open object, compiles in ~0.1 s since open_keys.py).
SLOW_ID = "o42855"


def _slow_schema() -> str:
    from prescient.latency_bench.bundled import jsonschemabench_file

    for line in jsonschemabench_file("Github_medium.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["id"] == SLOW_ID:
            return json.dumps(row["schema"])
    raise LookupError(SLOW_ID)


def _until_up(compiler: GrammarCompiler) -> None:
    """Wait until both warm workers can compile (each takes ~2.5 s to start): a test that counts
    on "the other worker" must not find it still importing."""
    deadline = time.monotonic() + 60
    while compiler._procs.ready_workers < 2:
        assert time.monotonic() < deadline, "the compile workers did not start"
        time.sleep(0.05)


def test_workers_compile_like_the_process_does(real_tokenizer):
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(isolate=True, time_limit_s=30))
    try:
        compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
        assert accepts_text(compiled.matcher(), real_tokenizer, '{"a": 12}')
        assert not accepts_text(compiled.matcher(), real_tokenizer, '{"a": "x"}')
        with pytest.raises(GrammarError, match="invalid regex") as err:
            compiler.compile(GrammarSpec("regex", "a(b"))
        assert err.value.feature == "regex"
        with pytest.raises(GrammarError, match="'not'"):  # refused by the schema checks, in the worker
            compiler.compile(GrammarSpec("json_schema", json.dumps({"type": "array", "not": {"items": {"type": "integer"}}})))
        assert not compiler.compile(GrammarSpec("regex", "(c{1000}){1000}")).forced_spans
        workers = list(compiler._procs._procs)
        assert len(workers) == 2
        deadline = time.monotonic() + 30  # each lowers its own priority once started
        while not all(os.getpriority(os.PRIO_PROCESS, p.pid) >= 10 for p in workers):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        compiler.close()
    time.sleep(0.2)
    assert all(p.poll() is not None for p in workers)  # close() stops them


def test_compile_past_the_limit_is_killed_and_refused(real_tokenizer):
    # nice 0: at nice 10 a worker under outside load gets little CPU, so its 0.5 s of compile
    # time (the limit) took seconds of wall time; the priority is not what this test is about
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(isolate=True, time_limit_s=0.5, nice=0))
    try:
        _until_up(compiler)
        before = {p.pid for p in compiler._procs._procs}
        slow = GrammarSpec("json_schema", _slow_schema())
        start = time.monotonic()
        with pytest.raises(GrammarError, match="time limit") as err:
            compiler.compile(slow)
        # refused at the limit (0.5 s of the compile's CPU time), or at the latest at the wall-clock
        # backstop for a starved worker (STARVED_WALL_FACTOR limits), plus a second for the refusal
        # on a busy host: not left to run on (the slow schema compiles in ~1-2 s, more under load)
        assert err.value.feature == "time_limit"
        assert time.monotonic() - start < 0.5 * STARVED_WALL_FACTOR + 1.0
        misses = compiler.misses
        with pytest.raises(GrammarError, match="time limit"):  # not cached: it compiles again
            compiler.compile(slow)  # (the machine may have been busy; _forget_if_timed_out)
        assert compiler.misses == misses + 1
        # a worker serves at once; each killed one (one per timed-out compile) is replaced
        assert compiler.compile(GrammarSpec("regex", "xyz")).spec.source == "xyz"
        time.sleep(0.2)
        assert len(before - {p.pid for p in compiler._procs._procs}) == 2
    finally:
        compiler.close()


def test_pool_grows_while_every_worker_is_busy(real_tokenizer):
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(isolate=True, max_workers=3, time_limit_s=60))
    try:
        slow = _slow_schema()
        pending = [compiler.submit(GrammarSpec("json_schema", json.dumps({**json.loads(slow), "title": f"v{i}"})))
                   for i in range(2)]
        light = compiler.submit(GrammarSpec("regex", "[0-9]{3}"))
        assert compiler._procs._threads == 3  # a third worker for the job the two warm ones cannot take
        assert light.result().spec.source == "[0-9]{3}"
        assert all(p.result().forced_spans for p in pending)
        assert compiler._procs._threads == 3  # the cap
    finally:
        compiler.close()


def test_the_limit_counts_the_compile_not_its_wait_in_the_queue(real_tokenizer):
    """One worker, busy with a compile killed at the 1 s limit (and then restarting, ~2.5 s): a
    light grammar queued behind it waits longer than the limit and still compiles, since its
    limit starts when a worker takes it."""
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(isolate=True, max_workers=1, time_limit_s=1.0))
    try:
        deadline = time.monotonic() + 60
        while compiler._procs.ready_workers < 1:
            assert time.monotonic() < deadline, "the compile worker did not start"
            time.sleep(0.05)
        slow = compiler.submit(GrammarSpec("json_schema", _slow_schema()))
        start = time.monotonic()
        light = compiler.submit(GrammarSpec("regex", "[a-f]{4}"))
        assert light.result().spec.source == "[a-f]{4}"
        assert time.monotonic() - start > 1.0  # it waited past the limit, and was not refused for it
        with pytest.raises(GrammarError, match="time limit"):
            slow.result()
    finally:
        compiler.close()


def _one_ready_worker(compiler: GrammarCompiler):
    deadline = time.monotonic() + 60
    while compiler._procs.ready_workers < 1:
        assert time.monotonic() < deadline, "the compile worker did not start"
        time.sleep(0.05)
    (proc,) = compiler._procs._procs
    return proc


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the CPU-time limit reads /proc")
def test_a_compile_left_no_cpu_is_not_refused_for_the_wait(real_tokenizer):
    """The limit counts the compile's CPU time: a worker frozen for twice the limit (as a fully
    loaded machine leaves a nice'd worker waiting for a core) still compiles once it runs."""
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(isolate=True, max_workers=1, time_limit_s=1.0))
    try:
        proc = _one_ready_worker(compiler)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            pending = compiler.submit(GrammarSpec("regex", "[a-f]{5}z"))
            time.sleep(2.0)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert pending.result().spec.source == "[a-f]{5}z"
    finally:
        compiler.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the CPU-time limit reads /proc")
def test_a_worker_that_never_runs_is_refused_at_the_wall_backstop(real_tokenizer):
    limit = 0.3
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(isolate=True, max_workers=1, time_limit_s=limit))
    try:
        proc = _one_ready_worker(compiler)
        os.kill(proc.pid, signal.SIGSTOP)  # killed (not continued) by the refusal
        start = time.monotonic()
        with pytest.raises(GrammarError, match="time limit"):
            compiler.submit(GrammarSpec("regex", "[a-f]{6}y")).result()
        waited = time.monotonic() - start
        assert limit * STARVED_WALL_FACTOR <= waited < limit * STARVED_WALL_FACTOR + 2.0
    finally:
        compiler.close()
