"""A request's failure is its own: an exception in any per-request stage of a step (drafting,
masking, penalties, sampling, verification, committing) ends that request with an error naming
the stage, while a bystander in the same batches decodes exactly what it decodes alone, and the
KV cache is whole afterwards. A grammar that admits no token ends its own request (or is refused
at its start). Only a forward failure is everyone's (test_engine_faults.py)."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from prescient.runtime.sampling_params import SamplingParams
from tests.server.conftest import tiny_engine, tiny_model_dir, smol_tokenizer_dir  # noqa: F401 (fixtures)

VICTIM, BYSTANDER = "victim", "bystander"
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):  # noqa: F811
    return {"off": tiny_engine(tiny_model_dir), "ngram": tiny_engine(tiny_model_dir, speculate="ngram")}


def _inject(engine, stage: str, monkeypatch) -> None:
    """Make `stage` raise for the victim's request only, from its second step on (so the
    failure hits a request that is decoding beside the bystander, not only at its start)."""
    import prescient.runtime.engine as engine_mod

    def boom():
        raise RuntimeError(f"injected {stage} fault")

    def late(request) -> bool:
        return request.request_id == VICTIM and len(request.output_token_ids) >= 2

    if stage == "drafting":
        propose = engine.speculator.propose

        def broken(seqs):
            if any(late(s.request) for s in seqs):
                boom()
            return propose(seqs)
        monkeypatch.setattr(engine.speculator, "propose", broken)
    elif stage == "masking":
        prepare_one = engine.grammar_step._prepare_one

        def broken(request, tree):
            if late(request):
                boom()
            return prepare_one(request, tree)
        monkeypatch.setattr(engine.grammar_step, "_prepare_one", broken)
    elif stage == "penalties":
        penalize = engine_mod.penalize_rows

        def broken(rows, request, tree, *upload):
            if late(request):
                boom()
            return penalize(rows, request, tree, *upload)
        monkeypatch.setattr(engine_mod, "penalize_rows", broken)
    elif stage == "sampling":
        sample_one = engine._sample_one

        def broken(seq, row_logits):
            if late(seq.request):
                boom()
            return sample_one(seq, row_logits)
        monkeypatch.setattr(engine, "_sample_one", broken)
    elif stage == "verification":
        verify = engine.speculator.verify

        def broken(seqs, trees, logits, kv):
            if any(late(s.request) for s in seqs):
                boom()
            return verify(seqs, trees, logits, kv)
        monkeypatch.setattr(engine.speculator, "verify", broken)
    elif stage == "committing":
        commit = engine_mod.commit_tokens

        def broken(request, result, detok, max_seq_len, now):
            if late(request):
                boom()
            return commit(request, result, detok, max_seq_len, now)
        monkeypatch.setattr(engine_mod, "commit_tokens", broken)
    else:
        raise ValueError(stage)


def _run(engine, prompts: dict[str, str], grammars: dict | None = None) -> dict[str, dict]:
    got = {rid: {"tokens": [], "finish": None, "error": None, "error_type": None} for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, PARAMS, request_id=rid, grammar=(grammars or {}).get(rid))
    while engine.has_unfinished_requests():
        for out in engine.step():
            g = got[out.request_id]
            g["tokens"] += out.new_token_ids
            if out.finished:
                g["finish"], g["error"], g["error_type"] = out.finish_reason, out.error, out.error_type
    return got


def _compile(engine, kind: str, source: str):
    from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarSpec, GrammarTokenizer

    gtok = GrammarTokenizer.from_huggingface(engine.tokenizer.hf, vocab_size=engine.model.config.vocab_size,
                                             stop_token_ids=list(engine.eos_token_ids))
    return GrammarCompiler(gtok, CompilerConfig(time_limit_s=60)).compile(GrammarSpec(kind, source))


STAGES = [("off", "penalties"), ("off", "sampling"), ("off", "committing"), ("off", "masking"),
          ("ngram", "drafting"), ("ngram", "verification"), ("ngram", "committing")]


@pytest.mark.parametrize("mode,stage", STAGES, ids=[f"{m}-{s}" for m, s in STAGES])
def test_a_failing_stage_ends_only_its_own_request(engines, mode, stage, monkeypatch):
    engine = engines[mode]
    free = engine.block_manager.num_free_blocks
    prompts = {BYSTANDER: "the bystander's prompt, repeated: one two three one two three one two",
               VICTIM: "the victim's own prompt"}
    alone = _run(engine, {BYSTANDER: prompts[BYSTANDER]})[BYSTANDER]
    # masking runs only for constrained requests: there the victim has a grammar
    grammars = {VICTIM: _compile(engine, "regex", "[a-z ]{1,200}").matcher()} if stage == "masking" else None
    _inject(engine, stage, monkeypatch)
    got = _run(engine, prompts, grammars)
    victim, bystander = got[VICTIM], got[BYSTANDER]
    assert victim["finish"] == "error" and f"injected {stage} fault" in victim["error"]
    assert victim["error_type"] is None  # a server fault (5xx), not the client's
    assert BYSTANDER not in victim["error"]
    assert bystander["finish"] == "length" and bystander["error"] is None
    assert bystander["tokens"] == alone["tokens"]  # untouched: same greedy output as alone
    engine.block_manager.check_invariants()
    assert not engine.requests and engine.block_manager.num_free_blocks == free


def test_a_grammar_that_admits_no_token_ends_its_request_cleanly(engines):
    """`root ::= "a" [^\\x00-\\U0010FFFF]`: after "a" nothing can follow. The request ends as
    an invalid request (its own input), the bystander goes on; the engine never raises."""
    engine = engines["off"]
    matcher = _compile(engine, "ebnf", 'root ::= "a" [^\\x00-\\U0010FFFF]').matcher()
    assert not matcher.allows_nothing()  # "a" is allowed first
    alone = _run(engine, {BYSTANDER: "hello there"})[BYSTANDER]
    got = _run(engine, {BYSTANDER: "hello there", VICTIM: "x"}, {VICTIM: matcher})
    assert got[BYSTANDER]["tokens"] == alone["tokens"] and got[BYSTANDER]["finish"] == "length"
    victim = got[VICTIM]
    assert victim["finish"] == "error" and victim["error_type"] == "invalid_request"
    assert "allows no token" in victim["error"] and VICTIM not in victim["error"]
    assert len(victim["tokens"]) == 1  # "a", then the dead end
    assert not engine.requests


def test_a_grammar_that_admits_nothing_at_all_is_seen_at_its_start(engines):
    engine = engines["off"]
    assert _compile(engine, "ebnf", "root ::= [^\\x00-\\U0010FFFF]").matcher().allows_nothing()
    assert not _compile(engine, "ebnf", 'root ::= "a"').matcher().allows_nothing()


def test_through_the_server_a_dead_grammar_never_ends_another_stream(canary_server):
    """The issue's repro: a canary streams while grammars that admit nothing (at all, or after
    "a") are sent; each is refused or ends alone, and the canary never sees an error."""
    from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarTokenizer

    server, canary = canary_server
    engine = server.engine
    gtok = GrammarTokenizer.from_huggingface(engine.tokenizer.hf, vocab_size=engine.model.config.vocab_size,
                                             stop_token_ids=list(engine.eos_token_ids))
    # in-process compiles with a generous limit: this test is about the engine, not the pool's start
    engine._grammar_compiler = GrammarCompiler(gtok, CompilerConfig(time_limit_s=120))
    t0 = time.perf_counter()
    host, port = server.url.removeprefix("http://").split(":")
    answers = []
    for grammar in ("root ::= [^\\x00-\\U0010FFFF]", 'root ::= "a" [^\\x00-\\U0010FFFF]'):
        for stream in (False, True):
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                         body=json.dumps({"model": "default", "messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 8, "stream": stream, "temperature": 0,
                                          "response_format": {"type": "grammar", "grammar": grammar}}))
            response = conn.getresponse()
            answers.append((grammar, stream, response.status, response.read()))
            conn.close()
    for grammar, stream, status, body in answers:
        if status == 200:  # streamed past the compile check: the stream ends in an error chunk
            assert stream and b'"error"' in body and b"allows no token" in body, (grammar, body[-300:])
        else:
            assert status == 400 and b"allows no token" in body, (grammar, status, body[:300])
        assert b"canary" not in body and b"req_" not in body.split(b'"error"')[-1]  # no one else's ids
    canary.check(t0)
    n = len(canary.arrivals)
    deadline = time.monotonic() + 30
    while len(canary.arrivals) == n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(canary.arrivals) > n, "the canary stopped receiving tokens"
