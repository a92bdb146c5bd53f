"""The int8 KV cache: quantization (reference.quantize_kv and the C store), the C attention on
int8 caches at every ISA tier, and how far int8 attention is from the fp32-cache attention.

Format: K and V caches int8 [num_blocks, block_size, num_kv_heads, head_dim], scales fp32
[num_blocks, block_size, num_kv_heads]; per (position, kv head) scale s = amax / 127 and
q = round(x / s), so a dequantized value q * s is within s / 2 of x.

Tolerances.
* Kernel vs reference on the same int8 cache: the reference dequantizes and runs the fp32
  attention; the kernel sums q * int8 and applies the K scale to the sum, and the V scale to
  the softmax weight.  Same values, different rounding order: the fp32 bounds of
  test_cpu_attention.py (1e-5; bf16 output: one rounding, 2^-8 |ref| + 1e-5).
* Roundtrip: |x - q s| <= s / 2, plus the fp32 rounding of x / s and of q s (each < 2^-24
  relative, at most 127 s * 2^-23 together): s * (1/2 + 2^-16).
* int8 vs fp32 cache (test_int8_attention_error_is_bounded_by_the_step): with d_t the score
  change of position t (scale * q . (K~_t - K_t)), delta = max |d_t| over the visible t,
  p / p~ the softmax weights without / with the quantization, o = sum p_t v_t:
      |o~ - o| <= max_t |V~_t - V_t| + (e^(2 delta) - 1) sum_t p_t |v_t - o|
  (p~_t / p_t lies in [e^-2delta, e^2delta], and sum (p~_t - p_t) = 0 lets o be subtracted
  from v).  Both terms come from the quantization step: |V~ - V| <= s_v / 2 and
  |d_t| <= scale * sum_d |q_d| s_k / 2.  Checked per output element, plus the RMS of the
  error against the first-order prediction of uniform rounding noise (variance step^2 / 12).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from prescient.kernels import cpu_attention, cpu_linear, ops, reference
from tests.kernels.test_cpu_attention import HEADS, _batch, _random_tree, _tier_or_skip

QDTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _needs_kernel(request):
    if not getattr(request.function, "no_kernel_needed", False) and not cpu_attention.available():
        pytest.skip(f"C attention kernel unavailable: {cpu_attention.why_not()}")
    yield


def _no_kernel_needed(fn):
    fn.no_kernel_needed = True
    return fn


@pytest.fixture
def isa_cap():
    yield cpu_linear._set_isa_cap
    cpu_linear._set_isa_cap(99)


def _int8_batch(q_lens, ctx_lens, *, qdtype=torch.float32, **kw):
    """_batch's random q and paged caches, the caches quantized: (q, kq, vq, ks, vs, bt, ctx,
    cu, k, v) with k, v the fp32 caches they came from."""
    q, k, v, bt, ctx, cu = _batch(q_lens, ctx_lens, dtype=torch.float32, **kw)
    (kq, ks), (vq, vs) = reference.quantize_kv(k), reference.quantize_kv(v)
    return q.to(qdtype), kq, vq, ks, vs, bt, ctx, cu, k, v


def _check_int8(q, kq, vq, ks, vs, bt, ctx, cu, mask_bits, scale=0.125):
    out = cpu_attention.tree_attention(q, kq, vq, bt, ctx, cu, mask_bits, scale,
                                       k_scale=ks, v_scale=vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference.tree_attention(q.float(), kq, vq, bt, ctx, cu, mask_bits, scale,
                                   k_scale=ks, v_scale=vs)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        err = (out.float() - ref).abs()
        tol = 2.0 ** -8 * ref.abs() + 1e-5
        assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"
    return out


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------

@_no_kernel_needed
@pytest.mark.parametrize("dtype", QDTYPES, ids=["f32", "bf16"])
def test_quantize_roundtrip_error_is_half_a_step(dtype):
    g = torch.Generator().manual_seed(1)
    # rows of very different magnitudes, an outlier per row, and an all-zero row
    x = torch.randn(64, 3, 64, generator=g) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    x[:, :, 5] *= 10
    x[7, 1] = 0
    x = x.to(dtype)
    q, s = reference.quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    xf = x.float()
    torch.testing.assert_close(s, xf.abs().amax(-1) / 127, rtol=0, atol=0)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    # every non-zero row uses the full range (its amax maps to +-127); the zero row is zeros
    live = s > 0
    assert bool((q.abs().amax(-1)[live] == 127).all())
    assert bool((q[7, 1] == 0).all()) and float(s[7, 1]) == 0.0
    err = (xf - reference.dequantize_kv(q, s)).abs()
    bound = s.unsqueeze(-1) * (0.5 + 2.0 ** -16)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    # ... and the bound is reached: round-to-nearest, not truncation (which would give ~1 s)
    assert float((err / s.clamp(min=1e-30).unsqueeze(-1))[live].max()) > 0.45


@pytest.mark.parametrize("dtype", QDTYPES, ids=["f32", "bf16"])
def test_c_store_matches_the_reference_bit_for_bit(dtype):
    """Strided k/v views (as the model's qkv slices), skipped slots (-1), and slots written by
    the C store and by the reference store agree exactly; other slots are untouched."""
    g = torch.Generator().manual_seed(2)
    num_blocks, block_size, kvh, d, t = 6, 16, 3, 64, 21
    qkv = (torch.randn(t, 15, d, generator=g) * 3).to(dtype)
    k, v = qkv[:, 9:12], qkv[:, 12:15]
    assert not k.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t].long()
    slots[[3, 11]] = -1
    caches = []
    for store in (cpu_attention.store_kv_int8, reference.store_kv):
        kc = torch.full((num_blocks, block_size, kvh, d), 99, dtype=torch.int8)
        vc = kc.clone()
        ks = torch.full((num_blocks, block_size, kvh), -1.0)
        vs = ks.clone()
        store(kc, vc, k, v, slots, ks, vs)
        caches.append((kc, vc, ks, vs))
    for a, b in zip(*caches):
        assert torch.equal(a, b)
    kc, vc, ks, vs = caches[0]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert bool((kc.view(-1, kvh, d)[~written] == 99).all())
    assert bool((ks.view(-1, kvh)[~written] == -1).all())
    q_ref, s_ref = reference.quantize_kv(k[slots >= 0])
    assert torch.equal(kc.view(-1, kvh, d)[slots[slots >= 0]], q_ref)
    assert torch.equal(ks.view(-1, kvh)[slots[slots >= 0]], s_ref)


def test_ops_store_kv_routes_int8(monkeypatch):
    """ops.store_kv: int8 CPU caches take the C store; PRESCIENT_KERNELS=reference the torch
    one; both give the same bytes.  A bf16 cache keeps the old 5-argument path."""
    monkeypatch.delenv("PRESCIENT_KERNELS", raising=False)
    monkeypatch.delenv("PRESCIENT_CPU_ATTENTION", raising=False)
    calls = []
    real = cpu_attention.store_kv_int8
    monkeypatch.setattr(cpu_attention, "store_kv_int8", lambda *a: (calls.append(1), real(*a)))
    k = torch.randn(4, 3, 64)
    slots = torch.tensor([5, 0, -1, 17])
    outs = []
    for env in ("auto", "reference"):
        monkeypatch.setenv("PRESCIENT_KERNELS", env)
        kc, ks = torch.zeros(2, 16, 3, 64, dtype=torch.int8), torch.zeros(2, 16, 3)
        vc, vs = kc.clone(), ks.clone()
        ops.store_kv(kc, vc, k, k * 2, slots, k_scale=ks, v_scale=vs)
        outs.append((kc, vc, ks, vs))
    assert calls == [1]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    monkeypatch.delenv("PRESCIENT_KERNELS")
    cache = torch.zeros(2, 16, 3, 64, dtype=torch.bfloat16)
    ops.store_kv(cache, cache.clone(), k, k, slots)
    assert torch.equal(cache.view(-1, 3, 64)[5], k[0].bfloat16())
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        ops.store_kv(outs[0][0], outs[0][1], k, k, slots)


def test_c_store_rejects_bad_arguments():
    kc, ks = torch.zeros(2, 16, 3, 64, dtype=torch.int8), torch.zeros(2, 16, 3)
    k = torch.randn(2, 3, 64)
    call = cpu_attention.store_kv_int8
    with pytest.raises(ValueError, match="token 1: slot_mapping"):
        call(kc, kc.clone(), k, k, torch.tensor([3, 32]), ks, ks.clone())
    assert bool((kc == 0).all()) and bool((ks == 0).all())  # nothing written
    with pytest.raises(ValueError, match="int8 caches"):
        call(kc.float(), kc.float(), k, k, torch.tensor([0, 1]), ks, ks)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        call(kc, kc.clone(), k, k, torch.tensor([0, 1]), ks[:, :, :2], ks)
    with pytest.raises(ValueError, match="k and v must be"):
        call(kc, kc.clone(), k[:, :2], k[:, :2], torch.tensor([0, 1]), ks, ks.clone())
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        call(kc, kc.clone(), k, k, torch.tensor([0, 1], dtype=torch.int32), ks, ks.clone())


# ---------------------------------------------------------------------------------------------
# Attention on an int8 cache: kernel vs reference, every tier
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["f32", "bf16"])
def test_every_isa_tier(isa_cap, tier, qdtype):
    """Decodes at several context lengths and GQA groups (rows per kv head 1, 3, 4, 8: K widened
    in registers or once per chunk, V widened in registers or once), trees, random mask bits,
    prefill chunks (48 and 66 rows per kv head), a mixed batch, small blocks, head dims 32, 96,
    128 (a last block of 8 K words at 96) and 48 (portable at every tier)."""
    _tier_or_skip(tier)
    assert isa_cap(tier) == tier
    rng = random.Random(7)
    kw = dict(qdtype=qdtype)
    for ctx in (1, 15, 16, 17, 900, 4000):
        for heads in HEADS + [(8, 1)]:
            _check_int8(*_int8_batch([1], [ctx], num_heads=heads[0], num_kv_heads=heads[1],
                                     seed=ctx, **kw)[:8], None)
    tree = _random_tree(16, rng)
    _check_int8(*_int8_batch([16], [916], seed=2, **kw)[:8], tree.mask_bits())
    tree = _random_tree(8, rng)
    _check_int8(*_int8_batch([8], [4008], num_heads=8, num_kv_heads=2, seed=5, **kw)[:8],
                tree.mask_bits())
    bits = torch.rand(40, 40, generator=torch.Generator().manual_seed(6)) < 0.5
    _check_int8(*_int8_batch([40], [60], seed=6, **kw)[:8], reference.pack_bits(bits))
    _check_int8(*_int8_batch([22], [150], seed=3, **kw)[:8], None)
    _check_int8(*_int8_batch([33], [50], head_dim=128, num_heads=8, num_kv_heads=2, seed=3,
                             **kw)[:8], None)
    _check_int8(*_int8_batch([1, 1, 5, 0, 12], [17, 300, 5, 9, 140], seed=4, **kw)[:8], None)
    _check_int8(*_int8_batch([1, 16], [200, 77], block_size=8, seed=8, **kw)[:8], None)
    for head_dim in (32, 48, 96):
        _check_int8(*_int8_batch([1, 9], [130, 40], num_heads=8, num_kv_heads=8,
                                 head_dim=head_dim, seed=head_dim, **kw)[:8], None)


def test_strided_q_zero_rows_and_ops_routing(monkeypatch):
    """q as a strided view; an all-zero cache row (scale 0); ops.tree_attention takes the kernel
    for int8 and the reference when forced, with the same result."""
    q, kq, vq, ks, vs, bt, ctx, cu, _, _ = _int8_batch([1, 6], [100, 60], seed=9)
    kq.view(-1, 3, 64)[:40] = 0
    ks.view(-1, 3)[:40] = 0
    qkv = torch.randn(q.shape[0], 15, 64)
    qkv[:, :9] = q
    view = qkv[:, :9]
    out = _check_int8(view, kq, vq, ks, vs, bt, ctx, cu, None, scale=0.3)
    monkeypatch.delenv("PRESCIENT_KERNELS", raising=False)
    monkeypatch.delenv("PRESCIENT_CPU_ATTENTION", raising=False)
    calls = []
    real = cpu_attention.tree_attention
    monkeypatch.setattr(cpu_attention, "tree_attention",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    args = (view, kq, vq, bt, ctx, cu, None, 0.3)
    assert torch.equal(ops.tree_attention(*args, k_scale=ks, v_scale=vs), out)
    monkeypatch.setenv("PRESCIENT_KERNELS", "reference")
    torch.testing.assert_close(ops.tree_attention(*args, k_scale=ks, v_scale=vs), out,
                               atol=1e-5, rtol=1e-5)
    assert calls == [1]


def test_results_do_not_depend_on_threads():
    """A split 4k decode and a batch: 1 or 2 threads give the same bits on an int8 cache."""
    before = cpu_linear.library().pg_num_threads()
    cases = [_int8_batch([1], [4000], qdtype=torch.bfloat16, seed=1)[:8],
             _int8_batch([16], [916], seed=2)[:8]]
    cpu_attention._set_solo_work(0)
    try:
        outs = []
        for n in (1, 2):
            cpu_linear.set_num_threads(n)
            outs.append([cpu_attention.tree_attention(c[0], c[1], c[2], *c[5:], None, 0.125,
                                                      k_scale=c[3], v_scale=c[4]) for c in cases])
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    finally:
        cpu_linear.set_num_threads(before)
        cpu_attention._set_solo_work(2048)


def test_attention_rejects_bad_scales():
    q, kq, vq, ks, vs, bt, ctx, cu, k, v = _int8_batch([1], [40], seed=10)
    call = cpu_attention.tree_attention
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        call(q, kq, vq, bt, ctx, cu, None, 0.1)
    with pytest.raises(ValueError, match="k_scale must be a float32"):
        call(q, kq, vq, bt, ctx, cu, None, 0.1, k_scale=ks[:, :8], v_scale=vs)
    with pytest.raises(ValueError, match="v_scale must be a float32"):
        call(q, kq, vq, bt, ctx, cu, None, 0.1, k_scale=ks, v_scale=vs.double())
    with pytest.raises(ValueError, match="v_cache is"):
        call(q, kq, v, bt, ctx, cu, None, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="for int8 caches"):
        call(q, k, v, bt, ctx, cu, None, 0.1, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="only then"):
        reference.tree_attention(q, kq, vq, bt, ctx, cu, None, 0.1)


# ---------------------------------------------------------------------------------------------
# int8 vs the fp32 cache
# ---------------------------------------------------------------------------------------------

def _error_bound(q, k, v, kd, vd, k_step, v_step, mask, scale):
    """Per element bound of |attention(q, kd, vd) - attention(q, k, v)| (module docstring), and
    the first-order variance for independent uniform rounding errors, for one sequence.
    q [q_len, H, D]; k, v, kd, vd [ctx, KVH, D] (kd, vd dequantized); k_step, v_step [ctx, KVH]
    (the scales); mask [q_len, ctx] bool or None.  Returns bound and variance [q_len, H, D],
    float64."""
    group = q.shape[1] // k.shape[1]

    def per_head(t):  # [ctx, KVH, ...] -> [H, ctx, ...]
        return t.double().repeat_interleave(group, dim=1).transpose(0, 1)

    k, v, kd, vd, k_step, v_step = map(per_head, (k, v, kd, vd, k_step, v_step))
    qh = q.double().transpose(0, 1)  # [H, q_len, D]
    s = qh @ k.transpose(1, 2) * scale  # [H, q_len, ctx]
    ds = qh @ (kd - k).transpose(1, 2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
        ds = ds.masked_fill(~mask, 0.0)
    p = s.softmax(-1)  # [H, q_len, ctx]
    o = p @ v  # [H, q_len, D]
    dev = (v[:, None] - o[:, :, None]).abs()  # [H, q_len, ctx, D]: |v_t - o|
    visible = (p > 0)[..., None]
    dv_max = ((vd - v).abs()[:, None] * visible).amax(2)  # [H, q_len, D]
    delta = ds.abs().amax(-1, keepdim=True)  # [H, q_len, 1]
    bound = dv_max + torch.expm1(2 * delta) * (p[..., None] * dev).sum(2)
    # first order: do = sum_t p_t (ds_t (v_t - o) + dv_t); a rounding error of step e has
    # variance e^2 / 12, so var(ds_t) = scale^2 |q|^2 k_step_t^2 / 12
    var_ds = scale ** 2 * (qh ** 2).sum(-1, keepdim=True) * (k_step ** 2 / 12)[:, None, :]
    var = (p[..., None] ** 2 * (dev ** 2 * var_ds[..., None]
                                + (v_step ** 2 / 12)[:, None, :, None])).sum(2)
    return bound.transpose(0, 1), var.transpose(0, 1)


@pytest.mark.parametrize("case", ["decode1k", "decode4k", "tree"])
def test_int8_attention_error_is_bounded_by_the_step(case):
    """Kernel output on the int8 cache vs the fp32 reference on the unquantized cache: within
    the worst-case bound element by element, and with the RMS error the rounding noise predicts
    (0.6x .. 1.6x: a misapplied scale or a wrong position would be far outside)."""
    ctx_len, q_len = {"decode1k": (1024, 1), "decode4k": (4096, 1), "tree": (916, 16)}[case]
    q, kq, vq, ks, vs, bt, ctx, cu, k, v = _int8_batch([q_len], [ctx_len], seed=ctx_len)
    mask = _random_tree(q_len, random.Random(3)).mask_bits() if q_len > 1 else None
    scale = 64 ** -0.5
    out = cpu_attention.tree_attention(q, kq, vq, bt, ctx, cu, mask, scale, k_scale=ks, v_scale=vs)
    exact = reference.tree_attention(q, k, v, bt, ctx, cu, mask, scale)
    kg, vg = reference.gather_kv(k, v, bt[0], ctx_len)
    kqg, vqg = reference.gather_kv(kq, vq, bt[0], ctx_len)
    ksg, vsg = reference.gather_kv(ks, vs, bt[0], ctx_len)
    bound, var = _error_bound(q, kg, vg, reference.dequantize_kv(kqg, ksg),
                              reference.dequantize_kv(vqg, vsg), ksg, vsg,
                              reference._query_mask(mask, q_len, ctx_len, q.device), scale)
    err = (out.double() - exact.double()).abs()
    assert bool((err <= bound + 1e-5).all()), f"max excess {(err - bound).max().item():.3g}"
    ratio = math.sqrt(float((err ** 2).mean() / var.mean()))
    assert 0.6 < ratio < 1.6, ratio
