"""Pure-torch reference of every kernel op (docs/CONTRACTS.md); also the CPU hot path.

Each function here is the specification its Triton twin is tested against, so it is written
for reading first, but without waste: on CPU the engine runs exactly this code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Bit l % 32 of word l // 32: the packed layout of mask_bits and of grammar bitmasks.
_BITS = 32


def unpack_bits(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Bit i of each row (bit i % 32 of word i // 32) as bool; words `[rows, num_words]` int32."""
    idx = torch.arange(num_bits, device=words.device)
    # int32 >> is arithmetic, so bit 31 of a negative word still comes out as 1 after & 1.
    sel = words[:, idx // _BITS] >> (idx % _BITS).to(words.dtype)
    return (sel & 1).bool()  # [rows, num_bits]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_bits: bool `[rows, n]` -> int32 `[rows, ceil(n / 32)]`."""
    rows, n = bits.shape
    num_words = (n + _BITS - 1) // _BITS
    padded = torch.zeros(rows, num_words * _BITS, dtype=torch.int64, device=bits.device)
    padded[:, :n] = bits.long()
    weights = 1 << torch.arange(_BITS, device=bits.device, dtype=torch.int64)
    words = (padded.view(rows, num_words, _BITS) * weights).sum(-1)
    # Reinterpret the low 32 bits as signed int32 (bit 31 set -> negative).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def store_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
) -> None:
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    if bool(keep.all()):
        # The common case: index_copy_ avoids materializing boolean-indexed copies of k and v.
        k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))
    else:
        slots = slot_mapping[keep]
        k_flat[slots] = k[keep].to(k_flat.dtype)
        v_flat[slots] = v[keep].to(v_flat.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32, one sequence's row
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    """The first context_len positions of one sequence, in order."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    first = int(blocks[0])
    # Consecutive blocks (the usual case for a lone request) are a plain slice: no copy at all,
    # which matters because CPU decode is bound by memory bandwidth.
    if num_blocks == 1 or int(blocks[-1]) - first == num_blocks - 1 and bool(
        (blocks.diff() == 1).all()
    ):
        flat = cache.view(-1, *cache.shape[2:])
        return flat[first * block_size : first * block_size + context_len]
    return cache[blocks].flatten(0, 1)[:context_len]


def _query_mask(
    mask_bits: torch.Tensor | None,  # [q_len, num_words] int32 for this sequence, or None
    q_len: int,
    context_len: int,
    device: torch.device,
) -> torch.Tensor | None:  # [q_len, context_len] bool, None = no masking needed
    if mask_bits is None and q_len == 1:
        return None  # single decode token: it sees every position
    prefix_len = context_len - q_len
    mask = torch.ones(q_len, context_len, dtype=torch.bool, device=device)
    if mask_bits is None:
        mask[:, prefix_len:] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    else:
        mask[:, prefix_len:] = unpack_bits(mask_bits, q_len)
    return mask


def tree_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], roped
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, KV length after this step's tokens
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    mask_bits: torch.Tensor | None,  # [num_tokens, num_words] int32, None = causal
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    out = torch.empty_like(q) if len(ctx) > 1 else None
    for i, context_len in enumerate(ctx):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], context_len).transpose(0, 1)  # [kv_heads, ctx, d]
        v = gather_kv(v_cache, block_tables[i], context_len).transpose(0, 1)
        rows = None if mask_bits is None else mask_bits[start:end]
        mask = _query_mask(rows, q_len, context_len, q.device)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [num_heads, q_len, head_dim]
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        ).transpose(0, 1)  # [q_len, num_heads, head_dim]
        if out is None:
            return o.contiguous()
        out[start:end] = o
    if out is None:  # a single sequence with no new tokens
        out = torch.empty_like(q)
    return out


def kv_copy(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # [n] int64
    dst_slots: torch.Tensor,  # [n] int64
) -> None:
    """Copy slot src_slots[i] to dst_slots[i]; all sources are read before any write, so the
    overlapping moves of an accepted path (node index -> depth, dst <= src) are safe."""
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, *cache.shape[2:])
        flat[dst_slots] = flat[src_slots]  # the gather materializes first, then the scatter


def _check_topological(parents: torch.Tensor, num_nodes: torch.Tensor) -> None:
    # The single forward pass over node indices below relies on parents[c] < c.
    idx = torch.arange(parents.shape[1], device=parents.device)
    live = (idx >= 1) & (idx < num_nodes[:, None])
    if not bool(((parents < idx) | ~live).all()):
        raise ValueError("draft tree nodes must come after their parents (parents[c] < c)")


def greedy_verify(
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64, node 0 = root, padding -1
    parents: torch.Tensor,  # [num_seqs, max_nodes] int64, parents[:, 0] = -1
    num_nodes: torch.Tensor,  # [num_seqs] int64
    target_argmax: torch.Tensor,  # [num_seqs, max_nodes] int64, target's argmax at each node
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest root path whose draft tokens match the target's argmax (SpecInfer, greedy case).

    Nodes are in topological order, so one pass over c = 1..max_nodes-1 walks every sequence:
    when the walk sits at node `cur`, the first child c of `cur` whose token equals
    target_argmax[cur] is met before any other matching sibling, and everything below c has a
    larger index. Each step is a vectorized update of all sequences; no host sync.
    """
    _check_topological(parents, num_nodes)
    num_seqs, max_nodes = draft_tokens.shape
    rows = torch.arange(num_seqs, device=draft_tokens.device)
    cur = torch.zeros(num_seqs, dtype=torch.int64, device=draft_tokens.device)
    accept_len = torch.zeros_like(cur)
    accepted_nodes = torch.full_like(draft_tokens, -1)
    accepted_nodes[:, 0] = 0
    for c in range(1, max_nodes):
        hit = (
            (parents[:, c] == cur)
            & (draft_tokens[:, c] == target_argmax[rows, cur])
            & (c < num_nodes)
        )
        accept_len += hit
        accepted_nodes[rows[hit], accept_len[hit]] = c
        cur = torch.where(hit, c, cur)
    return accept_len, accepted_nodes, target_argmax[rows, cur]


def rejection_sample(
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64, node 0 = root, padding -1
    parents: torch.Tensor,  # [num_seqs, max_nodes] int64
    num_nodes: torch.Tensor,  # [num_seqs] int64
    target_probs: torch.Tensor,  # [num_seqs, max_nodes, vocab], target distribution at each node
    draft_probs: torch.Tensor | None,  # [num_seqs, max_nodes, vocab] or None = one-hot drafts
    uniform: torch.Tensor,  # [num_seqs, max_nodes] float32 in [0, 1)
    recovery_noise: torch.Tensor,  # [num_seqs, vocab] float32, i.i.d. Exp(1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over a draft tree (SpecInfer; Leviathan et al. for a chain).

    `residual` is the distribution the walk would sample from if it stopped now: the target at
    the current node, minus the mass of every rejected sibling so far. Visiting node indices in
    increasing order visits each node's children in index order (topological node order).
    """
    _check_topological(parents, num_nodes)
    num_seqs, max_nodes = draft_tokens.shape
    rows = torch.arange(num_seqs, device=draft_tokens.device)
    cur = torch.zeros(num_seqs, dtype=torch.int64, device=draft_tokens.device)
    accept_len = torch.zeros_like(cur)
    accepted_nodes = torch.full_like(draft_tokens, -1)
    accepted_nodes[:, 0] = 0
    residual = target_probs[:, 0].clone()  # [num_seqs, vocab]
    for c in range(1, max_nodes):
        tried = (parents[:, c] == cur) & (c < num_nodes)
        token = draft_tokens[:, c].clamp(min=0)
        target_p = residual.gather(1, token[:, None])[:, 0]
        if draft_probs is None:
            draft_q = torch.ones_like(target_p)
            draft_row = F.one_hot(token, residual.shape[1]).to(residual.dtype)
        else:
            draft_row = draft_probs[:, c]
            draft_q = draft_row.gather(1, token[:, None])[:, 0]
        # Accept with probability min(1, p/q); written as u * q < p so that q = 0 never divides.
        accept = tried & (uniform[:, c] * draft_q < target_p)
        reject = tried & ~accept
        if bool(reject.any()):
            # On rejection the next sibling is judged against normalize(max(p - q, 0)).
            leftover = (residual - draft_row).clamp_(min=0)
            total = leftover.sum(1, keepdim=True)
            # total == 0 only by round-off (p == q); then keep p rather than divide by zero.
            leftover = torch.where(total > 0, leftover / total, residual)
            residual = torch.where(reject[:, None], leftover, residual)
        if bool(accept.any()):
            accept_len += accept
            accepted_nodes[rows[accept], accept_len[accept]] = c
            cur = torch.where(accept, c, cur)
            residual = torch.where(accept[:, None], target_probs[:, c], residual)
    # Exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from p.
    next_token = (residual / recovery_noise).argmax(1)
    return accept_len, accepted_nodes, next_token


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab]
    bitmask: torch.Tensor,  # [num_selected, ceil(vocab / 32)] int32, bit set = allowed
    indices: torch.Tensor | None = None,  # [num_selected] int64 logits rows; None = all rows
) -> None:
    """Set disallowed logits to -inf in place. Bitmask row i governs logits row indices[i] (or row
    i); tokens past the bitmask's 32 * num_words columns are left untouched, as in xgrammar."""
    vocab = min(logits.shape[1], bitmask.shape[1] * _BITS)
    allowed = unpack_bits(bitmask, vocab)  # [num_selected, vocab]
    if indices is None:
        logits[: allowed.shape[0], :vocab].masked_fill_(~allowed, float("-inf"))
    else:
        rows = logits[indices, :vocab].masked_fill_(~allowed, float("-inf"))
        logits[indices, :vocab] = rows
