"""Fast CPU linear for small M (decode M=1, speculative verify M<=16), fp32 or bf16 weights.

``F.linear`` at M=1 streams weights at roughly a third of DRAM bandwidth on the target CPUs
(see docs/CPU_PERFORMANCE.md).  This module wraps ``cpu_gemv.c``: a plain-C,
multi-threaded, bandwidth-bound matrix-vector kernel that reuses each weight chunk for all M
input rows, in ISA tiers (``ISA_TIERS``): AVX512_BF16 ``vdpbf16ps`` for bf16 weights, AVX-512
FMA, AVX2 + FMA, and a portable path (NEON intrinsics on aarch64, plain C elsewhere).  The C
file is compiled with the system C compiler at first use, cached per user under
``~/.cache/prescient/kernels`` (keyed by a hash of the source, flags, compiler and CPU), and
called through ctypes with tensor data pointers.  If no compiler is found or the build
fails, every call falls back to ``torch.nn.functional.linear`` and one warning is logged.
The same .so also holds the CPU tree-attention kernel (``cpu_attention.c``, wrapped by
``cpu_attention.py``), so both share one thread pool, the fused layer (``cpu_layer.c``), the
greedy tokens' argmax (``cpu_argmax.c``) and the grammar masks (``cpu_bitmask.c``); ``library()``
hands it out.

Public API::

    lin = pack_weight(w, bias=None, dtype=None)   # once per weight, at model load
    y = lin(x)                                    # x [..., in] fp32/bf16 -> y [..., out], x.dtype
    y = lin(x, out=buf)                           # same, into a preallocated buffer (~1 us less)
    available()                                   # True when the C kernel is in use
    library()                                     # the .so (also cpu_attention's), or None
    kernel_info()                                 # ISA tier in use, threads, .so path, or why not
    machine_tiers()                               # ISA tiers this CPU runs, lowest first
    prefill_mode()                                # how a bf16 weight's M > MAX_M call runs now
    set_num_threads(n), set_spin(spin_us, yield_us)

The weight keeps torch's [out, in] row-major layout (no copy when it is already contiguous and
of the requested dtype), so M > MAX_M calls use the same tensor with ``F.linear`` (the runtime's
prefill no longer makes them: runtime/linear.py runs it MAX_M rows a call) and a tied LM head can
share the embedding table.  Prefill of a bf16 weight below the avx512_bf16
tier does not use a bf16 GEMM: without AVX512_BF16, oneDNN's bf16 GEMM is several times
slower than fp32 (150 vs 34 ms for 512x576 @ 576x3072, one thread, oneDNN capped at AVX2),
so the weight is widened to fp32 a row block at a time (sized for L2) and each block is
multiplied into its output columns; no full fp32 copy of the weight is ever held.  The tier
deciding this is ``pg_isa()`` (capped by PRESCIENT_ISA), so the AVX2 path runs on any CPU.

Numerics: fp32 accumulation.  bf16 weights on AVX512_BF16 multiply bf16 activations (an fp32
x is rounded to bf16 once per call, as F.linear on a bf16 weight would); elsewhere x stays
fp32 (also in the blocked prefill).  A bf16 output is rounded to nearest even from the fp32
sum.

Threads: the kernel runs its own pool (caller + workers, one thread per usable physical core by
default: kernels/cpu_threads.py), independent of torch's intra-op threads.  Use
``torch.set_num_threads(1)`` next to it: torch's OpenMP workers would otherwise compete for the
cores the pool's workers spin on.  Calls may come
from any thread; the pool serves one call at a time and a concurrent caller runs on its own
thread only.  Environment: ``PRESCIENT_CPU_GEMV=0`` disables the kernel, ``PRESCIENT_ISA=portable|avx2|
avx512|avx512_vnni|avx512_bf16`` caps the ISA tier (to run a lower tier on a bigger CPU),
``PRESCIENT_AVX_VNNI=1|0`` turns tier avx2's AVX-VNNI rows on or off (default: on where avx2 is the
CPU's best tier and it has AVX-VNNI, so a capped AVX-512 CPU runs plain AVX2),
``PRESCIENT_BF16_DOT=dp|fma|amx`` how tier avx512_bf16 multiplies bf16 by bf16: vdpbf16ps, or its
products as two FMAs (the same bits; the default on Intel CPUs, which issue vdpbf16ps at a quarter
of their FMAs' rate), or bf16 weights on AMX tiles (other bits; the default where the CPU has
AMX-BF16: a copy of each bf16 weight in the tiles' layout, within ``PRESCIENT_REGROUP_MB``; a bf16
KV cache's q.K joins them with ``PRESCIENT_ATTN_AMX=1``: a batch-1 verify ~10% cheaper, decode
batches dearer, so off by default),
``PRESCIENT_GEMV_THREADS=n`` sets the pool size (1 on a shared, oversubscribed machine),
``PRESCIENT_GEMV_SPIN_US=spin[,yield]`` the worker's wait policy, ``PRESCIENT_CACHE_DIR`` the
build cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from prescient.cache_dir import cache_dir
from prescient.kernels import cpu_threads, huge_pages

log = logging.getLogger(__name__)


def _max_m() -> int:
    """PG_MAX_M of cpu_runtime.h, the one place it is written (the loaded library is checked
    against it): read from the header, so that no import has to build the library."""
    src = Path(__file__).with_name("cpu_runtime.h").read_text()
    return int(re.search(r"^#define PG_MAX_M (\d+)", src, re.M).group(1))


#: Largest number of input rows one kernel call handles; more rows go to F.linear (a GEMM).
MAX_M = _max_m()

# Every C source of the .so (one library, one thread pool): all are hashed and compiled.  In
# layer order, lowest first (each file uses only the ones before it; tests/kernels/
# test_format_table.py keeps the symbol graph acyclic): the runtime (pool, ISA), the kernels,
# the format table over them, the dispatcher over the table, the fused layer on top.
_SOURCE_NAMES = ("cpu_runtime.c", "cpu_gemv.c", "cpu_gemv_amx.c", "cpu_attention.c", "cpu_argmax.c", "cpu_bitmask.c",
                 "cpu_qgemv_cl.c", "cpu_qgemv_avx2.c", "cpu_qgemv_avx512.c", "cpu_qgemv_neon.c", "cpu_qgemv.c",
                 "cpu_qgemv_k.c",
                 "cpu_formats.c", "cpu_dispatch.c", "cpu_layer.c")
_HEADER_NAMES = ("cpu_runtime.h", "cpu_bf16.h", "cpu_gemv.h", "cpu_attention.h", "cpu_formats.h",
                 "cpu_qgemv.h", "cpu_qgemv_k.h", "cpu_dispatch.h")  # hashed, not compiled
_SOURCES = tuple(Path(__file__).with_name(f) for f in _SOURCE_NAMES)
_HEADERS = tuple(Path(__file__).with_name(h) for h in _HEADER_NAMES)
_DT = {torch.float32: 0, torch.bfloat16: 1}
#: ISA tiers (kernels/cpu_runtime.h), lowest first; PRESCIENT_ISA=<name> caps the tier in use.
_ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512", 3: "avx512_vnni", 4: "avx512_bf16"}
ISA_TIERS = tuple(_ISA_NAMES.values())

_C_VERSION = 5  # must match PG_VERSION in cpu_runtime.c

_lock = threading.RLock()
_lib: Optional[ctypes.CDLL] = None  # the loaded .so (GEMV enabled or not)
_lib_tried = False
_lib_error: Optional[str] = None
_fn = None  # pg_linear_w, bound once; None when the GEMV is unavailable or disabled
_tried = False
_why_not: Optional[str] = None
_so_path: Optional[str] = None
_RP_AMX = 2  # pg_weight_t.rpl of a bf16 weight's AMX copy (PG_RP_AMX, cpu_dispatch.h)
_amx_lock = threading.Lock()
_amx_held = 0  # bytes of AMX copies alive (PackedLinear._amx_copy)
_RP_PAIRS = 3  # pg_weight_t.rpl of a bf16 weight's row-pair copy (PG_RP_PAIRS, cpu_dispatch.h)
_pairs_held = 0  # bytes of row-pair copies alive (PackedLinear._pairs_copy), under _amx_lock
#: byte counts of the process's other weight copies (quant_linear.regrouped_bytes registers its
#: own): all of them share one PRESCIENT_REGROUP_MB budget
_other_copies: list = []
COPY_BUDGET_MB = 1024


def copy_budget() -> int:
    """Bytes the process's weight copies laid out for the kernels may take in all
    (PRESCIENT_REGROUP_MB, default COPY_BUDGET_MB; a copy doubles its weight's memory)."""
    try:
        return int(os.environ.get("PRESCIENT_REGROUP_MB", COPY_BUDGET_MB)) << 20
    except ValueError:
        return COPY_BUDGET_MB << 20


def copies_held() -> int:
    """Bytes of all weight copies alive: the AMX copies and those registered in _other_copies."""
    return _amx_held + _pairs_held + sum(f() for f in _other_copies)


def _amx_release(nbytes: int) -> None:
    global _amx_held
    with _amx_lock:
        _amx_held -= nbytes


def _pairs_release(nbytes: int) -> None:
    global _pairs_held
    with _amx_lock:
        _pairs_held -= nbytes


class _WeightDesc(ctypes.Structure):
    """Mirror of pg_weight_t in cpu_dispatch.h: a weight's fixed call arguments, built once."""
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("wdt", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32),
                ("rp", ctypes.c_void_p), ("rpl", ctypes.c_int32)]


