"""The shared suffix pool: an exact suffix automaton, bounded in tokens per tenant and overall,
evicted by age and size, never drafting one tenant's text for another; in the engine a second
session of a tenant drafts from the first one's output and greedy output stays identical."""

from __future__ import annotations

import random

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.request import SOURCE_DRAFT, SOURCE_TARGET
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.ngram import NgramConfig, NgramProposer
from prescient.speculative.proposer import ProposalContext
from prescient.speculative.speculator import Speculator
from prescient.speculative.suffix_pool import SEPARATOR, PoolConfig, SharedSuffixPool, SuffixAutomaton


def brute_longest_match(text: list[int], window: list[int]) -> tuple[int, int]:
    for length in range(len(window), 0, -1):
        pattern = window[-length:]
        for end in range(length, len(text) + 1):
            if text[end - length:end] == pattern:
                return length, end
    return 0, 0


def test_automaton_finds_the_longest_suffix_and_its_first_occurrence():
    rng = random.Random(0)
    entries = [[rng.randrange(12) for _ in range(150)] for _ in range(4)]
    automaton = SuffixAutomaton()
    for entry in entries:
        automaton.add(entry)
    assert automaton.num_states <= 2 * len(automaton.text) + 1
    for _ in range(400):
        if rng.random() < 0.5:
            window = [rng.randrange(12) for _ in range(rng.randrange(1, 14))]
        else:  # noise, then a real stretch of some entry
            entry = rng.choice(entries)
            start = rng.randrange(len(entry) - 12)
            window = [rng.randrange(12) for _ in range(3)] + entry[start:start + rng.randrange(1, 12)]
        assert automaton.longest_match(window) == brute_longest_match(automaton.text, window)


def test_matches_and_continuations_stay_inside_one_entry():
    automaton = SuffixAutomaton()
    automaton.add([1, 2, 3])
    automaton.add([4, 5, 6])
    assert automaton.text == [1, 2, 3, SEPARATOR, 4, 5, 6, SEPARATOR]
    assert automaton.longest_match([3, 4]) == (1, 5)  # [3, 4] never occurs: only "4" does
    length, end = automaton.longest_match([1, 2])
    assert (length, automaton.continuation(end, 10)) == (2, [3])  # stops at the entry's end


def test_draft_length_follows_the_match_length():
    pool = SharedSuffixPool(PoolConfig(lead_in=0, min_match=3, draft_per_match=1.5))
    text = list(range(100, 140))
    pool.add("t", [], text)
    # a 4-token match drafts ceil(1.5 * 4) = 6 tokens, an 8-token one 12, each within the budget
    assert pool.drafts("t", [7, 7, *text[:4]], 16) == [(4, text[4:10])]
    assert pool.drafts("t", [7, 7, *text[:8]], 16) == [(8, text[8:20])]
    assert pool.drafts("t", [7, 7, *text[:8]], 5) == [(8, text[8:13])]
    assert pool.drafts("t", [7, 7, *text[:2]], 16) == []  # under min_match


def test_the_lead_in_lets_an_output_start_be_drafted():
    pool = SharedSuffixPool(PoolConfig(lead_in=4, min_match=4))
    header = [50, 51, 52, 53]  # a turn header: the end of every prompt
    pool.add("t", [9, 9, 9, *header], [60, 61, 62, 63, 64])
    assert pool.drafts("t", [8, 8, *header], 16) == [(4, [60, 61, 62, 63, 64])]


def test_pool_is_bounded_per_tenant_and_overall():
    cfg = PoolConfig(max_tokens_per_tenant=200, max_total_tokens=500, max_tenants=3, lead_in=0, min_match=4)
    pool = SharedSuffixPool(cfg)
    rng = random.Random(1)
    for i in range(60):
        tenant = f"k{i % 5}"
        pool.add(tenant, [], [rng.randrange(1000) for _ in range(rng.randrange(1, 150))])
        assert all(pool.tenant_tokens(t) <= cfg.max_tokens_per_tenant for t in pool.tenants())
        assert pool.num_tokens <= cfg.max_total_tokens
        assert len(pool.tenants()) <= cfg.max_tenants
        assert pool.num_states() <= 2 * pool.num_tokens + 2 * 2 * len(pool.tenants())
    # one entry over half the tenant's budget keeps its end
    pool.add("big", [], list(range(1000)))
    assert pool.tenant_tokens("big") <= cfg.max_tokens_per_tenant // 2
    assert pool.drafts("big", [995, 996, 997, 998], 4) == [(4, [999])]


