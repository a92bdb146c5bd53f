"""Fast CPU tree_attention: the ctypes wrapper of ``cpu_attention.c``.

The C kernel lives in the same .so as the GEMV (``cpu_linear`` builds, caches and loads it;
one library, one thread pool) and computes the whole op, for every sequence of the batch, in
one call: ``tree_attention`` here has exactly the signature and semantics of
``reference.tree_attention`` (docs/CONTRACTS.md) for float32 and bfloat16 CPU tensors.
``prescient.kernels.ops.tree_attention`` routes CPU calls here; this module never falls
back by itself, so calling it directly when ``available()`` is False raises RuntimeError.

Numerics: fp32 online softmax and fp32 accumulation; bf16 q.k products are exact in fp32
(vdpbf16ps or widened FMAs), P.V is fp32, a bf16 output is rounded once to nearest even.
The work is split over the pool the same way whatever the thread count, so results do not
depend on it.  One difference from the reference: a query row that sees no position at all
(possible only with an all-zero mask_bits row and no prefix) gets zeros, not NaN.

Threads: the pool of cpu_linear (caller + 1 worker by default; ``cpu_linear.set_num_threads``
or ``PRESCIENT_GEMV_THREADS`` size it for both kernels).  Small calls run on the caller only,
and so does every call made while torch runs more than one intra-op thread (the model's
prefill-sized forwards): torch's OpenMP worker then spins on the pool's core, and sharing it
made a 512 + 64-token prefill chunk 20x slower on a busy 2-core machine.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import Optional

import torch

from prescient.kernels import cpu_linear

log = logging.getLogger(__name__)

_DT = {torch.float32: 0, torch.bfloat16: 1}
_C_VERSION = 2  # must match PA_VERSION in cpu_attention.c
# pa_args_t in cpu_attention.c: 8 addresses, 2 q strides, 10 sizes, flags (int64), the scale
# (double).  struct.pack builds a fresh bytes object per call: one ctypes argument, and
# thread-safe.
_ARGS = struct.Struct("=21qd")
_SOLO = 1  # PA_SOLO
_INT32 = torch.int32
_torch_threads = torch.get_num_threads

_fn = None  # pa_tree_attention once bound
_tried = False
_why_not: Optional[str] = None

# C error codes (pa_err: -(code + 8 * sequence index)).
_ERRORS = {
    1: "bad sizes",
    2: "cu_seqlens_q decreases",
    3: "context_lens must be >= the sequence's query length and <= max_blocks * block_size",
    4: "block_tables holds a block id outside [0, num_blocks)",
    5: "mask_bits has fewer than q_len bits per row",
    6: "out of memory",
    7: "cu_seqlens_q must start at 0 and end at num_tokens",
}


def _bind() -> None:
    global _fn, _tried, _why_not
    _tried = True
    lib = cpu_linear.library()
    if lib is None:
        _why_not = cpu_linear._lib_error or "the C library did not load"
        log.info("prescient cpu_attention: C kernel unavailable (%s)", _why_not)
        return
    lib.pa_version.restype = ctypes.c_int
    lib.pa_version.argtypes = []
    if lib.pa_version() != _C_VERSION:
        _why_not = f"cpu_attention.c version {lib.pa_version()}, expected {_C_VERSION}"
        log.warning("prescient cpu_attention: %s", _why_not)
        return
    lib.pa_set_solo_work.argtypes = [ctypes.c_int]
    lib.pa_set_solo_work.restype = None
    fn = lib.pa_tree_attention
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_int
    _fn = fn


def available() -> bool:
    """True when the C kernel is loaded (builds the .so on first call)."""
    if not _tried:
        _bind()
    return _fn is not None


def why_not() -> Optional[str]:
    """Why the kernel is unavailable, or None."""
    available()
    return _why_not


def _set_solo_work(n: int) -> None:
    """Testing/tuning hook: calls with less work (query rows x context positions) than ``n``
    run on the calling thread only (default 2048)."""
    if available():
        cpu_linear.library().pa_set_solo_work(int(n))


def _bad(msg: str) -> ValueError:
    return ValueError(f"cpu tree_attention: {msg}")


def tree_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], roped
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, KV length after this step's tokens
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    mask_bits: torch.Tensor | None,  # [num_tokens, num_words] int32, None = causal
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """reference.tree_attention in one C call.  Raises ValueError naming a bad argument.
    Written for per-call overhead (it runs once per layer): plain attribute reads, one
    struct.pack, one ctypes argument."""
    fn = _fn
    if fn is None:
        if not available():
            raise RuntimeError(f"cpu tree_attention kernel unavailable: {_why_not}")
        fn = _fn
    dtype = q.dtype
    dt = _DT.get(dtype)
    if dt is None:
        raise _bad(f"q must be float32 or bfloat16, not {dtype}")
    if k_cache.dtype is not dtype or v_cache.dtype is not dtype:
        raise _bad(f"k_cache/v_cache dtype ({k_cache.dtype}, {v_cache.dtype}) must be q's ({dtype})")
    try:
        num_tokens, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
        num_seqs, max_blocks = block_tables.shape
    except ValueError:
        raise _bad(f"q must be [num_tokens, num_heads, head_dim], the caches [num_blocks, "
                   f"block_size, num_kv_heads, head_dim] and block_tables [num_seqs, max_blocks]; "
                   f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(block_tables.shape)}"
                   ) from None
    if v_cache.shape != k_cache.shape:
        raise _bad(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    if kv_dim != head_dim:
        raise _bad(f"head_dim of q ({head_dim}) and of the caches ({kv_dim}) differ")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise _bad(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.dtype is not _INT32 or context_lens.dtype is not _INT32 \
            or cu_seqlens_q.dtype is not _INT32:
        raise _bad("block_tables, context_lens and cu_seqlens_q must be int32, got "
                   f"{block_tables.dtype}, {context_lens.dtype}, {cu_seqlens_q.dtype}")
    if context_lens.shape != (num_seqs,) or cu_seqlens_q.shape != (num_seqs + 1,):
        raise _bad(f"block_tables has {num_seqs} rows: context_lens must be [{num_seqs}] and "
                   f"cu_seqlens_q [{num_seqs + 1}], got {tuple(context_lens.shape)} and "
                   f"{tuple(cu_seqlens_q.shape)}")
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and block_tables.is_cpu
            and context_lens.is_cpu and cu_seqlens_q.is_cpu):
        raise _bad("all tensors must be on the CPU")
    if mask_bits is None:
        mask_ptr = num_words = 0
    else:
        if mask_bits.dtype is not _INT32 or mask_bits.dim() != 2 or mask_bits.shape[0] != num_tokens:
            raise _bad(f"mask_bits must be int32 [num_tokens={num_tokens}, num_words], got "
                       f"{mask_bits.dtype} {tuple(mask_bits.shape)}")
        if not mask_bits.is_cpu:
            raise _bad("all tensors must be on the CPU")
        num_words = mask_bits.shape[1]
        if num_words == 0:
            raise _bad("mask_bits has no words")
        if not mask_bits.is_contiguous():
            mask_bits = mask_bits.contiguous()
        mask_ptr = mask_bits.data_ptr()
    # The C side reads q through its token and head strides (the model's q is a view into
    # the fused qkv projection), so only head_dim has to be contiguous.
    q_strides = q.stride()
    if q_strides[2] != 1:
        q = q.contiguous()
        q_strides = q.stride()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
            and context_lens.is_contiguous() and cu_seqlens_q.is_contiguous()):
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        block_tables = block_tables.contiguous()
        context_lens, cu_seqlens_q = context_lens.contiguous(), cu_seqlens_q.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype)
    rc = fn(_ARGS.pack(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), cu_seqlens_q.data_ptr(), mask_ptr, out.data_ptr(),
        q_strides[0], q_strides[1], num_tokens, num_heads, head_dim, num_kv_heads,
        num_blocks, block_size, num_seqs, max_blocks, num_words, dt,
        _SOLO if _torch_threads() > 1 else 0, scale))
    if rc:
        code, index = (-rc) % 8, (-rc) // 8
        msg = _ERRORS.get(code, f"error {rc}")
        raise _bad(msg if code in (1, 6, 7) else f"sequence {index}: {msg}")
    return out
