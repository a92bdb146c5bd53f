"""Pure-torch reference of every kernel op (docs/CONTRACTS.md); also the CPU hot path.

Each function here is the specification its Triton twin is tested against, so it is written
for reading first, but without waste: on CPU the engine runs exactly this code.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

# Bit l % 32 of word l // 32: the packed layout of mask_bits and of grammar bitmasks.
_BITS = 32


def unpack_bits(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Bit i of each row (bit i % 32 of word i // 32) as bool; words `[rows, num_words]` int32."""
    if sys.byteorder == "little":
        # Byte j of a little-endian row holds bits 8j..8j+7 in order: shifting bytes instead of
        # words moves a quarter of the data (a 49K-token grammar mask unpacks ~10x faster).
        data = words.contiguous().view(torch.uint8)  # [rows, 4 * num_words]
        shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    else:
        # int32 >> is arithmetic, so bit 31 of a negative word still comes out as 1 after & 1.
        data, shifts = words, torch.arange(_BITS, dtype=words.dtype, device=words.device)
    bits = (data.unsqueeze(-1) >> shifts) & 1  # [rows, num_units, bits_per_unit]
    return bits.flatten(1)[:, :num_bits].bool()  # [rows, num_bits]


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


# int8 KV cache: symmetric, one fp32 scale per (position, kv head) = amax / 127 of its head_dim
# values, q = round(x / scale) (half to even) in [-127, 127].  The error of a dequantized value
# is at most scale / 2 (amax / 254); an all-zero row has scale 0 and dequantizes to zeros.
KV_INT8_QMAX = 127


def quantize_kv(
    x: torch.Tensor,  # [..., head_dim] float
) -> tuple[torch.Tensor, torch.Tensor]:  # q [..., head_dim] int8, scale [...] float32
    """Quantize K or V rows for an int8 cache.  The C store (cpu_attention.store_kv_int8) does
    the same fp32 operations (a true division by the scale) and matches this bit for bit."""
    xf = x.float()
    scale = xf.abs().amax(-1) / KV_INT8_QMAX  # [...]
    step = scale.unsqueeze(-1)
    q = torch.where(step > 0, xf / step, 0.0).round_().clamp_(-KV_INT8_QMAX, KV_INT8_QMAX)
    return q.nan_to_num_(0.0).to(torch.int8), scale


def dequantize_kv(
    q: torch.Tensor,  # [..., head_dim] int8
    scale: torch.Tensor,  # [...] float32
) -> torch.Tensor:  # [..., head_dim] float32
    return q.float() * scale.unsqueeze(-1)


