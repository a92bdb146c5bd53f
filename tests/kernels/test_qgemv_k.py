"""Correctness of the K-quant kernels (kernels/cpu_qgemv_k.c: Q4_K, Q5_K, Q6_K) against
kernels/quant_reference_k.py, and of that reference against ``gguf.quants`` (ggml's layout).

Every check runs on every ISA tier the machine has (``cpu_linear.machine_tiers()``, capped with
``cpu_linear._set_isa_cap``).  Tolerances, all computed from the operands:

* The reference is float64 and exact: W from ``dequantize_k(..., torch.float64)``, and the
  activations the kernel multiplies -- x itself on the fp32 path (portable tier, or forced), or
  xhat = q * d from ``quantize_x_q8k`` on the int8 tiers (checked bit for bit against the C
  prep below).  The kernel then differs only by fp32 rounding: of the weights (fp32 path), of
  the int32 -> fp32 conversions, the per-super-block scale products and the accumulation.  It
  sums the two parts of each weight (a = scale * code, o = the sub-block offset, W = a - o)
  separately, so the bound is on |a| + |o|:
      |y - ref| <= K * 2^-24 * ((|a| + |o|) @ |xhat| + |bias|)  (+ 2^-8 |ref| for bf16 y).
* Against the true x, the int8 tiers add the activation quantization: each x moves by at most
  d / 2 (d = absmax of its 256-block / 127; * (1 + 2^-10) for the fp32 roundings of the
  scales), so |W x - W xhat| <= |W| @ e with e_k = d_k / 2 * (1 + 2^-10).

``python tests/kernels/test_qgemv_k.py`` prints the M = 1 micro-timings (weight GB/s per format
and tier, one thread, fp32 vs int8 activations).
"""

from __future__ import annotations

import ctypes
import sys
import time

import pytest
import torch

from prescient.kernels import cpu_linear
from prescient.kernels import quant_reference_k as R

QTYPES = list(R.BLOCK_BYTES)
MS = [1, 2, 3, 5, 8, 16]
SHAPES = [(1, 256), (7, 512), (33, 768), (129, 256), (65, 1536)]  # (N, K): odd N, K = 256 k
# (N, K, kind): integer sums restart every super-block, so the extreme blocks need no large K.
CASES = [(N, K, kind) for N, K in SHAPES for kind in ("real", "random")] + [(7, 512, "extreme")]
DT_F32, DT_BF16 = 0, 1

_vp, _ci = ctypes.c_void_p, ctypes.c_int


def _lib():
    lib = cpu_linear.library()
    if lib is None:
        pytest.skip("C kernels unavailable: " + str(cpu_linear.kernel_info()["reason"]))
    lib.pqk_linear_entry.argtypes = [_ci, _vp, _vp, _ci, _ci, _vp, _ci, _vp, _ci, _ci]
    lib.pqk_linear_entry.restype = _ci
    lib.pqk_prep_entry.argtypes = [_ci, _vp, _ci, _ci, _vp, _vp, _vp]
    lib.pqk_prep_entry.restype = _ci
    lib.pqk_dequantize_rows.argtypes = [_ci, _vp, _ci, _ci, _ci, _vp]
    lib.pqk_dequantize_rows.restype = _ci
    lib.pqk_int8_activations.argtypes = [_ci]
    lib.pqk_int8_activations.restype = _ci
    lib.pqk_set_mode.argtypes = [_ci]
    lib.pqk_set_mode.restype = _ci
    return lib


@pytest.fixture(scope="module")
def lib():
    return _lib()


@pytest.fixture(params=cpu_linear.ISA_TIERS)
def tier(request, lib):
    """Run the test at one tier (skipped where the CPU lacks it), uncapped afterwards."""
    if request.param not in cpu_linear.machine_tiers():
        pytest.skip(f"this CPU cannot run {request.param}")
    assert cpu_linear._set_isa_cap(request.param) == request.param
    yield request.param
    cpu_linear._set_isa_cap(99)


