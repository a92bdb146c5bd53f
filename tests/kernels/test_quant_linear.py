"""Correctness of the GGUF block-format linears: kernels/quant_reference.py (against gguf.quants,
ggml's own Python port), the native small-M kernels of kernels/cpu_qgemv.c / cpu_qgemv_k.c on
every ISA tier this CPU runs and on both paths (fp32 and int8 activations), and QuantLinear's
prefill path, against float64 math on the exactly dequantized weight.

Tolerances.  The reference is ref = W x in float64 with W = dequantize(blocks) (exact: every
dequantized value is an fp32 number the kernels also produce exactly).  The kernels differ by
  * fp32 accumulation: |err| <= K * 2^-24 * sum_k |x_k| |w_k|, with |w_k| replaced by the
    magnitude of the parts the kernel sums (Q4_1: |d q| + |m|) -- the classic bound;
  * with int8 activations (pq_act_block = n > 0: one scale dx = amax / 127 per n elements),
    each x_k moves by at most dx / 2, so |err| grows by sum_k |w_k| dx_k / 2 (dx_k / 2 taken
    1 + 2^-8 larger for the fp32 rounding of x / dx), and the fp32 term above uses |x| + dx / 2;
  * a bf16 y: half an ulp of the fp32 result, 2^-8 * (|ref| + the bound above).
The K-quants (Q4_K / Q5_K / Q6_K) are included in the sweep and skip while cpu_qgemv_k.c has
no kernels (no row in cpu_formats.c) or quant_reference_k.dequantize_k is missing; for them
pq_act_block reports 256 when they quantize x (one scale per super-block).
"""

from __future__ import annotations

import gc
import platform

import numpy as np

import pytest
import torch

from prescient.kernels import cpu_linear, quant_linear as ql, quant_reference as qr
from prescient.kernels.quant_linear import QuantLinear

FORMATS = list(qr.QTYPES)
MS = [1, 2, 3, 5, 8, 16, 17, 64]  # to PG_MAX_M: decode batches and verify trees in one call
DTYPES = [torch.float32, torch.bfloat16]
# (N, K) for the 32-element formats: odd N (4-row tiles + 1-row tails); K / 32 = 1, 5, 11, 15,
# 18, 48 blocks covers every group shape of the int8 layouts (full 16- and 8-lane groups,
# zero-padded ones, pairs, single blocks); 1001 x 576 is large enough to split over the pool.
SHAPES_32 = [(37, 32), (37, 160), (41, 352), (33, 480), (61, 576), (9, 1536), (1001, 576)]
SHAPES_K = [(37, 256), (41, 512), (33, 1536), (1001, 768)]
HALF_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def _gguf_type(qtype: str):
    from gguf import GGMLQuantizationType as T
    return getattr(T, qtype.upper())


def _require(qtype: str) -> None:
    """Skip a K-quant while its reference or kernels are not there yet."""
    if qtype in qr.BLOCK32:
        return
    try:
        from prescient.kernels.quant_reference_k import dequantize_k  # noqa: F401
    except ImportError:
        pytest.skip("quant_reference_k.dequantize_k is missing")


def _require_native(qtype: str) -> None:
    _require(qtype)
    if not cpu_linear.available():
        pytest.skip("C kernels unavailable")
    if not ql.native_available(qtype):
        pytest.skip(f"no native {qtype} kernels yet (no row in cpu_formats.c)")