def store_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 K
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 V
) -> None:
    """Write the new rows into their slots; an int8 cache (which needs both scale tensors)
    stores quantize_kv of them and their scales."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == torch.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("store_kv: an int8 cache needs k_scale and v_scale")
        flats = (k_flat, v_flat, k_scale.view(-1, k_scale.shape[2]),
                 v_scale.view(-1, v_scale.shape[2]))  # scales: [num_slots, num_kv_heads]
        rows = (*quantize_kv(k), *quantize_kv(v))
        rows = (rows[0], rows[2], rows[1], rows[3])  # in the order of flats
    else:
        flats = (k_flat, v_flat)
        rows = (k.to(k_flat.dtype), v.to(v_flat.dtype))
    keep = slot_mapping >= 0
    if bool(keep.all()):
        # The common case: index_copy_ avoids materializing boolean-indexed copies of k and v.
        for flat, row in zip(flats, rows):
            flat.index_copy_(0, slot_mapping, row)
    else:
        slots = slot_mapping[keep]
        for flat, row in zip(flats, rows):
            flat[slots] = row[keep]


def gather_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32, one sequence's row
    context_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # k, v: [context_len, num_kv_heads, head_dim] each
    """The first context_len positions of one sequence, in order."""
    block_size = k_cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].tolist()
    first = blocks[0] if blocks else 0
    if blocks == list(range(first, first + num_blocks)):
        # Consecutive blocks (the usual case for a lone request) are a plain slice: no copy at
        # all, which matters because CPU decode is bound by memory bandwidth.
        span = slice(first * block_size, first * block_size + context_len)
        return k_cache.flatten(0, 1)[span], v_cache.flatten(0, 1)[span]
    index = torch.tensor(blocks, device=k_cache.device)
    return k_cache[index].flatten(0, 1)[:context_len], v_cache[index].flatten(0, 1)[:context_len]


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


# Above this many score elements (num_heads * q_len * context_len) a long prefill chunk goes to
# SDPA's memory-bounded flash kernel instead of materializing the score matrix.
_MAX_DENSE_SCORES = 1 << 24


def _attend(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    mask: torch.Tensor | None,  # [q_len, context_len] bool, True = attend
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, num_heads, _ = q.shape
    if num_heads * q_len * k.shape[0] <= _MAX_DENSE_SCORES:
        if q.dtype in (torch.float32, torch.float64):
            return _attend_dense(q, k, v, mask, scale)
        # bf16/fp16: compute in fp32 (exact upcasts; a bf16 score matrix would round the softmax
        # inputs). Converting K and V costs ~10 us per 1K positions, while SDPA's bf16 CPU path
        # at q_len 1 takes ~25x longer than this at 900 positions (measured, torch 2.13).
        return _attend_dense(q.float(), k.float(), v.float(), mask, scale).to(q.dtype)
    # Long prefill chunks: SDPA's flash kernel bounds memory and keeps fp32 softmax statistics.
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=num_heads > k.shape[1],
    ).transpose(0, 1)


def _attend_dense(
    q: torch.Tensor,  # [q_len, num_heads, head_dim], fp32 or fp64
    k: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    mask: torch.Tensor | None,  # [q_len, context_len] bool, True = attend
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, num_heads, head_dim = q.shape
    context_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    # Group the query heads that share a kv head into the rows of one matmul per kv head: K and V
    # are read in place (no GQA repeat, no copy), which on CPU is several times faster than
    # SDPA's enable_gqa path for decode and draft trees.
    q_grouped = q.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q_grouped = q_grouped.reshape(num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(q_grouped, k.permute(1, 2, 0)).mul_(scale)  # [kv, group * q_len, ctx]
    if mask is not None:
        scores.view(num_kv_heads, group, q_len, context_len).masked_fill_(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1), v.transpose(0, 1))  # [kv, group * q_len, head_dim]
    out = out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, head_dim)


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
    """An int8 cache (both scales given) is dequantized (dequantize_kv) and attended in fp32
    (float64 for a float64 q), the output rounded once to q's dtype."""
    if (k_scale is None) != (v_scale is None) or (k_scale is None) == (k_cache.dtype == torch.int8):
        raise ValueError("tree_attention: k_scale and v_scale go with an int8 cache, and only then")
    scales = None if k_scale is None else (k_scale, v_scale)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    if len(ctx) == 1 and cu[1] - cu[0] == q.shape[0] > 0:  # one sequence: no output scatter
        return _attend_sequence(q, k_cache, v_cache, block_tables[0], ctx[0], mask_bits, scale,
                                scales)
    out = torch.empty_like(q)
    for i, context_len in enumerate(ctx):
        start, end = cu[i], cu[i + 1]
        if end > start:
            rows = None if mask_bits is None else mask_bits[start:end]
            out[start:end] = _attend_sequence(
                q[start:end], k_cache, v_cache, block_tables[i], context_len, rows, scale, scales
            )
    return out


