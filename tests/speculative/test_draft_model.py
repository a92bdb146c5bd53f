"""Draft-model proposer on a tiny random float64 model: a draft equal to the target drafts exactly
the target's greedy continuation; top-k trees follow the draft's own ranking under the budget;
the draft's KV stays in step with accepted tokens; every draft block is free after requests end.
Plus hand-built EAGLE-2 expansion cases with known answers."""

from __future__ import annotations

import random

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative import draft_model
from prescient.speculative.draft_model import DraftModelConfig, DraftModelProposer, draft_config_for
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.draft_tree_expand import DynamicTree
from prescient.speculative.proposer import PROPOSERS, ProposalContext, Proposer
from prescient.speculative.speculator import Speculator
from prescient.speculative.tree import DraftTree
from prescient.speculative.verify import verify
from tests.conftest import make_tiny_checkpoint
from tests.runtime.test_model_reference import full_forward

VOCAB = 97


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 matmuls gain nothing from a second thread, and on a loaded 2-core machine
    OpenMP's spin-waiting makes them ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> LlamaModel:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("draft_target"), num_hidden_layers=3)
    ckpt = load_checkpoint(str(path))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


def proposer(target: LlamaModel, layers: int, **kw) -> DraftModelProposer:
    kw = {"max_depth": 4, "top_k": 1, "max_draft_tokens": 4, "block_size": 8, "num_blocks": 128, **kw}
    return DraftModelProposer(DraftModelConfig(target_model=target, early_exit_layers=layers, **kw))


def ctx(tokens, budget=4, request_id="r") -> ProposalContext:
    return ProposalContext(request_id, None, list(tokens), budget)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def greedy_continuation(model: LlamaModel, tokens: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation (no cache reuse)."""
    seq = list(tokens)
    for _ in range(n):
        seq.append(int(full_forward(model, seq)[-1].argmax()))
    return seq[len(tokens):]


def first_path(tree: DraftTree) -> list[int]:
    node, path = 0, []
    while tree.first_child[node] != -1:
        node = tree.first_child[node]
        path.append(node)
    return path


# ---------------------------------------------------------------- (a) draft == target


def test_target_as_draft_chains_are_accepted_in_full(target):
    """early_exit at full depth is the target itself: each greedy chain IS the target's greedy
    continuation, so the verifier accepts every draft token, step after step (the draft's KV
    catching up on the bonus token each time), for a batch of requests of different lengths."""
    draft = proposer(target, target.num_layers)
    seqs = {"a": random_tokens(5, 1), "b": random_tokens(19, 2), "c": random_tokens(33, 3)}
    for _ in range(3):
        ids = list(seqs)
        trees = draft.propose([ctx(seqs[i], request_id=i) for i in ids])
        for i, tree in zip(ids, trees):
            expected = greedy_continuation(target, seqs[i], 5)
            assert tree == DraftTree.chain(seqs[i][-1], expected[:4])
            # Verify as the engine would: target logits at the tree's nodes, one-hot drafts.
            logits = full_forward(target, seqs[i] + list(tree.tokens[1:]))[-tree.num_nodes:]
            (outcome,) = verify([tree], logits, [SamplingParams(temperature=0)], [None])
            assert outcome.num_accepted == 4 and outcome.tokens == expected
            seqs[i] = seqs[i] + outcome.tokens


def test_chain_depths_forward_only_their_new_node(target, monkeypatch):
    """A chain's ancestors already hold causal KV at their positions, so each depth forward
    after the catch-up computes one row per request (and the chain is still the target's
    greedy continuation); a tree with siblings recomputes the paths it needs."""
    rows = []
    real = DraftModelProposer._forward
    monkeypatch.setattr(DraftModelProposer, "_forward",
                        lambda self, seqs: rows.append([len(s.input_ids) for s in seqs]) or real(self, seqs))
    draft = proposer(target, target.num_layers)
    prompts = [random_tokens(9, 4), random_tokens(14, 5)]
    trees = draft.propose([ctx(p, request_id=str(i)) for i, p in enumerate(prompts)])
    assert rows == [[9, 14], [1, 1], [1, 1], [1, 1]]  # catch-up, then depths 2..4
    for p, tree in zip(prompts, trees):
        assert tree == DraftTree.chain(p[-1], greedy_continuation(target, p, 4))
    # trees (whose frontier nodes rarely share all held rows): the rule changes no proposal
    skipping = proposer(target, 2, top_k=3, max_draft_tokens=8).propose(
        [ctx(p, budget=8, request_id=str(i)) for i, p in enumerate(prompts)])
    monkeypatch.setattr(draft_model, "_held_rows", lambda *args: 0)
    recomputing = proposer(target, 2, top_k=3, max_draft_tokens=8).propose(
        [ctx(p, budget=8, request_id=str(i)) for i, p in enumerate(prompts)])
    assert skipping == recomputing and all(t.num_nodes == 9 for t in skipping)


def test_separate_draft_model_chains_its_own_greedy_continuation(target, tmp_path):
    """Any causal LM sharing the vocabulary can draft: the chain is the draft's greedy text."""
    ckpt = load_checkpoint(str(make_tiny_checkpoint(tmp_path / "draft", seed=1, num_hidden_layers=1)))
    small = LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)
    draft = DraftModelProposer(DraftModelConfig(draft_model=small, target_model=target, num_blocks=32, block_size=8))
    tokens = random_tokens(30, 14)
    for _ in range(2):
        tree = draft.propose([ctx(tokens)])[0]
        assert tree == DraftTree.chain(tokens[-1], greedy_continuation(small, tokens, 4))
        tokens = tokens + list(tree.tokens[1:3]) + [5]
    with pytest.raises(ValueError):
        DraftModelConfig(draft_model=small, early_exit_layers=2)


