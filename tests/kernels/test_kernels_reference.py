"""Known-answer and invariant tests of the kernel ops: hand-built trees, per-path attention and
the statistical exactness of rejection sampling (Leviathan et al.; SpecInfer for trees)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from prescient.kernels import ops, reference
from prescient.kernels.reference import pack_bits, unpack_bits
from tests.kernels import kernel_oracles as oracle


def test_pack_unpack_bits_roundtrip_with_bit_31():
    bits = torch.zeros(3, 70, dtype=torch.bool)
    bits[0, 31] = bits[1, 0] = bits[1, 63] = bits[2, 69] = True
    words = pack_bits(bits)
    assert words.dtype == torch.int32 and words.shape == (3, 3)
    assert int(words[0, 0]) == -(2**31) and int(words[1, 0]) == 1
    assert torch.equal(unpack_bits(words, 70), bits)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_tree_attention_equals_causal_attention_along_each_path(backend, device, num_heads, num_kv_heads):
    """For every node, attention over [prefix, root..node] with a plain causal mask gives the
    node's tree-attention output: the tree mask is exactly "ancestors and itself"."""
    torch.manual_seed(0)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 0]
    prefix_len, block_size, head_dim = 19, 16, 64
    n = len(parents)
    k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=torch.float64, device=device)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[2, 0, 3]], dtype=torch.int32, device=device)
    q_all = torch.randn(prefix_len + n, num_heads, head_dim, dtype=torch.float64, device=device)
    k_all = torch.randn(prefix_len + n, num_kv_heads, head_dim, dtype=torch.float64, device=device)
    v_all = torch.randn_like(k_all)
    # Prefix at positions 0..prefix_len-1, node i at prefix_len + i (node order), as in CONTRACTS.
    slots = torch.tensor([oracle.slot_of(block_table[0].cpu(), p, block_size) for p in range(prefix_len + n)])
    ops.store_kv(k_cache, v_cache, k_all, v_all, slots.to(device))
    mask_bits = pack_bits(oracle.tree_ancestors(parents)).to(device)
    out = ops.tree_attention(
        q_all[prefix_len:], k_cache, v_cache, block_table,
        torch.tensor([prefix_len + n], dtype=torch.int32, device=device),
        torch.tensor([0, n], dtype=torch.int32, device=device), mask_bits, head_dim**-0.5,
    )
    for node in range(n):
        seq = list(range(prefix_len)) + [prefix_len + a for a in oracle.path_to(parents, node)]
        want = F.scaled_dot_product_attention(
            q_all[seq].transpose(0, 1), k_all[seq].transpose(0, 1), v_all[seq].transpose(0, 1),
            is_causal=True, enable_gqa=True,
        )[:, -1]
        torch.testing.assert_close(out[node], want, atol=1e-10, rtol=1e-10)


def test_greedy_verify_hand_built_tree(backend, device):
    #        0
    #      /   \
    #     1(7)  2(3)
    #     |     /   \
    #    3(9) 4(1)  5(8)
    #                |
    #               6(4)
    parents = [-1, 0, 0, 1, 2, 2, 5]
    tokens = [
        [5, 7, 3, 9, 1, 8, 4],
        [5, 3, 3, 9, 1, 8, 4],  # two children carry token 3: the lower index wins
        [5, 7, 3, 9, 1, 8, 4],  # root only
        [5, 7, 3, 9, 1, 8, 4],  # nodes past num_nodes are ignored even when they would match
    ]
    target_argmax = [
        [3, 9, 8, 0, 2, 4, 6],  # 0 -> 2 -> 5 -> 6, bonus 6
        [3, 0, 8, 0, 2, 4, 6],  # 0 -> 1, then 9 != 0: stop, bonus 0
        [3, 9, 8, 0, 2, 4, 6],
        [3, 9, 8, 0, 2, 4, 6],  # 0 -> 2 stops at node 2 (5 is padding): bonus 8
    ]
    num_nodes = [7, 7, 1, 5]
    args = [torch.tensor(x, device=device) for x in ([parents] * 4, num_nodes, target_argmax)]
    accept_len, accepted, next_token = ops.greedy_verify(torch.tensor(tokens, device=device), *args)
    assert accept_len.tolist() == [3, 1, 0, 1]
    assert accepted.tolist() == [
        [0, 2, 5, 6, -1, -1, -1],
        [0, 1, -1, -1, -1, -1, -1],
        [0, -1, -1, -1, -1, -1, -1],
        [0, 2, -1, -1, -1, -1, -1],
    ]
    assert next_token.tolist() == [6, 0, 3, 8]


