"""Fast CPU tree_attention: the ctypes wrapper of ``cpu_attention.c``.

The C kernel lives in the same .so as the GEMV (``cpu_linear`` builds, caches and loads it;
one library, one thread pool) and computes the whole op, for every sequence of the batch, in
one call: ``tree_attention`` here has exactly the signature and semantics of
``reference.tree_attention`` (docs/CONTRACTS.md) for float32 and bfloat16 CPU tensors, and for
int8 caches with their per-(position, kv head) fp32 scales (``k_scale``/``v_scale``, written by
``store_kv_int8``; see reference.quantize_kv), with a float32 or bfloat16 q.
``prescient.kernels.ops.tree_attention`` routes CPU calls here; this module never falls
back by itself, so calling it directly when ``available()`` is False raises RuntimeError.

Numerics: fp32 online softmax and fp32 accumulation; bf16 q.k products are exact in fp32
(vdpbf16ps or widened FMAs; or AMX tiles, with their own summation, where PRESCIENT_ATTN_AMX=1
asks for them: off by default, see cpu_attention.c), P.V is fp32 but at tier avx512_bf16 on a bf16
cache, which rounds P to bf16 (``p_rounded``), a bf16 output is rounded once to nearest even.  An
int8 cache is widened exactly; its K scale multiplies the q.k sums, its V scale the softmax
weights, so the result is the reference's on the dequantized cache up to fp32 rounding.
Batch invariant (per ISA tier and dtype): a query row's output bits depend on its q, the
positions it sees and their K/V only -- not on the other rows, sequences or thread count of the
call (fixed context pieces, one fold, per-row arithmetic; see cpu_attention.c), so a draft-tree
node gets the bits of the plain decode step over the same prefix.  One difference from the
reference: a query row that sees no position at all (possible only with an all-zero mask_bits
row and no prefix) gets zeros, not NaN.

Threads: the pool of cpu_linear (one thread per usable physical core by default; ``cpu_linear.set_num_threads``
or ``PRESCIENT_GEMV_THREADS`` size it for both kernels).  Small calls run on the caller only,
and so does every call made while torch runs more than one intra-op thread (a caller that did
not set torch to one thread: the prepared model's forwards all do, runtime/model.CpuForward):
torch's OpenMP worker then spins on the pool's core, and sharing it made a 512 + 64-token
prefill chunk 20x slower on a busy 2-core machine.
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
_KV_INT8 = 8  # PA_KV_I8: the cache dtype code of an int8 cache
_C_VERSION = 3  # must match PA_VERSION in cpu_attention.c
# pa_args_t in cpu_attention.c: 8 addresses, 2 q strides, 10 sizes, flags, 2 scale addresses,
# the cache dtype (int64 each), the scale (double).  struct.pack builds a fresh bytes object per
# call: one ctypes argument, and thread-safe.
_ARGS = struct.Struct("=24qd")
# pa_store_args_t: 7 addresses, 4 strides, 5 sizes (int64 each).
_STORE_ARGS = struct.Struct("=16q")
_SOLO = 1  # PA_SOLO
_INT32 = torch.int32
_torch_threads = torch.get_num_threads

_fn = None  # pa_tree_attention once bound
_store_fn = None  # pa_store_kv_i8
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
# pa_store_kv_i8's (PS_* in cpu_attention.c; index = the token).
_STORE_ERRORS = {1: "bad sizes", 2: "slot_mapping holds a slot >= num_blocks * block_size"}


def _bind() -> None:
    global _fn, _store_fn, _tried, _why_not
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
    lib.pa_set_amx.argtypes = [ctypes.c_int]
    lib.pa_set_amx.restype = ctypes.c_int
    fn = lib.pa_tree_attention
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_int
    store = lib.pa_store_kv_i8
    store.argtypes = [ctypes.c_char_p]
    store.restype = ctypes.c_int
    _store_fn = store
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


def _set_amx(on: bool) -> bool:
    """A bf16 cache's q.K on AMX tiles (True) or not (False, the default; PRESCIENT_ATTN_AMX=1
    turns it on at load); returns whether it is in use now (tier avx512_bf16 on a CPU and OS with
    AMX-BF16, PRESCIENT_BF16_DOT not dp / fma). Other bits than the FMAs'. For tests and
    benchmarks."""
    return available() and bool(cpu_linear.library().pa_set_amx(int(bool(on))))


def amx_in_use() -> bool:
    """Whether a bf16 cache's q.K runs on AMX tiles now (PRESCIENT_ATTN_AMX=1 at this tier; for
    head_dim <= 128 only: wider heads and fp32 / int8 caches keep their FMA paths)."""
    return available() and bool(cpu_linear.library().pa_set_amx(-1))


def p_rounded(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether P.V rounds the softmax weights P to bf16 now: a bf16 cache at tier avx512_bf16
    (head_dim a multiple of 32), as the GPU kernel's P @ V runs in the cache dtype.  Each weight
    moves by up to 2^-8 of itself, the output by up to ~2^-7 of sum_j P_j |V_j| / l beyond its own
    rounding (the row sums add the rounded weights; tests bound it)."""
    if not available() or kv_dtype is not torch.bfloat16 or head_dim % 32:
        return False
    return cpu_linear.library().pg_isa() >= cpu_linear.ISA_TIERS.index("avx512_bf16")


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
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 K
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 V
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """reference.tree_attention in one C call.  Raises ValueError naming a bad argument.
    Written for per-call overhead (it runs once per layer): plain attribute reads, one
    struct.pack, one ctypes argument.  The caches have q's dtype, or are int8 with both
    scale tensors (q float32 or bfloat16)."""
    fn = _fn
    if fn is None:
        if not available():
            raise RuntimeError(f"cpu tree_attention kernel unavailable: {_why_not}")
        fn = _fn
    dtype = q.dtype
    dt = _DT.get(dtype)
    if dt is None:
        raise _bad(f"q must be float32 or bfloat16, not {dtype}")
    if k_cache.dtype is torch.int8:
        kv_dt = _KV_INT8
        if v_cache.dtype is not torch.int8:
            raise _bad(f"k_cache is int8 but v_cache is {v_cache.dtype}")
        if k_scale is None or v_scale is None:
            raise _bad("an int8 cache needs k_scale and v_scale")
        want = tuple(k_cache.shape[:3])
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t.dtype is not torch.float32 or tuple(t.shape) != want or not t.is_cpu:
                raise _bad(f"{name} must be a float32 CPU tensor [num_blocks, block_size, "
                           f"num_kv_heads] = {list(want)}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if not (k_scale.is_contiguous() and v_scale.is_contiguous()):
            k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
        ks_ptr, vs_ptr = k_scale.data_ptr(), v_scale.data_ptr()
    else:
        kv_dt = dt
        if k_cache.dtype is not dtype or v_cache.dtype is not dtype:
            raise _bad(f"k_cache/v_cache dtype ({k_cache.dtype}, {v_cache.dtype}) must be q's "
                       f"({dtype}) or int8")
        if k_scale is not None or v_scale is not None:
            raise _bad(f"k_scale/v_scale are for int8 caches, not {k_cache.dtype}")
        ks_ptr = vs_ptr = 0
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
        _SOLO if _torch_threads() > 1 else 0, ks_ptr, vs_ptr, kv_dt, scale))
    if rc:
        code, index = (-rc) % 8, (-rc) // 8
        msg = _ERRORS.get(code, f"error {rc}")
        raise _bad(msg if code in (1, 6, 7) else f"sequence {index}: {msg}")
    return out


