"""Every kernel op, through prescient.kernels.ops, on every backend, against the slow oracles.

The `backend` fixture (conftest) runs each test once on the torch reference and once on the
Triton kernels (interpreted on CPU). Shapes are small so the interpreter stays quick.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from prescient.kernels import ops
from prescient.kernels.reference import pack_bits
from tests.kernels import kernel_oracles as oracle
from tests.kernels.conftest import HAS_TRITON

BLOCK_SIZE = 16


def _attention_case(trees, prefix_lens, num_heads, num_kv_heads, head_dim, dtype, device, seed):
    """A batch whose sequence i has prefix_lens[i] cached tokens and new tokens shaped by
    trees[i]: a parents list (a draft tree), or an int (a causal chunk of that many tokens)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    q_lens = [len(t) if isinstance(t, list) else t for t in trees]
    context_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    num_blocks = sum(math.ceil(c / BLOCK_SIZE) for c in context_lens) + 3
    block_tables = oracle.paged_layout(context_lens, BLOCK_SIZE, num_blocks, rng)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.float64).to(dtype)
    v_cache = torch.randn(shape, dtype=torch.float64).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=torch.float64).to(dtype)
    visible = []
    for tree, n in zip(trees, q_lens):
        seen = oracle.tree_ancestors(tree) if isinstance(tree, list) else torch.ones(n, n).tril().bool()
        visible.extend(seen)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32), cu)
    # Causal rows carry their causal bits too, as in a mixed batch (docs/CONTRACTS.md).
    width = max(q_lens)
    mask_bits = pack_bits(torch.stack([torch.nn.functional.pad(v, (0, width - len(v))) for v in visible]))
    return [a.to(device) for a in args], mask_bits.to(device), visible


CHAIN = list(range(-1, 11))  # root + 11 nodes in a line
WIDE = [-1] + [0] * 12 + [1, 1, 2]
BIG = oracle.random_tree(40, random.Random(7), max_children=3)  # 40 nodes: two mask words
TREES = {"root_only": [-1], "one_node": [-1, 0], "chain": CHAIN, "wide": WIDE, "forty": BIG}
HEADS = [(2, 2, 64), (6, 2, 128), (8, 1, 64)]  # (num_heads, num_kv_heads, head_dim): GQA 1, 3, 8


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("tree", list(TREES), ids=str)
def test_tree_attention_trees(backend, device, tree, heads):
    num_heads, num_kv_heads, head_dim = heads
    # A second, causal sequence rides along: trees and prefill share a batch in the engine.
    (q, k, v, bt, ctx, cu), mask_bits, visible = _attention_case(
        [TREES[tree], 3], [21, 15], num_heads, num_kv_heads, head_dim, torch.float32, device, seed=1
    )
    scale = head_dim**-0.5
    out = ops.tree_attention(q, k, v, bt, ctx, cu, mask_bits, scale)
    want = oracle.attention_oracle(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), ctx.cpu(), cu.cpu(), visible, scale)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_tree_attention_block_edges_and_causal(backend, device, dtype):
    # Contexts ending just before, on and after block edges; decode rows (q_len 1), causal
    # chunks and an empty sequence (q_len 0) in one batch with mask_bits=None.
    q_lens = [1, 1, 1, 1, 4, 17, 0, 2]
    prefixes = [14, 15, 16, 31, 12, 16, 5, 30]
    (q, k, v, bt, ctx, cu), _, visible = _attention_case(
        q_lens, prefixes, 4, 2, 64, dtype, device, seed=2
    )
    out = ops.tree_attention(q, k, v, bt, ctx, cu, None, 0.125)
    want = oracle.attention_oracle(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), ctx.cpu(), cu.cpu(), visible, 0.125)
    tol = {torch.bfloat16: 2e-2, torch.float32: 2e-5, torch.float64: 1e-6}[dtype]
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_tree_attention_kv_splits(device):
    """Flash-decoding: the KV range split over 3 programs per query block, merged by a second
    kernel; one split of the short sequence is empty."""
    from prescient.kernels import triton_tree_attention

    (q, k, v, bt, ctx, cu), mask_bits, visible = _attention_case(
        [1, WIDE, 1], [90, 40, 3], 2, 2, 64, torch.float32, device, seed=8
    )
    out = triton_tree_attention.tree_attention(q, k, v, bt, ctx, cu, mask_bits, 0.125, num_splits=3)
    want = oracle.attention_oracle(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), ctx.cpu(), cu.cpu(), visible, 0.125)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)


