"""Correctness of prescient.kernels.cpu_linear (the small-M CPU GEMV) against float64 math.

Tolerances.  The reference is computed in float64 from the operands the kernel actually
multiplies: the weight as stored, and x as given, or rounded to bf16 when the kernel runs
bf16 activations (bf16 weights on the AVX512_BF16 path).  The kernel then differs only by
  * fp32 accumulation: |err| <= K * 2^-24 * sum_k |x_k w_k| (the classic bound for
    recursive summation; blocked/paired summation does better), and
  * output rounding when y is bf16: half an ulp, 2^-9 * |y| (2^-8 allowed for the
    bound above moving y across a binade).
so we assert |y - ref| <= K * 2^-24 * (|x| @ |w|^T) + (2^-8 * |ref| if y is bf16) + 1e-30.
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
from prescient.kernels.cpu_linear import MAX_M, PackedLinear, pack_weight

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


@pytest.fixture
def isa_cap():
    """Run a test at a lower ISA (portable / AVX-512 without BF16), restoring afterwards."""
    if not cpu_linear.available():
        pytest.skip("C kernel unavailable")
    yield cpu_linear._set_isa_cap
    cpu_linear._set_isa_cap(99)


def test_kernel_builds_here():
    info = cpu_linear.kernel_info()
    if not info["available"] and "no C compiler" in (info["reason"] or ""):
        pytest.skip("no C compiler on this machine")
    assert info["available"], info["reason"]
    assert info["isa"] in ("portable", "avx512", "avx512_bf16")
    assert info["threads"] >= 1


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


@pytest.mark.parametrize("cap", [0, 1, 2], ids=["portable", "avx512", "avx512_bf16"])
@pytest.mark.parametrize("wdt", DTYPES, ids=["w32", "wbf16"])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_isa_paths(isa_cap, cap, wdt, M):
    used = isa_cap(cap)
    for xdt in DTYPES:
        for N, K in [(577, 33), (64, 1000), (3, 17)]:
            g = torch.Generator().manual_seed(N + K + M + cap)
            w = torch.randn(N, K, generator=g).to(wdt)
            x = torch.randn(M, K, generator=g).to(xdt)
            xround = torch.bfloat16 if (wdt == torch.bfloat16 and used == "avx512_bf16") else None
            _check(pack_weight(w)(x), x, w, xround=xround)


def test_lm_head_shape():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(49152, 576, generator=g).to(torch.bfloat16)
    lin = pack_weight(w)
    for M in (1, 16):
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


def test_large_m_falls_back_to_f_linear():
    g = torch.Generator().manual_seed(4)
    for wdt in DTYPES:
        w = torch.randn(100, 50, generator=g).to(wdt)
        x = torch.randn(MAX_M + 1, 50, generator=g).to(wdt)
        torch.testing.assert_close(pack_weight(w)(x), F.linear(x, w), rtol=0, atol=0)
    x0 = torch.randn(0, 50)
    assert pack_weight(torch.randn(100, 50))(x0).shape == (0, 100)


def test_mixed_dtype_fallback_and_autograd():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    x = torch.randn(MAX_M + 4, 24, generator=g)  # fp32 x, bf16 w, M > MAX_M: fallback
    y = pack_weight(w)(x)  # F.linear in bf16 (no fp32 copy of the weight), cast back
    assert y.dtype == torch.float32
    _check(y, x, w, xround=torch.bfloat16, y_rounded_bf16=True)
    wf = torch.randn(40, 24, generator=g)
    xg = torch.randn(2, 24, generator=g, requires_grad=True)
    pack_weight(wf)(xg).sum().backward()  # autograd goes through F.linear
    torch.testing.assert_close(xg.grad, wf.sum(0).expand(2, 24))


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


def test_build_is_cached(tmp_path):
    """First use compiles into the cache dir; a second process loads the cached .so."""
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


def test_builds_and_runs_without_march_native(tmp_path):
    """The AVX-512 kernels use per-function target attributes and run-time CPUID dispatch,
    so a generic build (the fallback when -march=native is rejected) is complete too."""
    import ctypes

    cc = cpu_linear._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / "generic.so"
    flags = [f for f in cpu_linear._flag_sets()[-1] if "march" not in f]
    cpu_linear._compile(cc, flags, so)
    lib = ctypes.CDLL(str(so))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.pg_linear.argtypes = [vp, ci, vp, vp, ci, vp, ci, ci, ci]
    lib.pg_set_isa_cap.argtypes = [ci]
    g = torch.Generator().manual_seed(9)
    for cap in (0, 1, 2):
        used = lib.pg_set_isa_cap(cap)
        for wdt, code in ((torch.float32, 0), (torch.bfloat16, 1)):
            w = torch.randn(131, 45, generator=g).to(wdt)
            x = torch.randn(5, 45, generator=g)
            y = torch.empty(5, 131)
            assert lib.pg_linear(w.data_ptr(), code, None, x.data_ptr(), 0, y.data_ptr(),
                                 5, 131, 45) == 0
            xround = torch.bfloat16 if (code == 1 and used == 2) else None
            _check(y, x, w, xround=xround)


def test_damaged_cache_entry_is_rebuilt(tmp_path):
    code = """
        from prescient.kernels import cpu_linear
        print(cpu_linear.kernel_info()["so"])
    """
    env = {"PRESCIENT_CACHE_DIR": str(tmp_path)}
    first = _run_py(code, env)
    so = first.stdout.strip()
    if so == "None":
        pytest.skip("no working C compiler")
    with open(so, "wb") as f:
        f.write(b"not an ELF file")
    second = _run_py(code + "    assert cpu_linear.available()\n", env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == so


def test_cache_prunes_builds_unused_for_a_week(tmp_path):
    cur, stale, recent = (tmp_path / f"cpu_gemv-{n}.so" for n in ("cur", "stale", "recent"))
    for p in (cur, stale, recent):
        p.write_bytes(b"")
    week_ago = os.stat(cur).st_mtime - 8 * 86400
    os.utime(stale, (week_ago, week_ago))
    os.utime(cur, (week_ago, week_ago))  # in use now: touched, never pruned
    cpu_linear._touch_and_prune(cur)
    assert cur.exists() and recent.exists() and not stale.exists()
