"""Correctness of prescient.kernels.cpu_linear (the small-M CPU GEMV) against float64 math.

Tolerances.  The reference is computed in float64 from the operands the kernel actually
multiplies: the weight as stored, and x as given, or rounded to bf16 when the kernel runs
bf16 activations (bf16 weights on the AVX512_BF16 path).  The kernel then differs only by
  * fp32 accumulation: |err| <= K * 2^-24 * sum_k |x_k w_k| (the classic bound for
    recursive summation; blocked/paired summation does better), and
  * output rounding when y is bf16: half an ulp, 2^-9 * |y| (2^-8 allowed for the
    bound above moving y across a binade).
so we assert |y - ref| <= K * 2^-24 * (|x| @ |w|^T) + (2^-8 * |ref| if y is bf16) + 1e-30.

ISA tiers.  Every tier this CPU runs (``cpu_linear.machine_tiers()``: portable, avx2, avx512,
avx512_bf16 as available) is selected in turn with ``_set_isa_cap`` and checked against the
same reference; tiers the CPU lacks are skipped, naming the tier.  The aarch64 NEON path is
cross-compiled and run under qemu-aarch64 (test_neon_kernels_under_qemu).

The library's one-place invariants close the file: the format table is Python's (QTYPES), the
64-token limit has one definition, and the C files' symbol graph is acyclic and layered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

from prescient.kernels import cpu_linear
from prescient.kernels.cpu_linear import ISA_TIERS, MAX_M, PackedLinear, pack_weight
from tests.kernels.kernel_oracles import aarch64_cross_tools

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [  # (out_features, in_features): odd sizes, K not a multiple of 16/32, tiny, real
    (3072, 576), (576, 1536), (577, 33), (1001, 100), (5, 7), (1, 1), (64, 64),
    (49, 1000), (130, 577), (31, 32), (33, 17),
]
MS = [1, 3, 8, 16]


def _kernel_x_dtype(wdt: torch.dtype) -> torch.dtype | None:
    """dtype the kernel rounds x to before multiplying (None: x used as is)."""
    if wdt == torch.bfloat16 and cpu_linear.kernel_info().get("isa") == "avx512_bf16":
        return torch.bfloat16
    return None


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None, xround=None,
           y_rounded_bf16=None):
    xr = x.to(xround).double() if xround is not None else x.double()
    wd = w.double()
    ref = xr @ wd.T
    mag = xr.abs() @ wd.abs().T
    if bias is not None:
        ref = ref + bias.to(w.dtype).double()
        mag = mag + bias.to(w.dtype).double().abs()
    K = w.shape[1]
    tol = K * 2.0 ** -24 * mag + 1e-30
    if y_rounded_bf16 or (y_rounded_bf16 is None and y.dtype == torch.bfloat16):
        tol = tol + 2.0 ** -8 * ref.abs()
    err = (y.double() - ref).abs()
    bad = err > tol
    assert not bad.any(), (
        f"max err {err.max().item():.3g}, worst excess {(err - tol).max().item():.3g} "
        f"at {bad.nonzero()[0].tolist()}")


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    cpu_linear.available()
    yield


@pytest.fixture(params=ISA_TIERS)
def tier(request):
    """Each ISA tier in turn, as the tier in use (skipped where this CPU lacks it); the tier in
    use before (e.g. from PRESCIENT_ISA) is restored afterwards."""
    if not cpu_linear.available():
        pytest.skip("C kernel unavailable")
    if request.param not in cpu_linear.machine_tiers():
        pytest.skip(f"this CPU cannot run the {request.param} tier")
    before = cpu_linear.kernel_info()["isa"]
    assert cpu_linear._set_isa_cap(request.param) == request.param
    yield request.param
    cpu_linear._set_isa_cap(ISA_TIERS.index(before))


def test_kernel_builds_here():
    info = cpu_linear.kernel_info()
    if not info["available"] and "no C compiler" in (info["reason"] or ""):
        pytest.skip("no C compiler on this machine")
    assert info["available"], info["reason"]
    assert info["isa"] in ISA_TIERS
    assert info["threads"] >= 1
    tiers = cpu_linear.machine_tiers()
    assert tiers == list(ISA_TIERS[:len(tiers)]) and info["isa"] in tiers
    assert cpu_linear.kernel_info()["isa"] == info["isa"]  # machine_tiers() left the cap as is


@pytest.mark.parametrize("wdt", DTYPES, ids=["w32", "wbf16"])
@pytest.mark.parametrize("xdt", DTYPES, ids=["x32", "xbf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("M", MS)
def test_matches_float64(wdt, xdt, shape, M):
    N, K = shape
    g = torch.Generator().manual_seed(N * 7919 + K * 31 + M)
    w = torch.randn(N, K, generator=g).to(wdt)
    x = torch.randn(M, K, generator=g).to(xdt)
    y = pack_weight(w)(x)
    assert y.shape == (M, N) and y.dtype == xdt
    _check(y, x, w, xround=_kernel_x_dtype(wdt))


TIER_SHAPES = [(577, 33), (64, 1000), (3, 17), (130, 577), (31, 8)]  # odd N, K % 8 != 0


@pytest.mark.parametrize("wdt", DTYPES, ids=["w32", "wbf16"])
@pytest.mark.parametrize("xdt", DTYPES, ids=["x32", "xbf16"])
def test_every_tier_matches_float64(tier, wdt, xdt):
    """Each tier's kernels for M = 1..16 (every tile shape and leftover path) and larger M up to
    MAX_M (several 4-row blocks over one weight tile), odd N and K, with and without bias."""
    xround = torch.bfloat16 if (wdt == torch.bfloat16 and tier == "avx512_bf16") else None
    assert _kernel_x_dtype(wdt) == xround
    for si, (N, K) in enumerate(TIER_SHAPES):
        g = torch.Generator().manual_seed(N * 31 + K + ISA_TIERS.index(tier))
        w = torch.randn(N, K, generator=g).to(wdt)
        b = torch.randn(N, generator=g)
        for M in [*range(1, 17), 31, 33, MAX_M]:
            bias = b if (M + si) % 2 else None
            x = torch.randn(M, K, generator=g).to(xdt)
            y = pack_weight(w, bias)(x)
            assert y.shape == (M, N) and y.dtype == xdt
            _check(y, x, w, bias=bias, xround=xround)


@pytest.mark.parametrize("wdt", DTYPES, ids=["w32", "wbf16"])
def test_every_tier_pooled_and_lm_head(tier, wdt):
    """Matrices big enough to be split over the thread pool (both threads run tiles, chunk
    boundaries fall inside the tile loop), including the 49152-row LM head."""
    xround = torch.bfloat16 if (wdt == torch.bfloat16 and tier == "avx512_bf16") else None
    g = torch.Generator().manual_seed(11)
    for N, K, Ms in [(4099, 577, (1, 2, 6, 13)), (49152, 576, (1, 16))]:
        w = torch.randn(N, K, generator=g).to(wdt)
        lin = pack_weight(w)
        for M in Ms:
            x = torch.randn(M, K, generator=g).to(wdt)
            _check(lin(x), x, w, xround=xround)


def test_lm_head_shape():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(49152, 576, generator=g).to(torch.bfloat16)
    lin = pack_weight(w)
    for M in (1, 16, MAX_M):
        x = torch.randn(M, 576, generator=g).to(torch.bfloat16)
        _check(lin(x), x, w, xround=_kernel_x_dtype(torch.bfloat16))


@pytest.mark.parametrize("wdt", DTYPES, ids=["w32", "wbf16"])
def test_bias(wdt):
    g = torch.Generator().manual_seed(2)
    for N, K, M in [(577, 33, 3), (1024, 576, 1), (7, 9, 16), (301, 40, 7), (64, 64, 6)]:
        w = torch.randn(N, K, generator=g).to(wdt)
        b = torch.randn(N, generator=g)
        x = torch.randn(M, K, generator=g).to(wdt)
        _check(pack_weight(w, b)(x), x, w, bias=b, xround=_kernel_x_dtype(wdt))


def test_leading_dims_noncontiguous_and_out():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 64, generator=g)
    lin = pack_weight(w)
    x = torch.randn(2, 3, 64, generator=g)
    y = lin(x)
    assert y.shape == (2, 3, 300)
    _check(y.reshape(6, 300), x.reshape(6, 64), w)
    xt = torch.randn(64, 4, generator=g).T  # non-contiguous [4, 64]
    _check(lin(xt), xt.contiguous(), w)
    out = torch.empty(4, 300)
    assert lin(xt, out=out) is out
    _check(out, xt.contiguous(), w)


def _check_vs_fp32_linear(y, x, w, bias=None):
    """y against F.linear in fp32 of the same (widened) weights: two fp32 sums of the same
    products differ by at most twice the accumulation bound, plus y's bf16 rounding."""
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.to(w.dtype).float())
    mag = x.float().abs() @ w.float().abs().T
    if bias is not None:
        mag = mag + bias.to(w.dtype).float().abs()
    tol = 2 * w.shape[1] * 2.0 ** -24 * mag + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * ref.abs()
    err = (y.float().reshape(ref.shape) - ref).abs()
    assert (err <= tol).all(), f"max err {err.max().item():.3g} vs F.linear fp32"