# --------------------------------------------------------------------------------------------
# Build and load
# --------------------------------------------------------------------------------------------

def _cache_dir() -> Path:
    return cache_dir("kernels")


def _cpu_signature() -> str:
    """Model name and feature flags: a cache shared over NFS must not hand a -march=native
    build to a different CPU."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    sig += line
                if line.strip() == "":
                    break  # first processor block is enough
    except OSError:
        pass
    return sig


def _compiler() -> Optional[str]:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("cc")


def _flag_sets() -> list[list[str]]:
    # -Werror=implicit-function-declaration: a function the build does not see is an undefined
    # symbol, and the .so would fail to load (as it once did on aarch64: the AMX stubs sat in an
    # x86-only section)
    common = ["-O3", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-Werror=implicit-function-declaration"]
    # -march=native first; without it the AVX-512 kernels still exist (per-function target
    # attributes, chosen at run time) and only the portable path loses host tuning. Last, both
    # without AVX-VNNI's `{vex} vpdpbusd` (cpu_runtime.h PQ_AVXVNNI): a GCC >= 11 beside an
    # assembler older than binutils 2.36 must not cost every CPU its kernels.
    novnni = ["-DPQ_AVXVNNI=0", "-DPG_AMX=0"]
    return [common + ["-march=native"], common, common + ["-march=native"] + novnni, common + novnni]


def _so_path_for(cc: str, flags: list[str]) -> Path:
    """The cached .so of one build: named by a hash of sources, flags, compiler and CPU."""
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*_SOURCES, *_HEADERS)), " ".join(flags).encode(),
                 cc.encode(), str(os.stat(cc).st_mtime_ns).encode(), _cpu_signature().encode()):
        h.update(part)
        h.update(b"\0")
    return _cache_dir() / f"cpu_gemv-{h.hexdigest()[:20]}.so"


def is_built() -> bool:
    """True when loading needs no compile: already loaded, or the preferred build is cached
    (or there is no compiler, so nothing would be compiled)."""
    if _lib_tried:
        return True
    cc = _compiler()
    return cc is None or _so_path_for(cc, _flag_sets()[0]).exists()


def _run_cc(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()[-2000:]}")


def _compile(cc: str, flags: list[str], so: Path) -> None:
    so.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name and rename: concurrent processes never load a half-written .so.
    fd, tmp = tempfile.mkstemp(prefix=so.stem + ".", suffix=".tmp.so", dir=so.parent)
    os.close(fd)
    try:
        # One compiler per source, as many at once as there are cores, then one link: ~35 s
        # serial on 2 cores, cpu_qgemv_avx512.c alone ~12 s of it.
        with tempfile.TemporaryDirectory(prefix=so.stem + ".", dir=so.parent) as objdir:
            objs = [str(Path(objdir) / (src.stem + ".o")) for src in _SOURCES]
            cflags = [f for f in flags if f != "-shared"]
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), cores))) as pool:
                # the longest first, so the others fill the remaining cores around it
                order = sorted(range(len(_SOURCES)), key=lambda i: -_SOURCES[i].stat().st_size)
                for f in [pool.submit(_run_cc, [cc, *cflags, "-c", "-o", objs[i], str(_SOURCES[i])])
                          for i in order]:
                    f.result()
            _run_cc([cc, *flags, "-o", tmp, *objs, "-lm"])
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _touch_and_prune(so: Path, max_idle_days: float = 7.0) -> None:
    """Mark `so` as used now (mtime) and delete sibling builds unused for `max_idle_days`:
    every edit of the C source or change of compiler/CPU makes a new cache entry."""
    try:
        os.utime(so)
        cutoff = time.time() - max_idle_days * 86400
        for old in so.parent.glob("cpu_gemv-*.so"):
            if old != so and old.stat().st_mtime < cutoff:
                old.unlink()
    except OSError:
        pass  # a read-only or shared cache: never fatal


def _bind(lib: ctypes.CDLL) -> None:
    global _lib
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.pg_linear.argtypes = [vp, ci, vp, vp, ci, vp, ci, ci, ci]
    lib.pg_linear.restype = ci
    lib.pg_linear_w.argtypes = [vp, vp, vp, ci, ci]
    lib.pg_linear_w.restype = ci
    lib.pg_linear_rows.argtypes = [vp, vp, vp, ci, ci]
    lib.pg_linear_rows.restype = ci
    lib.pq_linear_w2.argtypes = [vp, vp, vp, vp, vp, vp, ci, ci]  # two block-format products, one pool call
    lib.pq_linear_w2.restype = ci
    for name in ("pg_version", "pg_max_m", "pg_isa", "pg_num_threads", "pg_avx_vnni", "pg_bf16_fma", "pg_bf16_amx",
                 "pg_one_stream", "pg_neon_dot"):
        getattr(lib, name).restype = ci
        getattr(lib, name).argtypes = []
    lib.pg_set_isa_cap.argtypes = [ci]
    lib.pg_set_isa_cap.restype = ci
    lib.pg_set_avx_vnni.argtypes = [ci]
    lib.pg_set_avx_vnni.restype = ci
    lib.pg_set_bf16_fma.argtypes = [ci]
    lib.pg_set_bf16_fma.restype = ci
    lib.pg_set_one_stream.argtypes = [ci]
    lib.pg_set_one_stream.restype = ci
    lib.pg_set_neon_dot.argtypes = [ci]
    lib.pg_set_neon_dot.restype = ci
    lib.pg_clock_ghz.argtypes = [ci]
    lib.pg_clock_ghz.restype = ctypes.c_double
    lib.pg_vector_gflops.argtypes = [ci]
    lib.pg_vector_gflops.restype = ctypes.c_double
    lib.pg_set_bf16_amx.argtypes = [ci]
    lib.pg_set_bf16_amx.restype = ci
    lib.pa_set_amx.argtypes = [ci]
    lib.pa_set_amx.restype = ci
    lib.pg_amx_repack_bytes.argtypes = [ci, ci]
    lib.pg_amx_repack_bytes.restype = ctypes.c_size_t
    lib.pg_amx_repack.argtypes = [vp, ci, ci, vp]
    lib.pg_amx_repack.restype = ci
    lib.pg_set_num_threads.argtypes = [ci]
    lib.pg_set_num_threads.restype = ci
    lib.pg_set_spin_us.argtypes = [ci, ci]
    lib.pg_set_spin_us.restype = None
    lib.pg_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    lib.pg_stats.restype = None
    lib.pg_set_solo_bytes.argtypes = [ci]
    lib.pg_set_solo_bytes.restype = None
    lib.pg_set_pairs_min_m.argtypes = [ci]
    lib.pg_set_pairs_min_m.restype = ci
    if lib.pg_version() != _C_VERSION or lib.pg_max_m() != MAX_M:
        raise RuntimeError(f"cpu_gemv.so version {lib.pg_version()}/MAX_M {lib.pg_max_m()}, "
                           f"expected {_C_VERSION}/{MAX_M}")
    _lib = lib


def _env_choice(name: str, choices) -> Optional[str]:
    """The variable `name`, stripped and lower-cased (None when unset); ValueError naming the
    choices when it is not one of them."""
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return None
    if v not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return v


def _env_isa_cap() -> Optional[int]:
    """PRESCIENT_ISA as a tier index (None when unset); ValueError naming the valid tiers."""
    isa = _env_choice("PRESCIENT_ISA", ISA_TIERS)
    return None if isa is None else ISA_TIERS.index(isa)


def _env_avx_vnni() -> Optional[int]:
    """PRESCIENT_AVX_VNNI=1|0 (None when unset): tier avx2's AVX-VNNI rows on or off."""
    v = _env_choice("PRESCIENT_AVX_VNNI", ("0", "1"))
    return None if v is None else int(v)


