"""verify(): hand-built logits with known answers, roles, batching, seeds and KV moves."""

from __future__ import annotations

import pytest
import torch

from prescient.runtime.sampler import make_generator, sample_row, target_probs_from_logits
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.tree import DraftTree, pack_trees
from prescient.speculative.verify import BONUS, RECOVERED, verify, verify_packed

VOCAB = 10
GREEDY = SamplingParams(temperature=0)

#        0 (root 9)
#      /   \
#     1(3)  4(5)
#    /  \      \
#   2(4) 3(6)   5(7)
#   |
#   6(8)
TREE = DraftTree([9, 3, 4, 6, 5, 7, 8], [-1, 0, 1, 1, 0, 4, 2])


def argmax_logits(argmax_per_node: list[int]) -> torch.Tensor:  # [num_nodes, VOCAB]
    logits = torch.zeros(len(argmax_per_node), VOCAB)
    logits[torch.arange(len(argmax_per_node)), torch.tensor(argmax_per_node)] = 5.0
    return logits


@pytest.mark.parametrize(
    "argmax, nodes, next_token, role",
    [
        # root wants 3, node 1 wants 6 (the second child), node 3 is a leaf: bonus from it
        ([3, 6, 0, 1, 0, 0, 0], (0, 1, 3), 1, BONUS),
        # the deepest path, then the leaf's argmax
        ([3, 4, 8, 0, 0, 0, 2], (0, 1, 2, 6), 2, BONUS),
        # root wants 5: the second branch
        ([5, 0, 0, 0, 7, 1, 0], (0, 4, 5), 1, BONUS),
        # root wants a token no child has: nothing accepted, the argmax is the recovered token
        ([2, 4, 8, 0, 7, 0, 0], (0,), 2, RECOVERED),
        # node 1 wants 0, neither 4 nor 6
        ([3, 0, 8, 0, 7, 0, 0], (0, 1), 0, RECOVERED),
    ],
)
def test_greedy_picks_the_argmax_path(argmax, nodes, next_token, role):
    [out] = verify([TREE], argmax_logits(argmax), [GREEDY], [None])
    assert out.accepted_nodes == nodes
    assert out.accepted_tokens == tuple(TREE.tokens[n] for n in nodes[1:])
    assert (out.next_token, out.next_role) == (next_token, role)
    assert out.num_draft_tokens == 6 and out.num_accepted == len(nodes) - 1
    assert out.tokens == [*out.accepted_tokens, next_token]


def test_root_only_tree_is_plain_decoding():
    logits = torch.randn(1, VOCAB)
    [out] = verify([DraftTree([4], [-1])], logits, [GREEDY], [None])
    assert out.tokens == [int(logits.argmax())] and out.next_role == BONUS and out.num_draft_tokens == 0
    # Seeded sampling: the same token plain decoding draws (Engine._sample_one: sample_row, the
    # same draws in the same order).
    params = SamplingParams(temperature=0.8, top_k=5, seed=7)
    for seed in range(20):
        [out] = verify([DraftTree([4], [-1])], logits, [params], [make_generator(seed)])
        assert out.tokens == [sample_row(logits, params, make_generator(seed))]


def test_root_only_trees_skip_the_tree_walk_with_its_verdict():
    """verify() answers a tree without drafts as plain decoding does (sample_row, from the
    request's own generator), without the rejection walk, beside drafted trees, which keep the
    walk's verdicts (verify_packed)."""
    trees = [DraftTree([4], [-1]), TREE, DraftTree([2], [-1]), DraftTree([7], [-1])]
    logits = torch.randn(sum(t.num_nodes for t in trees), VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0), GREEDY,
              SamplingParams(temperature=0.6, top_p=0.8)]
    rows = [0, 1, 8, 9]  # each tree's first row
    for seed in range(10):
        gen = lambda i: make_generator(seed * 4 + i)  # noqa: E731
        outs = verify(trees, logits, params, [gen(i) for i in range(4)])
        for i in (0, 2, 3):
            assert outs[i].tokens == [sample_row(logits[rows[i]:rows[i] + 1], params[i], gen(i))]
            assert outs[i].num_draft_tokens == 0 and outs[i].next_role == BONUS
        assert outs[2].tokens == [int(logits[8].argmax())]
        assert outs[1] == verify([TREE], logits[1:8], [params[1]], [gen(1)])[0]  # its own walk, undisturbed


