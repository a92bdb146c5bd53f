"""Constrained decoding with speculation equals constrained decoding without it, token for
token and finish reason for finish reason (tiny float64 model, toy vocabulary grammars): forced
spans that end at the stop token, narrow-choice branches next to a stop token, ignore_eos,
several stop tokens, logprobs, and requests that opt out of speculation; and what the speculator
tells the scheduler a grammar forces next, and when it skips the proposer."""

from __future__ import annotations

import random

import pytest
import torch

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarSpec, GrammarTokenizer
from prescient.grammar import matcher as matcher_module
from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.scheduler import ScheduledSeq
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.proposer import make_proposer
from prescient.speculative.speculator import Speculator

# id 0 special, ids 1 and 2 stop tokens; the rest spell the grammars below
WORDS = ["a", "b", "c", "ab", "{", "}", '"', ":", ",", " ", "1", "2", "x", "y", "z", "xy"]
VOCAB = ["", "", ""] + WORDS
GRAMMARS = [("regex", "a(b|c)xy"), ("regex", "ax?"), ("regex", "(1|2)(,(1|2))*"), ("regex", "a(b(xz|yz)|c)"),
            ("json_schema", '{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], '
                            '"additionalProperties": false}')]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


def compiler(stops):
    vocab = VOCAB + ["\u0000%d" % i for i in range(97 - len(VOCAB))]  # pad to the model's vocabulary
    return GrammarCompiler(GrammarTokenizer.from_vocab(vocab, stop_token_ids=list(stops)), CompilerConfig(time_limit_s=30))


def engine(model, stops, speculate):
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    speculator = None
    if speculate:
        adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, prior_acceptance=1.0,
                                                      verify_cost={1: 1.0, 64: 1.0}))
        speculator = Speculator(make_proposer("ngram"), 8, adaptive)
    return Engine(model, None, config, eos_token_ids=stops, speculator=speculator)


def generate(model, stops, speculate, grammar, prompt, params):
    e = engine(model, stops, speculate)
    request = e.add_request(prompt, params, grammar=compiler(stops).compile(GrammarSpec(*grammar)).matcher())
    while e.has_unfinished_requests():
        e.step()
    return request.output_token_ids, request.finish_reason, request.stop_reason, e


@pytest.mark.parametrize("grammar", GRAMMARS, ids=[g[1][:16] for g in GRAMMARS])
@pytest.mark.parametrize("stops,extra", [((1,), {}), ((1, 2), {}), ((1,), {"ignore_eos": True}),
                                         ((1, 2), {"logprobs": 0}), ((1,), {"speculate": False})],
                         ids=["one-stop", "two-stops", "ignore-eos", "logprobs", "opt-out"])
@pytest.mark.parametrize("branch_budget", [0, 8], ids=["span-only", "branches"])
def test_constrained_speculation_is_lossless(tiny, grammar, stops, extra, branch_budget, monkeypatch):
    monkeypatch.setattr(matcher_module, "BRANCH_BUDGET", branch_budget)
    rng = random.Random(hash(grammar) % 1000)
    for _ in range(3):
        prompt = [rng.randrange(3, 97) for _ in range(rng.randint(4, 20))]
        params = SamplingParams(temperature=0, max_tokens=12, **extra)
        plain = generate(tiny, stops, False, grammar, prompt, params)
        spec = generate(tiny, stops, True, grammar, prompt, params)
        assert spec[:3] == plain[:3]


def test_lone_forced_stop_is_committed_without_a_forward(tiny):
    # after "axy" the grammar allows only the stop token: plain decoding ends without a step for it
    prompt = [5, 9, 11, 4]
    tokens, reason, _, e = generate(tiny, (1,), False, ("regex", "axyz"), prompt,
                                    SamplingParams(temperature=0, max_tokens=10))
    assert reason == "stop" and tokens[-1] == 1
    assert e.grammar_step.stats.num_forced_stops == 1
    assert e.num_steps == len(tokens) - 1  # one step per sampled token, none for the stop


def test_proposer_drafts_past_a_forced_span(tiny):
    """After the forced `{"a": "` the n-gram proposer drafts the value the prompt holds after
    the same key; both are verified in one forward, and the output is still plain decoding's."""
    grammar = ("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}, '
                              '"required": ["a"], "additionalProperties": false}')
    key = [7, 9, 3, 9, 10, 12, 9]  # {"a": "
    for value in ([15, 16, 17], [13, 14, 13, 14, 15]):
        prompt = [4, 5] + key + value + [9, 8] + [12, 4]
        params = SamplingParams(temperature=0, max_tokens=12)
        plain = generate(tiny, (1,), False, grammar, prompt, params)
        spec = generate(tiny, (1,), True, grammar, prompt, params)
        assert spec[:3] == plain[:3]
        assert spec[3].speculator.stats.num_span_tail_tokens > 0