def test_large_m_uses_a_gemm(tier):
    """M > MAX_M: fp32 weights (and bf16 ones where the tier has AVX512_BF16) are exactly
    F.linear; below avx512_bf16 a bf16 weight runs the fp32 row-block GEMM."""
    g = torch.Generator().manual_seed(4)
    w32 = torch.randn(100, 50, generator=g)
    x32 = torch.randn(MAX_M + 1, 50, generator=g)
    torch.testing.assert_close(pack_weight(w32)(x32), F.linear(x32, w32), rtol=0, atol=0)
    assert cpu_linear.prefill_mode() == ("bf16_gemm" if tier == "avx512_bf16" else "fp32_blocked")
    w = w32.to(torch.bfloat16)
    x = x32.to(torch.bfloat16)
    y = pack_weight(w)(x)
    if tier == "avx512_bf16":
        torch.testing.assert_close(y, F.linear(x, w), rtol=0, atol=0)
    else:
        _check(y, x, w)
        _check_vs_fp32_linear(y, x, w)
    assert pack_weight(torch.randn(100, 50))(torch.randn(0, 50)).shape == (0, 100)
    assert pack_weight(w)(torch.randn(0, 50).to(torch.bfloat16)).shape == (0, 100)


@pytest.mark.parametrize("xdt", DTYPES, ids=["x32", "xbf16"])
def test_blocked_prefill_matches_fp32_linear(tier, xdt):
    """The fp32 row-block prefill of bf16 weights, run directly on every tier: several blocks
    with a partial last one (N not a multiple of the block), bias, leading dims, out=."""
    g = torch.Generator().manual_seed(12)
    for N, K, lead in [(1000, 576, (3, 41)), (1537, 100, (MAX_M + 1,)), (7, 33, (17,))]:
        rows = cpu_linear._prefill_rows(K, N)
        assert 1 <= rows <= N and (rows % 16 == 0 or rows == N)
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        b = torch.randn(N, generator=g)
        x = torch.randn(*lead, K, generator=g).to(xdt)
        for bias in (None, b):
            lin = pack_weight(w, bias)
            y = lin._blocked_fp32(x, None)
            assert y.shape == (*lead, N) and y.dtype == xdt
            xm = x.reshape(-1, K)
            _check(y.reshape(-1, N), xm, w, bias=bias)
            _check_vs_fp32_linear(y, xm, w, bias)
            out = torch.empty(*lead, N, dtype=xdt)
            assert lin._blocked_fp32(x, out) is out and torch.equal(out, y)
            if cpu_linear.prefill_mode() == "fp32_blocked" and xm.shape[0] > MAX_M:
                assert torch.equal(lin(x), y)  # what __call__ runs for M > MAX_M here
        with pytest.raises(ValueError):
            pack_weight(w)._blocked_fp32(x, torch.empty(3, dtype=xdt))