def one_hot_logits(tokens: list[int]) -> torch.Tensor:  # [num_nodes, VOCAB], near-certain targets
    logits = torch.full((len(tokens), VOCAB), -40.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 40.0
    return logits


def test_sampling_with_certain_target_is_deterministic():
    params = SamplingParams(temperature=1.0)
    # target is certain of the greedy answers above: same verdict as greedy
    [out] = verify([TREE], one_hot_logits([3, 6, 0, 1, 0, 0, 0]), [params], [make_generator(0)])
    assert (out.accepted_nodes, out.next_token, out.next_role) == ((0, 1, 3), 1, BONUS)
    [out] = verify([TREE], one_hot_logits([2, 4, 8, 0, 7, 0, 0]), [params], [make_generator(0)])
    assert (out.accepted_nodes, out.next_token, out.next_role) == ((0,), 2, RECOVERED)


def test_draft_probs_zero_target_rejects_and_recovers_from_the_residual():
    # Target at the root: tokens 1 and 2 with 1/2 each. The draft sampled token 3 (target 0):
    # always rejected, and the recovered token comes from max(target - draft, 0) = target.
    tree = DraftTree.chain(0, [3])
    logits = torch.full((2, VOCAB), -50.0)
    logits[0, [1, 2]] = 0.0
    draft_probs = torch.zeros(2, VOCAB)
    draft_probs[1, 3] = 1.0
    seen = set()
    for seed in range(40):
        [out] = verify([tree], logits, [SamplingParams()], [make_generator(seed)], [draft_probs])
        assert out.accepted_nodes == (0,) and out.next_role == RECOVERED
        seen.add(out.next_token)
    assert seen == {1, 2}


def test_mixed_batch_keeps_request_order_and_seeds():
    trees = [TREE, DraftTree.chain(1, [2, 3]), DraftTree([5], [-1]), DraftTree.chain(2, [4])]
    num_nodes = [t.num_nodes for t in trees]
    logits = torch.randn(sum(num_nodes), VOCAB, generator=torch.Generator().manual_seed(0))
    params = [GREEDY, SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, min_p=0.1),
              SamplingParams(temperature=0.9, top_k=4)]
    draft_probs = [None, None, None, torch.softmax(torch.randn(2, VOCAB), -1)]

    def run(order):
        rows = torch.split(logits, num_nodes)
        return verify([trees[i] for i in order], torch.cat([rows[i] for i in order]), [params[i] for i in order],
                      [make_generator(10 + i) for i in order], [draft_probs[i] for i in order])

    forward = run([0, 1, 2, 3])
    assert [o.num_draft_tokens for o in forward] == [6, 2, 0, 1]
    # greedy request: exactly the greedy rule
    [greedy] = verify([TREE], logits[:7], [GREEDY], [None])
    assert forward[0] == greedy
    # each seeded request's verdict does not depend on what else is in the batch, or where
    backward = run([3, 2, 1, 0])
    assert forward == backward[::-1]
    for i in range(4):
        assert run([i])[0] == forward[i]


def test_one_hot_draft_probs_judge_exactly_like_none():
    trees = [TREE, DraftTree.chain(1, [2, 3]), DraftTree.chain(2, [4])]
    logits = torch.randn(sum(t.num_nodes for t in trees), VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.9, top_k=5)] * 3
    one_hot = [torch.nn.functional.one_hot(torch.tensor(t.tokens), VOCAB).float() for t in trees]
    for seed in range(10):
        gens = lambda: [make_generator(seed * 3 + i) for i in range(3)]  # noqa: E731
        packed = verify_packed(*pack_trees(trees), logits, params, gens())
        plain = packed.outcomes()  # None: one-hot drafts
        assert verify(trees, logits, params, gens(), one_hot) == plain
        # a request given one-hot rows is judged by the batch walk beside one walked on the CPU
        mixed = verify(trees, logits, params, gens(), [one_hot[0], None, one_hot[2]])
        assert (mixed[0], mixed[2]) == (plain[0], plain[2])
        assert mixed[1] == verify([trees[1]], logits[7:10], params[1:2], gens()[1:2])[0]
        assert packed.accepted_tokens[:, 0].tolist() == [9, 1, 2]  # the roots


def _walk_samples(tree, table, params, n, seed0=0):
    """n verify() walks of `tree` (its node c's logits: table[tree.tokens[c]]), each seeded
    apart: the emitted token sequences."""
    logits = table[torch.tensor(tree.tokens)]  # [num_nodes, vocab]
    return [verify([tree], logits, [params], [make_generator(seed0 + i)])[0].tokens for i in range(n)]


