"""Speculation inside the engine is lossless: greedy outputs with speculation equal plain greedy
outputs token for token (tiny random model, float64), with n-gram trees and with an oracle
proposer whose trees put the right continuation in a non-first branch (so accepted nodes sit
out of depth order and their KV must be moved), under batching, preemption and aborts; KV blocks
all free afterwards."""

from __future__ import annotations

import random

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.proposer import make_proposer
from prescient.speculative.speculator import Speculator
from prescient.speculative.tree import DraftTree

VOCAB = 97


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


class OracleProposer:
    """Knows each request's plain greedy continuation; proposes a tree whose FIRST branch is
    wrong and whose second branch is the truth for `depth` tokens with a wrong tail."""

    def __init__(self, truth: dict[tuple, list[int]], depth: int = 4):
        self.truth = truth  # prompt tuple -> greedy output
        self.depth = depth

    def propose(self, contexts):
        trees = []
        for ctx in contexts:
            tokens = list(ctx.token_ids)
            match = None
            for prompt, out in self.truth.items():
                n = len(prompt)
                if tuple(tokens[:n]) == prompt:
                    match = out[len(tokens) - n:]
            budget = ctx.max_draft_tokens
            if not match or budget < 3:
                trees.append(None)
                continue
            k = min(self.depth, budget - 1, len(match))
            wrong = [(match[0] + 1) % VOCAB]
            right = match[:k]
            if k >= 2:
                right = right[:-1] + [(right[-1] + 5) % VOCAB]  # the last one is wrong
            paths = [wrong, right]
            trees.append(DraftTree.from_paths(tokens[-1], paths))
        return trees

    def on_tokens_appended(self, *a):
        pass

    def on_request_finished(self, request_id):
        pass

    def on_session_closed(self, session_id):
        pass


def engine_with(model, proposer, num_blocks=256, budget=64, max_num_seqs=8, max_draft=8) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget))
    speculator = None
    if proposer is not None:
        # prior 1.0 + a flat cost: always speculate, so the test exercises trees every step
        adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=max_draft, prior_acceptance=1.0,
                                                      verify_cost={1: 1.0, 64: 1.0}))
        speculator = Speculator(proposer, 8, adaptive)
    return Engine(model, None, config, eos_token_ids=(2,), speculator=speculator)


def prompts(seed, count, lo=5, hi=50, repeat=True):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        base = [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]
        out.append(base + base[: len(base) // 2] if repeat else base)  # copyable text for n-grams
    return out


def test_oracle_trees_are_accepted_and_lossless(tiny):
    ps = prompts(0, 4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = engine_with(tiny, None).generate(ps, params)
    truth = {tuple(p): o for p, o in zip(ps, plain)}
    engine = engine_with(tiny, OracleProposer(truth))
    assert engine.generate(ps, params) == plain
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0  # drafts really were accepted (out of depth order)
    assert stats.mean_accepted_length > 1.5
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_ngram_speculation_is_lossless_under_pressure(tiny):
    ps = prompts(1, 8, hi=60)
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = [engine_with(tiny, None).generate([p], params)[0] for p in ps]
    engine = engine_with(tiny, make_proposer("ngram"), num_blocks=40, budget=48)
    assert engine.generate(ps, params) == plain
    engine.block_manager.check_invariants()
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_aborts_with_trees_in_flight_free_everything(tiny):
    ps = prompts(2, 6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = engine_with(tiny, None).generate(ps, params)
    engine = engine_with(tiny, OracleProposer({tuple(p): o for p, o in zip(ps, plain)}), num_blocks=48)
    reqs = [engine.add_request(p, params) for p in ps]
    for step in range(12):
        engine.step()
        if step in (3, 7):
            engine.abort(reqs[step % len(reqs)].request_id)
    while engine.has_unfinished_requests():
        engine.step()
    for r, out in zip(reqs, plain):
        if r.finish_reason != "abort":
            assert r.output_token_ids == out
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_seeded_sampling_identical_without_drafts(tiny):
    """A seeded sampled request draws the same noise through the verifier as through plain
    sampling when no drafts are proposed."""
    p = prompts(3, 1)[0]
    params = SamplingParams(temperature=2.0, seed=7, max_tokens=20)
    plain = engine_with(tiny, None).generate([p], params)

    class Never(OracleProposer):
        def propose(self, contexts):
            return [None] * len(contexts)

    assert engine_with(tiny, Never({})).generate([p], params) == plain


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=-0.5)])
def test_penalties_are_lossless_with_trees(tiny, penalties):
    """Presence/frequency penalties count the draft tokens on each node's path, so speculative
    greedy output equals plain greedy output under penalties too (and the penalties matter)."""
    ps = prompts(4, 4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties)
    plain = engine_with(tiny, None).generate(ps, params)
    assert plain != engine_with(tiny, None).generate(ps, SamplingParams(temperature=0, max_tokens=24,
                                                                        ignore_eos=True))
    truth = {tuple(p): o for p, o in zip(ps, plain)}
    oracle = engine_with(tiny, OracleProposer(truth))
    assert oracle.generate(ps, params) == plain
    assert oracle.speculator.stats.num_accepted_tokens > 0
    assert engine_with(tiny, make_proposer("ngram")).generate(ps, params) == plain