def _env_one_stream() -> Optional[int]:
    """PRESCIENT_ONE_STREAM=1|0 (None when unset): the small-M rows read one weight stream at a
    time, and attention items whole cache rows where the pieces suffice (the default on x86 but
    Intel), or several streams and split items (Intel's and aarch64's default); the same bits."""
    v = _env_choice("PRESCIENT_ONE_STREAM", ("0", "1"))
    return None if v is None else int(v)


_BF16_DOTS = ("dp", "fma", "amx")


def _env_bf16_dot() -> Optional[str]:
    """PRESCIENT_BF16_DOT=dp|fma|amx (None when unset): how tier avx512_bf16 multiplies bf16 by
    bf16. dp: vdpbf16ps; fma: its products as two FMAs (the same bits); amx: bf16 weights on AMX
    tiles (other bits; and the bf16 cache's q.K with PRESCIENT_ATTN_AMX=1)."""
    return _env_choice("PRESCIENT_BF16_DOT", _BF16_DOTS)


def _apply_env(lib: ctypes.CDLL) -> None:
    n = os.environ.get("PRESCIENT_GEMV_THREADS")
    lib.pg_set_num_threads(int(n) if n else cpu_threads.default_threads())
    cap = _env_isa_cap()
    if cap is not None:
        lib.pg_set_isa_cap(cap)
    vnni = _env_avx_vnni()
    if vnni is not None:
        lib.pg_set_avx_vnni(vnni)
    one = _env_one_stream()
    if one is not None:
        lib.pg_set_one_stream(one)
    dot = _env_bf16_dot()
    if dot is not None:
        if not lib.pg_set_bf16_amx(int(dot == "amx")) and dot == "amx" and lib.pg_isa() >= ISA_TIERS.index("avx512_bf16"):
            log.warning("PRESCIENT_BF16_DOT=amx: this CPU or OS has no AMX-BF16 tiles; bf16 weights run on FMAs")
        if dot != "amx":
            lib.pg_set_bf16_fma(int(dot == "fma"))
    if _env_choice("PRESCIENT_ATTN_AMX", ("0", "1")) == "1" and not lib.pa_set_amx(1):
        log.warning("PRESCIENT_ATTN_AMX=1: no AMX-BF16 tiles here (tier, CPU, OS, or PRESCIENT_BF16_DOT=dp|fma); q.K runs on FMAs")
    spin = os.environ.get("PRESCIENT_GEMV_SPIN_US")
    if spin:
        parts = [int(p) for p in spin.split(",")]
        lib.pg_set_spin_us(parts[0], parts[1] if len(parts) > 1 else 3000)