def test_mixed_dtype_fallback_and_autograd():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    x = torch.randn(MAX_M + 4, 24, generator=g)  # fp32 x, bf16 w, M > MAX_M: a GEMM
    y = pack_weight(w)(x)
    assert y.dtype == torch.float32
    if cpu_linear.prefill_mode() == "bf16_gemm":
        # F.linear in bf16 (no fp32 copy of the weight), cast back
        _check(y, x, w, xround=torch.bfloat16, y_rounded_bf16=True)
    else:  # fp32 row blocks: x is not rounded
        _check(y, x, w)
    wf = torch.randn(40, 24, generator=g)
    xg = torch.randn(2, 24, generator=g, requires_grad=True)
    pack_weight(wf)(xg).sum().backward()  # autograd goes through F.linear
    torch.testing.assert_close(xg.grad, wf.sum(0).expand(2, 24))
    xg = torch.randn(MAX_M + 1, 24, generator=g, requires_grad=True)
    pack_weight(w)(xg.to(torch.bfloat16)).float().sum().backward()  # never the blocked path
    assert xg.grad is not None and xg.grad.shape == xg.shape


def test_pack_weight_keeps_layout_and_converts():
    w = torch.randn(10, 6)
    assert pack_weight(w).weight.data_ptr() == w.data_ptr()  # no copy: shares storage
    lin = pack_weight(w, dtype=torch.bfloat16)
    assert lin.dtype == torch.bfloat16 and lin.weight.shape == (10, 6)
    assert pack_weight(w.half()).dtype == torch.float32
    assert isinstance(lin, PackedLinear) and "PackedLinear" in repr(lin)
    with pytest.raises(ValueError):
        lin(torch.randn(1, 7))
    with pytest.raises(ValueError):
        pack_weight(torch.randn(3))


