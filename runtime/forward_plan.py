"""Batch-invariant forwards: which scheduled sequences share a target forward.

A decode or verify row must get the same bits whatever else the step holds (greedy output with
speculation equal to plain decoding; a request alone equal to the same request in a batch). The
kernels give that only within one path: the small-M path (the GEMV kernels MAX_M rows a call,
the fused native layers, up to `BATCH_INVARIANT_M` tokens a forward) computes a row alike in
any such forward, and so does the GEMM path (F.linear / the tiled quantized path, above it),
but the two round differently. So the plan decides the path per *sequence*, never by the
step's total:

    small = [s for s in seqs if rows(s) <= BATCH_INVARIANT_M]   # decode, verify trees, short chunks
    large = the rest                                            # prefill chunks
    forwards = [large (one forward, > BATCH_INVARIANT_M rows)] +
               [small, packed in order into forwards of <= BATCH_INVARIANT_M rows]

and the logits come back in the sequences' order. A step of only decodes (the common case) is one
forward, as before; a prefill chunk beside decodes costs one extra forward's dispatch, and more
than BATCH_INVARIANT_M decode/verify rows cost one weight pass per forward (the price of giving
up the GEMM for them). A prompt's own chunking still decides its KV bits: the same chunks give
the same bits, but a token budget that splits a prompt differently may not.
"""

from __future__ import annotations

import torch

from prescient.runtime.batch import ForwardBatch, build_forward_batch
from prescient.runtime.linear import BATCH_INVARIANT_M


def seq_rows(seq, tree) -> int:
    """Rows a scheduled sequence adds to a forward: its draft tree's nodes, or its new tokens."""
    return len(tree.tokens) if tree is not None else seq.num_new_tokens


def seq_logits(seq, tree) -> int:
    """Logits rows it gets back (build_forward_batch): every tree node, or its last new token
    when the step samples."""
    return len(tree.tokens) if tree is not None else int(seq.samples)


def plan(seqs: list, trees: list) -> list[list[int]]:
    """The sequences' indices grouped into forwards (module docstring): the large ones first,
    together, then the small ones in order, at most BATCH_INVARIANT_M rows a forward."""
    large = [i for i, (s, t) in enumerate(zip(seqs, trees)) if seq_rows(s, t) > BATCH_INVARIANT_M]
    groups = [large] if large else []
    cur: list[int] = []
    rows = 0
    for i, (s, t) in enumerate(zip(seqs, trees)):
        n = seq_rows(s, t)
        if n > BATCH_INVARIANT_M:
            continue
        if cur and rows + n > BATCH_INVARIANT_M:
            groups.append(cur)
            cur, rows = [], 0
        cur.append(i)
        rows += n
    if cur:
        groups.append(cur)
    return groups


def run_forward(model, kv_caches, seqs: list, trees: list, block_size: int) -> torch.Tensor:
    """One step's target logits [num_logits, vocab], sequences in order (as one
    build_forward_batch forward would return them), computed in the planned forwards."""
    groups = plan(seqs, trees)
    if len(groups) == 1:
        batch = build_forward_batch(seqs, trees, block_size, model.device)
        return model.forward(batch, kv_caches)
    parts: list[torch.Tensor | None] = [None] * len(seqs)  # per sequence: its logits rows
    for group in groups:
        batch: ForwardBatch = build_forward_batch([seqs[i] for i in group], [trees[i] for i in group],
                                                  block_size, model.device)
        logits = model.forward(batch, kv_caches)  # [group's logits rows, vocab]
        row = 0
        for i in group:
            n = seq_logits(seqs[i], trees[i])
            parts[i] = logits[row:row + n]
            row += n
    return torch.cat([p for p in parts if p is not None])
