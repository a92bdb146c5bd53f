"""QuantLinear: a linear layer whose weight stays in GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
Q6_K), for CPU decode without ever widening the weight to bf16/fp32 in memory.

Small M (decode M=1, speculative verify M<=16) runs the native kernels of kernels/cpu_qgemv.c
(through ``pg_linear_w`` and a ``pg_weight_t`` descriptor built once, as ``PackedLinear``), which
stream the blocks as stored.  A call of more than MAX_M rows dequantizes the weight a tile of
rows at a time into one reused fp32 buffer (``pq_dequantize_rows``: every format of the
library's table, vectorized per ISA tier) and multiplies it with ``torch.addmm`` into the
matching output columns: fp32 GEMM speed without a full fp32 copy of the weight.  Without the
C library (no compiler, ``PRESCIENT_CPU_GEMV=0``) or for a format it has no kernels for, every
call takes the tiled path, with kernels/quant_reference.py's dequantizer.  The runtime
(runtime/linear.QuantizedLinear) sends prefill through the native kernel too, MAX_M rows a call,
so there the tiled path is only that fallback.

Numerics: fp32 accumulation.  The native small-M kernels multiply either fp32 activations
(exactly the dequantized W) or, where faster, activations quantized to int8 blocks of 32 as
llama.cpp does (``act_block`` says which; kernels/cpu_qgemv.c's header gives the accuracy).
The tiled path never quantizes activations.  y has x's dtype (bf16 rounded to nearest even).

    lin = QuantLinear(blocks, "q4_0", N, K, bias=None)   # blocks uint8 [N, row_bytes]
    y = lin(x)                                           # x [..., K] fp32/bf16 -> [..., N]
    w = lin.dequantize()                                 # fp32 [N, K] (tests, export)
    e = lin.dequantize_rows(ids)                         # [len(ids), K]: embedding lookups
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Optional, Sequence, Union

import torch

from prescient.kernels import cpu_linear, huge_pages
from prescient.kernels.quant_reference import QTYPES, dequantize as _ref_dequantize, row_bytes

MAX_M = cpu_linear.MAX_M
_DT = {torch.float32: 0, torch.bfloat16: 1}
_MODES = {"auto": 0, "float": 1, "int8": 2}
#: fp32 bytes of one tile of the tiled path (about L2-sized, so the GEMM reads it hot).
_TILE_BYTES = 2 << 20

_lock = threading.Lock()
_qlib_tried = False
_qlib: Optional[ctypes.CDLL] = None
_pqk_mode = None  # pqk_set_mode(0 default | 1 fp32) of cpu_qgemv_k.c, if present


def _lib() -> Optional[ctypes.CDLL]:
    """The .so with the pq_* entry points bound, or None (no compiler, GEMV disabled)."""
    global _qlib_tried, _qlib
    if _qlib_tried:
        return _qlib
    with _lock:
        if not _qlib_tried:
            lib = cpu_linear.library() if cpu_linear.available() else None
            if lib is not None:
                try:
                    vp, ci = ctypes.c_void_p, ctypes.c_int
                    lib.pq_dequantize_rows.argtypes = [vp, ci, ci, vp]
                    lib.pq_dequantize_ids.argtypes = [vp, vp, ci, vp]
                    lib.pq_repack.argtypes = [vp, vp, ci]
                    lib.pq_repack.restype = ci
                    lib.pq_repack_bytes.argtypes = [vp, ci]
                    lib.pq_repack_bytes.restype = ctypes.c_size_t
                    for name in ("pq_set_mode", "pq_supported", "pq_act_block", "pq_set_par_prep"):
                        getattr(lib, name).argtypes = [ci]
                    for name in ("pq_dequantize_rows", "pq_dequantize_ids", "pq_set_mode",
                                 "pq_supported", "pq_act_block", "pq_set_par_prep"):
                        getattr(lib, name).restype = ci
                except AttributeError:  # an older .so without the block-format kernels
                    lib = None
                # The K-quants' mode switch (kernels/cpu_qgemv_k.c), when that file provides it.
                global _pqk_mode
                if lib is not None and hasattr(lib, "pqk_set_mode"):
                    _pqk_mode = lib.pqk_set_mode
                    _pqk_mode.argtypes = [ctypes.c_int]
                    _pqk_mode.restype = ctypes.c_int
            _qlib = lib
            _qlib_tried = True
    return _qlib


# The regrouped copies share one budget with bf16 weights' AMX copies (cpu_linear.copy_budget:
# PRESCIENT_REGROUP_MB, default 1024 MiB; 0: none): a copy doubles a weight's memory, so a large
# model gets copies for its first layers only.
_regroup_held = 0  # bytes of regrouped copies alive
#: The copy's layouts (pg_weight_t.rpl, cpu_dispatch.h): "groups" (each full 16-block group in
#: the block-lane registers' order; the AVX-512 int8 rows read it, the bits of the blocks) and
#: "cl" (16 output columns in a vector's lanes; the VNNI and AVX2 int8 rows read it,
#: cpu_qgemv_cl.c, and aarch64's SDOT rows, cpu_qgemv_neon.c: bits of its own, the same at every
#: M and on each of them).
LAYOUTS = {"groups": 0, "cl": 1}
_best_layout: Optional[str] = None  # the CPU's, asked once (machine_tiers moves the ISA cap)


def default_layout() -> Optional[str]:
    """The copy this CPU's best tier reads: "cl" with AVX-512 VNNI (avx512_vnni, avx512_bf16) or
    AVX2 at best, or on aarch64 with SDOT (cpu_qgemv_neon.c), "groups" with AVX-512 alone (whose
    AVX2 cap then reads the blocks), None without SIMD rows (the portable ones read the blocks).
    PRESCIENT_REGROUP_LAYOUT=groups gives the blocks' bits instead (to compare): "groups" where
    AVX-512 reads it, no copy on an AVX2-only CPU (its rows then read the blocks)."""
    global _best_layout
    want = os.environ.get("PRESCIENT_REGROUP_LAYOUT", "").strip().lower()
    if want and want not in LAYOUTS:  # asked every time: a bad value never passes silently
        raise ValueError(f"PRESCIENT_REGROUP_LAYOUT={want!r}: expected one of {', '.join(LAYOUTS)}")
    if _best_layout is None:
        tiers = cpu_linear.machine_tiers()
        _best_layout = ("cl" if "avx512_vnni" in tiers else "groups" if "avx512" in tiers
                        else "cl" if "avx2" in tiers or cpu_linear.neon_dot() else "")
    if want == "groups" and _best_layout:
        return "groups" if _best_layout == "groups" or "avx512" in cpu_linear.machine_tiers() else None
    return _best_layout or None


def _regroup_wanted(nbytes: int) -> bool:
    """Whether a new copy of nbytes stays within PRESCIENT_REGROUP_MB with the copies held (these
    and bf16 weights' AMX copies: cpu_linear.copies_held, one budget)."""
    return 0 < nbytes and cpu_linear.copies_held() + nbytes <= cpu_linear.copy_budget()


def regrouped_bytes() -> int:
    """Bytes of regrouped weight copies alive in this process (QuantLinear.regroup)."""
    return _regroup_held


cpu_linear._other_copies.append(regrouped_bytes)  # one budget with the AMX copies


def _release(nbytes: int) -> None:
    global _regroup_held
    with _lock:
        _regroup_held -= nbytes


def _wdt(qtype: str) -> int:
    qtype = qtype.lower()
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {', '.join(QTYPES)}")
    return QTYPES[qtype][0]


def native_available(qtype: str) -> bool:
    """True when the small-M kernel of ``qtype`` runs natively (else the tiled reference)."""
    lib = _lib()
    return lib is not None and bool(lib.pq_supported(_wdt(qtype)))


def act_block(qtype: str) -> int:
    """How the native kernel of ``qtype`` multiplies activations at the ISA tier in use: 0 as
    fp32; n > 0: quantized to int8 with one scale per n elements (an upper bound for the
    K-quants: and on aarch64 for a weight without the column-lane copy, which SDOT's rows need,
    so it runs in fp32); -1 when it does not run natively."""
    lib = _lib()
    return -1 if lib is None else int(lib.pq_act_block(_wdt(qtype)))


def set_mode(mode: str) -> str:
    """Choose the native kernels' path: "auto" (each tier's measured default), "float" (fp32
    activations everywhere) or "int8" (int8 activations wherever the tier has them). Returns the
    previous mode. For tests and benchmarks; process-wide."""
    lib = _lib()
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {', '.join(_MODES)}")
    if lib is None:
        return "auto"
    if _pqk_mode is not None:  # the K-quants know "float" (1) and their default (0)
        _pqk_mode(1 if mode == "float" else 0)
    old = lib.pq_set_mode(_MODES[mode])
    return {v: k for k, v in _MODES.items()}[old]


def set_pooled_prep(on: bool) -> bool:
    """Whether a native call of >= 4 rows prepares its activations (bf16 widened, int8 blocks) on
    the kernel pool's threads, as the first phase of its pool call (True, the default), or on the
    calling thread first. The same bits either way; returns the previous setting. For tests and
    benchmarks; process-wide."""
    lib = _lib()
    return True if lib is None else bool(lib.pq_set_par_prep(int(on)))


class QuantLinear:
    """y = x @ W^T (+ bias) for W [N, K] held as GGUF blocks; inference only (a gradient reaches
    x through the tiled path's torch ops, never W)."""

    __slots__ = ("blocks", "qtype", "in_features", "out_features", "weight_bytes", "bias",
                 "_wdt", "_desc", "_dptr", "_native", "_deq_native", "_regrouped", "_layout")

    def __init__(self, blocks: torch.Tensor, qtype: str, N: int, K: int,
                 bias: Optional[torch.Tensor] = None):
        qtype = qtype.lower()
        self._wdt = _wdt(qtype)
        if blocks.dtype != torch.uint8:
            raise ValueError(f"blocks must be uint8, got {blocks.dtype}")
        if blocks.device.type != "cpu":
            raise ValueError("QuantLinear is a CPU kernel; blocks are on " + str(blocks.device))
        rb = row_bytes(qtype, K)
        if blocks.numel() != N * rb:
            raise ValueError(f"{qtype} [{N}, {K}] needs {N} x {rb} bytes, got {tuple(blocks.shape)}")
        # [N, row_bytes] blocks, row-major (cpu_formats.h); the C side reads them through raw
        # pointers, so this object keeps the tensor (and the bias) alive.
        self.blocks = blocks.detach().contiguous().reshape(N, rb)
        self.qtype = qtype
        self.in_features, self.out_features = K, N
        self.weight_bytes = self.blocks.numel()
        self.bias = None
        if bias is not None:
            if bias.shape != (N,):
                raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
            self.bias = bias.detach().to(torch.float32).contiguous()
        self._desc = cpu_linear._WeightDesc(self.blocks.data_ptr(),
                                            None if self.bias is None else self.bias.data_ptr(),
                                            self._wdt, N, K)
        self._dptr = ctypes.addressof(self._desc)
        lib = _lib()
        self._native = lib is not None and bool(lib.pq_supported(self._wdt))
        # pq_dequantize_rows / _ids run every format of the library's table (cpu_dispatch.c)
        self._deq_native = self._native
        self._regrouped = None
        self._layout = None
        # a copy where this CPU's kernels read one (default_layout), within the budget
        layout = default_layout() if self._native else None
        if layout and _regroup_wanted(lib.pq_repack_bytes(self._dptr, LAYOUTS[layout])):
            self.regroup()

    def regroup(self, on: bool = True, layout: Optional[str] = None) -> bool:
        """Hold (or drop) a copy of W laid out for the SIMD int8 kernels (cpu_qgemv.c's
        q32_repack; LAYOUTS; `layout` None: the held copy's, else default_layout()). "groups"
        (AVX-512) gives the blocks' bits faster; "cl" (AVX-512 VNNI, AVX2, aarch64's SDOT) gives the
        column-lane rows, faster at every M, with bits of their own, the same at every M, so a weight
        keeps the copy it got at construction (on a CPU with AVX2, AVX-512 or SDOT, for Q8_0 / Q4_0 / Q4_1, within
        PRESCIENT_REGROUP_MB for the process: cpu_linear.copy_budget). As large as W ("cl": N rounded up to 16). Returns whether
        a copy is held. Not while another thread runs this weight (the kernels read the copy
        through the descriptor)."""
        global _regroup_held
        layout = layout or self._layout or default_layout()
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
        tiers = set(cpu_linear.machine_tiers())
        cl_read = {"avx512_vnni", "avx2"} & tiers or cpu_linear.neon_dot()
        if (layout == "cl" and not cl_read) or (layout == "groups" and "avx512" not in tiers):
            layout = None  # no kernel here reads it
        if not on or not self._native or layout is None or self._layout != layout:
            self._desc.rp = None  # before the copy can be freed
            self._regrouped = None
            self._layout = None
            if not on or not self._native or layout is None:
                return False
        if self._regrouped is None:
            code = LAYOUTS[layout]
            nbytes = _qlib.pq_repack_bytes(self._dptr, code)
            if not nbytes:
                return False
            out = huge_pages.empty(nbytes)
            if _qlib.pq_repack(self._dptr, out.data_ptr(), code) != 0:
                return False
            with _lock:
                _regroup_held += out.numel()
            weakref.finalize(out, _release, out.numel())
            self._regrouped = out
            self._layout = layout
            self._desc.rpl = code
            self._desc.rp = out.data_ptr()
        return True

    @property
    def regrouped(self) -> bool:
        """Whether the kernels read a copy of W (at the SIMD tiers; `layout` says which)."""
        return self._regrouped is not None

    @property
    def layout(self) -> Optional[str]:
        """The copy's layout ("groups" or "cl"), None without one."""
        return self._layout

    @property
    def native(self) -> bool:
        """Whether this format's small-M kernel runs natively here (else the tiled path)."""
        return self._native

    def __repr__(self) -> str:
        return (f"QuantLinear({self.qtype}, in={self.in_features}, out={self.out_features}, "
                f"bias={self.bias is not None}, native={self._native})")

    # ---- weights ----------------------------------------------------------------------------

    def _dequant_into(self, n0: int, n1: int, buf: torch.Tensor) -> torch.Tensor:
        """Rows n0..n1-1 of W as fp32 [n1 - n0, K] in buf (the C dequantizer, or the reference)."""
        if self._deq_native and _qlib.pq_dequantize_rows(self._dptr, n0, n1, buf.data_ptr()) == 0:
            return buf
        buf.copy_(_ref_dequantize(self.blocks[n0:n1], self.qtype, n1 - n0, self.in_features))
        return buf

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as a dense [N, K] tensor of ``dtype`` (a full copy: for tests and export)."""
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        return self._dequant_into(0, self.out_features, w).to(dtype)

    def dequantize_rows(self, ids: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        """Rows ``ids`` of W as fp32 [len(ids), K]: the lookups of a quantized embedding table."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).contiguous()
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        # the C call checks the ids itself: the range is checked here only where it refused (a
        # decode step's lookup then makes no reductions of its own)
        if (self._deq_native
                and _qlib.pq_dequantize_ids(self._dptr, ids.data_ptr(), ids.numel(), out.data_ptr()) == 0):
            return out
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must lie in [0, {self.out_features})")
        return _ref_dequantize(self.blocks[ids], self.qtype, ids.numel(), self.in_features)

    # ---- forward ----------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = x @ W^T (+ bias): x [..., K] fp32/bf16 on CPU -> [..., N] of x's dtype.  ``out``
        (contiguous, x's dtype, M * N elements) skips the allocation.  Written for per-call
        overhead, as PackedLinear: a decode step makes ~200 of these calls."""
        K, N = self.in_features, self.out_features
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
        if (M > MAX_M or M == 0 or xdt is None or not self._native or not x.is_cpu
                or (x.requires_grad and torch.is_grad_enabled())):
            return self._slow(x, out, M, shape)
        if not x.is_contiguous():
            x = x.contiguous()
        if out is None:
            out = x.new_empty(shape)
        elif out.dtype != x.dtype or out.numel() != M * N or not out.is_contiguous():
            raise ValueError("out must be contiguous, of x's dtype, with M*out_features elements")
        rc = _qlib.pg_linear_w(self._dptr, x.data_ptr(), out.data_ptr(), M, xdt)
        if rc:
            raise RuntimeError(f"pq_linear_w failed with code {rc}")
        return out

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T for x [M, K] fp32/bf16 with any M (a prefill chunk) on the native kernels,
        MAX_M rows a kernel call -- each row the bits of a lone decode step -- in one library
        call (pg_linear_rows: the chunks' activations prepared in parallel, their column tiles
        spread over the pool at once).  Without native kernels (or under autograd), __call__."""
        M = x.shape[0]
        xdt = _DT.get(x.dtype)
        if (M <= MAX_M or xdt is None or not self._native or x.dim() != 2 or not x.is_cpu
                or (x.requires_grad and torch.is_grad_enabled())):
            return self(x)
        if x.shape[1] != self.in_features:
            raise ValueError(f"x has {x.shape[1]} features, weight expects {self.in_features}")
        x = x.contiguous()
        out = x.new_empty(M, self.out_features)
        rc = _qlib.pg_linear_rows(self._dptr, x.data_ptr(), out.data_ptr(), M, xdt)
        if rc:
            raise RuntimeError(f"pg_linear_rows failed with code {rc}")
        return out

    def _slow(self, x: torch.Tensor, out: Optional[torch.Tensor], M: int, shape) -> torch.Tensor:
        if not x.is_cpu:
            raise ValueError("QuantLinear is a CPU kernel; x is on " + str(x.device))
        if x.dtype not in _DT:
            raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
        if out is not None and (out.dtype != x.dtype or out.numel() != M * self.out_features
                                or not out.is_contiguous()):
            raise ValueError("out must be contiguous, of x's dtype, with M*out_features elements")
        y = self._tiled(x.reshape(M, self.in_features)).reshape(shape)
        if out is not None:
            out.copy_(y.reshape(out.shape))
            return out
        return y

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype: W dequantized a row tile at a time into one fp32
        buffer, each tile multiplied into its output columns (M > MAX_M, and the fallback)."""
        M, K = x.shape
        N = self.out_features
        x32 = x.to(torch.float32)
        y = torch.empty(M, N, dtype=torch.float32)
        if M == 0:
            return y.to(x.dtype)
        rows = max(16, min(N, _TILE_BYTES // (4 * K)) // 16 * 16)
        # One buffer for every tile, except under autograd: the matmul keeps its tile for the
        # backward pass, and the C dequantizer's writes would go unseen by version counters.
        grad = x.requires_grad and torch.is_grad_enabled()
        buf = None if grad else torch.empty(min(rows, N), K, dtype=torch.float32)
        if x.dtype == torch.bfloat16 and not grad and cpu_linear._bf16_gemm_native():
            return self._tiled_bf16(x, rows, buf)
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            tile = torch.empty(n1 - n0, K, dtype=torch.float32) if grad else buf[:n1 - n0]
            w = self._dequant_into(n0, n1, tile)
            if self.bias is not None:
                y[:, n0:n1] = torch.addmm(self.bias[n0:n1], x32, w.T)
            else:
                y[:, n0:n1] = x32 @ w.T
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _tiled_bf16(self, x: torch.Tensor, rows: int, buf: torch.Tensor) -> torch.Tensor:
        """The tiles as bf16 and a bf16 GEMM, for a bf16 x where the tier has AVX512_BF16: there
        oneDNN's bf16 GEMM is ~4x its fp32 one (512x576 @ 576x1536: 2.3 vs 9.3 ms). Each weight is
        rounded once to bf16 (relative 2^-9, far under the blocks' own quantization step)."""
        M, N = x.shape[0], self.out_features
        y = torch.empty(M, N, dtype=torch.bfloat16)
        wb = torch.empty(buf.shape, dtype=torch.bfloat16)
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            tile = wb[:n1 - n0]
            tile.copy_(self._dequant_into(n0, n1, buf[:n1 - n0]))
            y[:, n0:n1] = x @ tile.T if bias is None else torch.addmm(bias[n0:n1], x, tile.T)
        return y