def test_thread_count_does_not_change_results():
    """Each output is computed by exactly one thread in a fixed order: bitwise identical."""
    if not cpu_linear.available():
        pytest.skip("C kernel unavailable")
    g = torch.Generator().manual_seed(6)
    cases = [(torch.randn(4099, 577, generator=g).to(dt), torch.randn(m, 577, generator=g).to(dt))
             for dt in DTYPES for m in (1, 7)]
    before = cpu_linear.kernel_info()["threads"]
    try:
        outs = []
        for n in (1, 2, 3):
            cpu_linear.set_num_threads(n)
            outs.append([pack_weight(w)(x) for w, x in cases])
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b)
    finally:
        cpu_linear.set_num_threads(before)


def test_concurrent_callers():
    """The pool serves one caller at a time; others run single-threaded, still correct."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(2048, 576, generator=g).to(torch.bfloat16)
    lin = pack_weight(w)
    xs = [torch.randn(3, 576, generator=g).to(torch.bfloat16) for _ in range(4)]
    refs = [lin(x) for x in xs]
    errors = []

    def run(i):
        try:
            for _ in range(50):
                if not torch.equal(lin(xs[i]), refs[i]):
                    errors.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_works_after_fork():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(3000, 100, generator=g)
    lin = pack_weight(w)
    x = torch.randn(2, 100, generator=g)
    ref = lin(x)  # starts the pool in the parent
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: its pool threads are gone; the kernel must restart them
        ok = torch.equal(lin(x), ref)
        os.write(wfd, b"1" if ok else b"0")
        os._exit(0)
    os.close(wfd)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"


def _run_py(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


FALLBACK_SCRIPT = """
    import logging, torch, torch.nn.functional as F
    logging.basicConfig(level=logging.WARNING)
    from prescient.kernels import cpu_linear
    w = torch.randn(300, 70); x = torch.randn(3, 70)
    lin = cpu_linear.pack_weight(w)
    for _ in range(3):
        y = lin(x)
    assert torch.equal(y, F.linear(x, w))
    info = cpu_linear.kernel_info()
    assert not info["available"] and info["reason"]
    print("OK")
