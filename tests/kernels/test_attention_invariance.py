"""Batch invariance of the CPU tree-attention kernel (kernels/cpu_attention.c).

A query row's output must be bit for bit the same whatever else shares the call: other
sequences and their lengths, the row's place in the batch, the other rows of its own query
(a draft tree, a causal multi-token query) and the thread count.  The invariant a speculative
decoder relies on: a tree node at depth j, on any branch, gets the bits of the plain decode
step (q_len 1, causal) that follows its ancestors once accepted -- the KV prefix, then its
ancestors' K/V in depth order, context prefix + j + 1.  Checked on every ISA tier this CPU runs, for fp32 and bf16 caches and an int8
cache (with fp32 and bf16 q), at contexts inside one 256-position piece, straddling a piece
boundary, and long enough to be split over several work items.  Bits are compared as integers
(so -0.0 against 0.0 or a NaN would fail too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from prescient.kernels import cpu_attention, cpu_linear, reference
from tests.kernels.kernel_oracles import path_to, run_at_tier, tree_ancestors

BLOCK = 16
SCALE = 0.125
# Prefix lengths: inside the first chunk, a chain straddling the 256 boundary, and long ones
# whose pieces a lone decode spreads over several items (but a batch does not).
PREFIXES = [3, 250, 1020, 2300]
CHAIN = 8


@dataclass(frozen=True)
class Kind:
    name: str
    q_dtype: torch.dtype
    int8: bool
    amx: bool = False  # q.K on AMX tiles (PRESCIENT_ATTN_AMX=1): tier avx512_bf16 with AMX-BF16 only


KINDS = [Kind("f32", torch.float32, False), Kind("bf16", torch.bfloat16, False),
         Kind("bf16_amx", torch.bfloat16, False, amx=True),
         Kind("i8_f32q", torch.float32, True), Kind("i8_bf16q", torch.bfloat16, True)]
# (num_heads, num_kv_heads, head_dim): the default model's shape, and GQA 1 at head_dim 128.
SHAPES = [(9, 3, 64), (4, 4, 128)]


@pytest.fixture(autouse=True)
def _kernel():
    if not cpu_attention.available():
        pytest.skip(f"C attention kernel unavailable: {cpu_attention.why_not()}")
    yield
    cpu_attention._set_amx(False)
    cpu_linear._set_isa_cap(99)


_tier = run_at_tier  # reset by the autouse fixture


@contextlib.contextmanager
def _threads(n: int):
    """n pool threads; with 2, every call goes through the pool, however small."""
    before = cpu_linear.library().pg_num_threads()
    cpu_linear.set_num_threads(n)
    cpu_attention._set_solo_work(0 if n > 1 else 1 << 30)
    try:
        yield
    finally:
        cpu_attention._set_solo_work(2048)
        cpu_linear.set_num_threads(before)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    differ = (_bits(a) != _bits(b)).sum().item()
    gap = (a.float() - b.float()).abs().max().item()
    assert differ == 0, f"{what}: {differ} values differ (max |diff| {gap:.3g})"


class Cache:
    """One paged K/V cache (scattered blocks) shared by every sequence of a test."""

    def __init__(self, kind: Kind, shape, positions: int, seed: int):
        if kind.amx and not cpu_attention._set_amx(True):  # after the test's tier is set
            pytest.skip("q.K on AMX tiles needs tier avx512_bf16 on a CPU and OS with AMX-BF16")
        self.kind, (self.H, self.KVH, self.D) = kind, shape
        g = torch.Generator().manual_seed(seed)
        nb = positions // BLOCK + 64
        k = torch.randn(nb, BLOCK, self.KVH, self.D, generator=g)
        v = torch.randn(nb, BLOCK, self.KVH, self.D, generator=g)
        if kind.int8:
            (self.k, ks), (self.v, vs) = reference.quantize_kv(k), reference.quantize_kv(v)
            self.scales = dict(k_scale=ks, v_scale=vs)
        else:
            self.k, self.v, self.scales = k.to(kind.q_dtype), v.to(kind.q_dtype), {}
        self._free = torch.randperm(nb, generator=g).int().tolist()
        self.g = g

    def table(self, positions: int) -> list[int]:
        """Blocks for a new sequence of `positions` positions."""
        n = -(-positions // BLOCK)
        out, self._free = self._free[:n], self._free[n:]
        assert len(out) == n, "cache too small for the test"
        return out

    def q(self, rows: int) -> torch.Tensor:  # [rows, H, D]
        return torch.randn(rows, self.H, self.D, generator=self.g).to(self.kind.q_dtype)

    def attend(self, seqs, mask=None) -> torch.Tensor:
        """seqs: (q [q_len, H, D], block table, context length) per sequence; mask_bits rows
        for all of them or None (causal)."""
        q = torch.cat([s[0] for s in seqs])
        width = max(len(s[1]) for s in seqs)
        bt = torch.tensor([s[1] + [0] * (width - len(s[1])) for s in seqs], dtype=torch.int32)
        ctx = torch.tensor([s[2] for s in seqs], dtype=torch.int32)
        cu = torch.tensor([0] + torch.tensor([s[0].shape[0] for s in seqs]).cumsum(0).tolist(),
                          dtype=torch.int32)
        return cpu_attention.tree_attention(q, self.k, self.v, bt, ctx, cu, mask, SCALE,
                                            **self.scales)

    def reference(self, q, table, ctx, mask=None, abs_v=False) -> torch.Tensor:
        """reference.tree_attention on this cache (abs_v: over |V|, the scale of P's rounding)."""
        bt = torch.tensor([table], dtype=torch.int32)
        k, v = (self.k, self.v) if self.kind.int8 else (self.k.float(), self.v.float())
        v = v.abs() if abs_v else v
        return reference.tree_attention(q.float(), k, v, bt, torch.tensor([ctx], dtype=torch.int32),
                                        torch.tensor([0, q.shape[0]], dtype=torch.int32), mask,
                                        SCALE, **self.scales)


def _decodes(cache: Cache, q, table, ctx_last) -> list[torch.Tensor]:
    """Row i of q as a lone decode step (1 thread) whose context ends at ctx_last - n + 1 + i."""
    n = q.shape[0]
    with _threads(1):
        return [cache.attend([(q[i:i + 1], table, ctx_last - n + 1 + i)])[0] for i in range(n)]


def _masks(parents: list[int]) -> torch.Tensor:  # [n, 1] int32: each node's ancestors and itself
    return reference.pack_bits(tree_ancestors(parents))


def _decode_after(cache: Cache, q_row, table, prefix: int, path: list[int]) -> torch.Tensor:
    """q_row as the lone decode step (1 thread) that follows the tokens of `path` once accepted:
    a new sequence holding the prefix and then the path's K/V in depth order, as the engine's KV
    moves leave them (the tree's node i sits at prefix + i)."""
    ctx = prefix + len(path)
    new = cache.table(ctx)
    src = [*range(prefix), *(prefix + a for a in path)]

    def slots(tab, positions):
        return torch.tensor([tab[p // BLOCK] * BLOCK + p % BLOCK for p in positions])

    s, d = slots(table, src), slots(new, range(ctx))
    for t in (cache.k, cache.v, *cache.scales.values()):
        flat = t.view(-1, *t.shape[2:])
        flat[d] = flat[s]
    with _threads(1):
        return cache.attend([(q_row, new, ctx)])[0]


def _close_to_reference(out, cache: Cache, q, table, ctx, mask=None, rows=slice(None)) -> None:
    """The accuracy test_cpu_attention.py asks for (its bf16 bound where P is rounded to bf16):
    invariance must not come from a wrong answer."""
    ref = cache.reference(q, table, ctx, mask)[rows]
    if cache.kind.q_dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    tol = 2.0 ** -8 * ref.abs() + 1e-5
    if not cache.kind.int8 and cpu_attention.p_rounded(cache.v.dtype, q.shape[-1]):
        tol = tol + 2.0 ** -7 * cache.reference(q, table, ctx, mask, abs_v=True)[rows]
    assert bool(((out.float() - ref).abs() <= tol).all())


TIERS = list(cpu_linear.ISA_TIERS)
kinds = pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
tiers = pytest.mark.parametrize("tier", TIERS)


@tiers
@kinds
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
def test_tree_chain_nodes_get_the_decode_steps_bits(tier, kind, shape):
    """Chain nodes of a draft tree (mask_bits), also with side branches after them, and the
    same rows as a causal 8-token query: each row has exactly the bits of the decode step."""
    _tier(tier)
    cache = Cache(kind, shape, sum(PREFIXES) + 4 * CHAIN, seed=1)
    for prefix in PREFIXES:
        ctx = prefix + CHAIN
        table, q = cache.table(ctx), cache.q(CHAIN)
        lone = _decodes(cache, q, table, ctx)
        chain = _masks([-1] + list(range(CHAIN - 1)))
        # nodes 0-3 a chain, 4-7 side branches off it: rows 0-3 still see just their chain
        branched = _masks([-1, 0, 1, 2, 0, 1, 4, 2])
        with _threads(2):
            as_tree = cache.attend([(q, table, ctx)], chain)
            as_causal = cache.attend([(q, table, ctx)])
            as_branched = cache.attend([(q, table, ctx)], branched)
        for j in range(CHAIN):
            _same_bits(as_tree[j], lone[j], f"prefix {prefix}, chain node {j}")
            _same_bits(as_causal[j], lone[j], f"prefix {prefix}, causal row {j}")
        for j in range(4):
            _same_bits(as_branched[j], lone[j], f"prefix {prefix}, branched tree node {j}")
        if prefix == 1020:  # (the reference is slow; one context is enough for sanity)
            _close_to_reference(as_tree, cache, q, table, ctx, chain)


@tiers
@kinds
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
def test_wide_tree_over_a_long_context_gets_the_decode_steps_bits(tier, kind, shape):
    """A 17-node verify tree (17 x G query rows sharing each K/V chunk) over a 2000-position
    prefix (eight 256-position pieces, spread over several work items): every row gets exactly
    the bits of its own lone decode step.  Checked for a 17-deep chain and for a tree whose
    path 0-8 is a chain with eight side branches hanging off it: a side node gets the bits of
    the decode step after its own ancestors (the kernel reads each node's new positions in
    depth order, so the other branches' positions in between are no holes)."""
    _tier(tier)
    n, prefix = 17, 2000
    cache = Cache(kind, shape, (prefix + n + BLOCK) * 11, seed=4)
    table, q = cache.table(prefix + n), cache.q(n)
    lone = _decodes(cache, q, table, prefix + n)
    chain = _masks([-1] + list(range(n - 1)))
    path = 9  # nodes 0-8: the accepted path; 9-16 hang off it (and off each other)
    parents = [-1] + list(range(path - 1)) + [0, 2, 2, 4, 9, 6, 11, 8]
    assert len(parents) == n
    branched = _masks(parents)
    with _threads(2):
        as_chain = cache.attend([(q, table, prefix + n)], chain)
    with _threads(1):
        as_tree = cache.attend([(q, table, prefix + n)], branched)
    for j in range(n):
        _same_bits(as_chain[j], lone[j], f"17-chain node {j}")
    for j in range(path):
        _same_bits(as_tree[j], lone[j], f"branched tree, path node {j}")
    for j in range(path, n):
        _same_bits(as_tree[j], _decode_after(cache, q[j:j + 1], table, prefix, path_to(parents, j)),
                   f"branched tree, side node {j}")
    _close_to_reference(as_tree[path:], cache, q, table, prefix + n, branched, rows=slice(path, None))


@tiers
@kinds
def test_interleaved_branches_get_their_own_decode_steps_bits(tier, kind):
    """Two branches from the root laid out breadth first (nodes 1, 3, 5, ... and 2, 4, 6, ...,
    as a best-first n-gram tree of two near-equal continuations comes): a node of either
    branch gets the bits of the decode step after its own ancestors, at prefixes where the
    branches cross a chunk, a piece (256) or neither.  (Before the kernel read a node's new
    positions in depth order, the second branch's nodes saw the first's as holes, and greedy
    decoding with such trees left plain decoding's tokens.)"""
    _tier(tier)
    parents = [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    n = len(parents)
    cache = Cache(kind, (9, 3, 64), (3 + 250 + 1990 + 3 * (n + 2 * BLOCK)) * (n + 2), seed=9)
    for prefix in (3, 250, 1990):
        table, q = cache.table(prefix + n), cache.q(n)
        with _threads(2):
            out = cache.attend([(q, table, prefix + n)], _masks(parents))
        for j in range(n):
            _same_bits(out[j], _decode_after(cache, q[j:j + 1], table, prefix, path_to(parents, j)),
                       f"prefix {prefix}, node {j}")


@tiers
@kinds
def test_prefill_chunk_rows_get_the_decode_steps_bits(tier, kind):
    """A 45-token causal chunk (three token blocks of one sequence) crossing a piece
    boundary: every row is the decode step at its own position."""
    _tier(tier)
    cache = Cache(kind, SHAPES[0], 400, seed=2)
    prefix, n = 240, 45
    table, q = cache.table(prefix + n), cache.q(n)
    lone = _decodes(cache, q, table, prefix + n)
    with _threads(2):
        chunk = cache.attend([(q, table, prefix + n)])
    for j in range(n):
        _same_bits(chunk[j], lone[j], f"chunk row {j}")


@tiers
@kinds
def test_rows_do_not_depend_on_the_rest_of_the_batch(tier, kind):
    """A decode row and a draft tree, alone (1 thread) or among other sequences of every kind
    -- short and long decodes, a prefill chunk, nine decodes (enough that nothing is split
    over items) -- first, last or in between (2 threads): the same bits."""
    _tier(tier)
    cache = Cache(kind, SHAPES[0], 20000, seed=3)
    others = [(cache.q(1), cache.table(c), c) for c in (40, 600, 3000)]
    prefill = (cache.q(30), cache.table(800), 800)
    many = [(cache.q(1), cache.table(300 + 97 * i), 300 + 97 * i) for i in range(8)]
    tree_parents = [-1, 0, 0, 1, 3]
    tree_mask = _masks(tree_parents)
    causal = lambda s: torch.tensor(  # noqa: E731 -- mask_bits rows of a causal query
        [[(1 << (j + 1)) - 1] for j in range(s[0].shape[0])], dtype=torch.int64).to(torch.int32)
    for ctx in (17, 1000, 2300):
        me = (cache.q(1), cache.table(ctx), ctx)
        tree = (cache.q(5), cache.table(ctx + 5), ctx + 5)
        with _threads(1):
            alone = cache.attend([me])
            tree_alone = cache.attend([tree], tree_mask)
        batches = {
            "first": [me, *others],
            "last": [*others, prefill, me],
            "among nine": [*many[:4], me, *many[4:]],
            "beside a tree": [tree, me, others[1]],
        }
        with _threads(2):
            for name, seqs in batches.items():
                mask = None
                if any(s is tree for s in seqs):
                    mask = torch.cat([tree_mask if s is tree else causal(s) for s in seqs])
                out = cache.attend(seqs, mask)
                rows = [s[0].shape[0] for s in seqs]
                at = sum(rows[:next(i for i, s in enumerate(seqs) if s is me)])
                _same_bits(out[at], alone[0], f"ctx {ctx}, decode row {name}")
                if mask is not None:
                    t = sum(rows[:next(i for i, s in enumerate(seqs) if s is tree)])
                    _same_bits(out[t:t + 5], tree_alone, f"ctx {ctx}, tree {name}")
        if ctx == 1000:
            _close_to_reference(alone, cache, *me)


@tiers
@kinds
# the default model's shape, and 40 query heads per kv head (one token per row block at most)
@pytest.mark.parametrize("shape", [SHAPES[0], (40, 1, 64)], ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
def test_a_lone_tree_split_over_heads_and_token_blocks_keeps_its_bits(tier, kind, shape):
    """A lone draft tree (8 nodes, and a 2-token chain) is cut into one item per kv head and
    token blocks, so both threads get a full-length item when its context is one long piece and
    a short one (scheduling only); beside nine decodes nothing is cut.  Same bits either way,
    at 1 and 2 threads, and each node has its decode step's bits.  (With 40 query heads a kv
    head a row block holds one token: the cut must not make it two, which overran the partial
    slots sized for one.)"""
    _tier(tier)
    cache = Cache(kind, shape, 24000, seed=5)
    many = [(cache.q(1), cache.table(200 + 61 * i), 200 + 61 * i) for i in range(9)]
    causal = torch.ones(len(many), 1, dtype=torch.int32)
    for parents in ([-1, 0, 1, 2, 3, 1, 5, 6], [-1, 0]):
        n, mask = len(parents), _masks(parents)
        for ctx in (256 + n, 700):
            tree = (cache.q(n), cache.table(ctx), ctx)
            with _threads(1):
                one = cache.attend([tree], mask)
            with _threads(2):
                two = cache.attend([tree], mask)
                crowd = cache.attend([*many, tree], torch.cat([causal, mask]))
            _same_bits(two, one, f"{n} nodes, ctx {ctx}, lone tree at 2 threads")
            _same_bits(crowd[len(many):], one, f"{n} nodes, ctx {ctx}, tree beside nine decodes")
            for j in range(n):
                _same_bits(one[j], _decode_after(cache, tree[0][j:j + 1], tree[1], ctx - n,
                                                 path_to(parents, j)), f"{n} nodes, ctx {ctx}, node {j}")
