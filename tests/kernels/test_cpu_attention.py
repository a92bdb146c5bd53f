"""Correctness of prescient.kernels.cpu_attention (the C tree_attention) against the reference.

Tolerances.  fp32: the kernel and the reference differ only in fp32 summation order and in
the softmax's exp (the kernel works in base 2), so atol = rtol = 1e-5.  bf16: the reference
is computed in fp32 from the same bf16 inputs (the products of bf16 values are exact in fp32,
so that is what the kernel computes before its one rounding of the output), and the kernel
may differ by one bf16 rounding of the output: |out - ref| <= 2^-8 |ref| + 1e-5.  Where the
kernel rounds the softmax weights P to bf16 for P.V (tier avx512_bf16, a bf16 cache:
cpu_attention.p_rounded), each weight moves by up to 2^-8 of itself, and with the row sums of the
rounded weights the output by up to ~2^-7 of sum_j P_j |V_j| / l (the reference's attention over
|V|, `mag`): the bound adds 2^-7 mag (random data stays near 2^-9).

ISA tiers: test_every_isa_tier runs each tier of cpu_linear.ISA_TIERS the CPU can run (capped
with cpu_linear._set_isa_cap), the other tests the best one.  The int8 cache has its own file,
test_kv_int8.py.
"""

from __future__ import annotations

import ctypes
import os
import random

import pytest
import torch

from prescient.kernels import cpu_attention, cpu_linear, ops, reference
from prescient.speculative.tree import DraftTree

DTYPES = [torch.float32, torch.bfloat16]
# (num_heads, num_kv_heads): GQA groups 1, 3 (the default model), 4; (8, 8) at head_dim 128
# also splits the kv heads over several work items.
HEADS = [(4, 4), (9, 3), (8, 2)]


def _kernel_or_skip() -> None:
    if not cpu_attention.available():
        reason = cpu_attention.why_not() or ""
        pytest.skip(f"C attention kernel unavailable: {reason}")


def _no_kernel_needed(fn):
    fn.no_kernel_needed = True
    return fn


@pytest.fixture(autouse=True)
def _needs_kernel(request):
    if not getattr(request.function, "no_kernel_needed", False):
        _kernel_or_skip()
    yield


@pytest.fixture
def isa_cap():
    """Run at a lower ISA tier (a name of cpu_linear.ISA_TIERS), restoring afterwards."""
    yield cpu_linear._set_isa_cap
    cpu_linear._set_isa_cap(99)


def _tier_or_skip(tier: str) -> None:
    """Skip a tier this CPU cannot run (the tiers are listed by name, so the test ids do not
    depend on the machine)."""
    if tier not in cpu_linear.machine_tiers():
        pytest.skip(f"this CPU cannot run the {tier} tier")


@pytest.fixture
def pooled():
    """Send every call through the thread pool, however small (restores the default)."""
    cpu_attention._set_solo_work(0)
    yield
    cpu_attention._set_solo_work(2048)


def _batch(q_lens, ctx_lens, *, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
           dtype=torch.float32, seed=0, spare_blocks=5):
    """Random q and paged caches; every sequence's blocks are scattered (shuffled ids)."""
    g = torch.Generator().manual_seed(seed)
    need = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g).int()
    max_blocks = max(need + [1]) + 2  # unused trailing entries, as in the engine's tables
    block_tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    at = 0
    for s, n in enumerate(need):
        block_tables[s, :n] = ids[at:at + n]
        at += n
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, torch.tensor(ctx_lens, dtype=torch.int32), cu


def _bf16_tol(ref, q, k_cache, v_cache, block_tables, ctx, cu, mask_bits, scale, rounded=None):
    """|out - ref| allowed for a bf16 output (the module docstring): 2^-8 |ref| + 1e-5, plus
    2^-7 mag where P is rounded (rounded: None asks cpu_attention.p_rounded)."""
    tol = 2.0 ** -8 * ref.abs() + 1e-5
    if rounded is None:
        rounded = cpu_attention.p_rounded(v_cache.dtype, q.shape[-1])
    if rounded:
        tol = tol + 2.0 ** -7 * reference.tree_attention(
            q.float(), k_cache.float(), v_cache.float().abs(), block_tables, ctx, cu, mask_bits, scale)
    return tol