def _load_library() -> None:
    """Compile (or find in the cache) and load the .so once; on failure record why, warn once."""
    global _lib_tried, _lib_error, _so_path
    with _lock:
        if _lib_tried:
            return
        _env_isa_cap()  # a bad PRESCIENT_ISA raises here, on every call, before anything loads
        _env_avx_vnni()
        _env_one_stream()
        _lib_tried = True
        errors = []
        cc = _compiler()
        if cc is None:
            errors.append("no C compiler (gcc/cc/$CC) on PATH")
        else:
            for flags in _flag_sets():
                so = _so_path_for(cc, flags)
                try:
                    if not so.exists():
                        _compile(cc, flags, so)
                    try:
                        lib = ctypes.CDLL(str(so))
                    except OSError:  # a damaged cache entry: rebuild it once
                        _compile(cc, flags, so)
                        lib = ctypes.CDLL(str(so))
                    _bind(lib)
                    _so_path = str(so)
                    _touch_and_prune(so)
                    _apply_env(_lib)
                    return
                except Exception as e:  # noqa: BLE001 - any failure means "try next / fall back"
                    errors.append(f"{' '.join(flags)}: {e}")
        _lib_error = "; ".join(errors)
        log.warning("prescient cpu_linear: C kernel unavailable, falling back to F.linear (%s)",
                    _lib_error)


