"""Triton tree verification: greedy_verify and rejection_sample, one program per sequence.

Both walk the draft tree in one pass over node indices 1..num_nodes-1, as the reference's
rejection_sample does (its greedy_verify chases first-matching-child pointers instead, which is
equivalent): nodes are in topological order, so a node's children come after it and in index
order, and the walk moves to child c when c is accepted. Everything stays on the device: the
result tensors are written by the kernel and no value is read back by the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _init_accepted(accepted_ptr, max_nodes, BLOCK_NODES: tl.constexpr):
    # accepted_nodes row = [0, -1, -1, ...]; the barrier orders it before the walk's stores,
    # which other threads of the program may issue.
    nodes = tl.arange(0, BLOCK_NODES)
    tl.store(accepted_ptr + nodes, tl.where(nodes == 0, 0, -1).to(tl.int64), mask=nodes < max_nodes)
    tl.debug_barrier()


# max_nodes is the step's widest draft tree: unspecialized, so tree sizes that share a
# BLOCK_NODES share one compiled variant instead of splitting on == 1 / multiple of 16.
@triton.jit(do_not_specialize=["max_nodes"])
def _greedy_verify_kernel(
    draft_ptr,  # [num_seqs, max_nodes] int64
    parents_ptr,  # [num_seqs, max_nodes] int64
    num_nodes_ptr,  # [num_seqs] int64
    argmax_ptr,  # [num_seqs, max_nodes] int64
    accept_len_ptr,  # [num_seqs] int64, out
    accepted_ptr,  # [num_seqs, max_nodes] int64, out
    next_ptr,  # [num_seqs] int64, out
    max_nodes,
    BLOCK_NODES: tl.constexpr,
):
    seq = tl.program_id(0)
    row = seq.to(tl.int64) * max_nodes
    _init_accepted(accepted_ptr + row, max_nodes, BLOCK_NODES)
    num_nodes = tl.minimum(tl.load(num_nodes_ptr + seq), max_nodes)
    cur = tl.zeros([], tl.int64)
    depth = tl.zeros([], tl.int64)
    want = tl.load(argmax_ptr + row)  # the target's choice after the current node
    for c in range(1, num_nodes):
        hit = (tl.load(parents_ptr + row + c) == cur) & (tl.load(draft_ptr + row + c) == want)
        depth += hit.to(tl.int64)
        tl.store(accepted_ptr + row + depth, tl.cast(c, tl.int64), mask=hit)
        cur = tl.where(hit, tl.cast(c, tl.int64), cur)
        want = tl.where(hit, tl.load(argmax_ptr + row + c), want)
    tl.store(accept_len_ptr + seq, depth)
    tl.store(next_ptr + seq, want)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64, node 0 = root, padding -1
    parents: torch.Tensor,  # [num_seqs, max_nodes] int64, parents[:, 0] = -1
    num_nodes: torch.Tensor,  # [num_seqs] int64
    target_argmax: torch.Tensor,  # [num_seqs, max_nodes] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # accept_len, accepted_nodes, next_token
    num_seqs, max_nodes = draft_tokens.shape
    device = draft_tokens.device
    accept_len = torch.empty(num_seqs, dtype=torch.int64, device=device)
    accepted_nodes = torch.empty(num_seqs, max_nodes, dtype=torch.int64, device=device)
    next_token = torch.empty(num_seqs, dtype=torch.int64, device=device)
    if num_seqs == 0:
        return accept_len, accepted_nodes, next_token
    _greedy_verify_kernel[(num_seqs,)](
        draft_tokens.contiguous(),
        parents.contiguous(),
        num_nodes.contiguous(),
        target_argmax.contiguous(),
        accept_len,
        accepted_nodes,
        next_token,
        max_nodes,
        BLOCK_NODES=triton.next_power_of_2(max_nodes),
    )
    return accept_len, accepted_nodes, next_token


@triton.jit
def _load_chunk(target_row, residual_row, in_residual, offs, ok):
    # The walk's current distribution is the target row at the current node until a sibling is
    # rejected there; from then on it lives in the per-sequence residual scratch row.
    if in_residual:
        p = tl.load(residual_row + offs, mask=ok, other=0.0)
    else:
        p = tl.load(target_row + offs, mask=ok, other=0.0).to(tl.float32)
    return p


@triton.jit(do_not_specialize=["max_nodes"])  # as _greedy_verify_kernel
def _rejection_sample_kernel(
    draft_ptr,  # [num_seqs, max_nodes] int64
    parents_ptr,  # [num_seqs, max_nodes] int64
    num_nodes_ptr,  # [num_seqs] int64
    target_ptr,  # [num_seqs, max_nodes, vocab]
    draft_probs_ptr,  # [num_seqs, max_nodes, vocab] (unused unless HAS_DRAFT_PROBS)
    uniform_ptr,  # [num_seqs, max_nodes] float32
    noise_ptr,  # [num_seqs, vocab] float32
    residual_ptr,  # [num_seqs, vocab] float32 scratch
    accept_len_ptr,  # [num_seqs] int64, out
    accepted_ptr,  # [num_seqs, max_nodes] int64, out
    next_ptr,  # [num_seqs] int64, out
    max_nodes,
    vocab,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_NODES: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    row = seq.to(tl.int64) * max_nodes
    _init_accepted(accepted_ptr + row, max_nodes, BLOCK_NODES)
    residual_row = residual_ptr + seq.to(tl.int64) * vocab
    num_nodes = tl.minimum(tl.load(num_nodes_ptr + seq), max_nodes)
    cur = tl.zeros([], tl.int64)
    depth = tl.zeros([], tl.int64)
    in_residual = tl.zeros([], tl.int32)
    for c in range(1, num_nodes):
        if tl.load(parents_ptr + row + c) == cur:
            token = tl.maximum(tl.load(draft_ptr + row + c), 0)
            target_row = target_ptr + (row + cur) * vocab
            draft_row = draft_probs_ptr + (row + c) * vocab
            if in_residual != 0:
                target_p = tl.load(residual_row + token)
            else:
                target_p = tl.load(target_row + token).to(tl.float32)
            if HAS_DRAFT_PROBS:
                draft_q = tl.load(draft_row + token).to(tl.float32)
            else:
                draft_q = 1.0
            # Accept with probability min(1, p/q), as u * q < p so that q = 0 never divides.
            if tl.load(uniform_ptr + row + c) * draft_q < target_p:
                depth += 1
                tl.store(accepted_ptr + row + depth, tl.cast(c, tl.int64))
                cur = tl.cast(c, tl.int64)
                in_residual = tl.zeros([], tl.int32)
            else:
                # Rejected: the next sibling is judged against normalize(max(p - q, 0)).
                total = tl.zeros([], tl.float32)
                for start in range(0, vocab, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    ok = offs < vocab
                    p = _load_chunk(target_row, residual_row, in_residual, offs, ok)
                    if HAS_DRAFT_PROBS:
                        q = tl.load(draft_row + offs, mask=ok, other=0.0).to(tl.float32)
                    else:
                        q = tl.where(offs == token, 1.0, 0.0)
                    total += tl.sum(tl.maximum(p - q, 0.0))
                for start in range(0, vocab, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    ok = offs < vocab
                    p = _load_chunk(target_row, residual_row, in_residual, offs, ok)
                    if HAS_DRAFT_PROBS:
                        q = tl.load(draft_row + offs, mask=ok, other=0.0).to(tl.float32)
                    else:
                        q = tl.where(offs == token, 1.0, 0.0)
                    # total == 0 only by round-off (p == q): keep p rather than divide by zero.
                    left = tl.where(total > 0, tl.maximum(p - q, 0.0) / total, p)
                    tl.store(residual_row + offs, left, mask=ok)
                # Later reads of the residual (the next sibling's p[token], the final sample)
                # may come from other threads of the program than the ones that wrote it.
                tl.debug_barrier()
                in_residual = tl.full([], 1, tl.int32)
    # Exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from p (recovered token
    # after a rejection, bonus token after a leaf). Ties go to the lowest index, as torch.argmax.
    target_row = target_ptr + (row + cur) * vocab
    noise_row = noise_ptr + seq.to(tl.int64) * vocab
    best = tl.full([], -1.0, tl.float32)
    best_token = tl.zeros([], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < vocab
        p = _load_chunk(target_row, residual_row, in_residual, offs, ok)
        score = tl.where(ok, p / tl.load(noise_row + offs, mask=ok, other=1.0), -1.0)
        chunk_best = tl.max(score)
        chunk_token = tl.min(tl.where(score == chunk_best, offs, vocab))
        better = chunk_best > best
        best_token = tl.where(better, chunk_token.to(tl.int64), best_token)
        best = tl.maximum(chunk_best, best)
    tl.store(accept_len_ptr + seq, depth)
    tl.store(next_ptr + seq, best_token)


def rejection_sample(
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64, node 0 = root, padding -1
    parents: torch.Tensor,  # [num_seqs, max_nodes] int64
    num_nodes: torch.Tensor,  # [num_seqs] int64
    target_probs: torch.Tensor,  # [num_seqs, max_nodes, vocab]
    draft_probs: torch.Tensor | None,  # [num_seqs, max_nodes, vocab] or None = one-hot drafts
    uniform: torch.Tensor,  # [num_seqs, max_nodes] float32 in [0, 1)
    recovery_noise: torch.Tensor,  # [num_seqs, vocab] float32, i.i.d. Exp(1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # accept_len, accepted_nodes, next_token
    num_seqs, max_nodes = draft_tokens.shape
    vocab = target_probs.shape[2]
    device = draft_tokens.device
    accept_len = torch.empty(num_seqs, dtype=torch.int64, device=device)
    accepted_nodes = torch.empty(num_seqs, max_nodes, dtype=torch.int64, device=device)
    next_token = torch.empty(num_seqs, dtype=torch.int64, device=device)
    if num_seqs == 0:
        return accept_len, accepted_nodes, next_token
    residual = torch.empty(num_seqs, vocab, dtype=torch.float32, device=device)  # [num_seqs, vocab]
    target_probs = target_probs.contiguous()
    _rejection_sample_kernel[(num_seqs,)](
        draft_tokens.contiguous(),
        parents.contiguous(),
        num_nodes.contiguous(),
        target_probs,
        target_probs if draft_probs is None else draft_probs.contiguous(),
        uniform.contiguous(),
        recovery_noise.contiguous(),
        residual,
        accept_len,
        accepted_nodes,
        next_token,
        max_nodes,
        vocab,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_NODES=triton.next_power_of_2(max_nodes),
        BLOCK_V=min(1024, triton.next_power_of_2(vocab)),
    )
    return accept_len, accepted_nodes, next_token