def _check(q, k_cache, v_cache, block_tables, ctx, cu, mask_bits, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = cpu_attention.tree_attention(q, k_cache, v_cache, block_tables, ctx, cu, mask_bits, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference.tree_attention(q.float(), k_cache.float(), v_cache.float(), block_tables,
                                   ctx, cu, mask_bits, scale)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        err = (out.float() - ref).abs()
        tol = _bf16_tol(ref, q, k_cache, v_cache, block_tables, ctx, cu, mask_bits, scale)
        assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"
    return out


def _random_tree(n: int, rng: random.Random) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree([rng.randrange(1000) for _ in range(n)], parents)


# ---------------------------------------------------------------------------------------------
# Shapes the engine produces
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("ctx", [1, 15, 16, 17, 900, 4000])
def test_decode(dtype, heads, ctx):
    _check(*_batch([1], [ctx], num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype, seed=ctx),
           None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len", [2, 7, 16, 33, 64])
@pytest.mark.parametrize("prefix", [0, 100])
def test_prefill_chunk_causal(dtype, head_dim, q_len, prefix):
    _check(*_batch([q_len], [prefix + q_len], head_dim=head_dim, dtype=dtype, seed=q_len + prefix),
           None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("nodes", [1, 5, 16, 40])
@pytest.mark.parametrize("prefix", [0, 37, 900])
def test_draft_tree(dtype, heads, nodes, prefix):
    rng = random.Random(nodes * 1000 + prefix)
    tree = _random_tree(nodes, rng)
    q, k, v, bt, ctx, cu = _batch([nodes], [prefix + nodes], num_heads=heads[0],
                                  num_kv_heads=heads[1], dtype=dtype, seed=nodes + prefix)
    _check(q, k, v, bt, ctx, cu, tree.mask_bits())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_random_mask_bits(dtype):
    """Arbitrary bits (not a tree), extra words beyond q_len's, bit 31 set: with a prefix,
    every row sees something."""
    g = torch.Generator().manual_seed(3)
    for q_len in (3, 32, 33, 50):
        q, k, v, bt, ctx, cu = _batch([q_len], [q_len + 20], dtype=dtype, seed=q_len)
        bits = torch.rand(q_len, q_len, generator=g) < 0.5
        words = reference.pack_bits(bits)
        # Garbage past bit q_len in the last word and a spare word must be ignored.
        words = torch.cat([words, torch.full((q_len, 1), -1, dtype=torch.int32)], dim=1)
        if q_len % 32:
            words[:, q_len // 32] |= torch.tensor(-1 << (q_len % 32), dtype=torch.int32)
        out = cpu_attention.tree_attention(q, k, v, bt, ctx, cu, words, 0.125)
        ref = reference.tree_attention(q.float(), k.float(), v.float(), bt, ctx, cu,
                                       reference.pack_bits(bits), 0.125)
        if dtype == torch.float32:
            tol = 2.0 ** -8 * ref.abs() + 1e-5
        else:
            tol = _bf16_tol(ref, q, k, v, bt, ctx, cu, reference.pack_bits(bits), 0.125)
        assert bool(((out.float() - ref).abs() <= tol).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_mixed_batch(dtype, heads):
    """Decodes, a draft tree, a prefill chunk and an empty sequence in one call, the causal
    rows carrying their causal bits (as in the engine's mixed batches)."""
    rng = random.Random(5)
    tree = _random_tree(12, rng)
    q_lens = [1, 12, 0, 30, 1, 4]
    ctx = [300, 512 + 12, 17, 30, 1, 200]
    rows = []
    for n in q_lens:
        if n == 12:
            rows.append(tree.mask_bits(num_words=1))
        elif n:
            rows.append(reference.pack_bits(torch.ones(n, n, dtype=torch.bool).tril()))
    width = max(r.shape[1] for r in rows)
    mask = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])
    batch = _batch(q_lens, ctx, num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype, seed=7)
    _check(*batch, mask)
    # Causal rows only: mask_bits None gives the same result.
    q_lens2, ctx2 = [1, 0, 30, 1, 4], [300, 17, 30, 1, 200]
    _check(*_batch(q_lens2, ctx2, num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype, seed=8),
           None)


def test_many_sequences_shuffled_blocks():
    """16 decodes of different lengths over one shuffled pool of blocks (no splitting)."""
    ctx = [300 + 37 * i for i in range(16)]
    for dtype in DTYPES:
        _check(*_batch([1] * 16, ctx, dtype=dtype, seed=11), None)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_sizes(block_size):
    """Chunks of 16 positions straddle blocks smaller than 16 and start mid-block."""
    for dtype in DTYPES:
        _check(*_batch([1, 16], [200, 77], block_size=block_size, dtype=dtype, seed=block_size),
               None)


@pytest.mark.parametrize("head_dim", [32, 48, 80, 96, 128, 256])
def test_head_dims(head_dim):
    """Multiples of 32 take the vector path (96: a 64 + 32 column split); others (48, 80)
    the portable one."""
    for dtype in DTYPES:
        _check(*_batch([1, 9], [130, 40], num_heads=8, num_kv_heads=8, head_dim=head_dim,
                       dtype=dtype, seed=head_dim), None)


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_every_isa_tier(isa_cap, tier, dtype):
    """Each tier's own code (portable, AVX2, AVX-512, AVX-512 + BF16) against the reference:
    decodes at several context lengths and GQA groups (1, 3, 4 rows per kv head: the AVX2
    q.K tiles of 4 and of 2 positions), draft trees, random mask bits, a prefill chunk at head_dim
    128, a mixed batch, blocks smaller than a chunk, and head dims 32 / 96 (vector paths) and
    48 (portable at every tier)."""
    _tier_or_skip(tier)
    assert isa_cap(tier) == tier
    rng = random.Random(len(tier))
    for ctx in (1, 17, 900, 4000):
        for heads in HEADS:
            _check(*_batch([1], [ctx], num_heads=heads[0], num_kv_heads=heads[1], dtype=dtype,
                           seed=ctx), None)
    tree = _random_tree(16, rng)
    _check(*_batch([16], [916], dtype=dtype, seed=2), tree.mask_bits())
    tree = _random_tree(8, rng)
    _check(*_batch([8], [4008], num_heads=8, num_kv_heads=2, dtype=dtype, seed=5), tree.mask_bits())
    bits = torch.rand(40, 40, generator=torch.Generator().manual_seed(6)) < 0.5
    _check(*_batch([40], [60], dtype=dtype, seed=6), reference.pack_bits(bits))
    _check(*_batch([33], [50], head_dim=128, num_heads=8, num_kv_heads=2, dtype=dtype, seed=3), None)
    _check(*_batch([1, 1, 5, 0, 12], [17, 300, 5, 9, 140], dtype=dtype, seed=4), None)
    _check(*_batch([1, 16], [200, 77], block_size=8, dtype=dtype, seed=7), None)
    for head_dim in (32, 48, 96):
        _check(*_batch([1, 9], [130, 40], num_heads=8, num_kv_heads=8, head_dim=head_dim,
                       dtype=dtype, seed=head_dim), None)


def test_strided_q_and_scale():
    """q as the model passes it: a view into the fused qkv projection (token stride > row)."""
    for dtype in DTYPES:
        q, k, v, bt, ctx, cu = _batch([1, 6], [100, 60], dtype=dtype, seed=9)
        qkv = torch.randn(q.shape[0], 15, 64).to(dtype)
        qkv[:, :9] = q
        view = qkv[:, :9]
        assert not view.is_contiguous()
        _check(view, k, v, bt, ctx, cu, None, scale=0.3)


def test_results_do_not_depend_on_threads(pooled):
    """1, 2 or 3 threads, and both item plans (whole cache rows per item or split by kv head and
    tokens: pg_one_stream), give the same bits (the context pieces are fixed positions; threads
    and items only schedule them -- test_attention_invariance.py checks this row by row)."""
    before = cpu_linear.library().pg_num_threads()
    cases = [_batch([1], [4000], dtype=torch.bfloat16, seed=1),
             _batch([16], [916], dtype=torch.float32, seed=2),
             _batch([8], [1032], dtype=torch.bfloat16, seed=4),
             _batch([1] * 8, [100 * (i + 1) for i in range(8)], dtype=torch.bfloat16, seed=3)]
    try:
        outs = []
        for n in (1, 2, 3):
            cpu_linear.set_num_threads(n)
            for one in (False, True):
                cpu_linear._set_one_stream(one)
                outs.append([cpu_attention.tree_attention(*c, None, 0.125) for c in cases])
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b)
    finally:
        cpu_linear.set_num_threads(before)
        cpu_linear._set_one_stream(None)


def test_pool_on_small_calls(pooled):
    for dtype in DTYPES:
        _check(*_batch([1, 3, 1], [5, 20, 33], dtype=dtype, seed=12), None)


def test_solo_while_torch_is_multithreaded(pooled):
    """With torch on several threads the call stays on the caller's thread: same bits."""
    import ctypes as ct

    lib = cpu_linear.library()
    stats = (ct.c_uint64 * 3)()
    before_threads = torch.get_num_threads()
    case = _batch([1], [2000], dtype=torch.bfloat16, seed=13)
    try:
        torch.set_num_threads(1)
        lib.pg_stats(stats)
        calls = stats[0]
        pooled_out = cpu_attention.tree_attention(*case, None, 0.125)
        lib.pg_stats(stats)
        assert stats[0] == calls + (lib.pg_num_threads() > 1)
        torch.set_num_threads(2)
        solo_out = cpu_attention.tree_attention(*case, None, 0.125)
        lib.pg_stats(stats)
        assert stats[0] == calls + (lib.pg_num_threads() > 1)  # no pooled call this time
        assert torch.equal(pooled_out, solo_out)
    finally:
        torch.set_num_threads(before_threads)


def test_empty_inputs():
    q, k, v, bt, ctx, cu = _batch([0, 0], [5, 9])
    out = cpu_attention.tree_attention(q, k, v, bt, ctx, cu, None, 0.125)
    assert out.shape == (0, 9, 64)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_bad_arguments_raise():
    q, k, v, bt, ctx, cu = _batch([2, 1], [40, 20])
    call = cpu_attention.tree_attention

    def raises(match, *args):
        with pytest.raises(ValueError, match=match):
            call(*args)

    raises("float32 or bfloat16", q.double(), k.double(), v.double(), bt, ctx, cu, None, 1.0)
    raises("dtype", q, k.bfloat16(), v, bt, ctx, cu, None, 1.0)
    raises("head_dim", q[..., :32], k, v, bt, ctx, cu, None, 1.0)
    raises("multiple of num_kv_heads", q[:, :8], k, v, bt, ctx, cu, None, 1.0)
    raises("v_cache", q, k, v[:, :8], bt, ctx, cu, None, 1.0)
    raises(r"q must be \[num_tokens", q[0], k, v, bt, ctx, cu, None, 1.0)
    raises("int32", q, k, v, bt.long(), ctx, cu, None, 1.0)
    raises("cu_seqlens_q", q, k, v, bt, ctx, cu[:-1], None, 1.0)
    raises("cu_seqlens_q must start at 0", q, k, v, bt, ctx, cu + 1, None, 1.0)
    raises("sequence 1: cu_seqlens_q", q, k, v, bt, ctx, torch.tensor([0, 4, 3], dtype=torch.int32),
           None, 1.0)
    raises("sequence 1: context_lens", q, k, v, bt, torch.tensor([40, 0], dtype=torch.int32), cu,
           None, 1.0)
    too_long = torch.tensor([40, bt.shape[1] * 16 + 1], dtype=torch.int32)
    raises("sequence 1: context_lens", q, k, v, bt, too_long, cu, None, 1.0)
    bad_block = bt.clone()
    bad_block[0, 1] = k.shape[0]
    raises("sequence 0: block_tables", q, k, v, bad_block, ctx, cu, None, 1.0)
    bad_block[0, 1] = -1
    raises("sequence 0: block_tables", q, k, v, bad_block, ctx, cu, None, 1.0)
    raises("mask_bits must be int32", q, k, v, bt, ctx, cu, torch.zeros(2, 1, dtype=torch.int32), 1.0)
    raises("mask_bits must be int32", q, k, v, bt, ctx, cu, torch.zeros(3, 1, dtype=torch.int64), 1.0)
    raises("no words", q, k, v, bt, ctx, cu, torch.zeros(3, 0, dtype=torch.int32), 1.0)
    q40, k40, v40, bt40, ctx40, cu40 = _batch([40], [40])
    raises("sequence 0: mask_bits", q40, k40, v40, bt40, ctx40, cu40,
           torch.zeros(40, 1, dtype=torch.int32), 1.0)


# ---------------------------------------------------------------------------------------------
# Dispatch and build
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = cpu_attention.tree_attention

    def wrapped(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "tree_attention", wrapped)
    monkeypatch.delenv("PRESCIENT_KERNELS", raising=False)
    monkeypatch.delenv("PRESCIENT_CPU_ATTENTION", raising=False)
    return calls


def test_ops_routes_cpu_calls_to_the_kernel(spy, monkeypatch):
    q, k, v, bt, ctx, cu = _batch([1, 4], [50, 20])
    for dtype in DTYPES:
        args = (q.to(dtype), k.to(dtype), v.to(dtype), bt, ctx, cu, None, 0.125)
        out = ops.tree_attention(*args)
        ref = reference.tree_attention(*args)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert spy == DTYPES
    # float64 and float16 stay on the reference
    for dtype in (torch.float64, torch.float16):
        ops.tree_attention(q.to(dtype), k.to(dtype), v.to(dtype), bt, ctx, cu, None, 0.125)
    assert spy == DTYPES
    monkeypatch.setenv("PRESCIENT_CPU_ATTENTION", "0")
    ops.tree_attention(q, k, v, bt, ctx, cu, None, 0.125)
    monkeypatch.setenv("PRESCIENT_CPU_ATTENTION", "1")
    monkeypatch.setenv("PRESCIENT_KERNELS", "reference")
    ops.tree_attention(q, k, v, bt, ctx, cu, None, 0.125)
    assert spy == DTYPES
    monkeypatch.delenv("PRESCIENT_KERNELS")
    ops.tree_attention(q, k, v, bt, ctx, cu, None, 0.125)
    assert spy == DTYPES + [torch.float32]


@_no_kernel_needed
def test_ops_falls_back_when_unavailable(monkeypatch):
    """Without the compiled kernel (no compiler), CPU calls run the reference."""
    monkeypatch.setattr(cpu_attention, "_fn", None)
    monkeypatch.setattr(cpu_attention, "_tried", True)
    monkeypatch.delenv("PRESCIENT_KERNELS", raising=False)
    q, k, v, bt, ctx, cu = _batch([1, 4], [50, 20])
    torch.testing.assert_close(ops.tree_attention(q, k, v, bt, ctx, cu, None, 0.125),
                               reference.tree_attention(q, k, v, bt, ctx, cu, None, 0.125))
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_attention.tree_attention(q, k, v, bt, ctx, cu, None, 0.125)


def _pack_args(q, k, v, bt, ctx, cu, scale, *, out, k_scale=None, v_scale=None):
    """pa_args_t for a direct call into a separately built library (no mask)."""
    dt = cpu_attention._DT[q.dtype]
    kv_dt = cpu_attention._KV_INT8 if k.dtype is torch.int8 else dt
    return cpu_attention._ARGS.pack(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), bt.data_ptr(), ctx.data_ptr(), cu.data_ptr(), 0,
        out.data_ptr(), q.stride(0), q.stride(1), *q.shape, k.shape[2], k.shape[0], k.shape[1],
        bt.shape[0], bt.shape[1], 0, dt, 0,
        0 if k_scale is None else k_scale.data_ptr(), 0 if v_scale is None else v_scale.data_ptr(),
        kv_dt, scale)


def test_generic_build_runs_every_path(generic_so):
    """Built without -march=native (per-function targets, run-time ISA choice) the attention
    kernel is complete too, at every tier this CPU runs, for fp32, bf16 and int8 caches, and with
    the bf16 q.K on AMX tiles where the CPU has them (that build once dropped the tile config's
    stores and faulted)."""
    lib = ctypes.CDLL(str(generic_so))
    lib.pa_tree_attention.argtypes = [ctypes.c_char_p]
    lib.pg_set_isa_cap.argtypes = [ctypes.c_int]
    lib.pa_set_amx.argtypes = [ctypes.c_int]
    for dtype, kv in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.int8)):
        q, k, v, bt, ctx, cu = _batch([1, 5], [300, 40], dtype=dtype, seed=len(str(kv)))
        scales = {}
        if kv is torch.int8:
            (k, ks), (v, vs) = reference.quantize_kv(k), reference.quantize_kv(v)
            scales = dict(k_scale=ks, v_scale=vs)
        ref = reference.tree_attention(q.float(), k if scales else k.float(),
                                       v if scales else v.float(), bt, ctx, cu, None, 0.125, **scales)
        for tier in cpu_linear.machine_tiers():
            index = cpu_linear.ISA_TIERS.index(tier)
            assert lib.pg_set_isa_cap(index) == index
            for amx in (0, 1):
                if amx and not lib.pa_set_amx(1):
                    lib.pa_set_amx(0)  # below avx512_bf16 or without AMX: the switch stays off
                    continue
                out = torch.empty_like(q)
                assert lib.pa_tree_attention(_pack_args(q, k, v, bt, ctx, cu, 0.125, out=out, **scales)) == 0
                lib.pa_set_amx(0)
                err = (out.float() - ref).abs()
                tol = 2.0 ** -8 * ref.abs() + 1e-5
                if dtype == torch.bfloat16 and kv is None and tier == "avx512_bf16":  # P rounded
                    tol = _bf16_tol(ref, q, k, v, bt, ctx, cu, None, 0.125, rounded=True)
                assert bool((err <= tol).all()), (dtype, kv, tier, amx)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_bf16_products_as_fmas_give_the_instructions_bits(heads, isa_cap):
    """Tier avx512_bf16's q.K and P.V on a bf16 cache, by vdpbf16ps or as its two FMAs a lane (odd
    product first; pg_bf16_fma, the default on Intel; the SDM's order, checked lane by lane on the
    Xeon and on Zen 4): the same bits for decode rows, trees, prefill chunks (odd chunk tails
    among them: a last pair with P = 0) and several sequences, at head_dim 64 and 128, alone and
    pooled; and close to the reference."""
    _tier_or_skip("avx512_bf16")
    isa_cap("avx512_bf16")
    cpu_attention._set_amx(False)  # the tiles have bits of their own (the test below)
    rng = random.Random(5)
    try:
        for head_dim in (64, 96, 128):
            for q_lens, ctx_lens, tree in [([1], [17], None), ([1, 1, 1], [33, 400, 1000], None),
                                           ([9], [300], 9), ([16], [1040], 16), ([40], [40], None),
                                           ([5], [5], None), ([3], [21], None)]:
                batch = _batch(q_lens, ctx_lens, num_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim + ctx_lens[0])
                mask = _random_tree(tree, rng).mask_bits() if tree else None
                outs = []
                for fma in (False, True):
                    assert cpu_linear._set_bf16_fma(fma) is fma
                    for solo in (2048, 0):
                        cpu_attention._set_solo_work(solo)
                        outs.append(cpu_attention.tree_attention(*batch, mask, head_dim ** -0.5))
                assert all(torch.equal(outs[0], o) for o in outs[1:]), (head_dim, q_lens, ctx_lens)
                _check(*batch, mask, head_dim ** -0.5)
    finally:
        cpu_linear._set_bf16_fma(None)
        cpu_attention._set_solo_work(2048)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_bf16_qk_on_amx_tiles(heads, isa_cap):
    """Asked for (PRESCIENT_ATTN_AMX=1) where the CPU has AMX-BF16, a bf16 cache's q.K runs on
    tiles: close to the reference for decode rows, trees, prefill chunks and several sequences at
    head_dim 32-128, the same bits alone and pooled, other bits than the FMAs' (the switch takes
    effect); past head_dim 128 the FMAs' bits. Off by default."""
    _tier_or_skip("avx512_bf16")
    isa_cap("avx512_bf16")
    if not cpu_attention._set_amx(True):
        pytest.skip("no AMX-BF16 tiles on this CPU or OS")
    rng = random.Random(7)
    differ = 0
    try:
        for head_dim in (32, 64, 96, 128, 256):
            for q_lens, ctx_lens, tree in [([1], [17], None), ([1, 1, 1], [33, 400, 1000], None),
                                           ([9], [300], 9), ([16], [1040], 16), ([40], [40], None),
                                           ([3, 8], [700, 530], None)]:
                batch = _batch(q_lens, ctx_lens, num_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim + ctx_lens[0])
                mask = _random_tree(tree, rng).mask_bits() if tree else None
                outs = {}
                for amx in (True, False):
                    cpu_attention._set_amx(amx)
                    for solo in (2048, 0):
                        cpu_attention._set_solo_work(solo)
                        outs[amx, solo] = cpu_attention.tree_attention(*batch, mask, head_dim ** -0.5)
                    if amx:
                        _check(*batch, mask, head_dim ** -0.5)
                what = (head_dim, q_lens, ctx_lens)
                assert torch.equal(outs[True, 2048], outs[True, 0]), what
                if head_dim > 128:
                    assert torch.equal(outs[True, 2048], outs[False, 2048]), what
                else:
                    differ += int(not torch.equal(outs[True, 2048], outs[False, 2048]))
        assert differ > 0, "the tiles gave the FMAs' bits everywhere: are they in use?"
    finally:
        cpu_attention._set_amx(False)
        cpu_attention._set_solo_work(2048)


def test_attn_amx_is_off_by_default_and_the_env_turns_it_on_at_load():
    """A bf16 cache's q.K stays off the tiles by default; PRESCIENT_ATTN_AMX=1 puts it there from
    the library's load (where the CPU, OS and tier have them), and the startup line says so."""
    import subprocess
    import sys

    was = cpu_attention.amx_in_use()
    can = cpu_attention._set_amx(True)
    cpu_attention._set_amx(was)
    if not can:
        pytest.skip("no AMX-BF16 tiles on this CPU or OS")
    code = ("from prescient.kernels import cpu_linear, cpu_attention\n"
            "from prescient.build import kernels_line\n"
            "i = cpu_linear.kernel_info()\n"
            "print(i['attn_amx'], cpu_attention.amx_in_use(), 'q.K on AMX' in kernels_line(i))")
    env = {k: v for k, v in os.environ.items() if k not in ("PRESCIENT_BF16_DOT", "PRESCIENT_ISA", "PRESCIENT_ATTN_AMX")}
    for value, expect in ((None, "False"), ("1", "True")):
        run_env = env if value is None else {**env, "PRESCIENT_ATTN_AMX": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [expect] * 3, (value, out.stdout)