def test_tree_attention_prefill_chunk(backend, device):
    # 70 new tokens after 10 cached ones, GQA 2: the kernel's wide (64-row) query blocks, three
    # of them in one sequence, each stopping its KV loop at its last query.
    (q, k, v, bt, ctx, cu), _, visible = _attention_case([70], [10], 4, 2, 64, torch.float32, device, seed=9)
    out = ops.tree_attention(q, k, v, bt, ctx, cu, None, 0.125)
    want = oracle.attention_oracle(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), ctx.cpu(), cu.cpu(), visible, 0.125)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_and_kv_copy(backend, device, dtype):
    torch.manual_seed(3)
    k_cache = torch.randn(4, BLOCK_SIZE, 3, 64).to(dtype)
    v_cache = torch.randn_like(k_cache)
    # k and v split off one fused projection: strided over tokens, as the model produces them.
    qkv = torch.randn(6, 9, 64).to(dtype)
    k, v = qkv[:, 3:6], qkv[:, 6:9]
    slots = torch.tensor([0, 15, -1, 16, 63, -1])  # block edges, padding tokens
    want_k, want_v = k_cache.clone().view(-1, 3, 64), v_cache.clone().view(-1, 3, 64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s], want_v[s] = k[t], v[t]
    # An accepted path's move (node index -> depth): sources overlap destinations.
    src, dst = torch.tensor([20, 22, 25, 40]), torch.tensor([19, 20, 22, 23])
    want_k[dst], want_v[dst] = want_k[src].clone(), want_v[src].clone()

    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    ops.store_kv(k_cache, v_cache, k.to(device), v.to(device), slots.to(device))
    ops.kv_copy(k_cache, v_cache, src.to(device), dst.to(device))
    ops.kv_copy(k_cache, v_cache, src[:0].to(device), dst[:0].to(device))  # nothing accepted
    assert torch.equal(k_cache.cpu().view(-1, 3, 64), want_k)
    assert torch.equal(v_cache.cpu().view(-1, 3, 64), want_v)


def _verify_batch(num_seqs, max_nodes, vocab, seed, sampled):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((num_seqs, max_nodes), -1, dtype=torch.int64)
    tokens = torch.full((num_seqs, max_nodes), -1, dtype=torch.int64)
    num_nodes = torch.randint(1, max_nodes + 1, (num_seqs,), generator=gen)
    for s in range(num_seqs):
        n = int(num_nodes[s])
        parents[s, :n] = torch.tensor(oracle.random_tree(n, rng))
        tokens[s, :n] = torch.randint(0, vocab, (n,), generator=gen)
    target = torch.rand(num_seqs, max_nodes, vocab, generator=gen) ** 4  # peaked, so some accept
    target /= target.sum(-1, keepdim=True)
    draft = None
    if sampled:
        draft = torch.rand(num_seqs, max_nodes, vocab, generator=gen) ** 4
        draft /= draft.sum(-1, keepdim=True)
    uniform = torch.rand(num_seqs, max_nodes, generator=gen)
    noise = torch.empty(num_seqs, vocab).exponential_(generator=gen)
    return tokens, parents, num_nodes, target, draft, uniform, noise


def test_greedy_verify(backend, device):
    tokens, parents, num_nodes, target, _, _, _ = _verify_batch(48, 9, 3, seed=4, sampled=False)
    target_argmax = target.argmax(-1)
    got = ops.greedy_verify(*(t.to(device) for t in (tokens, parents, num_nodes, target_argmax)))
    want = oracle.greedy_oracle(tokens, parents, num_nodes, target_argmax)
    assert want[0].max() >= 2, "the random trees should accept something"
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("vocab", [5, 37, 1500], ids=lambda v: f"vocab{v}")  # 1500: chunked
@pytest.mark.parametrize("sampled", [False, True], ids=["onehot", "sampled"])
def test_rejection_sample(backend, device, vocab, sampled):
    num_seqs = 40 if vocab < 1000 else 6
    batch = _verify_batch(num_seqs, 8, vocab, seed=5 + vocab, sampled=sampled)
    got = ops.rejection_sample(*(None if t is None else t.to(device) for t in batch))
    want = oracle.rejection_oracle(*batch)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("vocab", [37, 64, 100], ids=lambda v: f"vocab{v}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_indices", [False, True], ids=["all_rows", "indices"])
def test_apply_token_bitmask(backend, device, vocab, dtype, with_indices):
    torch.manual_seed(6)
    logits = torch.randn(5, vocab).to(dtype)
    indices = torch.tensor([4, 0, 2]) if with_indices else None
    num_words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3 if with_indices else 5, num_words), dtype=torch.int32)
    want = oracle.bitmask_oracle(logits, bitmask, indices)
    got = logits.to(device)
    ops.apply_token_bitmask(got, bitmask.to(device), None if indices is None else indices.to(device))
    assert torch.equal(got.cpu(), want)


def test_apply_token_bitmask_leaves_uncovered_columns(backend, device):
    # A padded logits vocabulary wider than the bitmask: the extra columns are not touched.
    logits = torch.zeros(2, 70, device=device)
    bitmask = torch.zeros(2, 2, dtype=torch.int32, device=device)  # covers 64 tokens, none allowed
    ops.apply_token_bitmask(logits, bitmask)
    assert torch.isinf(logits[:, :64]).all() and (logits[:, 64:] == 0).all()


@pytest.mark.parametrize("hidden", [64, 576, 1000], ids=lambda h: f"hidden{h}")  # 576: SmolLM2; 1000: masked tail
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_half_precision(backend, device, hidden, dtype):
    """The fused RMSNorm (Triton) and the reference's eight ops agree with a float64 RMSNorm to
    the output's rounding, and with each other to at most one rounding of the output."""
    torch.manual_seed(hidden)
    x = (torch.randn(7, hidden) * 3).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    got = ops.rms_norm(x.to(device), w.to(device), 1e-5).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    xd = x.double()
    exact = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    # normalised row rounded once, the weight product rounded again: two roundings at most
    assert ((got.double() - exact).abs() <= 2 * ulp * exact.abs() + 1e-6).all()
    ref = ops.reference.rms_norm(x, w, 1e-5)
    assert ((got.double() - ref.double()).abs() <= ulp * ref.double().abs() + 1e-6).all()