class LazySymbol:
    """One function of the library with its ctypes signature, bound on first use (building the .so
    then); `get()` is it, or None where the library cannot be had (the caller's fallback then)."""

    def __init__(self, name: str, argtypes: list, restype):
        self.name, self.argtypes, self.restype = name, argtypes, restype
        self._fn, self._tried = None, False

    def get(self):
        if not self._tried:
            self._tried = True
            lib = library()
            if lib is not None:
                fn = getattr(lib, self.name)
                fn.argtypes, fn.restype = self.argtypes, self.restype
                self._fn = fn
        return self._fn


def library() -> Optional[ctypes.CDLL]:
    """The loaded .so (compiled on first call) whatever PRESCIENT_CPU_GEMV says, or None when it
    cannot be built; for the other kernels it holds (cpu_attention)."""
    if not _lib_tried:
        _load_library()
    return _lib


def _load() -> None:
    """Enable the GEMV: load the .so unless PRESCIENT_CPU_GEMV=0."""
    global _tried, _why_not, _fn
    with _lock:
        if _tried:
            return
        if os.environ.get("PRESCIENT_CPU_GEMV", "1") in ("0", "false", "off"):
            _why_not = "disabled by PRESCIENT_CPU_GEMV=0"
            log.info("prescient cpu_linear: %s; using F.linear", _why_not)
        else:
            _load_library()
            if _lib is not None:
                _fn = _lib.pg_linear_w
            else:
                _why_not = _lib_error
        _tried = True


def available() -> bool:
    """True when the compiled kernel is loaded (compiles it on first call)."""
    if not _tried:
        _load()
    return _fn is not None


def kernel_info() -> dict:
    """What is in use: {'available', 'isa', 'threads', 'so', 'reason'} and pool counters:
    'pool_calls' (calls split over the pool) and 'worker_share' (fraction of their row chunks
    the worker threads ran: about (n - 1) / n with n threads when the workers keep up, near 0
    when they rarely get a core, e.g. on an oversubscribed machine)."""
    ok = available()
    info = {"available": ok, "so": _so_path, "reason": _why_not}
    if ok:
        info["isa"] = _ISA_NAMES[_lib.pg_isa()]
        info["avx_vnni"] = bool(_lib.pg_avx_vnni())
        # aarch64: the int8 kernels on SDOT (the block formats' rows, cpu_qgemv_neon.c, and the
        # K-quants', cpu_qgemv_k.c); always False on x86
        info["neon_dot"] = bool(_lib.pg_neon_dot())
        # the small-M rows read one weight stream at a time, attention items whole cache rows
        # (pg_one_stream; the same bits)
        info["one_stream"] = bool(_lib.pg_one_stream())
        # how tier avx512_bf16 computes vdpbf16ps's products ("dp": the instruction, "fma": two
        # FMAs, the same bits); None below it
        info["bf16_dot"] = ("fma" if _lib.pg_bf16_fma() else "dp") if info["isa"] == "avx512_bf16" else None
        # bf16 weights packed from now on get an AMX copy and run on the tiles (cpu_gemv_amx.c)
        info["bf16_amx"] = bool(_lib.pg_bf16_amx())
        # a bf16 cache's q.K on the tiles too (PRESCIENT_ATTN_AMX=1, cpu_attention.c)
        info["attn_amx"] = bool(_lib.pa_set_amx(-1))
        info["threads"] = _lib.pg_num_threads()
        st = (ctypes.c_uint64 * 3)()
        _lib.pg_stats(st)
        info["pool_calls"] = st[0]
        info["worker_share"] = st[1] / st[2] if st[2] else None
    return info


def core_speed(us: int = 2000) -> tuple[Optional[float], Optional[float]]:
    """The calling core now, each probe run for about ``us`` microseconds: (its clock in GHz, by a
    chain of dependent adds: pg_clock_ghz; its fp32 multiply-add rate in GFLOP/s, twelve chains:
    pg_vector_gflops, which also sees a host's other hyperthread sharing the vector pipes). None
    for a probe without the library, or on an ISA the clock has no add chain for. A shared host's
    vCPU moves (1.9-3.7 GHz within a minute on the Zen 4 host): the benchmarks print both beside
    their figures."""
    lib = library()
    if lib is None:
        return None, None
    ghz, gflops = float(lib.pg_clock_ghz(int(us))), float(lib.pg_vector_gflops(int(us)))
    return (ghz if ghz > 0 else None), (gflops if gflops > 0 else None)


def neon_dot() -> bool:
    """Whether the int8 kernels run on aarch64's SDOT here (the CPU has the dot-product
    extension): the block formats' rows (cpu_qgemv_neon.c reads the column-lane copy, the bits of
    x86's VNNI and AVX2 rows) and the K-quants' (cpu_qgemv_k.c)."""
    lib = library()
    return lib is not None and bool(lib.pg_neon_dot())


def set_num_threads(n: int) -> int:
    """Threads per call (caller included) of the pool, which the GEMV and cpu_attention share.
    Default: the usable physical cores (kernels/cpu_threads.default_threads)."""
    lib = library()
    return lib.pg_set_num_threads(int(n)) if lib is not None else 1


def set_spin(spin_us: int, yield_us: int = 3000) -> None:
    """After a call, pool workers busy-wait ``spin_us`` (fastest wake-up), then sched_yield()
    for ``yield_us`` (cheap for other threads on the core), then sleep on a futex."""
    lib = library()
    if lib is not None:
        lib.pg_set_spin_us(int(spin_us), int(yield_us))