def _int8_at(tier: str) -> bool:
    """Whether the int8 kernels run at `tier`: every SIMD tier, and aarch64's portable one with
    SDOT (cpu_linear.neon_dot)."""
    return tier != "portable" or cpu_linear.neon_dot()


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _blocks(qtype: str, N: int, K: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """uint8 [N, K/256 * block_bytes] test weights.  real: quantize_k of Gaussian rows (with a
    few larger rows); random: every byte random except finite fp16 d / dmin of either sign
    (all codes, 6-bit scales and mins, int8 scales incl. -128); extreme: the largest integer
    sums the kernels can meet (top codes and scales, Q6_K codes 0 with scale -128)."""
    bb, nb = R.BLOCK_BYTES[qtype], N * (K // R.QK)
    if kind == "real":
        w = torch.randn(N, K, generator=g) * (1 + 3 * torch.rand(N, 1, generator=g))
        return R.quantize_k(w, qtype)
    if kind == "random":
        blk = torch.randint(0, 256, (nb, bb), generator=g, dtype=torch.uint8)
        d = _f16_bytes(torch.randn(2 * nb, generator=g) * 0.02).reshape(nb, 4)
        if qtype == "q6_k":
            blk[:, 208:210] = d[:, :2]
        else:
            blk[:, 0:4] = d
        return blk.reshape(N, -1)
    blk = torch.empty(nb, bb, dtype=torch.uint8)
    if qtype == "q6_k":
        blk[:, :192] = 0                      # q = 0: q - 32 = -32
        blk[:, 192:208] = 0x80                # sc = -128
        blk[:, 208:210] = _f16_bytes(torch.full((nb,), 1e-3))
    else:
        blk[:, 4:] = 0xFF                     # sc = m = 63, codes 15 / 31
        blk[:, 0:4] = _f16_bytes(torch.tensor([1e-3, 2e-4]).repeat(nb)).reshape(nb, 4)
    return blk.reshape(N, -1)


def _x(M: int, K: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "extreme":                     # every x quantizes to +127
        return torch.full((M, K), 3.0)
    x = torch.randn(M, K, generator=g)
    x[:, torch.randint(0, K, (max(1, K // 100),), generator=g)] *= 20  # outlier channels
    if M > 1:
        x[-1, : R.QK] = 0                     # an all-zero activation block
    return x


def _xhat(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xhat, e) float64 [M, K]: the int8 tiers' activations and the bound on |x - xhat|."""
    q, d, _ = R.quantize_x_q8k(x)
    M, K = x.shape
    dk = d.double().repeat_interleave(R.QK, 1)
    return q.double() * dk, dk * (0.5 * (1 + 2.0 ** -10))


class _Ref:
    """The float64 reference of one weight: W, |a| + |o| and |W| (module docstring)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, K: int):
        N = blocks.shape[0]
        a, o = R.dequantize_k_parts(blocks, qtype, N, K)
        self.W = a - o  # == dequantize_k(..., float64), checked in test_dequantize_k_matches_gguf
        self.mag = a.abs() + o.abs()
        self.Wabs = self.W.abs()


def _check(y, x, ref: _Ref, bias, int8):
    """Assert y (the kernel's [M, N]) against the float64 reference (module docstring)."""
    K = x.shape[1]
    if int8:
        xh, e = _xhat(x)
    else:
        xh, e = x.double(), None
    want = xh @ ref.W.T
    mag = xh.abs() @ ref.mag.T
    if bias is not None:
        want = want + bias.double()
        mag = mag + bias.double().abs()
    tol = K * 2.0 ** -24 * mag + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * want.abs()
    err = (y.double() - want).abs()
    assert not (err > tol).any(), (
        f"vs xhat: max err {err.max().item():.3g}, worst excess {(err - tol).max().item():.3g} "
        f"at {(err > tol).nonzero()[0].tolist()}")
    if int8:  # the same result against the unquantized activations
        want_x = x.double() @ ref.W.T + (0 if bias is None else bias.double())
        tol_x = tol + e @ ref.Wabs.T
        err_x = (y.double() - want_x).abs()
        assert not (err_x > tol_x).any(), f"vs x: worst excess {(err_x - tol_x).max().item():.3g}"


def _run(lib, qtype, blocks, x, bias=None, ydt=DT_F32, flags=0):
    M, K = x.shape
    N = blocks.shape[0]
    y = torch.empty(M, N, dtype=torch.float32 if ydt == DT_F32 else torch.bfloat16)
    rc = lib.pqk_linear_entry(R.DT_CODES[qtype], blocks.data_ptr(),
                              None if bias is None else bias.data_ptr(), N, K,
                              x.data_ptr(), M, y.data_ptr(), ydt, flags)
    assert rc == 0
    return y


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf on NaN d
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("kind", ["real", "random", "allbits"])
def test_dequantize_k_matches_gguf(qtype, kind):
    from gguf import GGMLQuantizationType as T
    from gguf import quants
    g = torch.Generator().manual_seed(10 * QTYPES.index(qtype) + len(kind))
    N, K = 9, 768
    if kind == "allbits":  # fp16 fields random too: subnormals, inf, NaN
        blocks = torch.randint(0, 256, (N, K // 256 * R.BLOCK_BYTES[qtype]), generator=g, dtype=torch.uint8)
    else:
        blocks = _blocks(qtype, N, K, kind, g)
    gt = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}[qtype]
    ref = torch.from_numpy(quants.dequantize(blocks.numpy(), gt))
    mine = R.dequantize_k(blocks, qtype, N, K)
    assert mine.shape == (N, K) and mine.dtype == torch.float32
    torch.testing.assert_close(mine, ref, rtol=0, atol=0, equal_nan=True)
    a, o = R.dequantize_k_parts(blocks, qtype, N, K)
    w64 = R.dequantize_k(blocks, qtype, N, K, torch.float64)
    torch.testing.assert_close(a - o, w64, rtol=0, atol=0, equal_nan=True)
    finite = torch.isfinite(w64)
    assert (w64.float()[finite] - mine[finite]).abs().max() <= 2.0 ** -22 * (a.abs() + o.abs())[finite].max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_k_is_close_and_uses_the_format(qtype):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 512, generator=g)
    blocks = R.quantize_k(w, qtype)
    assert blocks.dtype == torch.uint8 and blocks.shape == (64, 2 * R.BLOCK_BYTES[qtype])
    back = R.dequantize_k(blocks, qtype, 64, 512)
    rel = ((back - w).norm() / w.norm()).item()
    # Round-to-nearest levels: 16 / 32 / 64 over each sub-block's range.
    assert rel < {"q4_k": 0.10, "q5_k": 0.05, "q6_k": 0.03}[qtype], rel
    if qtype == "q6_k":  # the largest-magnitude value maps to -32: scales of both signs
        sc = blocks.reshape(-1, 210)[:, 192:208].contiguous().view(torch.int8)
        assert (sc < 0).any() and (sc > 0).any()
    assert torch.equal(R.quantize_k(w, qtype), blocks)  # deterministic
    with pytest.raises(ValueError):
        R.quantize_k(torch.randn(2, 100), qtype)


def test_quantize_x_q8k_bounds():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 512, generator=g) * 5
    x[1, :256] = 0
    q, d, bs = R.quantize_x_q8k(x)
    assert q.dtype == torch.int8 and d.shape == (3, 2) and bs.shape == (3, 32)
    assert q.abs().max() == 127 and d[1, 0] == 0 and (q[1, :256] == 0).all()
    xh, e = _xhat(x)
    assert ((xh - x.double()).abs() <= e).all()
    assert torch.equal(bs.long(), q.long().reshape(3, 32, 16).sum(-1))


# ---------------------------------------------------------------------------------------------
# The C kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_prep_matches_reference(lib, tier, qtype):
    g = torch.Generator().manual_seed(13)
    M, K = 5, 1024
    x = _x(M, K, "real", g)
    x[0, 256:512] = 0
    x[1, 512] = 1e-30  # one tiny nonzero value
    x[2, 600:700] = 1e30
    q = torch.empty(M, K, dtype=torch.int8)
    d = torch.empty(M, K // 256)
    bs = torch.empty(M, K // 16, dtype=torch.int16)
    rc = lib.pqk_prep_entry(R.DT_CODES[qtype], x.data_ptr(), M, K, q.data_ptr(), d.data_ptr(), bs.data_ptr())
    int8 = bool(lib.pqk_int8_activations(cpu_linear.ISA_TIERS.index(tier)))
    assert int8 == _int8_at(tier)
    if not int8:
        assert rc == -1
        return
    assert rc == 0
    rq, rd, rbs = R.quantize_x_q8k(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(bs, rbs)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_matches_reference(lib, tier, qtype, M, bias):
    int8 = _int8_at(tier)
    g = torch.Generator().manual_seed(1000 * M + 10 * QTYPES.index(qtype) + bias)
    for N, K, kind in CASES:
        blocks = _blocks(qtype, N, K, kind, g)
        ref = _Ref(blocks, qtype, K)
        x = _x(M, K, kind, g)
        b = torch.randn(N, generator=g) if bias else None
        for ydt in (DT_F32, DT_BF16):
            _check(_run(lib, qtype, blocks, x, b, ydt), x, ref, b, int8)
        # The fp32-activation path, which every tier also has (flags bit 0).
        _check(_run(lib, qtype, blocks, x, b, DT_F32, flags=1), x, ref, b, False)


@pytest.mark.parametrize("qtype", QTYPES)
def test_pool_split_is_bitwise_identical(lib, tier, qtype):
    """Each output is computed by one thread in a fixed order, whoever runs its rows."""
    g = torch.Generator().manual_seed(14)
    N, K = 1001, 1536
    blocks = _blocks(qtype, N, K, "real", g)
    for M in (1, 7, 16, 33):
        x = _x(M, K, "real", g)
        assert torch.equal(_run(lib, qtype, blocks, x, flags=0), _run(lib, qtype, blocks, x, flags=2))


@pytest.mark.parametrize("qtype", QTYPES)
def test_avx_vnni_rows_have_the_avx2_rows_bits(lib, qtype):
    """Where the CPU has AVX-VNNI, tier avx2's rows sum the int16 pair products with vpdpwssd
    instead of vpmaddwd + vpaddd: the same exact int32s, so the same bits, at every M of the
    4-input tiles (1-5, 8, 33), on real, random and extreme blocks, with a bias."""
    if "avx2" not in cpu_linear.machine_tiers():
        pytest.skip("this CPU cannot run avx2")
    cpu_linear._set_isa_cap("avx2")
    try:
        if not cpu_linear._set_avx_vnni(True):
            pytest.skip("needs a CPU with AVX-VNNI")
        g = torch.Generator().manual_seed(17)
        N, K = 67, 512
        for kind in ("real", "random", "extreme"):
            blocks = _blocks(qtype, N, K, kind, g)
            bias = torch.randn(N, generator=g)
            for M in (1, 2, 3, 4, 5, 8, 33):
                x = _x(M, K, kind, g)
                got = []
                for on in (False, True):
                    assert cpu_linear._set_avx_vnni(on) == on
                    got.append(_run(lib, qtype, blocks, x, bias))
                assert torch.equal(got[0], got[1]), (kind, M, (got[0] != got[1]).sum().item())
    finally:
        cpu_linear._set_avx_vnni(None)
        cpu_linear._set_isa_cap(99)


@pytest.mark.parametrize("qtype", QTYPES)
def test_through_pg_linear_w(lib, tier, qtype):
    """The whole path: cpu_gemv.c's pg_linear_w -> cpu_qgemv.c (x conversion, prep, pool)
    -> this file's rows, fp32 and bf16 x."""
    g = torch.Generator().manual_seed(15)
    N, K = 577, 1536
    blocks = _blocks(qtype, N, K, "real", g)
    bias = torch.randn(N, generator=g)
    desc = cpu_linear._WeightDesc(blocks.data_ptr(), bias.data_ptr(), R.DT_CODES[qtype], N, K)
    ref = _Ref(blocks, qtype, K)
    for M in (1, 5, 16, 64):
        for xdt in (torch.float32, torch.bfloat16):
            x = _x(M, K, "real", g).to(xdt)
            y = torch.empty(M, N, dtype=xdt)
            rc = lib.pg_linear_w(ctypes.addressof(desc), x.data_ptr(), y.data_ptr(), M,
                                 DT_F32 if xdt == torch.float32 else DT_BF16)
            if rc == -1:
                pytest.skip("cpu_qgemv.c does not route the K-quants yet")
            assert rc == 0
            _check(y, x.float(), ref, bias, _int8_at(tier))


@pytest.mark.parametrize("qtype", QTYPES)
def test_mode_float_gives_the_fp32_path(lib, tier, qtype):
    g = torch.Generator().manual_seed(16)
    N, K, M = 200, 768, 3
    blocks = _blocks(qtype, N, K, "real", g)
    desc = cpu_linear._WeightDesc(blocks.data_ptr(), None, R.DT_CODES[qtype], N, K)
    x = _x(M, K, "real", g)
    y = torch.empty(M, N)
    old = lib.pqk_set_mode(1)
    try:
        rc = lib.pg_linear_w(ctypes.addressof(desc), x.data_ptr(), y.data_ptr(), M, DT_F32)
    finally:
        lib.pqk_set_mode(old)
    if rc == -1:
        pytest.skip("cpu_qgemv.c does not route the K-quants yet")
    _check(y, x, _Ref(blocks, qtype, K), None, False)
    assert torch.equal(y, _run(lib, qtype, blocks, x, flags=1))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_rows_exact(lib, tier, qtype):
    g = torch.Generator().manual_seed(17)
    N, K = 301, 1536  # 1.8 MB of fp32 out: split over the pool
    blocks = _blocks(qtype, N, K, "random", g)
    ref = R.dequantize_k(blocks, qtype, N, K)
    out = torch.empty(N, K)
    assert lib.pqk_dequantize_rows(R.DT_CODES[qtype], blocks.data_ptr(), K, 0, N, out.data_ptr()) == 0
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    part = torch.full((50, K), 7.0)
    assert lib.pqk_dequantize_rows(R.DT_CODES[qtype], blocks.data_ptr(), K, 100, 150, part.data_ptr()) == 0
    torch.testing.assert_close(part, ref[100:150], rtol=0, atol=0, equal_nan=True)
    assert lib.pqk_dequantize_rows(R.DT_CODES[qtype], blocks.data_ptr(), 1000, 0, 1, out.data_ptr()) == -1
    assert lib.pqk_dequantize_rows(R.DT_CODES[qtype], blocks.data_ptr(), K, 5, 4, out.data_ptr()) == -1
    assert lib.pqk_dequantize_rows(17, blocks.data_ptr(), K, 0, 1, out.data_ptr()) == -1


def test_entry_rejects_bad_arguments(lib):
    w = torch.zeros(4, 144, dtype=torch.uint8)
    from prescient.kernels.cpu_linear import MAX_M

    x = torch.zeros(MAX_M + 1, 256)
    y = torch.empty(MAX_M + 1, 4)
    assert lib.pqk_linear_entry(R.DT_CODES["q4_k"], w.data_ptr(), None, 4, 256, x.data_ptr(), MAX_M + 1,
                                y.data_ptr(), 0, 0) == -1
    assert lib.pqk_linear_entry(R.DT_CODES["q4_k"], w.data_ptr(), None, 4, 100, x.data_ptr(), 1, y.data_ptr(), 0, 0) == -1
    assert lib.pqk_linear_entry(16, w.data_ptr(), None, 4, 256, x.data_ptr(), 1, y.data_ptr(), 0, 0) == -1
    assert lib.pqk_linear_entry(R.DT_CODES["q4_k"], w.data_ptr(), None, 4, 256, x.data_ptr(), 1, y.data_ptr(), 0, 0) == 0


# ---------------------------------------------------------------------------------------------
# Micro-timing (not a test): python tests/kernels/test_qgemv_k.py
# ---------------------------------------------------------------------------------------------

def _bench() -> None:
    lib = _lib()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"{cpu_linear.kernel_info()['so']}\nweight GB/s at M = 1, one thread (CPU time), "
          "int8 / fp32 activations")
    for N, K in [(576, 1536), (1536, 768)]:  # K = 576 is not a multiple of 256
        x = torch.randn(1, K, generator=g)
        y = torch.empty(1, N)
        for qtype in QTYPES:
            blocks = R.quantize_k(torch.randn(N, K, generator=g), qtype)
            cells = []
            for tier in cpu_linear.machine_tiers():
                cpu_linear._set_isa_cap(tier)
                rates = []
                for flags in (0, 1):
                    args = (R.DT_CODES[qtype], blocks.data_ptr(), None, N, K, x.data_ptr(), 1,
                            y.data_ptr(), DT_F32, flags)
                    best = float("inf")
                    for _ in range(25):
                        t = time.thread_time()
                        for _ in range(40):
                            lib.pqk_linear_entry(*args)
                        best = min(best, (time.thread_time() - t) / 40)
                    rates.append(blocks.numel() / best / 1e9)
                cells.append(f"{tier} {rates[0]:5.1f} / {rates[1]:4.1f}")
            print(f"  {N}x{K} {qtype}: " + "   ".join(cells))
    cpu_linear._set_isa_cap(99)


if __name__ == "__main__":
    sys.exit(_bench())