def _attend_sequence(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    context_len: int,
    mask_bits: torch.Tensor | None,  # [q_len, num_words] int32, None = causal
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 cache: (k_scale, v_scale)
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    k, v = gather_kv(k_cache, v_cache, block_table, context_len)
    mask = _query_mask(mask_bits, q.shape[0], context_len, q.device)
    if scales is None:
        return _attend(q, k, v, mask, scale)
    ks, vs = gather_kv(*scales, block_table, context_len)  # [context_len, num_kv_heads] each
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = dequantize_kv(k, ks).to(wide), dequantize_kv(v, vs).to(wide)
    return _attend(q.to(wide), k, v, mask, scale).to(q.dtype)


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
    # The kernels walk a tree in one pass over node indices, which needs parents[c] < c; checking
    # here makes a misordered tree fail loudly on CPU rather than verify differently on GPU.
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

    A node matches when its token is the target's argmax at its parent; the walk follows, from
    each node, its lowest-index matching child. So: one scatter finds that child for every node,
    then a pointer chase of (accepted depth + 1) steps walks all sequences at once.
    """
    _check_topological(parents, num_nodes)
    num_seqs, max_nodes = draft_tokens.shape
    nodes = torch.arange(max_nodes, device=draft_tokens.device)
    parent = parents.clamp(min=0)  # the root's -1 never matters: node 0 is excluded below
    live = (nodes >= 1) & (nodes < num_nodes[:, None])
    match = (draft_tokens == target_argmax.gather(1, parent)) & live
    first_child = torch.full_like(draft_tokens, max_nodes)  # max_nodes = no matching child
    first_child.scatter_reduce_(1, parent, torch.where(match, nodes, max_nodes), "amin")
    cur = torch.zeros(num_seqs, dtype=torch.int64, device=draft_tokens.device)
    accept_len = torch.zeros_like(cur)
    accepted_nodes = torch.full_like(draft_tokens, -1)
    accepted_nodes[:, 0] = 0
    for depth in range(1, max_nodes):
        child = first_child.gather(1, cur[:, None])[:, 0]
        hit = child < max_nodes
        if not bool(hit.any()):
            break
        # A sequence that stopped stays stopped: its cur, and so its child, no longer change.
        accepted_nodes[:, depth] = torch.where(hit, child, -1)
        accept_len += hit
        cur = torch.where(hit, child, cur)
    return accept_len, accepted_nodes, target_argmax.gather(1, cur[:, None])[:, 0]


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
    the current node, minus the mass of every rejected sibling so far. In topological node order,
    one pass over node indices visits each node's children in index order, and everything below
    an accepted child comes after it; each step updates all sequences at once.
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
        if not bool(tried.any()):
            continue
        token = draft_tokens[:, c].clamp(min=0)[:, None]  # [num_seqs, 1]
        target_p = residual.gather(1, token)[:, 0]
        draft_q = 1.0 if draft_probs is None else draft_probs[:, c].gather(1, token)[:, 0]
        # Accept with probability min(1, p/q); written as u * q < p so that q = 0 never divides.
        accept = tried & (uniform[:, c] * draft_q < target_p)
        reject = tried & ~accept
        if bool(reject.any()):
            # On rejection the next sibling is judged against normalize(max(p - q, 0)). For a
            # one-hot q that is p with p[token] zeroed (p[token] <= 1), computed as such.
            if draft_probs is None:
                leftover = residual.scatter(1, token, 0.0)
            else:
                leftover = (residual - draft_probs[:, c]).clamp_(min=0)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden], weight: [hidden] -> [..., hidden] in x's dtype: normalised in float32
    (float64 for a float64 x), rounded to x's dtype, then scaled by the weight in x's dtype (the
    model's half-precision RMSNorm; a float32 model calls F.rms_norm instead)."""
    xf = x.float() if x.dtype != torch.float64 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab]
    bitmask: torch.Tensor,  # [num_selected, ceil(vocab / 32)] int32, bit set = allowed
    indices: torch.Tensor | None = None,  # [num_selected] int64 logits rows; None = all rows
) -> None:
    """Set disallowed logits to -inf in place. Bitmask row i governs logits row indices[i] (or row
    i); tokens past the bitmask's 32 * num_words columns are left untouched, as in xgrammar."""
    vocab = min(logits.shape[1], bitmask.shape[1] * _BITS)
    allowed = unpack_bits(bitmask, vocab)  # [num_selected, vocab]
    # +inf where allowed, -inf where banned, so min(logit, bound) keeps or bans each logit. Unlike
    # masked_fill_, this has no data-dependent branch to mispredict on random-looking grammar
    # masks (about 10x faster on CPU for a 49K-token vocabulary).
    bound = allowed.to(logits.dtype).sub_(0.5).mul_(float("inf"))  # [num_selected, vocab]
    if indices is None:
        rows = logits[: bound.shape[0], :vocab]
        torch.minimum(rows, bound, out=rows)
    else:
        logits[indices, :vocab] = torch.minimum(logits[indices, :vocab], bound)