def test_the_newest_text_survives_size_eviction():
    pool = SharedSuffixPool(PoolConfig(max_tokens_per_tenant=100, lead_in=0, min_match=3))
    for i in range(20):
        pool.add("t", [], [1000 + 10 * i + j for j in range(10)])
    newest = [1190 + j for j in range(10)]
    assert pool.drafts("t", newest[:3], 8) == [(3, newest[3:8])]
    assert pool.drafts("t", [1000, 1001, 1002], 8) == []  # the oldest entries are gone


def test_pool_forgets_by_age():
    now = [0.0]
    pool = SharedSuffixPool(PoolConfig(max_age_s=100.0, lead_in=0, min_match=3), clock=lambda: now[0])
    old, new = list(range(10, 20)), list(range(30, 40))
    pool.add("t", [], old)
    now[0] = 60.0  # past half the age limit: the next entry opens a new generation
    pool.add("t", [], new)
    assert pool.drafts("t", old[:3], 4) == [(3, old[3:7])]
    now[0] = 101.0  # the old entry is past the limit; the new one is 41 s old
    assert pool.drafts("t", old[:3], 4) == []
    assert pool.drafts("t", new[:3], 4) == [(3, new[3:7])]
    now[0] = 161.0
    assert pool.drafts("t", new[:3], 4) == []
    assert pool.tenants() == []


def _context(request_id, tokens, tenant, session=None, budget=8):
    return ProposalContext(request_id, session, tokens, budget, tenant)


def test_proposer_drafts_from_the_tenants_other_sessions_only():
    proposer = NgramProposer(NgramConfig(pool=PoolConfig(lead_in=4, min_match=4)))
    header = [5, 6, 7, 8]
    first_output = [40, 41, 42, 43, 44, 45, 46, 47]
    proposer.learn_output("alice", [1, 2, 3, *header], first_output)
    prompt = [90, 91, 92, *header, 40]  # another session of alice, one output token in
    tree = proposer.propose([_context("a2", prompt, "alice", session="s2")])[0]
    assert tree is not None and list(tree.tokens[1:]) == first_output[1:]  # a 5-token match: up to 8 drafted
    for tenant in ("bob", None):  # another tenant, or no pool: nothing to copy from
        assert proposer.propose([_context(f"r-{tenant}", prompt, tenant)])[0] is None
    off = NgramProposer(NgramConfig(pool=None))
    off.learn_output("alice", [1, 2, 3, *header], first_output)
    assert off.propose([_context("a3", prompt, "alice")])[0] is None


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


def _engine(model, speculate: bool = True) -> Engine:
    speculator = None
    if speculate:
        adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, verify_cost={1: 1.0, 8: 1.1, 16: 1.2}))
        speculator = Speculator(NgramProposer(NgramConfig(pool=PoolConfig(min_match=4))), 16, adaptive)
    config = EngineConfig(dtype="float64", cache=CacheConfig(block_size=16, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    return Engine(model, None, config, eos_token_ids=(), speculator=speculator)


def _run(engine: Engine, prompt: list[int], tenant: str | None, session: str | None):
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, tenant=tenant),
                                 session_id=session)
    steps = engine.num_steps
    while engine.has_unfinished_requests():
        engine.step()
    return request, engine.num_steps - steps


def test_a_second_session_of_a_tenant_drafts_from_the_first_and_output_is_unchanged(tiny):
    rng = random.Random(3)
    prompt = [rng.randrange(97) for _ in range(24)]
    plain = _run(_engine(tiny, speculate=False), prompt, None, None)[0].output_token_ids
    engine = _engine(tiny)
    first, _ = _run(engine, prompt, "alice", "s1")
    same_tenant, same_steps = _run(engine, prompt, "alice", "s2")
    other_tenant, other_steps = _run(engine, prompt, "bob", "s3")
    for request in (first, same_tenant, other_tenant):
        assert request.output_token_ids == plain  # the pool only proposes
        assert set(request.token_sources) <= {SOURCE_TARGET, SOURCE_DRAFT}
    # alice's second session copies the first one's output: most of it arrives as drafts;
    # bob's identical request has only its own text to copy from
    assert same_tenant.num_accepted_tokens >= len(plain) // 2
    assert same_tenant.num_accepted_tokens > other_tenant.num_accepted_tokens
    assert same_steps < other_steps