def test_the_speculator_tells_the_scheduler_what_the_grammar_forces_next(tiny):
    """After each commit a constrained request's `forced_budget` is the length of the span its
    grammar forces next (what the scheduler still grants while prompts wait for prefill)."""
    e = engine(tiny, (1,), True)
    request = e.add_request([5, 9, 11, 4], SamplingParams(temperature=0, max_tokens=12),
                            grammar=compiler((1,)).compile(GrammarSpec("regex", "axyzxyzxyz")).matcher())
    seen = []
    while e.has_unfinished_requests():
        e.step()
        if request.finish_reason is None:
            seen.append((request.forced_budget, len(request.grammar.forced_tokens())))
    assert seen and all(budget == forced for budget, forced in seen)
    assert seen[0][0] > 0


def test_slots_only_a_forced_span_fills_do_not_run_the_proposer(tiny):
    """A constrained request granted just its forced span's slots (the scheduler under a prompt
    backlog) gets the span as its tree without a proposer call (a draft model's pass would be
    thrown away); with room past the span the proposer drafts the tail as before."""
    e = engine(tiny, (1,), True)
    request = e.add_request([5, 9, 11, 4], SamplingParams(temperature=0, max_tokens=12),
                            grammar=compiler((1,)).compile(GrammarSpec("regex", "axyzxyzxyz")).matcher())
    e.step()
    forced = request.forced_budget
    assert forced > 1
    calls = []
    real = e.speculator.proposer.propose
    e.speculator.proposer.propose = lambda contexts: calls.append(len(contexts)) or real(contexts)
    for slots, proposer_runs in ((forced, False), (forced - 1, False), (forced + 4, True)):
        calls.clear()
        drafts = e.speculator.propose([ScheduledSeq(request, 1, slots)])
        assert bool(calls) == proposer_runs, slots
        assert drafts.forced[0] == min(slots, forced)


def test_forced_tokens_are_not_accepted_drafts(tiny):
    """A forced span is accepted by construction: counted apart (num_forced_tokens_accepted),
    never in the acceptance rate or the planner's estimate, which judge the drafts alone."""
    json_key = ("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}, '
                               '"required": ["a"], "additionalProperties": false}')
    prompt = [4, 5, 7, 9, 3, 9, 10, 12, 9, 15, 16, 17, 9, 8, 12, 4]  # holds {"a": "xyz"}: tails to copy
    for grammar, has_drafts in ((("regex", "axyz"), False), (json_key, True)):
        e = engine(tiny, (1,), True)
        planner = e.speculator.adaptive = AdaptiveSpeculation(AdaptiveConfig(
            max_draft_tokens=8, prior_acceptance=0.5, verify_cost={1: 1.0, 64: 1.0}))
        planner.forget = lambda request_id: None  # keep the estimate past the request's end
        request = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=12),
                                grammar=compiler((1,)).compile(GrammarSpec(*grammar)).matcher())
        while e.has_unfinished_requests():
            e.step()
        stats, sources = e.speculator.stats, request.token_sources
        assert stats.num_accepted_tokens == request.num_accepted_tokens == sources.count("draft"), grammar
        assert stats.num_forced_tokens_accepted == sources.count("forced") > 0
        assert stats.num_draft_tokens == request.num_draft_tokens
        if has_drafts:  # the n-gram tail after the forced key: judged on its own
            assert 0 < stats.num_draft_tokens and stats.num_accepted_tokens < stats.num_draft_tokens
            assert stats.acceptance_rate == stats.num_accepted_tokens / stats.num_draft_tokens < 1.0
            # an EMA stays within its inputs: the prior's 1.0 and each step's accepted drafts (a
            # forced span of several tokens counted in would push it past them)
            assert planner.mean_accepted(request.request_id) <= max(1.0, stats.num_accepted_tokens)
        else:  # only forced spans: no draft was offered, and the planner learnt nothing
            assert stats.num_draft_tokens == stats.num_accepted_tokens == stats.acceptance_rate == 0
            assert stats.num_steps == 0 and stats.mean_accepted_length == 0
            assert planner.acceptance_rate(request.request_id) == 0.5


def test_the_row_after_a_drafted_stop_allows_the_stop_tokens():
    """GrammarStep.prepare: a tree node whose token is a stop token has nothing the grammar allows
    after it; its row is given the stop tokens (not a row of -inf only, whose probabilities would
    be NaN), and every other row keeps the grammar's mask."""
    from types import SimpleNamespace

    from prescient.runtime.constrain import GrammarStep
    from prescient.speculative.tree import DraftTree

    matcher = compiler((1, 2)).compile(GrammarSpec("regex", "ab")).matcher()
    seq = SimpleNamespace(samples=True, request=SimpleNamespace(grammar=matcher, output_token_ids=[]))
    a, b = VOCAB.index("a"), VOCAB.index("b")
    step = GrammarStep(97, stop_token_ids=(1, 2))
    trees, masks, failed = step.prepare([seq], [DraftTree([5, a, b, 1], [-1, 0, 1, 2])])
    assert not failed and trees[0].num_nodes == 4
    allowed = [{t for t in range(97) if (int(masks.bitmask[r, t // 32]) >> (t % 32)) & 1} for r in range(4)]
    assert allowed == [{a, VOCAB.index("ab")}, {b}, {1, 2}, {1, 2}]  # after "ab" its stops; after the stop: the fill
