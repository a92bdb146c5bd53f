"""Triton kernels that move K/V into and within the paged cache: store_kv and kv_copy.

Both address a slot as (slot // block_size, slot % block_size) through the cache's strides, so a
per-layer view of a larger cache tensor works as long as each slot's [num_kv_heads, head_dim]
row is contiguous. Semantics match prescient.kernels.reference exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # a padding token: nothing to store
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    ok = (heads < num_kv_heads) & (dims < head_dim)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + heads * stride_ch + dims
    # int64 token offsets: a long prefill's num_tokens * stride can pass 2**31.
    src_token = token.to(tl.int64)
    k = tl.load(k_ptr + src_token * stride_kt + heads * stride_kh + dims, mask=ok)
    v = tl.load(v_ptr + src_token * stride_vt + heads * stride_vh + dims, mask=ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must share shape and strides")
    if k_cache.stride(3) != 1 or k_cache.stride(2) != k_cache.shape[3]:
        raise ValueError("each cache slot's [num_kv_heads, head_dim] row must be contiguous")


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # A k/v split off a fused QKV projection is strided over tokens and heads, which the kernel
    # handles; only the head dimension itself must be contiguous.
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
) -> None:
    _check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# n (copies this call) changes every step: unspecialized, or each value 1 / multiple of 16 /
# other would compile its own variant in the middle of a timed run.
@triton.jit(do_not_specialize=["n"])
def _kv_copy_kernel(
    cache_ptr,  # [num_blocks, block_size, row] (row = num_kv_heads * head_dim), k or v
    scratch_ptr,  # [n, row], this call's staging rows
    src_ptr,  # [n] int64
    dst_ptr,  # [n] int64
    n,
    row,
    stride_cb,
    stride_cs,
    block_size,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Each program owns a column slice of every copy, so programs never touch the same memory.
    # Within a program, all sources are staged before any destination is written: copies may
    # overlap (an accepted path moves node index -> depth), and the reference gathers first.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < row
    for start in range(0, n, BLOCK_R):
        i = start + tl.arange(0, BLOCK_R)
        ok = (i < n)[:, None] & col_ok[None, :]
        src = tl.load(src_ptr + i, mask=i < n, other=0)
        base = (src // block_size) * stride_cb + (src % block_size) * stride_cs
        vals = tl.load(cache_ptr + base[:, None] + cols[None, :], mask=ok)
        tl.store(scratch_ptr + i.to(tl.int64)[:, None] * row + cols[None, :], vals, mask=ok)
    tl.debug_barrier()  # make the staged rows visible to every thread of the program
    for start in range(0, n, BLOCK_R):
        i = start + tl.arange(0, BLOCK_R)
        ok = (i < n)[:, None] & col_ok[None, :]
        dst = tl.load(dst_ptr + i, mask=i < n, other=0)
        base = (dst // block_size) * stride_cb + (dst % block_size) * stride_cs
        vals = tl.load(scratch_ptr + i.to(tl.int64)[:, None] * row + cols[None, :], mask=ok)
        tl.store(cache_ptr + base[:, None] + cols[None, :], vals, mask=ok)


def kv_copy(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # [n] int64
    dst_slots: torch.Tensor,  # [n] int64
) -> None:
    _check_cache(k_cache, v_cache)
    n = src_slots.shape[0]
    if n == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    block_c = min(triton.next_power_of_2(row), 256)
    scratch = torch.empty(n, row, dtype=k_cache.dtype, device=k_cache.device)  # [n, row]
    for cache in (k_cache, v_cache):
        _kv_copy_kernel[(triton.cdiv(row, block_c),)](
            cache,
            scratch,
            src_slots,
            dst_slots,
            n,
            row,
            cache.stride(0),
            cache.stride(1),
            cache.shape[1],
            BLOCK_R=16,
            BLOCK_C=block_c,
        )