def _random_blocks(qtype: str, N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Arbitrary block bytes (every code, Q8_0's -128 included) with finite fp16 scales of
    random sign and size."""
    _, be, bb = qr.QTYPES[qtype]
    b = torch.randint(0, 256, (N * (K // be), bb), dtype=torch.uint8, generator=g)
    for off in HALF_FIELDS[qtype]:
        h = ((torch.rand(b.shape[0], generator=g) - 0.5) * 0.1).to(torch.float16)
        b[:, off:off + 2] = h.view(torch.uint8).reshape(-1, 2)
    return b.reshape(N, K // be * bb)


def _weights(qtype: str, N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Blocks of quantized Gaussian weights (rows of different scale) for the 32-formats, the
    random-byte blocks otherwise."""
    if qtype in qr.BLOCK32:
        w = torch.randn(N, K, generator=g) * (0.02 + torch.rand(N, 1, generator=g))
        return qr.quantize(w, qtype)
    return _random_blocks(qtype, N, K, g)


def _mag(blocks: torch.Tensor, qtype: str, N: int, K: int, W: torch.Tensor) -> torch.Tensor:
    """Magnitude of the parts the kernels sum per weight: |d q| + |m| for Q4_1, else |w|."""
    if qtype != "q4_1":
        return W.abs()
    m = qr.dequantize(blocks, qtype, N, K).double() - qr.dequantize(_zero_m(blocks), qtype, N, K).double()
    return (W - m).abs() + m.abs()


def _zero_m(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks.clone().reshape(-1, 20)
    b[:, 2:4] = 0
    return b


def _check(y, x, W, mag, act_block, bias=None, w_round=0.0):
    """Assert |y - W x (+ bias)| within the bound of the module docstring; `w_round`: the relative
    rounding of each weight (and bias) before the product (2^-8 for the bf16 prefill tiles)."""
    xd = x.double()
    K = W.shape[1]
    ref = xd @ W.T
    xmag = xd.abs()
    extra = torch.zeros_like(ref)
    if act_block:
        M = x.shape[0]
        half = xd.abs().reshape(M, K // act_block, act_block).amax(-1) / 127 / 2 * (1 + 2.0 ** -8)
        half = half.repeat_interleave(act_block, dim=1)
        extra = half @ W.abs().T
        xmag = xmag + half
    tol = K * 2.0 ** -24 * (xmag @ mag.T) + extra + w_round * (xmag @ W.abs().T)
    if bias is not None:
        ref = ref + bias.double()
        tol = tol + (K * 2.0 ** -24 + w_round) * bias.double().abs()
    if y.dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * (ref.abs() + tol)
    tol = tol + 1e-30
    err = (y.double() - ref).abs()
    bad = err > tol
    assert not bad.any(), (f"max err {err.max().item():.3g}, worst excess {(err - tol).max().item():.3g} "
                           f"at {bad.nonzero()[0].tolist()} (act_block {act_block})")


@pytest.fixture
def tier_cap():
    """Run at a capped ISA tier / forced path, restoring both afterwards."""
    yield cpu_linear._set_isa_cap
    cpu_linear._set_isa_cap(99)
    ql.set_mode("auto")


# ---- reference --------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", FORMATS)
def test_dequantize_matches_gguf(qtype):
    _require(qtype)
    from gguf import quants
    g = torch.Generator().manual_seed(1)
    N, K = (7, 512) if qtype not in qr.BLOCK32 else (7, 160)
    b = _random_blocks(qtype, N, K, g)
    ours = qr.dequantize(b, qtype, N, K)
    theirs = torch.from_numpy(quants.dequantize(b.numpy(), _gguf_type(qtype)).astype(np.float32))
    assert ours.dtype == torch.float32 and ours.shape == (N, K)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_quantize_matches_gguf(qtype):
    """Byte-identical to gguf.quants.quantize (ggml's reference rounding), edge blocks too."""
    from gguf import quants
    g = torch.Generator().manual_seed(2)
    w = torch.randn(12, 256, generator=g) * torch.rand(12, 1, generator=g) * 4
    w[0, :32] = 0                                  # all-zero block: d = 0
    w[1, :32] = 1.25                               # constant block
    w[2, :32] = torch.arange(32) * 0.5 - 8         # ties at .5 steps
    w[3, :32] = -w[3, :32].abs()                   # one-signed
    w[4, :32] = torch.linspace(-3, 3, 32)          # signed extremes of equal magnitude
    ours = qr.quantize(w, qtype)
    theirs = torch.from_numpy(quants.quantize(w.numpy(), _gguf_type(qtype)))
    assert ours.dtype == torch.uint8 and ours.shape == (12, 256 // 32 * qr.QTYPES[qtype][2])
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_quantize_roundtrip_bounds(qtype):
    """Per element: Q8_0 |w - w^| <= d/2, Q4_1 <= d/2, Q4_0 <= |d| (the clip at q = 15 can cost
    a full step on the side opposite the largest value), plus what storing d (and m) in fp16
    costs; and the bulk is far inside the bound."""
    g = torch.Generator().manual_seed(3)
    N, K = 64, 512
    w = torch.randn(N, K, generator=g) * (0.05 + torch.rand(N, 1, generator=g))
    b = qr.quantize(w, qtype)
    wh = qr.dequantize(b, qtype, N, K).double()
    x = w.double().reshape(-1, 32)
    if qtype == "q8_0":
        d = x.abs().amax(1, keepdim=True) / 127
        d16 = d.float().half().double()
        bound = d / 2 + 127 * (d - d16).abs()
    elif qtype == "q4_0":
        mx = torch.gather(x, 1, x.abs().argmax(1, keepdim=True))
        d = (mx / -8).abs()
        d16 = (mx / -8).float().half().double().abs()
        bound = d + 8 * (d - d16).abs()
    else:
        mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        d = (mx - mn) / 15
        d16 = d.float().half().double()
        bound = d / 2 + 15 * (d - d16).abs() + (mn - mn.float().half().double()).abs()
    err = (wh.reshape(-1, 32) - x).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-12).all(), (err - bound).max()
    assert err.mean() < 0.3 * d.mean()  # rounding to nearest: mean error ~ d / 4


def test_qtypes_table():
    from gguf import GGML_QUANT_SIZES
    for name, (wdt, be, bb) in qr.QTYPES.items():
        assert GGML_QUANT_SIZES[_gguf_type(name)] == (be, bb)
    assert [v[0] for v in qr.QTYPES.values()] == [16, 17, 18, 19, 20, 21]  # cpu_formats.h DT_Q* (ABI)


# ---- native kernels: every format x tier x path x M x dtype -----------------------------------

def _tiers():
    return cpu_linear.machine_tiers() if cpu_linear.available() else []


@pytest.mark.parametrize("tier", ["portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"])
@pytest.mark.parametrize("qtype", FORMATS)
def test_small_m_every_tier(tier_cap, qtype, tier):
    _require_native(qtype)
    if tier not in _tiers():
        pytest.skip(f"this CPU cannot run {tier}")
    assert tier_cap(tier) == tier
    g = torch.Generator().manual_seed(100 * FORMATS.index(qtype) + len(tier))
    shapes = SHAPES_32 if qtype in qr.BLOCK32 else SHAPES_K
    for N, K in shapes:
        b = _weights(qtype, N, K, g)
        W = qr.dequantize(b, qtype, N, K).double()
        mag = _mag(b, qtype, N, K, W)
        bias = torch.randn(N, generator=g)
        lins = (QuantLinear(b, qtype, N, K), QuantLinear(b, qtype, N, K, bias=bias))
        for mode in ("float", "int8"):
            ql.set_mode(mode)
            act = ql.act_block(qtype)
            assert act >= 0
            if mode == "float" or tier == "portable":
                assert act == 0
            elif qtype in qr.BLOCK32:
                assert act == 32
            for M in MS:
                for dt in DTYPES:
                    x = torch.randn(M, K, generator=g).to(dt)
                    lin = lins[M % 2]
                    y = lin(x)
                    assert y.shape == (M, N) and y.dtype == dt
                    _check(y, x, W, mag, act, bias=lin.bias)


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_int8_path_uses_quantized_activations(tier_cap, qtype):
    """The int8 path must differ from the fp32 one (else the tolerance above is untested) and
    stay within ~1% on Gaussian data (the header's accuracy figure), on every SIMD tier."""
    _require_native(qtype)
    g = torch.Generator().manual_seed(4)
    N, K = 256, 1536
    b = _weights(qtype, N, K, g)
    lin = QuantLinear(b, qtype, N, K)
    x = torch.randn(4, K, generator=g)
    W = qr.dequantize(b, qtype, N, K).double()
    ref = x.double() @ W.T
    for tier in [t for t in _tiers() if t != "portable"]:
        tier_cap(tier)
        ql.set_mode("float")
        yf = lin(x).double()
        ql.set_mode("int8")
        yi = lin(x).double()
        assert ((yf - ref).norm() / ref.norm()).item() < 1e-6
        rel = ((yi - ref).norm() / ref.norm()).item()
        assert 1e-4 < rel < 1e-2, (tier, rel)


def test_thread_count_does_not_change_results():
    """Each output is computed by one thread in a fixed order: bitwise identical."""
    if not cpu_linear.available():
        pytest.skip("C kernels unavailable")
    g = torch.Generator().manual_seed(5)
    cases = []
    for qtype in qr.BLOCK32:
        b = _weights(qtype, 2049, 576, g)
        cases.append((QuantLinear(b, qtype, 2049, 576), torch.randn(3, 576, generator=g)))
    before = cpu_linear.kernel_info()["threads"]
    try:
        outs = []
        for n in (1, 2, 3):
            cpu_linear.set_num_threads(n)
            outs.append([lin(x) for lin, x in cases])
        for other in outs[1:]:
            for a, c in zip(outs[0], other):
                assert torch.equal(a, c)
    finally:
        cpu_linear.set_num_threads(before)


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_rows_with_bias_do_not_depend_on_the_call(tier_cap, qtype):
    """With a bias, fp32 or bf16 output, on every tier and both paths: row i of an M-row call
    has the bits of the one-row call (a 4-input tile's rows are summed and rounded together,
    a lone row apart -- in the same order), and N = 2049 leaves a one-row tail."""
    _require_native(qtype)
    g = torch.Generator().manual_seed(11)
    N, K = 2049, 576
    b = _weights(qtype, N, K, g)
    lin = QuantLinear(b, qtype, N, K, bias=torch.randn(N, generator=g))
    for tier in _tiers():
        tier_cap(tier)
        for mode in ("float", "int8"):
            ql.set_mode(mode)
            for dt in DTYPES:
                x = torch.randn(13, K, generator=g).to(dt)  # [M, K]
                alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
                for m in (4, 8, 13):
                    got = lin(x[:m])
                    assert torch.equal(got, alone[:m]), (tier, mode, dt, m, (got != alone[:m]).sum().item())
    ql.set_mode("auto")


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_regrouped_copy_gives_the_blocks_bits(tier_cap, qtype):
    """On a CPU with AVX-512, a weight of the 32-element family can hold a copy in the "groups"
    layout (full 16-block groups as the block-lane registers take them; tail blocks and short
    rows as is; the default on AVX-512 without VNNI): every tier and path, fp32 and bf16, with a
    bias, gives the bits of the blocks themselves (the copy dropped)."""
    _require_native(qtype)
    if "avx512" not in _tiers():
        pytest.skip("the regrouped copy is for the AVX-512 kernels")
    g = torch.Generator().manual_seed(12)
    # K: two full groups and a tail of 3 (pairs), one and a padded group of 9; a short row
    for N, K in ((45, 1120), (29, 800), (21, 224)):
        lin = QuantLinear(_weights(qtype, N, K, g), qtype, N, K, bias=torch.randn(N, generator=g))
        assert lin.regrouped and lin.layout == ql.default_layout()
        assert lin.regroup(True, "groups") and lin.layout == "groups"
        for tier in _tiers():
            tier_cap(tier)
            for mode in ("float", "int8"):
                ql.set_mode(mode)
                for M, dt in ((1, torch.bfloat16), (5, torch.float32), (64, torch.bfloat16)):
                    x = torch.randn(M, K, generator=g).to(dt)
                    got = lin(x)
                    lin.regroup(False)
                    want = lin(x)
                    assert lin.regroup(True, "groups")
                    assert torch.equal(got, want), (N, K, tier, mode, M, dt)
    # and the AVX-512 int8 rows do read the copy: a changed byte in its first group shows there
    lin = QuantLinear(_weights(qtype, 8, 512, g), qtype, 8, 512)
    assert lin.regroup(True, "groups")
    x = torch.randn(1, 512, generator=g)
    ql.set_mode("int8")
    tier_cap("avx512")
    clean = lin(x)
    lin._regrouped[0] ^= 0x11  # a quant byte of block 0 (lane 0 of the first vector)
    assert not torch.equal(lin(x), clean)
    tier_cap("avx2")
    before = lin(x)
    lin._regrouped[0] ^= 0x11
    assert torch.equal(lin(x), before)  # the AVX2 rows read the blocks here (a "cl" copy they would read)
    ql.set_mode("auto")


CL_TIERS = ("avx512_bf16", "avx512_vnni", "avx2")  # the tiers whose int8 rows read a "cl" copy


@pytest.mark.parametrize("tier", CL_TIERS)
@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_column_lane_copy_rows_do_not_depend_on_m(tier_cap, qtype, tier):
    """With AVX2 or AVX-512 VNNI a weight holds a "cl" copy (16 output columns in a vector's
    lanes; "groups" is AVX-512 without VNNI's) and the int8 rows of tiers avx512_bf16,
    avx512_vnni and avx2 read it: row i of an M-row call has the bits of the one-row call at every M (the tiles of
    1-4 inputs x 1-2 column tiles or halves, one or two blocks a step), with a bias, fp32 and
    bf16, N past a multiple of 16 (and of 8), a matrix split over the pool; within the int8
    bound of the reference.  Plain AVX-512's rows do not read the copy."""
    _require_native(qtype)
    if tier not in _tiers():
        pytest.skip(f"this CPU has no {tier} tier")
    tier_cap(tier)
    ql.set_mode("int8")
    g = torch.Generator().manual_seed(14)
    # an 8-column tail tile, 4 pool chunks (a 16-row-aligned split) and an odd block count; a
    # 4-column tail (half a half); one block
    for N, K in ((40, 576), (200, 1504), (36, 96), (16, 32)):
        b = _weights(qtype, N, K, g)
        lin = QuantLinear(b, qtype, N, K, bias=torch.randn(N, generator=g))
        if ql.default_layout() != "cl":  # AVX-512 without VNNI: its "groups" copy is the default
            assert lin.regroup(True, "cl")
        assert lin.layout == "cl"
        W = qr.dequantize(b, qtype, N, K).double()
        mag = _mag(b, qtype, N, K, W)
        for dt in DTYPES:
            x = torch.randn(64, K, generator=g).to(dt)
            alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
            _check(alone, x, W, mag, 32, bias=lin.bias)
            for M in (2, 3, 4, 5, 7, 8, 13, 64):
                got = lin(x[:M])
                assert torch.equal(got, alone[:M]), (N, K, dt, M, (got != alone[:M]).sum().item())
    # the copy is what the tier's rows read; plain AVX-512's (where this CPU has it) do not
    x = torch.randn(3, K, generator=g)
    clean = lin(x)
    lin._regrouped[0] ^= 0x11  # a quant byte of column 0, block 0
    assert not torch.equal(lin(x), clean)
    if "avx512" in _tiers():
        tier_cap("avx512")
        before = lin(x)
        lin._regrouped[0] ^= 0x11
        assert torch.equal(lin(x), before)
    ql.set_mode("auto")


CL_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 64)  # every row tiling of the CL kernels: 1-8-row passes


def _assert_cl_rows_agree(qtype: str, seed: int, setups: dict) -> None:
    """Each of `setups` (name -> a call that points the kernels at one variant) gives the first's
    bits on random "cl" weights (every quant code: Q8_0's -128, whose pairs reach the int16 limit;
    scales of both signs), with a bias, at every M of CL_ROWS, fp32 and bf16, activations whose
    blocks quantize to +-127 throughout among them (the largest pair sums)."""
    ql.set_mode("int8")
    g = torch.Generator().manual_seed(seed)
    for N, K in ((200, 1504), (44, 576), (16, 32)):
        lin = QuantLinear(_random_blocks(qtype, N, K, g), qtype, N, K, bias=torch.randn(N, generator=g))
        assert lin.layout == "cl"
        for dt in DTYPES:
            x = torch.cat([torch.randn(32, K, generator=g), torch.sign(torch.randn(32, K, generator=g))]).to(dt)
            got = {}
            for name, setup in setups.items():
                setup()
                got[name] = [lin(x[:M]) for M in CL_ROWS]
            first = next(iter(got))
            for name, outs in got.items():
                for M, a, b in zip(CL_ROWS, got[first], outs):
                    assert torch.equal(a, b), (name, N, K, dt, M, (a != b).sum().item())
    ql.set_mode("auto")


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_activations_prepared_on_the_pool_give_the_callers_bits(tier_cap, qtype):
    """A call of >= 4 rows prepares its activations (widened from bf16, quantized to int8 blocks)
    on the pool's threads, each a range of the rows, as its pool call's first phase: the same
    prepared rows as on the caller, so the same bits, at every tier this CPU runs (the column-lane
    records, the block-group plan, the portable rows), int8 and fp32 paths, fp32 and bf16 x, M
    not a multiple of the threads, matrices large enough to be pooled."""
    _require_native(qtype)
    g = torch.Generator().manual_seed(31)
    lins = [QuantLinear(_random_blocks(qtype, N, K, g), qtype, N, K, bias=torch.randn(N, generator=g))
            for N, K in ((1536, 576), (576, 1536))]
    try:
        for tier in _tiers():
            tier_cap(tier)
            for mode in ("int8", "float"):
                ql.set_mode(mode)
                for lin in lins:
                    for dt in DTYPES:
                        x, junk = torch.randn(2, 16, lin.in_features, generator=g).to(dt)
                        for M in (4, 5, 8, 16):
                            got = {}
                            for pooled in (False, True):
                                ql.set_pooled_prep(False)
                                lin(junk[:M])  # every scratch row now holds another x's: none is left over
                                ql.set_pooled_prep(pooled)
                                got[pooled] = lin(x[:M])
                            assert torch.equal(got[False], got[True]), (tier, mode, lin.out_features, dt, M)
                            # and a row's bits are its own (M = 1 is always prepared on the caller)
                            assert torch.equal(got[True][M - 1:], lin(x[M - 1:M])), (tier, mode, dt, M)
    finally:
        assert ql.set_pooled_prep(True) is True


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_avx2_column_lane_rows_have_the_vnni_rows_bits(tier_cap, qtype):
    """The AVX2 rows (vpmaddubsw: Q4's int16 sums over a block, Q8_0's |q| x sign(x, q) pairs)
    compute each column's block sums exactly, as vpdpbusd does, and run the same fp32 epilogue:
    on the same "cl" copy tiers avx2, avx512_vnni and avx512_bf16 give the same bits, at every M,
    fp32 and bf16, with a bias (so a model's text does not depend on which of them the CPU has)."""
    _require_native(qtype)
    if not {"avx2", "avx512_vnni"} <= set(_tiers()):
        pytest.skip("needs a CPU with AVX-512 VNNI")
    tiers = [t for t in ("avx512_bf16", "avx512_vnni") if t in _tiers()] + ["avx2"]
    _assert_cl_rows_agree(qtype, 15, {t: (lambda t=t: tier_cap(t)) for t in tiers})


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_avx_vnni_rows_have_the_avx2_rows_bits(tier_cap, qtype):
    """Where the CPU has AVX-VNNI, tier avx2's rows take vpdpbusd (Q4's nibbles as they are,
    Q8_0's |q| x sign(x, q)) for vpmaddubsw's pair sums: the same exact int32 block sums and the
    same epilogue, so the same bits as the plain AVX2 rows, at every M (both row tilings), fp32
    and bf16, with a bias. An Intel client core (no AVX-512) runs them by default."""
    _require_native(qtype)
    tier_cap("avx2")
    if not cpu_linear._set_avx_vnni(True):
        pytest.skip("needs a CPU with AVX-VNNI")

    def rows(on: bool):
        assert cpu_linear._set_avx_vnni(on) == on

    try:
        _assert_cl_rows_agree(qtype, 16, {"avx2": lambda: rows(False), "avx-vnni": lambda: rows(True)})
    finally:
        cpu_linear._set_avx_vnni(None)


def test_avx_vnni_rows_run_only_at_tier_avx2_and_by_default_only_where_it_is_the_best(tier_cap):
    """The AVX-VNNI rows are tier avx2's alone (the AVX-512 tiers have their own vpdpbusd rows),
    on by default only on a CPU whose best tier is avx2 (an Intel client core): a bigger CPU
    capped to avx2 (PRESCIENT_ISA=avx2) still runs, and tests, the plain AVX2 rows."""
    if cpu_linear.library() is None:
        pytest.skip("no C library here")
    tiers = _tiers()
    try:
        if "avx512" in tiers:
            tier_cap("avx2")
            assert cpu_linear._set_avx_vnni(None) is False
            tier_cap(99)
            assert cpu_linear._set_avx_vnni(True) is False  # on, but not this tier's rows
            assert cpu_linear.kernel_info()["avx_vnni"] is False
        if "avx2" in tiers:
            tier_cap("avx2")
            assert cpu_linear._set_avx_vnni(False) is False
    finally:
        cpu_linear._set_avx_vnni(None)


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_cl_rows_one_tile_a_pass_have_the_two_tile_rows_bits(tier_cap, qtype):
    """The VNNI rows walk the column-lane copy one 16-column tile at a time for up to 16 input rows
    in passes of up to 8 (one weight stream: the default except on Intel) or two tiles a pass for
    up to 4 (Intel's):
    each column's chain over its blocks is the same, so are the bits, at every M and row tiling,
    fp32 and bf16, with a bias."""
    _require_native(qtype)
    if "avx512_vnni" not in _tiers():
        pytest.skip("needs a CPU with AVX-512 VNNI")

    def walk(one: bool):
        assert cpu_linear._set_one_stream(one) == one
        assert cpu_linear.kernel_info()["one_stream"] is one

    try:
        _assert_cl_rows_agree(qtype, 17, {"two tiles": lambda: walk(False), "one tile": lambda: walk(True)})
    finally:
        cpu_linear._set_one_stream(None)


def test_small_m_rows_read_one_stream_by_default_except_on_intel(monkeypatch):
    """One weight stream by default on x86 (measured on Zen 4), several on Intel (measured on the
    Xeon against more) and aarch64 (not measured); PRESCIENT_ONE_STREAM names the choice, a bad
    value is refused by name, and cost tables are kept apart by it."""
    if cpu_linear.library() is None:
        pytest.skip("no C library here")
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    assert cpu_linear._set_one_stream(None) is (x86 and not intel)
    try:
        signatures = set()
        for one in (False, True):
            cpu_linear._set_one_stream(one)
            signatures.add(cpu_linear.build_signature())
        assert len(signatures) == 2
    finally:
        cpu_linear._set_one_stream(None)
    monkeypatch.setenv("PRESCIENT_ONE_STREAM", "0")
    assert cpu_linear._env_one_stream() == 0
    monkeypatch.setenv("PRESCIENT_ONE_STREAM", "2")
    with pytest.raises(ValueError, match="PRESCIENT_ONE_STREAM"):
        cpu_linear._env_one_stream()


def test_a_bad_avx_vnni_switch_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PRESCIENT_AVX_VNNI", "yes")
    with pytest.raises(ValueError, match="PRESCIENT_AVX_VNNI"):
        cpu_linear._env_avx_vnni()


@pytest.mark.parametrize("qtype", FORMATS)
def test_many_rows_in_one_call_equal_the_64_row_calls(tier_cap, qtype):
    """rows() takes a prefill chunk's rows in one library call (pg_linear_rows: every 64-row
    chunk's activations prepared in parallel, then (chunk, column range) units over the pool);
    each row still gets the bits of the kernel calls of at most MAX_M rows -- and so of a lone
    decode step -- on every tier, fp32 and bf16, with a bias, a last chunk of 1 or 22 rows, one
    and two threads."""
    _require_native(qtype)
    g = torch.Generator().manual_seed(21)
    K = 512 if qtype in qr.BLOCK32 else 768
    N = 200
    lin = QuantLinear(_weights(qtype, N, K, g), qtype, N, K, bias=torch.randn(N, generator=g))
    before = cpu_linear.kernel_info()["threads"]
    try:
        for tier in _tiers():
            tier_cap(tier)
            for dt in DTYPES:
                x = torch.randn(150, K, generator=g).to(dt)  # [M, K]: chunks of 64, 64, 22
                calls = torch.cat([lin(x[i:i + ql.MAX_M]) for i in range(0, 150, ql.MAX_M)])
                alone = lin(x[149:150])
                for threads in (2, 1):
                    cpu_linear.set_num_threads(threads)
                    for M in (150, ql.MAX_M + 1):
                        got = lin.rows(x[:M])
                        assert got.dtype == dt and got.shape == (M, N)
                        assert torch.equal(got, calls[:M]), (tier, dt, threads, M, (got != calls[:M]).sum().item())
                    assert torch.equal(lin.rows(x)[149:], alone)
                cpu_linear.set_num_threads(before)
    finally:
        cpu_linear.set_num_threads(before)


def test_regrouped_copies_stay_within_their_budget(monkeypatch):
    """PRESCIENT_REGROUP_MB bounds the copies a process holds (0: none); a dropped weight's
    copy is given back; K-quants have no regrouped layout."""
    _require_native("q4_1")
    if "avx512" not in _tiers():
        pytest.skip("the regrouped copy is for the AVX-512 kernels")
    g = torch.Generator().manual_seed(13)
    b = _weights("q4_1", 64, 512, g)
    monkeypatch.setenv("PRESCIENT_REGROUP_MB", "0")
    assert not QuantLinear(b, "q4_1", 64, 512).regrouped
    gc.collect()  # copies of earlier tests' weights still alive count against the budget
    held = cpu_linear.copies_held()  # all kinds: bf16 weights' AMX copies share the budget
    before = ql.regrouped_bytes()
    mb = (held + b.numel() + (1 << 20) - 1) >> 20  # room for b's copy, less than 1 MiB more
    monkeypatch.setenv("PRESCIENT_REGROUP_MB", str(mb))
    lin = QuantLinear(b, "q4_1", 64, 512)  # 64 rows: the "cl" copy needs no padding either
    assert lin.regrouped and ql.regrouped_bytes() == before + b.numel()
    assert cpu_linear.copies_held() == held + b.numel()
    del lin
    gc.collect()
    assert ql.regrouped_bytes() == before
    rows = ((mb << 20) - held) // 640 + 1  # 640 bytes a 1024-wide Q4_1 row: just past the budget
    big = _weights("q4_1", rows, 1 << 10, g)
    assert not QuantLinear(big, "q4_1", rows, 1 << 10).regrouped
    if "q4_k" in FORMATS and ql.native_available("q4_k"):
        monkeypatch.setenv("PRESCIENT_REGROUP_MB", "1024")
        assert not QuantLinear(_weights("q4_k", 16, 256, g), "q4_k", 16, 256).regrouped


def test_a_copy_layout_is_checked_before_anything_changes(monkeypatch):
    """An unknown layout, argument or PRESCIENT_REGROUP_LAYOUT, is refused naming the choices, every
    time it is asked, and the copy held stays; regroup() without a layout keeps the held one."""
    _require_native("q4_1")
    if "avx512" not in _tiers():
        pytest.skip("the copies are for the AVX-512 kernels")
    g = torch.Generator().manual_seed(15)
    lin = QuantLinear(_weights("q4_1", 32, 256, g), "q4_1", 32, 256)
    held = lin.layout
    with pytest.raises(ValueError, match="groups, cl"):
        lin.regroup(True, "CL")
    assert lin.layout == held and lin.regrouped
    assert lin.regroup(True, "groups") and lin.regroup() and lin.layout == "groups"
    monkeypatch.setenv("PRESCIENT_REGROUP_LAYOUT", "blocks")
    for _ in range(2):
        with pytest.raises(ValueError, match="PRESCIENT_REGROUP_LAYOUT"):
            ql.default_layout()
    monkeypatch.setenv("PRESCIENT_REGROUP_LAYOUT", "groups")
    assert ql.default_layout() == "groups"


def test_the_column_lane_copy_is_the_default_where_a_kernel_reads_it(monkeypatch):
    """default_layout by what the CPU runs (asked of cpu_linear, here stood in for): the VNNI
    tiers and an AVX2-only CPU read "cl", AVX-512 without VNNI "groups", aarch64 "cl" only with
    SDOT (cpu_qgemv_neon.c), a portable-only x86 none."""
    monkeypatch.delenv("PRESCIENT_REGROUP_LAYOUT", raising=False)
    for tiers, sdot, want in ((["portable", "avx2", "avx512", "avx512_vnni"], False, "cl"),
                              (["portable", "avx2", "avx512"], False, "groups"),
                              (["portable", "avx2"], False, "cl"),
                              (["portable"], True, "cl"),
                              (["portable"], False, None)):
        monkeypatch.setattr(ql.cpu_linear, "machine_tiers", lambda t=tiers: list(t))
        monkeypatch.setattr(ql.cpu_linear, "neon_dot", lambda s=sdot: s)
        monkeypatch.setattr(ql, "_best_layout", None)  # asked once a process: ask again
        assert ql.default_layout() == want, (tiers, sdot)


# ---- dequantization, prefill, fallback, API ---------------------------------------------------

@pytest.mark.parametrize("qtype", FORMATS)
def test_native_dequantize_is_exact(tier_cap, qtype):
    """C dequantizers (every tier) give the reference's fp32 values bit for bit."""
    _require(qtype)
    g = torch.Generator().manual_seed(6)
    N, K = (45, 768) if qtype not in qr.BLOCK32 else (45, 352)
    b = _random_blocks(qtype, N, K, g)
    lin = QuantLinear(b, qtype, N, K)
    ref = qr.dequantize(b, qtype, N, K)
    ids = [44, 0, 7, 7, 30]
    for tier in _tiers() or ["none"]:
        if tier != "none":
            tier_cap(tier)
        assert torch.equal(lin.dequantize(), ref)
        assert torch.equal(lin.dequantize_rows(ids), ref[ids])
        assert torch.equal(lin.dequantize_rows(torch.tensor(ids)), ref[ids])
    assert lin.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert lin.dequantize_rows([]).shape == (0, K)
    for bad in ([N], [0, -1]):  # refused by the C call first, then named here
        with pytest.raises(IndexError):
            lin.dequantize_rows(bad)


@pytest.mark.parametrize("qtype", FORMATS)
def test_prefill_path(qtype, monkeypatch):
    """M > MAX_M: fp32 activations, W dequantized tile by tile (a tiny tile budget forces many
    tiles and a ragged last one); with and without bias, fp32 and bf16, leading dims."""
    _require(qtype)
    g = torch.Generator().manual_seed(7)
    N, K = (77, 512) if qtype not in qr.BLOCK32 else (77, 160)
    b = _weights(qtype, N, K, g)
    W = qr.dequantize(b, qtype, N, K).double()
    mag = _mag(b, qtype, N, K, W)
    bias = torch.randn(N, generator=g)
    monkeypatch.setattr(ql, "_TILE_BYTES", 16 * K * 4)  # 16-row tiles: 5 tiles, the last 13 rows
    for lin in (QuantLinear(b, qtype, N, K), QuantLinear(b, qtype, N, K, bias=bias)):
        for dt in DTYPES:
            half = ql.MAX_M // 2 + 4  # 2 x half rows > MAX_M
            x = torch.randn(2, half, K, generator=g).to(dt)
            y = lin(x)
            assert y.shape == (2, half, N) and y.dtype == dt
            # a bf16 x where the tier has AVX512_BF16: bf16 tiles and oneDNN's bf16 GEMM
            bf16_tiles = dt == torch.bfloat16 and cpu_linear._bf16_gemm_native()
            _check(y.reshape(2 * half, N), x.reshape(2 * half, K), W, mag, 0, bias=lin.bias,
                   w_round=2.0 ** -8 if bf16_tiles else 0.0)
    x = torch.randn(0, K)
    assert QuantLinear(b, qtype, N, K)(x).shape == (0, N)


@pytest.mark.parametrize("qtype", qr.BLOCK32)
def test_fallback_without_native(qtype):
    """Without the C kernels (as with no compiler) small M takes the tiled reference path."""
    g = torch.Generator().manual_seed(8)
    N, K = 50, 96
    b = _weights(qtype, N, K, g)
    W = qr.dequantize(b, qtype, N, K).double()
    lin = QuantLinear(b, qtype, N, K, bias=torch.randn(N, generator=g))
    lin._native = lin._deq_native = False
    x = torch.randn(3, K, generator=g)
    _check(lin(x), x, W, _mag(b, qtype, N, K, W), 0, bias=lin.bias)
    assert torch.equal(lin.dequantize(), W.float())
    assert torch.equal(lin.dequantize_rows([3, 1]), W.float()[[3, 1]])


def test_autograd_reaches_x():
    g = torch.Generator().manual_seed(9)
    b = _weights("q4_0", 20, 64, g)
    lin = QuantLinear(b, "q4_0", 20, 64)
    x = torch.randn(2, 64, generator=g, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, lin.dequantize().sum(0).expand(2, 64))


def test_out_noncontiguous_and_attributes():
    g = torch.Generator().manual_seed(10)
    N, K = 300, 128
    b = _weights("q8_0", N, K, g)
    lin = QuantLinear(b, "q8_0", N, K)
    assert (lin.in_features, lin.out_features, lin.qtype) == (K, N, "q8_0")
    assert lin.weight_bytes == N * K // 32 * 34 == b.numel()
    assert "QuantLinear" in repr(lin)
    W = qr.dequantize(b, "q8_0", N, K).double()
    xt = torch.randn(K, 4, generator=g).T  # non-contiguous [4, K]
    out = torch.empty(4, N)
    assert lin(xt, out=out) is out
    _check(out, xt.contiguous(), W, W.abs(), max(ql.act_block("q8_0"), 0))
    with pytest.raises(ValueError):
        lin(torch.randn(1, K + 1))
    with pytest.raises(ValueError):
        lin(torch.randn(1, K), out=torch.empty(1, N, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        lin(torch.randn(1, K, dtype=torch.float64))
    with pytest.raises(ValueError):
        QuantLinear(b[:-1], "q8_0", N, K)
    with pytest.raises(ValueError):
        QuantLinear(b, "q8_0", N, K + 32)
    with pytest.raises(ValueError):
        QuantLinear(b.to(torch.int16), "q8_0", N, K)
    with pytest.raises(ValueError):
        QuantLinear(b, "q3_k", N, K)


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_two_products_in_one_pool_call_give_each_calls_bits(tier_cap, qtype):
    """pq_linear_w2 (a row-parallel linear's two column groups, cpu_layer.c's split_linear) runs
    two products in one pool call: every output row equals its own pq_linear_w call's, at every
    tier this CPU runs, for the decode and verify row counts (from 4 rows the preps run on the
    pool too), with a 16-row-grid cut and with a first product too small to pool (the fallback)."""
    _require_native(qtype)
    g = torch.Generator().manual_seed(47)
    lib = cpu_linear.library()
    pairs = [((576, 384), (576, 192)), ((576, 768), (576, 768)), ((32, 64), (32, 64))]
    try:
        for tier in _tiers():
            tier_cap(tier)
            for mode in ("int8", "float"):
                ql.set_mode(mode)
                for (N0, K0), (N1, K1) in pairs:
                    a, b = (QuantLinear(_random_blocks(qtype, N, K, g), qtype, N, K) for N, K in ((N0, K0), (N1, K1)))
                    for M in (1, 2, 5, 16):
                        x0, x1 = torch.randn(M, K0, generator=g), torch.randn(M, K1, generator=g)
                        y0, y1 = torch.full((M, N0), float("nan")), torch.full((M, N1), float("nan"))
                        rc = lib.pq_linear_w2(a._dptr, x0.data_ptr(), y0.data_ptr(), b._dptr, x1.data_ptr(),
                                              y1.data_ptr(), M, 0)
                        assert rc == 0, (tier, mode, N0, M)
                        assert torch.equal(y0, a(x0)) and torch.equal(y1, b(x1)), (tier, mode, qtype, N0, K0, M)
    finally:
        ql.set_mode("auto")