def store_kv_int8(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] float32 / bfloat16
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], k's dtype
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    k_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] float32
    v_scale: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] float32
) -> None:
    """reference.store_kv for an int8 cache in one C call: each new (token, kv head) row is
    quantized (reference.quantize_kv, bit for bit) into its slot, its scale into the scale
    tensors.  k and v may be strided views (the model's slices of the qkv projection) as long as
    head_dim is contiguous.  Raises ValueError naming a bad argument; nothing is written then."""
    fn = _store_fn
    if fn is None:
        if not available():
            raise RuntimeError(f"cpu store_kv_int8 kernel unavailable: {_why_not}")
        fn = _store_fn
    if k_cache.dtype is not torch.int8 or v_cache.dtype is not torch.int8:
        raise _bad(f"store_kv_int8 needs int8 caches, got {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise _bad(f"k_cache/v_cache must be one shape [num_blocks, block_size, num_kv_heads, "
                   f"head_dim], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    want = (num_blocks, block_size, num_kv_heads)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.dtype is not torch.float32 or tuple(t.shape) != want:
            raise _bad(f"{name} must be float32 [num_blocks, block_size, num_kv_heads] = "
                       f"{list(want)}, got {None if t is None else (t.dtype, tuple(t.shape))}")
    dt = _DT.get(k.dtype)
    if dt is None or v.dtype is not k.dtype:
        raise _bad(f"k and v must be both float32 or both bfloat16, got {k.dtype}, {v.dtype}")
    num_tokens = k.shape[0] if k.dim() == 3 else -1
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise _bad(f"k and v must be [num_tokens, {num_kv_heads}, {head_dim}], got "
                   f"{tuple(k.shape)}, {tuple(v.shape)}")
    if slot_mapping.dtype is not torch.int64 or slot_mapping.shape != (num_tokens,):
        raise _bad(f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
                   f"{tuple(slot_mapping.shape)}")
    if not all(t.is_cpu for t in (k_cache, v_cache, k_scale, v_scale, k, v, slot_mapping)):
        raise _bad("all tensors must be on the CPU")
    # The caches and scales are written in place: a contiguous copy would lose the write.
    if not all(t.is_contiguous() for t in (k_cache, v_cache, k_scale, v_scale)):
        raise _bad("k_cache, v_cache, k_scale and v_scale must be contiguous")
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    rc = fn(_STORE_ARGS.pack(
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(),
        v_scale.data_ptr(), slot_mapping.data_ptr(), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), num_tokens, num_kv_heads, head_dim, num_blocks * block_size, dt))
    if rc:
        code, index = (-rc) % 8, (-rc) // 8
        msg = _STORE_ERRORS.get(code, f"error {rc}")
        raise _bad(f"token {index}: {msg}" if code == 2 else msg)