"""


def test_fallback_when_compiler_fails(tmp_path):
    """A failing compiler means F.linear everywhere and exactly one logged warning."""
    p = _run_py(FALLBACK_SCRIPT, {"CC": "false", "PATH": "/nonexistent",
                                  "PRESCIENT_CACHE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert "OK" in p.stdout
    assert p.stderr.count("falling back to F.linear") == 1, p.stderr


def test_build_is_cached_and_a_damaged_entry_is_rebuilt(tmp_path):
    """First use compiles into the cache dir; a second process loads the cached .so; a cached
    file that is not a library any more is rebuilt in its place. (One test: each compile is
    tens of seconds on 2 cores.)"""
    code = """
        from prescient.kernels import cpu_linear
        print(cpu_linear.kernel_info()["so"])
    """
    env = {"PRESCIENT_CACHE_DIR": str(tmp_path)}
    first = _run_py(code, env)
    if "None" in first.stdout:
        pytest.skip("no working C compiler")
    so = first.stdout.strip()
    assert so.startswith(str(tmp_path)) and os.path.exists(so)
    inode = os.stat(so).st_ino  # a rebuild would os.replace() it with a new file
    second = _run_py(code, env)
    assert second.stdout.strip() == so and os.stat(so).st_ino == inode
    with open(so, "wb") as f:
        f.write(b"not an ELF file")
    third = _run_py(code + "    assert cpu_linear.available()\n", env)
    assert third.returncode == 0, third.stderr
    assert third.stdout.strip() == so


def test_builds_and_runs_without_march_native(generic_so):
    """The AVX-512 kernels use per-function target attributes and run-time CPUID dispatch,
    so a generic build (the fallback when -march=native is rejected) is complete too."""
    import ctypes

    lib = ctypes.CDLL(str(generic_so))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.pg_linear.argtypes = [vp, ci, vp, vp, ci, vp, ci, ci, ci]
    lib.pg_set_isa_cap.argtypes = [ci]
    g = torch.Generator().manual_seed(9)
    tiers = cpu_linear.machine_tiers() or ["portable"]
    for name in tiers:
        used = lib.pg_set_isa_cap(ISA_TIERS.index(name))
        assert used == ISA_TIERS.index(name)
        for wdt, code in ((torch.float32, 0), (torch.bfloat16, 1)):
            for M in (1, 5, 16):
                w = torch.randn(131, 45, generator=g).to(wdt)
                x = torch.randn(M, 45, generator=g)
                y = torch.empty(M, 131)
                assert lib.pg_linear(w.data_ptr(), code, None, x.data_ptr(), 0, y.data_ptr(),
                                     M, 131, 45) == 0
                xround = torch.bfloat16 if (code == 1 and name == "avx512_bf16") else None
                _check(y, x, w, xround=xround)


@pytest.fixture
def bf16_tier():
    """Tier avx512_bf16 (skipped where this CPU lacks it) with the AMX tiles off; the tier and the
    bf16 switches are restored afterwards."""
    if not cpu_linear.available() or "avx512_bf16" not in cpu_linear.machine_tiers():
        pytest.skip("this CPU cannot run the avx512_bf16 tier")
    before = cpu_linear.kernel_info()["isa"]
    cpu_linear._set_isa_cap("avx512_bf16")
    cpu_linear._set_bf16_amx(False)  # the vdpbf16ps path unless a test turns the tiles on
    yield
    cpu_linear._set_bf16_fma(None)
    cpu_linear._set_bf16_amx(None)
    cpu_linear._set_isa_cap(ISA_TIERS.index(before))


def test_bf16_products_as_fmas_give_the_instructions_bits(bf16_tier):
    """Tier avx512_bf16 computes vdpbf16ps's products (bf16 weights x x rounded to bf16) either by
    the instruction or as two FMAs a lane, the odd product then the even one (pg_bf16_fma, the
    default on Intel; the SDM's order, checked lane by lane on the Xeon and on Zen 4): the same
    bits at every M and tile shape, K with and without a tail (of 1, 3, 8, 13 and 31 elements),
    fp32 and bf16 x, with a bias, pooled (the LM head) or not, and close to float64."""
    g = torch.Generator().manual_seed(21)
    cases = 0
    for N, K, Ms in [(577, 33, range(1, 17)), (130, 577, (1, 5, 8, 9, 31)), (64, 1000, (3, 8, MAX_M)),
                     (31, 8, (1, 7)), (70, 35, (1, 6, 17)), (45, 45, (2, 8)), (33, 63, (1, 9)),
                     (4099, 576, (1, 2, 8, 13)), (49152, 576, (1, 9))]:
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        b = torch.randn(N, generator=g)
        for M in Ms:
            for xdt in DTYPES:
                x = torch.randn(M, K, generator=g).to(xdt)
                lin = pack_weight(w, b if (M + N) % 2 else None)
                assert cpu_linear._set_bf16_fma(False) is False
                assert cpu_linear.kernel_info()["bf16_dot"] == "dp"
                y_dp = lin(x)
                assert cpu_linear._set_bf16_fma(True) is True
                assert cpu_linear.kernel_info()["bf16_dot"] == "fma"
                y_fma = lin(x)
                assert torch.equal(y_dp, y_fma), (N, K, M, xdt)
                if M < 3:
                    _check(y_dp, x, w, bias=lin.bias, xround=torch.bfloat16)
                cases += 1
    assert cases == 2 * (16 + 5 + 3 + 2 + 3 + 2 + 2 + 4 + 2)


def test_one_weight_stream_rows_have_the_tile_rows_bits(tier):
    """At M <= 6 the AVX-512 rows read one weight row at a time where pg_one_stream (the default
    but on Intel) or 4-row tiles (or 2-row pairs) otherwise: each output is one chain over K
    either way, so the same bits, for fp32 and bf16 weights and x, N not a multiple of 4, K tails,
    a bias, pooled (the LM head) or not, vdpbf16ps and its FMAs; and a row's bits the same at
    every M from 1 to 7 (7: the tiles whatever pg_one_stream says)."""
    if not tier.startswith("avx512"):
        pytest.skip("the one-stream rows are the AVX-512 tiers'")
    g = torch.Generator().manual_seed(23)
    modes = (False, True) if tier == "avx512_bf16" else (None,)
    try:
        for wdt in DTYPES:
            for N, K in [(577, 33), (130, 577), (31, 1000), (49152, 576)]:
                w = torch.randn(N, K, generator=g).to(wdt)
                lin = pack_weight(w, torch.randn(N, generator=g) if N % 2 else None)
                for xdt in DTYPES:
                    x = torch.randn(7, K, generator=g).to(xdt)
                    for fma in modes:
                        if fma is not None:
                            cpu_linear._set_bf16_fma(fma)
                        ys = {}
                        for one in (False, True):
                            assert cpu_linear._set_one_stream(one) is one
                            ys[one] = [lin(x[:M]) for M in range(1, 8)]
                        for a, b in zip(ys[False], ys[True]):
                            assert torch.equal(a, b), (wdt, N, K, xdt, fma)
                        seven = ys[True][-1]
                        for M, y in enumerate(ys[True], start=1):
                            assert torch.equal(y, seven[:M]), (wdt, N, K, xdt, fma, M)
    finally:
        cpu_linear._set_one_stream(None)
        cpu_linear._set_bf16_fma(None)


def test_bf16_fma_switch_only_at_tier_avx512_bf16_and_by_name(bf16_tier, monkeypatch):
    """Below tier avx512_bf16 there is no vdpbf16ps to compute (the bf16 rows widen x as fp32), so
    the switch reads off; a bad PRESCIENT_BF16_DOT is refused by name."""
    assert cpu_linear._set_bf16_fma(True) is True
    cpu_linear._set_isa_cap("avx512")
    assert cpu_linear._set_bf16_fma(True) is False
    assert cpu_linear.kernel_info()["bf16_dot"] is None
    monkeypatch.setenv("PRESCIENT_BF16_DOT", "amx2")
    with pytest.raises(ValueError, match="PRESCIENT_BF16_DOT"):
        cpu_linear._env_bf16_dot()
    monkeypatch.setenv("PRESCIENT_BF16_DOT", "FMA")
    assert cpu_linear._env_bf16_dot() == "fma"


@pytest.fixture
def pairs_tier(bf16_tier, monkeypatch):
    """Tier avx512_bf16 by vdpbf16ps on one weight stream (where bf16 weights get a row-pair
    copy), room for the tests' copies; the copy's M range restored afterwards."""
    cpu_linear._set_bf16_fma(False)
    cpu_linear._set_one_stream(True)
    monkeypatch.setenv("PRESCIENT_REGROUP_MB", str((cpu_linear.copies_held() >> 20) + 512))
    yield
    cpu_linear._set_pairs_min_m(None)
    cpu_linear._set_one_stream(None)


def _without_copy(lin):
    """The same weight packed again, its descriptor pointing at no copy (the rows as stored)."""
    bare = pack_weight(lin.weight, lin.bias)
    bare._desc.rp, bare._desc.rpl = None, 0
    return bare


def test_row_pair_copy_gives_the_rows_bits(pairs_tier):
    """A bf16 weight's row-pair copy (pg_linear_pairs: rows 2p and 2p + 1 a 32-block apart, one
    stream a 2-row tile) gives the bits of the rows as stored at every M it is read for, with an
    odd last row, a bias, fp32 and bf16 x, alone and pooled (the 49152-row head); and it is what
    is read: a changed copy changes its row's outputs, from the default 5 inputs to 20 only."""
    g = torch.Generator().manual_seed(41)
    for N, K in [(577, 576), (130, 64), (2, 32), (33, 1536), (4099, 576), (49152, 576)]:
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        lin = pack_weight(w, torch.randn(N, generator=g) if N % 2 else None)
        assert lin._pairs is not None and lin._pairs.shape == (N // 2, K // 32, 2, 32)
        bare = _without_copy(lin)
        assert cpu_linear._set_pairs_min_m(1) == 1
        # every M the copy is read for (each tile height 1-8, and 9-20 as two blocks), its ends
        Ms = (*range(1, 22), 24, MAX_M) if N < 4099 else (1, 5, 6, 7, 8, 13, 19, 20)
        for xdt in DTYPES:
            x = torch.randn(MAX_M, K, generator=g).to(xdt)
            for M in Ms:
                assert torch.equal(lin(x[:M]), bare(x[:M])), (N, K, M, xdt)
        cpu_linear._set_pairs_min_m(None)
        x = torch.randn(MAX_M, K, generator=g)
        before = {M: lin(x[:M]) for M in (4, 5, 20, 21)}
        lin._pairs[0, 0, 1, 0] += 1.0  # row 1's first element, in the copy only
        for M, y in before.items():
            after = lin(x[:M])
            assert torch.equal(after[:, 2:], y[:, 2:]) and torch.equal(after[:, 0], y[:, 0])
            assert torch.equal(after[:, 1], y[:, 1]) == (M not in (5, 20)), (N, K, M)


def test_row_pair_copies_where_they_are_read_within_the_budget(pairs_tier, monkeypatch):
    """The copy is made for bf16 weights with K a multiple of 32 and at least two rows, at tier
    avx512_bf16 by vdpbf16ps on one stream; it counts in copies_held (one PRESCIENT_REGROUP_MB
    with the other copies), is given back with its weight, and is not made past the budget."""
    import gc

    g = torch.Generator().manual_seed(42)
    w = torch.randn(1001, 1024, generator=g).to(torch.bfloat16)
    gc.collect()
    held = cpu_linear.copies_held()
    lin = pack_weight(w)
    assert lin._pairs is not None and cpu_linear.copies_held() == held + 1000 * 1024 * 2
    del lin
    gc.collect()
    assert cpu_linear.copies_held() == held
    assert pack_weight(w[:, :1000])._pairs is None  # K % 32
    assert pack_weight(w[:1])._pairs is None
    assert pack_weight(w.float())._pairs is None
    cpu_linear._set_bf16_fma(True)
    assert pack_weight(w)._pairs is None  # the FMA path reads the rows as stored
    cpu_linear._set_bf16_fma(False)
    cpu_linear._set_isa_cap("avx512")
    assert pack_weight(w)._pairs is None
    cpu_linear._set_isa_cap("avx512_bf16")
    monkeypatch.setenv("PRESCIENT_REGROUP_MB", str((held + 1000 * 1024 * 2 - 1) >> 20))  # just short
    assert pack_weight(w)._pairs is None


@pytest.fixture
def amx_tier(bf16_tier, monkeypatch):
    """Tier avx512_bf16 with bf16 weights on AMX tiles (skipped where the CPU or the OS has none),
    with room for the tests' copies whatever earlier tests still hold."""
    if not cpu_linear._set_bf16_amx(True):
        pytest.skip("no AMX-BF16 tiles on this CPU (or not granted by the OS)")
    monkeypatch.setenv("PRESCIENT_REGROUP_MB", str((cpu_linear.copies_held() >> 20) + 512))
    yield


def test_amx_rows_match_float64_and_do_not_depend_on_m(amx_tier):
    """bf16 weights on AMX tiles (cpu_gemv_amx.c): x rounded to bf16 and fp32 sums, within the
    fp32 bound of the float64 product; each row's bits the same at every M (1 to 4 row groups of
    16), with tails of N and K, a bias, fp32 and bf16 x, alone and pooled (the 49152-row head)."""
    g = torch.Generator().manual_seed(31)
    Ms = (1, 2, 7, 15, 16, 17, 31, 33, 48, MAX_M)
    for N, K in [(577, 33), (130, 577), (64, 1000), (31, 8), (45, 45), (1536, 576), (49152, 576)]:
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        bias = torch.randn(N, generator=g) if N % 2 else None
        lin = pack_weight(w, bias)
        assert lin._amx is not None and cpu_linear.kernel_info()["bf16_amx"]
        for xdt in DTYPES:
            x = torch.randn(MAX_M, K, generator=g).to(xdt)
            full = lin(x)
            _check(full, x, w, bias=bias, xround=torch.bfloat16)
            for M in Ms if N < 49152 else (1, 9, MAX_M):
                assert torch.equal(lin(x[:M]), full[:M]), (N, K, M, xdt)
            assert torch.equal(lin(x[MAX_M - 1:]), full[MAX_M - 1:])  # a last row alone


def test_amx_switch_is_read_per_call_and_by_name(amx_tier, monkeypatch):
    """With the tiles off, a weight that carries an AMX copy runs the vdpbf16ps path (its bits:
    those of a weight packed without a copy); weights packed while they are off get no copy.
    PRESCIENT_BF16_DOT takes amx too."""
    g = torch.Generator().manual_seed(32)
    w = torch.randn(300, 576, generator=g).to(torch.bfloat16)
    x = torch.randn(8, 576, generator=g)  # fp32 y: bf16 outputs would round most differences away
    with_copy = pack_weight(w)
    on = with_copy(x)
    assert cpu_linear._set_bf16_amx(False) is False
    without = pack_weight(w)
    assert without._amx is None and cpu_linear.kernel_info()["bf16_amx"] is False
    off = with_copy(x)
    assert torch.equal(off, without(x)) and not torch.equal(off, on)
    cpu_linear._set_bf16_amx(True)
    assert torch.equal(with_copy(x), on)
    monkeypatch.setenv("PRESCIENT_BF16_DOT", "AMX")
    assert cpu_linear._env_bf16_dot() == "amx"


def test_amx_copies_share_the_copy_budget(amx_tier, monkeypatch):
    """A bf16 weight's AMX copy counts in cpu_linear.copies_held (with the block formats'
    regrouped copies: one PRESCIENT_REGROUP_MB), is given back with its weight, and is not made
    past the budget (the weight then runs on FMAs)."""
    import gc

    g = torch.Generator().manual_seed(33)
    w = torch.randn(1000, 1024, generator=g).to(torch.bfloat16)
    gc.collect()
    held = cpu_linear.copies_held()
    lin = pack_weight(w)
    size = 63 * 32 * 1024  # 63 column tiles x 32 blocks x 1 KB
    assert lin._amx is not None and cpu_linear.copies_held() == held + size
    del lin
    gc.collect()
    assert cpu_linear.copies_held() == held
    monkeypatch.setenv("PRESCIENT_REGROUP_MB", str((held + size - 1) >> 20))  # just short of it
    assert pack_weight(w)._amx is None


def test_prescient_isa_env():
    """PRESCIENT_ISA=avx2 caps the tier at load; a bad value is an error naming the tiers."""
    if "avx2" not in cpu_linear.machine_tiers():
        pytest.skip("this CPU cannot run the avx2 tier")
    code = """
        import torch
        from prescient.kernels import cpu_linear
        info = cpu_linear.kernel_info()
        w = torch.randn(300, 70).to(torch.bfloat16); x = torch.randn(3, 70)
        y = cpu_linear.pack_weight(w)(x)
        err = (y.double() - x.double() @ w.double().T).abs().max().item()
        print(info["isa"], info["available"], cpu_linear.prefill_mode(), err < 1e-3)
    """
    p = _run_py(code, {"PRESCIENT_ISA": "avx2"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["avx2", "True", "fp32_blocked", "True"]
    bad = _run_py(code, {"PRESCIENT_ISA": "avx3"})
    assert bad.returncode != 0
    assert "PRESCIENT_ISA='avx3'" in bad.stderr and "portable, avx2, avx512, avx512_vnni, avx512_bf16" in bad.stderr


def test_neon_kernels_under_qemu(tmp_path):
    """The aarch64 NEON kernels (fp32 and bf16 weights, fp32 and bf16 x, M up to 16, odd
    shapes, bias, 2 threads) against the double-precision reference of
    tests/kernels/neon_driver.c, cross-compiled with cpu_gemv.c + cpu_runtime.c, run under qemu-aarch64."""
    cc, qemu, why = aarch64_cross_tools()
    if why:
        pytest.skip(why)
    exe = tmp_path / "neon_driver"
    kdir = os.path.join(REPO, "kernels")
    build = subprocess.run(
        [cc, "-O3", "-std=gnu11", "-pthread", "-Wall", "-Werror", "-I", kdir, "-o", str(exe),
         os.path.join(REPO, "tests", "kernels", "neon_driver.c"), os.path.join(kdir, "cpu_gemv.c"),
         os.path.join(kdir, "cpu_runtime.c"), "-lm"], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert summary.startswith("neon_driver: isa 0,") and summary.endswith(" 0 failed"), summary
    assert int(summary.split(",")[1].split()[0]) > 300  # every case ran


def test_cache_prunes_builds_unused_for_a_week(tmp_path):
    cur, stale, recent = (tmp_path / f"cpu_gemv-{n}.so" for n in ("cur", "stale", "recent"))
    for p in (cur, stale, recent):
        p.write_bytes(b"")
    week_ago = os.stat(cur).st_mtime - 8 * 86400
    os.utime(stale, (week_ago, week_ago))
    os.utime(cur, (week_ago, week_ago))  # in use now: touched, never pruned
    cpu_linear._touch_and_prune(cur)
    assert cur.exists() and recent.exists() and not stale.exists()


def test_read_probe_xors_every_word():
    """pg_read_probe (gemv_bench's read-bandwidth floor) must really read all of the buffer:
    its result is the XOR of every 64-bit word, over the pool, with a ragged last chunk."""
    import ctypes

    import numpy as np

    lib = cpu_linear.library()
    if lib is None:
        pytest.skip("C kernel unavailable")
    lib.pg_read_probe.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.pg_read_probe.restype = ctypes.c_uint64
    g = torch.Generator().manual_seed(13)
    for words in (1, 7, 8193, (3 << 20) + 5):
        buf = torch.randint(-2**62, 2**62, (words,), dtype=torch.int64, generator=g)
        want = int(np.bitwise_xor.reduce(buf.numpy().view(np.uint64)))
        assert lib.pg_read_probe(buf.data_ptr(), words * 8) == want
    assert lib.pg_read_probe(buf.data_ptr(), 0) == 0


def test_the_clock_and_fma_probes_read_a_core():
    """pg_clock_ghz (the benchmarks' header): a chain of dependent adds runs one add a cycle, so its
    rate is the core's clock now: within 0.3-7 GHz on any machine this runs on (a probe that
    miscounted its adds, or timed the wrong span, lands far outside)."""
    ghz, gflops = cpu_linear.core_speed(3000)
    if ghz is None:
        pytest.skip("no compiled kernels, or an ISA without the probe's add chain")
    assert 0.3 < ghz < 7.0
    # pg_vector_gflops: 12 chains of 8-float multiply-adds, so 1 to 100 flops a cycle on any core
    # (SSE mul + add to two 512-bit FMA pipes), whatever shares it; a miscounted probe falls outside
    assert gflops is not None and 1.0 < gflops / ghz < 100.0