def _set_isa_cap(cap: int | str) -> str:
    """Cap the tier (an index or a name of ISA_TIERS; 99 = none) and return the tier now in use;
    also caps cpu_attention and cpu_qgemv, which share the .so.  For tests and benchmarks."""
    if isinstance(cap, str):
        cap = ISA_TIERS.index(cap)
    return _ISA_NAMES[library().pg_set_isa_cap(int(cap))]


def _set_avx_vnni(on: bool | None) -> bool:
    """Tier avx2's AVX-VNNI rows on / off (None: the default, on where avx2 is the CPU's best
    tier); returns whether they are in use now (never without the instruction). For tests and
    benchmarks."""
    return bool(library().pg_set_avx_vnni(-1 if on is None else int(bool(on))))


def _set_one_stream(on: bool | None) -> bool:
    """The small-M rows on one weight stream and attention items on whole cache rows (True) or not
    (False), or None: the default (on for x86 CPUs but Intel's); returns whether it is on now. For
    tests and benchmarks."""
    return bool(library().pg_set_one_stream(-1 if on is None else int(bool(on))))


def _set_bf16_fma(on: bool | None) -> bool:
    """Tier avx512_bf16's vdpbf16ps products by two FMAs (True) or by the instruction (False),
    the same bits either way, or None: the default (FMAs on Intel CPUs); returns whether the FMAs
    are in use now (never below the tier). For tests and benchmarks."""
    return bool(library().pg_set_bf16_fma(-1 if on is None else int(bool(on))))


def _set_bf16_amx(on: bool | None) -> bool:
    """bf16 products on AMX tiles (True) or not (False), or None: the default (on where the CPU
    has AMX-BF16 and the OS grants it); returns whether they are on now. Weights packed while
    it is on carry an AMX copy; each linear call (and attention call, with cpu_attention._set_amx)
    takes the tiles only while it is on. For tests and benchmarks."""
    return bool(library().pg_set_bf16_amx(-1 if on is None else int(bool(on))))


def amx_bytes() -> int:
    """Bytes of bf16 weights' AMX copies alive in this process (PackedLinear)."""
    return _amx_held


def pairs_bytes() -> int:
    """Bytes of bf16 weights' row-pair copies alive in this process (PackedLinear)."""
    return _pairs_held


def _set_pairs_min_m(m: int | None) -> int:
    """The fewest inputs whose product reads a bf16 weight's row-pair copy (None: the default,
    5; at most 20 inputs read it); returns the value in force. The same bits either way. For
    tests and benchmarks."""
    return library().pg_set_pairs_min_m(0 if m is None else int(m))


def machine_tiers() -> list[str]:
    """The tiers this CPU can run, lowest first (what the kernel tests sweep)."""
    lib = library()
    if lib is None:
        return []
    cur = lib.pg_isa()
    lib.pg_set_isa_cap(99)
    best = lib.pg_isa()
    lib.pg_set_isa_cap(cur if cur != best else 99)
    return list(ISA_TIERS[:best + 1])


def _set_solo_bytes(n: int) -> None:
    """Testing/tuning hook: matrices under ``n`` weight bytes run on the calling thread only."""
    _lib.pg_set_solo_bytes(int(n))


# --------------------------------------------------------------------------------------------
# Prefill (M > MAX_M) of bf16 weights
# --------------------------------------------------------------------------------------------

#: fp32 bytes of one weight row block of the blocked prefill: half of a 1 MB L2 (Zen 4/5;
#: Intel server cores have 1-2 MB), leaving room for the x and y panels the GEMM streams.
#: 512x576 @ 576x49152 on one core: blocks of 256 rows 292 ms, 512 rows 445 ms.
_PREFILL_BLOCK_BYTES = 512 * 1024
_cpu_flags_bf16: Optional[bool] = None