def test_draft_config_for_the_cli(target, tmp_path):
    """`--speculate draft` without a path: the early-exit draft; with one: that checkpoint,
    loaded in the target's dtype."""
    early = DraftModelProposer(draft_config_for(target))
    assert early.model.layers == target.layers[:max(1, target.num_layers // 4)]
    path = make_tiny_checkpoint(tmp_path / "draft", seed=2, num_hidden_layers=1)
    config = draft_config_for(target, None, str(path), max_depth=3)
    assert config.draft_model.dtype == torch.float64 and config.draft_model.num_layers == 1
    assert config.max_depth == 3 and config.target_model is target


def test_budget_and_empty_proposals(target):
    draft = proposer(target, target.num_layers, max_draft_tokens=3)
    tokens = random_tokens(12, 4)
    expected = greedy_continuation(target, tokens, 3)
    trees = draft.propose([ctx(tokens, budget=0, request_id="off"), ctx(tokens, budget=2, request_id="two"),
                           ctx(tokens, budget=9, request_id="capped"), ctx([], request_id="empty")])
    assert trees[0] is None and trees[3] is None
    assert trees[1] == DraftTree.chain(tokens[-1], expected[:2])
    assert trees[2] == DraftTree.chain(tokens[-1], expected[:3])  # config max_draft_tokens caps it


def test_registered_as_draft(target):
    made = PROPOSERS["draft"](DraftModelConfig(target_model=target, early_exit_layers=1, num_blocks=8))
    assert isinstance(made, DraftModelProposer) and isinstance(made, Proposer)
    assert made.model.num_layers == 1 and made.model.embed is target.embed  # shares weights
    with pytest.raises(ValueError):
        DraftModelConfig()


# ---------------------------------------------------------------- (b) top-k trees


@pytest.mark.parametrize("top_k,budget", [(2, 6), (3, 10), (4, 16)])
def test_tree_follows_draft_ranking_under_budget(target, top_k, budget):
    """Every node's children are exactly the draft's most likely next tokens after the node's
    path (by full recomputation), best first, at most top_k; the tree fills its budget, stays
    within max_depth, and its first path is the greedy chain (at nodes 1, 2, ...)."""
    layers = 1  # a draft that differs from the target
    draft_model = target.early_exit(layers)
    tokens = random_tokens(21, 5)
    tree = proposer(target, layers, top_k=top_k, max_draft_tokens=budget).propose([ctx(tokens, budget)])[0]
    assert tree.num_draft_tokens == budget and tree.max_depth <= 4
    for node in range(tree.num_nodes):
        children = tree.children[node]
        if children:
            logits = full_forward(draft_model, tokens + tree.path_tokens(node))[-1]
            ranked = torch.topk(logits, len(children)).indices.tolist()
            assert [tree.tokens[c] for c in children] == ranked and len(children) <= top_k
    chain = proposer(target, layers).propose([ctx(tokens)])[0]
    path = first_path(tree)
    assert path == list(range(1, len(path) + 1))
    assert [tree.tokens[n] for n in path] == list(chain.tokens[1:1 + len(path)])


def test_batched_trees_equal_trees_proposed_alone(target):
    seqs = [random_tokens(n, 10 + n) for n in (3, 17, 40)]
    kw = {"top_k": 3, "max_draft_tokens": 8}
    together = proposer(target, 2, **kw).propose([ctx(s, 8, f"r{i}") for i, s in enumerate(seqs)])
    alone = [proposer(target, 2, **kw).propose([ctx(s, 8)])[0] for s in seqs]
    assert together == alone


def test_long_prompt_catch_up_is_chunked(target):
    tokens = random_tokens(150, 6)
    small_chunks = proposer(target, 2, max_batched_tokens=16, num_blocks=64)
    assert small_chunks.propose([ctx(tokens)]) == proposer(target, 2).propose([ctx(tokens)])


# Hand-built EAGLE-2 expansion: (top_k, budget, max_depth, per-expansion {node: [(token, logprob)]},
# expected frontiers, expected (tokens, parents)). Node ids count in creation order.
EXPANSION_CASES = [
    # root -> a(1) -0.1, b(2) -2.5; a -> a1(3) -0.3, a2(4) -2.0; b -> b1(5) -2.6, b2(6) -5.5;
    # depth 2: a1, a2 are the top 2; a1 -> a1x(7) -0.35, a1y(8); a2 -> a2x(9) -2.5, a2y(10).
    # Keep the best 4: a, a1, a1x, a2; depth first, best child first.
    ("rerank", 2, 4, 3,
     [{0: [(10, -0.1), (20, -2.4)]},
      {1: [(11, -0.2), (12, -1.9)], 2: [(21, -0.1), (22, -3.0)]},
      {3: [(13, -0.05), (14, -4.0)], 4: [(15, -0.5), (16, -1.0)]}],
     [[1, 2], [3, 4], []],
     ([0, 10, 11, 13, 12], [-1, 0, 1, 2, 1])),
    # budget 2: b has a better node above it, so no child of b could be kept: not forwarded.
    ("prune", 2, 2, 3,
     [{0: [(10, -0.1), (20, -2.4)]}, {1: [(11, -0.2), (12, -1.9)]}],
     [[1], []],
     ([0, 10, 11], [-1, 0, 1])),
    # the greedy node (argmax child of the argmax child) is expanded, first, even when two
    # nodes under b outrank it; reranking then keeps the best 6 overall, which drops it.
    ("greedy_forced", 2, 6, 3,
     [{0: [(10, -0.5), (20, -0.6)]},
      {1: [(11, -2.5), (12, -2.6)], 2: [(21, -0.7), (22, -0.75)]},
      {3: [(13, -0.1), (14, -3.0)], 5: [(23, -0.1), (24, -2.0)], 6: [(25, -0.2), (26, -2.0)]}],
     [[1, 2], [3, 5, 6], []],
     ([0, 10, 20, 21, 23, 22, 25], [-1, 0, 0, 2, 3, 2, 5])),
    # top_k 1 is chain drafting, depth capped by the budget
    ("chain", 1, 2, 5, [{0: [(10, -3.0)]}, {1: [(11, -4.0)]}], [[1], []], ([0, 10, 11], [-1, 0, 1])),
]


@pytest.mark.parametrize("name,top_k,budget,max_depth,expansions,frontiers,expected", EXPANSION_CASES,
                         ids=[c[0] for c in EXPANSION_CASES])
def test_dynamic_tree_expansion(name, top_k, budget, max_depth, expansions, frontiers, expected):
    tree = DynamicTree(0, budget, max_depth, top_k)
    nodes = [0]
    for step, children in enumerate(expansions):
        assert sorted(children) == sorted(nodes)
        tree.expand(nodes, torch.tensor([[t for t, _ in children[n]] for n in nodes]),
                    torch.tensor([[lp for _, lp in children[n]] for n in nodes], dtype=torch.float64))
        nodes = tree.frontier()
        assert nodes == frontiers[step], f"after expansion {step}"
    assert tree.build() == DraftTree(*expected)


def test_rows_put_the_first_path_in_place():
    tree = DynamicTree(0, 8, 4, 2)
    tree.expand([0], torch.tensor([[10, 20]]), torch.tensor([[-0.1, -0.2]], dtype=torch.float64))
    tree.expand([1, 2], torch.tensor([[11, 12], [21, 22]]), torch.tensor([[-0.1, -0.2], [-0.1, -0.2]]))
    rows, attend = tree.rows([3, 5])  # a1 (under a = 1), b1 (under b = 2)
    assert rows == [1, 3, 2, 5]
    assert attend.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_build_with_a_chain_first_is_the_union_within_the_budget():
    """Ranked nodes a(-0.1) > a1(-0.15) > b(-0.2) > b1(-0.3) > a2(-0.4). Without a chain the four
    best nodes. A chain [b, 7] placed first takes nodes 1, 2; then a, a1 fill the budget of 4, b
    costing nothing again, b1 not fitting. A chain as long as the budget leaves no room."""
    tree = DynamicTree(0, 4, 4, 2)
    f64 = torch.float64
    tree.expand([0], torch.tensor([[10, 20]]), torch.tensor([[-0.1, -0.2]], dtype=f64))
    tree.expand([1, 2], torch.tensor([[11, 12], [21, 22]]), torch.tensor([[-0.05, -0.3], [-0.1, -0.4]], dtype=f64))
    assert tree.build() == DraftTree([0, 10, 11, 20, 21], [-1, 0, 1, 0, 3])
    assert tree.build(first=[20, 7]) == DraftTree([0, 20, 7, 10, 11], [-1, 0, 1, 0, 3])
    assert tree.build(first=[20, 21, 5, 6, 8]) == DraftTree([0, 20, 21, 5, 6], [-1, 0, 1, 2, 3])


# ---------------------------------------------------------------- (c) KV in step


@pytest.mark.parametrize("top_k,budget", [(1, 4), (3, 8)])
@pytest.mark.parametrize("num_accepted", [0, 2, 3, 4])
def test_kv_in_step_after_partial_acceptance(target, top_k, budget, num_accepted):
    """Accept a prefix of the first path plus a bonus token that differs from the draft's next
    guess: the next proposal equals a fresh proposer's on the same sequence (float64, exact)."""
    kw = {"top_k": top_k, "max_draft_tokens": budget}
    draft = proposer(target, 2, **kw)
    tokens = random_tokens(29, 7)
    tree = draft.propose([ctx(tokens, budget)])[0]
    path = [tree.tokens[n] for n in first_path(tree)]
    if top_k == 1:
        # The chain's first max_depth - 1 tokens were forwarded in place: the draft holds their KV.
        assert draft._requests["r"].token_ids == tokens + path[:3]
    accepted = path[:num_accepted]
    guess = path[num_accepted] if num_accepted < len(path) else -1
    bonus = next(t for t in range(3, VOCAB) if t != guess)
    tokens2 = tokens + accepted + [bonus]
    forwards, caught_up = draft.num_forwards, draft.num_catch_up_tokens
    again = draft.propose([ctx(tokens2, budget)])[0]
    fresh = proposer(target, 2, **kw)
    assert again == fresh.propose([ctx(tokens2, budget)])[0]
    assert draft.num_forwards - forwards == fresh.num_forwards  # one catch-up forward, same depths
    if top_k == 1:  # only the bonus token and the draft tokens never forwarded are recomputed
        assert draft.num_catch_up_tokens - caught_up == num_accepted + 1 - min(num_accepted, 3)


@pytest.mark.parametrize("seed", range(3))
def test_held_kv_is_valid_causal_kv(target, seed):
    """Whatever a tree step leaves the draft holding is valid for any context extending it
    (budget 16: several frontier nodes at the last depth, so rows beyond the first path exist)."""
    draft = proposer(target, 2, top_k=3, max_draft_tokens=16)
    tokens = random_tokens(23, 20 + seed)
    draft.propose([ctx(tokens, 16)])
    held = draft._requests["r"].token_ids
    assert held[:len(tokens)] == tokens and len(held) > len(tokens)
    extended = held + [random_tokens(1, seed)[0]]
    assert draft.propose([ctx(extended, 16)]) == proposer(target, 2, top_k=3, max_draft_tokens=16).propose(
        [ctx(extended, 16)])


def test_prompt_caught_up_after_prefill(target):
    """on_tokens_appended after prefill runs the draft over the prompt, so the first propose only
    computes the new token; the proposal is the same."""
    draft = proposer(target, 2)
    prompt = random_tokens(37, 15)
    draft.on_tokens_appended("r", None, prompt)
    assert draft.num_catch_up_tokens == 37
    tokens = prompt + [9]
    assert draft.propose([ctx(tokens)]) == proposer(target, 2).propose([ctx(tokens)])
    assert draft.num_catch_up_tokens == 38


def test_kv_follows_a_rewritten_context(target):
    """A context that diverges early (or shrinks) is recomputed from the divergence point."""
    draft = proposer(target, 2)
    base = random_tokens(40, 8)
    for tokens in (base, base[:25] + random_tokens(10, 9), base[:12]):
        assert draft.propose([ctx(tokens)]) == proposer(target, 2).propose([ctx(tokens)])


# ---------------------------------------------------------------- (d) blocks free, capacity


def test_blocks_all_free_after_many_requests(target):
    draft = proposer(target, 2, top_k=2, max_draft_tokens=6, num_blocks=96)
    rng = random.Random(11)
    live = {f"q{i}": random_tokens(rng.randrange(1, 60), 100 + i) for i in range(24)}
    for step in range(5):
        ids = sorted(live)
        trees = draft.propose([ctx(live[i], 6, i) for i in ids])
        for i, tree in zip(ids, trees):
            if tree is None:
                continue
            path = [tree.tokens[n] for n in tree.path_to(rng.choice(tree.leaves))[1:]]
            live[i] = live[i] + path[:rng.randrange(len(path) + 1)] + [rng.randrange(3, VOCAB)]
        for i in ids[step::5]:  # finish (or abort) a few requests each step
            draft.on_request_finished(i)
            del live[i]
        draft.block_manager.check_invariants()
    for i in list(live):
        draft.on_request_finished(i)
    draft.on_request_finished("never-seen")
    assert draft.num_free_blocks == draft.block_manager.num_blocks
    draft.block_manager.check_invariants()


def test_over_capacity_gets_no_proposal_and_frees_its_blocks(target):
    draft = proposer(target, 2, num_blocks=12, max_context_len=64)  # 8 tokens per block
    short, long = random_tokens(20, 12), random_tokens(70, 13)
    assert draft.propose([ctx(short, request_id="s")])[0] is not None
    held = draft.block_manager.num_blocks - draft.num_free_blocks
    assert held == 3  # 20 context + 3 scratch rows
    # The same request grows past max_context_len: no proposal, its blocks go back.
    assert draft.propose([ctx(short + long[:50], request_id="s")])[0] is None
    assert draft.num_free_blocks == draft.block_manager.num_blocks
    # Pool exhaustion: the request that does not fit decodes plainly, the others still draft.
    trees = draft.propose([ctx(long[:60], request_id=f"p{i}") for i in range(2)])
    assert trees[0] is not None and trees[1] is None
    draft.on_request_finished("p0")
    draft.on_request_finished("p1")
    assert draft.num_free_blocks == draft.block_manager.num_blocks


# ---------------------------------------------------------------- in the engine


def engine_with(model, draft: DraftModelProposer | None) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    speculator = None
    if draft is not None:
        # Always speculate (prior 1.0, flat verify cost) so that every step carries a tree.
        adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, prior_acceptance=1.0,
                                                      verify_cost={1: 1.0, 64: 1.0}))
        speculator = Speculator(draft, 8, adaptive)
    return Engine(model, None, config, eos_token_ids=(2,), speculator=speculator)


@pytest.mark.parametrize("layers,top_k", [(3, 1), (2, 1), (2, 3)])
def test_engine_greedy_with_draft_equals_plain(target, layers, top_k):
    """Through Engine.step (batching, chunked prefill, KV moves of accepted tree paths): greedy
    output with the draft proposer equals plain greedy decoding token for token, and every draft
    block is free afterwards."""
    prompts = [random_tokens(n, 30 + n) for n in (4, 21, 45)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = engine_with(target, None).generate(prompts, params)
    draft = proposer(target, layers, top_k=top_k, max_draft_tokens=8, num_blocks=64)
    engine = engine_with(target, draft)
    assert engine.generate(prompts, params) == plain
    assert engine.speculator.stats.num_draft_tokens > 0
    if layers == target.num_layers:  # the target drafting for itself: every chain is accepted
        assert engine.speculator.stats.acceptance_rate == 1.0
    assert draft.num_free_blocks == draft.block_manager.num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
