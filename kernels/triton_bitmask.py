"""Triton apply_token_bitmask: set the logits of grammar-disallowed tokens to -inf in place.

The bitmask uses xgrammar's layout (bit t % 32 of word t // 32 set = token t allowed). Bitmask
row i governs logits row indices[i] (row i without indices); columns past the bitmask's
32 * num_words are left untouched, as in xgrammar.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [num_rows, vocab]
    bitmask_ptr,  # [num_selected, num_words] int32
    indices_ptr,  # [num_selected] int64 (unused unless HAS_INDICES)
    vocab,  # columns covered: min(logits vocab, 32 * num_words)
    stride_logits,
    stride_bitmask,
    HAS_INDICES: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    if HAS_INDICES:
        logits_row = tl.load(indices_ptr + row).to(tl.int64)
    else:
        logits_row = row.to(tl.int64)
    tokens = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = tokens < vocab
    words = tl.load(bitmask_ptr + row * stride_bitmask + tokens // 32, mask=ok, other=-1)
    banned = ((words >> (tokens % 32)) & 1) == 0
    # Store only the banned columns: most of a grammar mask's bandwidth is in what it keeps.
    tl.store(
        logits_ptr + logits_row * stride_logits + tokens,
        tl.full([BLOCK_V], float("-inf"), logits_ptr.dtype.element_ty),
        mask=ok & banned,
    )


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab]
    bitmask: torch.Tensor,  # [num_selected, ceil(vocab / 32)] int32, bit set = allowed
    indices: torch.Tensor | None = None,  # [num_selected] int64 logits rows; None = all rows
) -> None:
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    num_selected = bitmask.shape[0] if indices is None else indices.shape[0]
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    if num_selected == 0 or vocab == 0:
        return
    bitmask = bitmask if bitmask.stride(1) == 1 else bitmask.contiguous()
    block_v = min(4096, triton.next_power_of_2(vocab))
    _apply_token_bitmask_kernel[(num_selected, triton.cdiv(vocab, block_v))](
        logits,
        bitmask,
        indices if indices is not None else bitmask,
        vocab,
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=indices is not None,
        BLOCK_V=block_v,
    )
