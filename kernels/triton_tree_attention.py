"""Triton tree attention over the paged KV cache: every sequence of a batch in one launch.

A program owns one (query block, kv head) pair: BLOCK_Q consecutive new tokens of one sequence
times the GROUP query heads that share the kv head (GQA), flattened into BLOCK_M rows so that the
K/V tiles are loaded once for the whole group. Query blocks of all sequences are numbered in one
grid axis without a host sync: sequence i's blocks start at cu_seqlens_q[i] // BLOCK_Q + i, and a
program finds its sequence by binary search over cu_seqlens_q (the vLLM unified-attention trick).
The KV loop is FlashAttention-2's online softmax (base-2 exponentials). Rows see every prefix
position; among the new tokens they see the bits of mask_bits, or causal when it is None.

Decoding a few sequences leaves most of a GPU idle, so the KV range can be split across programs
(flash-decoding): each split writes an unnormalized partial (acc, running max, running sum) and a
second kernel merges them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
# The interpreter cannot do arithmetic on bfloat16/float16 values (it stores them as uint16), so
# under it the kernel upcasts loads to float32; bf16 products are exact in fp32, so the numerics
# match a bf16 tensor-core dot with fp32 accumulation.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _find_seq(cu_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query block is <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton specializes integer arguments on == 1 and on divisibility by 16. These change from
# step to step (batch size, tokens this step, block-table width, mask words = tree size / 32),
# so each would compile new variants mid-run; the kernel gains nothing from knowing them.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt", "stride_mt"])
def _tree_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]; split: [num_splits, num_tokens, num_heads, head_dim]
    max_ptr,  # [num_splits, num_tokens, num_heads] running max (log2 domain), split only
    sum_ptr,  # [num_splits, num_tokens, num_heads] running sum, split only
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    cu_ptr,  # [num_seqs + 1] int32
    mask_ptr,  # [num_tokens, num_words] int32 (unused when not HAS_MASK)
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_tokens,
    num_heads,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_mt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = _find_seq(cu_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    first_query = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_query >= q_len:  # spare grid slot past this sequence's queries
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len

    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // GROUP  # [BLOCK_M] index among the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (query < q_len)
    token = (q_start + query).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Causal queries never look past the block's last query; a mask may point anywhere.
    if HAS_MASK:
        kv_end = context_len
    else:
        kv_end = tl.minimum(context_len, prefix_len + first_query + BLOCK_Q)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits)
    kv_lo = split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    table = block_tables_ptr + seq * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] KV positions
        pos_ok = pos < kv_hi
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0)
        slot = block.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(ACC)  # [BLOCK_M, BLOCK_N]
        s = s * qk_scale

        new = pos - prefix_len  # index among the new tokens; negative = prefix
        is_new = new >= 0
        if HAS_MASK:
            bit = tl.maximum(new, 0)
            word = tl.load(
                mask_ptr + token[:, None] * stride_mt + (bit // 32)[None, :],
                mask=row_ok[:, None] & (is_new & pos_ok)[None, :],
                other=0,
            )
            seen = ((word >> (bit % 32)[None, :]) & 1) != 0
        else:
            seen = new[None, :] <= query[:, None]
        seen = (seen | ~is_new[None, :]) & pos_ok[None, :]
        s = tl.where(seen, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v_cache_ptr.dtype.element_ty)  # the P @ V dot runs in the cache dtype
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION).to(ACC)
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        part = (split * num_tokens + token) * num_heads + head  # [BLOCK_M] (split, token, head)
        tl.store(out_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=out_mask)
        tl.store(max_ptr + part, m_i, mask=row_ok)
        tl.store(sum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


# num_splits follows the batch's shape and num_tokens the step: unspecialized, as above.
@triton.jit(do_not_specialize=["num_splits", "num_tokens"])
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    acc_ptr,  # [num_splits, num_tokens, num_heads, head_dim]
    max_ptr,  # [num_splits, num_tokens, num_heads]
    sum_ptr,  # [num_splits, num_tokens, num_heads]
    num_splits,
    num_tokens,
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    row = token * num_heads + head
    stride_split = num_tokens * num_heads
    m_all = tl.full([], float("-inf"), ACC)
    for s in range(num_splits):
        m_all = tl.maximum(m_all, tl.load(max_ptr + s * stride_split + row))
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([], ACC)
    acc = tl.zeros([BLOCK_D], ACC)
    for s in range(num_splits):
        # An empty split has m = -inf and weight 0.
        w = tl.exp2(tl.load(max_ptr + s * stride_split + row) - m_ref)
        total += w * tl.load(sum_ptr + s * stride_split + row)
        part = acc_ptr + (s * stride_split + row) * head_dim
        acc += w * tl.load(part + dims, mask=dim_ok, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_num_splits(
    device: torch.device, num_q_blocks: int, num_kv_heads: int, max_context: int
) -> int:
    # Split only when the grid would leave SMs idle and contexts are long enough to share.
    # Decided from shapes alone: reading context_lens would cost a host sync.
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device)
    by_occupancy = triton.cdiv(2 * num_sms, max(1, num_q_blocks * num_kv_heads))
    by_length = triton.cdiv(max_context, 512)
    return max(1, min(_MAX_SPLITS, by_occupancy, by_length))


def tree_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], roped
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, KV length after this step's tokens
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    mask_bits: torch.Tensor | None,  # [num_tokens, num_words] int32, None = causal
    scale: float,
    num_splits: int | None = None,  # KV splits per query block; None = pick by occupancy
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    if mask_bits is not None and mask_bits.stride(-1) != 1:
        mask_bits = mask_bits.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    group = num_heads // num_kv_heads
    # Wide row blocks for prefill-like batches, 16 rows (tl.dot's minimum) for decode and trees.
    target_rows = 64 if num_tokens * group >= 64 * num_seqs else 16
    block_q = max(1, target_rows // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = _default_num_splits(q.device, num_q_blocks, num_kv_heads, max_context)
    split = num_splits > 1
    acc_dtype = tl.float64 if q.dtype == torch.float64 else tl.float32
    torch_acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if split:
        partial = torch.empty(
            num_splits, num_tokens, num_heads, head_dim, dtype=torch_acc, device=q.device
        )
        part_max = torch.empty(num_splits, num_tokens, num_heads, dtype=torch_acc, device=q.device)
        part_sum = torch.empty_like(part_max)
        dest = partial
    else:
        part_max = part_sum = dest = out
    mask = mask_bits if mask_bits is not None else cu_seqlens_q  # any int32 tensor as a dummy
    _tree_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        dest,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        mask,
        scale * _LOG2E,
        num_seqs,
        num_tokens,
        num_heads,
        head_dim,
        block_size,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        mask.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HAS_MASK=mask_bits is not None,
        SPLIT=split,
        UPCAST=_INTERPRET and q.dtype in (torch.bfloat16, torch.float16),
        ACC=acc_dtype,
        # fp32 tensor cores would round q and k to tf32; the CPU reference would then disagree.
        PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial,
            part_max,
            part_sum,
            num_splits,
            num_tokens,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            BLOCK_D=triton.next_power_of_2(head_dim),
            ACC=acc_dtype,
        )
    return out