def test_sampled_walk_samples_the_target_distribution():
    """A sampled request's one-hot drafts are walked node by node on the CPU (verify's fast path,
    the last token drawn by inverting the residual's CDF): every emitted token follows the
    target -- the first from the root's distribution whatever the drafts, the next from the
    distribution after the first when the walk went on -- for a tree whose first choice is the
    target's favourite (deep walks) and one whose drafts the target rarely takes (recoveries)."""
    vocab = 8
    g = torch.Generator().manual_seed(21)
    table = torch.randn(vocab, vocab, generator=g) * 1.5  # [previous token, next token] logits
    params = SamplingParams(temperature=0.9, top_k=6)
    exact = target_probs_from_logits(table, params).double()  # [prev, next]
    root = 3
    fav = int(exact[root].argmax())
    rare = int(exact[root].argmin())  # top-k removed it: never accepted
    deep = DraftTree([root, fav, int(exact[fav].argmax()), (fav + 1) % vocab], [-1, 0, 1, 0])
    shallow = DraftTree([root, rare, (root + 1) % vocab], [-1, 0, 0])
    n = 12_000
    for tree in (deep, shallow):
        out = _walk_samples(tree, table, params, n)
        first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=vocab).double() / n
        assert 0.5 * float((first - exact[root]).abs().sum()) < 0.03, (tree.tokens, first, exact[root])
        assert first[rare] == 0  # a token of no mass is never emitted, drafted or not
        after = [t[1] for t in out if len(t) > 1 and t[0] == fav]
        if tree is deep:
            assert len(after) > n // 4  # the walk goes on past the favourite
            second = torch.bincount(torch.tensor(after), minlength=vocab).double() / len(after)
            assert 0.5 * float((second - exact[fav]).abs().sum()) < 0.04
    # reproducible per seed
    assert _walk_samples(deep, table, params, 20, 7) == _walk_samples(deep, table, params, 20, 7)


def test_greedy_walk_gives_the_batch_walks_verdicts():
    """A greedy request's drafts are walked in Python on the CPU (verify's fast path: one argmax
    per row); verify_packed walks them with the reference kernel. The same verdicts over random
    trees (chains, siblings sharing a token -- the lowest index wins --, deep and wide), in a
    batch beside root-only and sampled requests, with targets that often accept the drafts."""
    vocab = 50
    g = torch.Generator().manual_seed(12)
    deep = 0
    for case in range(80):
        n = int(torch.randint(2, 14, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        if case % 3 == 0:
            parents = list(range(-1, n - 1))  # a chain
        tokens = torch.randint(0, 6 if case % 4 == 1 else vocab, (n,), generator=g).tolist()
        tree = DraftTree(tokens, parents)
        logits = torch.randn(n, vocab, generator=g)
        if case % 2:  # the target's argmax below each parent is a child's token: walks go deep
            for c in range(1, n):
                logits[parents[c], tokens[c]] += 10.0 * float(torch.rand(1, generator=g)) + 5.0
        walked = verify([tree], logits, [GREEDY], [None])
        packed = verify_packed(*pack_trees([tree]), logits, [GREEDY], [None]).outcomes()
        assert walked == packed, (case, tree.tokens, tree.parents)
        deep += walked[0].num_accepted >= 2
        # in a batch: a root-only request and a sampled one around it keep their rows
        other = DraftTree([1, 2, 3], [-1, 0, 1])
        batch_logits = torch.cat([torch.randn(1, vocab, generator=g), logits, torch.randn(3, vocab, generator=g)])
        params = [GREEDY, GREEDY, SamplingParams(temperature=0.7, seed=1)]
        outs = verify([DraftTree([5], [-1]), tree, other], batch_logits, params, [None, None, make_generator(3)])
        assert outs[1] == walked[0]
        assert outs[0].tokens == [int(batch_logits[0].argmax())]
    assert deep >= 10


def test_unseeded_requests_share_the_default_generator():
    logits = torch.randn(3, VOCAB)
    tree = DraftTree.chain(1, [2, 3])
    torch.manual_seed(3)
    first = verify([tree, tree], torch.cat([logits, logits]), [SamplingParams()] * 2, [None, None])
    torch.manual_seed(3)
    assert verify([tree, tree], torch.cat([logits, logits]), [SamplingParams()] * 2, [None, None]) == first


def test_kv_moves():
    [out] = verify([TREE], argmax_logits([5, 0, 0, 0, 7, 1, 0]), [GREEDY], [None])
    assert out.accepted_nodes == (0, 4, 5)
    assert out.kv_moves(prefix_len=100) == ([104, 105], [101, 102])
    [out] = verify([TREE], argmax_logits([3, 4, 8, 0, 0, 0, 2]), [GREEDY], [None])
    assert out.kv_moves(prefix_len=100) == ([106], [103])  # nodes 1, 2 already at their depth


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="rows"):
        verify([TREE], torch.zeros(3, VOCAB), [GREEDY], [None])
    with pytest.raises(ValueError, match="one entry per request"):
        verify([TREE], torch.zeros(7, VOCAB), [GREEDY, GREEDY], [None])