def test_rejection_sample_hand_built(backend, device):
    # Root with children token 0 (node 1) and token 1 (node 2); target at the root [.5, .5, 0, 0].
    # u = 0.99 rejects token 0 (p = .5); the residual normalize(max(p - onehot(0), 0)) is
    # [0, 1, 0, 0], so token 1 is then accepted for sure, and node 2's target is one-hot at 3.
    target = torch.tensor([[[0.5, 0.5, 0, 0], [1.0, 0, 0, 0], [0, 0, 0, 1.0]]])
    args = (
        torch.tensor([[9, 0, 1]]), torch.tensor([[-1, 0, 0]]), torch.tensor([3]), target, None,
        torch.tensor([[0.0, 0.99, 0.99]]), torch.ones(1, 4),
    )
    accept_len, accepted, next_token = ops.rejection_sample(*(a if a is None else a.to(device) for a in args))
    assert accept_len.tolist() == [1] and accepted.tolist() == [[0, 2, -1]] and next_token.tolist() == [3]
    # The same tree where the target gives both draft tokens zero mass: both rejected, and the
    # recovered token comes from the untouched target (one-hot at 2).
    target[0, 0] = torch.tensor([0, 0, 1.0, 0])
    accept_len, accepted, next_token = ops.rejection_sample(
        *(a if a is None else a.to(device) for a in (args[:3] + (target,) + args[4:]))
    )
    assert accept_len.tolist() == [0] and accepted.tolist() == [[0, -1, -1]] and next_token.tolist() == [2]


def _emitted(draft_tokens, accept_len, accepted_nodes, next_token, k):
    """The k-th token the step emits per sequence: accepted drafts, then the next token; -1 past."""
    node = accepted_nodes[:, min(k + 1, accepted_nodes.shape[1] - 1)].clamp(min=0)
    drafted = draft_tokens.gather(1, node[:, None])[:, 0]
    return torch.where(k < accept_len, drafted, torch.where(k == accept_len, next_token, -1))


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * float((freq - probs.double()).abs().sum())


def _distribution(vocab: int, gen: torch.Generator) -> torch.Tensor:
    p = torch.rand(vocab, generator=gen) + 0.1
    return p / p.sum()