def _prefill_rows(K: int, N: int) -> int:
    """Weight rows per block: a multiple of 16 in [16, N] near _PREFILL_BLOCK_BYTES."""
    rows = max(16, _PREFILL_BLOCK_BYTES // (4 * K) // 16 * 16)
    return min(rows, N)


def _bf16_gemm_native() -> bool:
    """Whether torch's bf16 GEMM is the fast path: the tier in use (``pg_isa()``, so capped by
    PRESCIENT_ISA / _set_isa_cap) has AVX512_BF16.  Without the .so, the CPU flags decide
    (avx512_bf16 or amx_bf16 on x86, the bf16 extension on aarch64)."""
    global _cpu_flags_bf16
    if _lib is not None:
        return _lib.pg_isa() >= ISA_TIERS.index("avx512_bf16")
    if _cpu_flags_bf16 is None:
        flags = set(_cpu_signature().split())
        _cpu_flags_bf16 = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return _cpu_flags_bf16


def prefill_mode() -> str:
    """How a bf16 weight's M > MAX_M call runs now: 'bf16_gemm' (F.linear) or 'fp32_blocked'."""
    return "bf16_gemm" if _bf16_gemm_native() else "fp32_blocked"


# --------------------------------------------------------------------------------------------
# Packed weights
# --------------------------------------------------------------------------------------------

class PackedLinear:
    """A weight ready for the small-M kernel.  ``__call__(x)``: x [..., in_features] fp32 or
    bf16 on CPU -> y [..., out_features] of x's dtype; M = prod(x.shape[:-1]).  M <= MAX_M runs
    the C kernel (fp32 accumulation), larger M a GEMM (``fallback``: F.linear, or the fp32
    row-block GEMM for a bf16 weight below avx512_bf16); other devices/dtypes or autograd use
    F.linear.
    Inference only: the weight is held detached (a gradient reaches x, never the weight)."""

    __slots__ = ("weight", "bias", "in_features", "out_features", "dtype",
                 "_bias32", "_desc", "_dptr", "_amx", "_pairs", "__weakref__")

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out, in], got {tuple(weight.shape)}")
        if weight.dtype not in _DT:
            raise ValueError(f"weight dtype must be float32 or bfloat16, got {weight.dtype}")
        if weight.device.type != "cpu":
            raise ValueError("PackedLinear is a CPU kernel; weight is on " + str(weight.device))
        self.weight = weight.detach().contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.dtype = self.weight.dtype
        self.bias = None if bias is None else bias.detach().to(self.dtype).contiguous()
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        # The kernel adds the bias in fp32 after fp32 accumulation; it is the weight-dtype
        # bias (what F.linear would use) widened, so kernel and fallback agree.
        self._bias32 = None if self.bias is None else self.bias.to(torch.float32).contiguous()
        # The C side reads weight/bias through raw pointers; self.weight and self._bias32
        # keep that memory alive for as long as this object (and its descriptor) lives.
        self._desc = _WeightDesc(self.weight.data_ptr(),
                                 None if self._bias32 is None else self._bias32.data_ptr(),
                                 _DT[self.dtype], self.out_features, self.in_features)
        self._dptr = ctypes.addressof(self._desc)
        self._amx = self._amx_copy()
        self._pairs = self._pairs_copy() if self._amx is None else None

    def _pairs_copy(self) -> Optional[torch.Tensor]:
        """A bf16 weight's row-pair copy ([N // 2, K // 32, 2, 32]: each 32-element block of rows
        2p and 2p + 1 side by side; pg_linear_pairs), where tier avx512_bf16 multiplies by
        vdpbf16ps on one weight stream a thread (pg_one_stream: AMD's; Intel's default FMA path
        does not read it) and the copies stay within PRESCIENT_REGROUP_MB; the descriptor then
        points to it. At 7-8 inputs the rows as stored read four streams a tile, and on Zen 4
        their multiply-adds did not overlap the read (cpu_gemv.c, tile_bf16_pairs)."""
        global _pairs_held
        N, K = self.out_features, self.in_features
        lib = _lib
        if (self.dtype != torch.bfloat16 or lib is None or _fn is None or K % 32 or N < 2
                or lib.pg_isa() != ISA_TIERS.index("avx512_bf16") or lib.pg_bf16_fma() or not lib.pg_one_stream()):
            return None
        rows = N - N % 2  # an odd last row is read as stored
        nbytes = rows * K * 2
        with _amx_lock:
            if copies_held() + nbytes > copy_budget():
                return None
            _pairs_held += nbytes
        try:
            # a new tensor always (`contiguous` would hand back the weight itself at K == 32)
            copy = huge_pages.empty(nbytes).view(torch.bfloat16).view(rows // 2, K // 32, 2, 32)
            copy.copy_(self.weight[:rows].view(rows // 2, 2, K // 32, 32).transpose(1, 2))
        except BaseException:
            _pairs_release(nbytes)
            raise
        weakref.finalize(self, _pairs_release, nbytes)
        self._desc.rp = copy.data_ptr()
        self._desc.rpl = _RP_PAIRS
        return copy

    def _amx_copy(self) -> Optional[torch.Tensor]:
        """A bf16 weight's copy in the AMX tiles' layout (pg_amx_repack), where the tiles are on
        now and the copies stay within PRESCIENT_REGROUP_MB (default 1024 MiB, as the block
        formats' copies: a copy doubles a weight's memory); the descriptor then points to it."""
        global _amx_held
        if self.dtype != torch.bfloat16 or _lib is None or _fn is None or not _lib.pg_bf16_amx():
            return None
        N, K = self.out_features, self.in_features
        nbytes = _lib.pg_amx_repack_bytes(N, K)
        with _amx_lock:
            if copies_held() + nbytes > copy_budget():
                return None
            _amx_held += nbytes
        try:
            copy = huge_pages.empty(nbytes).view(torch.int16)
            ok = _lib.pg_amx_repack(self.weight.data_ptr(), N, K, copy.data_ptr()) == 0
        except BaseException:
            _amx_release(nbytes)
            raise
        if not ok:
            _amx_release(nbytes)
            return None
        weakref.finalize(self, _amx_release, nbytes)
        self._desc.rp = copy.data_ptr()
        self._desc.rpl = _RP_AMX
        return copy

    def __repr__(self) -> str:
        return (f"PackedLinear(in={self.in_features}, out={self.out_features}, "
                f"dtype={self.dtype}, bias={self.bias is not None})")

    def fallback(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The GEMM path (M > MAX_M, and whenever the kernel can't run): F.linear on the same
        weight, except a bf16 weight on a tier without AVX512_BF16, which runs the fp32
        row-block GEMM (``_blocked_fp32``).  ``out``, when given, must be contiguous, of x's
        dtype, with M*out_features elements; the result is written there and returned."""
        if (self.dtype == torch.bfloat16 and x.dtype in _DT and x.is_cpu and x.numel()
                and not (x.requires_grad and torch.is_grad_enabled()) and not _bf16_gemm_native()):
            return self._blocked_fp32(x, out)
        if x.dtype == self.dtype:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = F.linear(x.to(self.dtype), self.weight, self.bias).to(x.dtype)
        if out is not None:
            out.copy_(y.reshape(out.shape))
            return out
        return y

    def _blocked_fp32(self, x: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        """y = x @ W^T (+ b) in fp32 for a bf16 W: x [..., K] fp32/bf16 -> y [..., N] of x's
        dtype.  W is widened ``rows`` rows at a time into one fp32 buffer [rows, K] (kept in L2)
        and each block is multiplied into its output columns, so the only fp32 copies are x,
        that buffer and, for a bf16 y, one [M, rows] block of the product."""
        K, N = self.in_features, self.out_features
        M = x.numel() // K
        shape = tuple(x.shape[:-1]) + (N,)
        x32 = x.reshape(M, K).to(torch.float32)                       # [M, K]
        if out is not None:
            if out.dtype != x.dtype or out.numel() != M * N or not out.is_contiguous():
                raise ValueError("out must be contiguous, of x's dtype, with M*out_features "
                                 "elements")
            y = out.view(M, N)                                        # [M, N]
        else:
            y = torch.empty(M, N, dtype=x.dtype)
        rows = _prefill_rows(K, N)
        wbuf = torch.empty(rows, K, dtype=torch.float32)             # [rows, K]
        # A bf16 y gets each block through an fp32 [M, rows] buffer, rounded once on copy.
        ybuf = None if y.dtype == torch.float32 else torch.empty(M, rows, dtype=torch.float32)
        b32 = self._bias32
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            wb = wbuf[:n1 - n0]
            wb.copy_(self.weight[n0:n1])
            dst = y[:, n0:n1] if ybuf is None else ybuf[:, :n1 - n0]
            if b32 is None:
                torch.mm(x32, wb.T, out=dst)
            else:
                torch.addmm(b32[n0:n1], x32, wb.T, out=dst)
            if ybuf is not None:
                y[:, n0:n1].copy_(dst)
        return out if out is not None else y.view(shape)

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = x @ weight.T (+ bias).  ``out`` (contiguous, x's dtype, M*out_features
        elements) saves the ~1 us allocation.  Written for per-call overhead: a decode step
        makes ~200 of these calls, so every tensor attribute read here costs ~60 ns."""
        K = self.in_features
        N = self.out_features
        if x.dim() == 2:
            M, kx = x.shape
            shape = (M, N)
        else:
            kx = x.shape[-1]
            M = x.numel() // kx if kx else 0
            shape = tuple(x.shape[:-1]) + (N,)
        if kx != K:
            raise ValueError(f"x has {kx} features, weight expects {K}")
        xdt = _DT.get(x.dtype)
        if (M > MAX_M or M == 0 or xdt is None or _fn is None or not x.is_cpu
                or (x.requires_grad and torch.is_grad_enabled())):
            return self._slow(x, out)
        if not x.is_contiguous():
            x = x.contiguous()
        if out is None:
            out = x.new_empty(shape)
        elif out.dtype != x.dtype or out.numel() != M * N or not out.is_contiguous():
            raise ValueError("out must be contiguous, of x's dtype, with M*out_features elements")
        rc = _fn(self._dptr, x.data_ptr(), out.data_ptr(), M, xdt)
        if rc:
            raise RuntimeError(f"pg_linear failed with code {rc}")
        return out

    def _slow(self, x: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        if not _tried:  # built directly, not through pack_weight: load now and retry
            _load()
            if _fn is not None:
                return self(x, out)
        return self.fallback(x, out)


def pack_weight(w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                dtype: Optional[torch.dtype] = None) -> PackedLinear:
    """Prepare ``w`` [out, in] (and an optional ``bias`` [out]) for the small-M kernel.

    ``dtype`` (float32 or bfloat16) converts the weight once here; by default it keeps
    ``w.dtype`` (float16 and other dtypes become float32).  Also builds/loads the C kernel, so
    call it at model load time rather than in the first decode step."""
    if dtype is None:
        dtype = w.dtype if w.dtype in _DT else torch.float32
    if dtype not in _DT:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    if not _tried:
        _load()
    return PackedLinear(w.detach().to(dtype), bias)


def build_signature() -> str:
    """What a measurement on these kernels depends on: the CPU, the compiled .so (its name is a
    hash of sources, flags and compiler), the ISA tier in use (and tier avx2's AVX-VNNI rows,
    tier avx512_bf16's bf16 products, the one-stream rows). Cost tables are keyed by it."""
    info = kernel_info()
    isa = (f"{info.get('isa')}{'+avxvnni' if info.get('avx_vnni') else ''}"
           f"{'+bf16fma' if info.get('bf16_dot') == 'fma' else ''}{'+bf16amx' if info.get('bf16_amx') else ''}"
           f"{'+onestream' if info.get('one_stream') else ''}")
    return "|".join(str(x) for x in (_cpu_signature(), info.get("so"), isa, info.get("threads"),
                                      torch.__version__, len(os.sched_getaffinity(0))))