def test_rejection_sample_one_hot_tree_has_target_distribution():
    """Root with three deterministic children (tokens 2, 0, 4) and a grandchild under the first:
    the first emitted token ~ target at the root, the next one ~ target at the node it chose."""
    num_trials, vocab = 200_000, 6
    gen = torch.Generator().manual_seed(0)
    parents = torch.tensor([-1, 0, 0, 0, 1]).repeat(num_trials, 1)
    tokens = torch.tensor([5, 2, 0, 4, 1]).repeat(num_trials, 1)
    # Target at each node; mass on the drafted tokens keeps every conditional well populated.
    rows = torch.tensor([
        [0.25, 0.05, 0.35, 0.05, 0.20, 0.10],
        [0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
        [0.30, 0.10, 0.20, 0.20, 0.10, 0.10],
        [0.05, 0.15, 0.20, 0.30, 0.10, 0.20],
        [0.20, 0.20, 0.05, 0.15, 0.30, 0.10],
    ])
    target = rows.repeat(num_trials, 1, 1)
    uniform = torch.rand(num_trials, 5, generator=gen)
    noise = torch.empty(num_trials, vocab).exponential_(generator=gen)
    result = reference.rejection_sample(tokens, parents, torch.full((num_trials,), 5), target, None, uniform, noise)
    first = _emitted(tokens, *result, 0)
    second = _emitted(tokens, *result, 1)
    third = _emitted(tokens, *result, 2)
    assert _tv(first, rows[0]) < 0.02
    for token, node in ((2, 1), (0, 2), (4, 3)):  # second token given the child that was taken
        chosen = second[first == token]
        assert chosen.numel() > 20_000 and (chosen >= 0).all()
        assert _tv(chosen, rows[node]) < 0.02
    deep = third[(first == 2) & (second == 1)]
    assert deep.numel() > 20_000 and _tv(deep, rows[4]) < 0.02


def test_rejection_sample_sampled_chain_has_target_distribution():
    """A chain of 3 draft tokens sampled from draft distributions, with targets that depend on
    the token just drafted: every emitted token ~ the target given the tokens before it."""
    num_trials, vocab, depth = 300_000, 5, 3
    gen = torch.Generator().manual_seed(1)
    root_target = _distribution(vocab, gen)
    # Target after token x at depth d: next_target[d][x]; draft at depth d: draft_dist[d].
    next_target = torch.stack([torch.stack([_distribution(vocab, gen) for _ in range(vocab)]) for _ in range(depth)])
    draft_dist = torch.stack([(_distribution(vocab, gen) + root_target) / 2 for _ in range(depth + 1)])
    tokens = torch.zeros(num_trials, depth + 1, dtype=torch.int64)
    target = torch.zeros(num_trials, depth + 1, vocab)
    target[:, 0] = root_target
    for d in range(1, depth + 1):
        tokens[:, d] = torch.multinomial(draft_dist[d], num_trials, replacement=True, generator=gen)
        target[:, d] = next_target[d - 1][tokens[:, d]]
    draft = draft_dist[None].expand(num_trials, -1, -1).contiguous()
    parents = torch.arange(-1, depth).repeat(num_trials, 1)
    uniform = torch.rand(num_trials, depth + 1, generator=gen)
    noise = torch.empty(num_trials, vocab).exponential_(generator=gen)
    result = reference.rejection_sample(
        tokens, parents, torch.full((num_trials,), depth + 1), target, draft, uniform, noise
    )
    assert 0.3 < result[0].float().mean() / depth < 0.95, "the test should exercise both outcomes"
    first = _emitted(tokens, *result, 0)
    second = _emitted(tokens, *result, 1)
    assert _tv(first, root_target) < 0.02
    checked = 0
    for x in range(vocab):
        chosen = second[(first == x) & (second >= 0)]
        if chosen.numel() > 20_000:
            assert _tv(chosen, next_target[0][x]) < 0.02
            checked += 1
    assert checked >= 3


def test_rejection_sample_rejects_unordered_trees():
    tokens = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="parents"):
        reference.greedy_verify(tokens, torch.tensor([[-1, 2, 0]]), torch.tensor([3]), tokens)


def test_store_kv_skips_negative_slots_and_tree_attention_decode_fast_path():
    # Decode (one token, no mask) must not need a mask and equals plain attention over the cache.
    torch.manual_seed(2)
    k_cache = torch.zeros(3, 16, 2, 64)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    slots = torch.arange(40)
    slots[7] = -1
    reference.store_kv(k_cache, v_cache, k, v, slots)
    assert (k_cache.view(-1, 2, 64)[7] == 0).all() and torch.equal(k_cache.view(-1, 2, 64)[8], k[8])
    q = torch.randn(1, 4, 64)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    out = reference.tree_attention(q, k_cache, v_cache, table, torch.tensor([40], dtype=torch.int32),
                                   torch.tensor([0, 1], dtype=torch.int32), None, 0.125)
    keys = k_cache.view(-1, 2, 64)[:40].repeat_interleave(2, 1)
    vals = v_cache.view(-1, 2, 64)[:40].repeat_interleave(2, 1)
    want = torch.einsum("hc,chd->hd", torch.einsum("hd,chd->hc", q[0], keys).mul(0.125).softmax(-1), vals)
    torch.testing.assert_close(out[0], want)
