"""`ForwardBatch`: everything one forward needs, as flat tensors (vLLM vocabulary).

The new tokens of all scheduled requests (prefill chunks, plain decode tokens, draft-tree nodes)
are concatenated; `cu_seqlens_q` marks where each request's rows start. Data reaches the model
through this argument only: no globals.

One builder owns the flattening: every forward (the engine's target step, the draft model's
catch-up and tree depths, the verify-cost measurement) describes each sequence's rows as a
`SeqRows` and `pack_forward_batch` turns the list into a `ForwardBatch`; `build_forward_batch`
is the engine's conversion of scheduled requests (and their draft trees) into `SeqRows`.
`slot_of` is the one copy of the paged layout's slot arithmetic (docs/CONTRACTS.md), used by the
builder and by the KV moves after verification alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prescient.kernels.reference import pack_bits


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32, KV length after this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    mask_bits: torch.Tensor | None  # [num_tokens, num_words] int32, None = causal
    logits_indices: torch.Tensor  # [num_logits] int64, rows whose logits are returned

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def slot_of(block_ids: Sequence[int], position: int, block_size: int) -> int:
    """The KV slot of sequence position `position` in a sequence with block table `block_ids`."""
    return block_ids[position // block_size] * block_size + position % block_size


@dataclass
class SeqRows:
    """One sequence's rows of a forward, before flattening."""

    input_ids: Sequence[int]  # [num_rows]
    positions: Sequence[int]  # [num_rows] RoPE positions
    # KV position of row 0: row r writes the slot of position start + r, and the sequence's KV
    # length after the forward is start + num_rows (RoPE positions may differ: tree nodes).
    start: int
    block_ids: Sequence[int]  # the sequence's block table
    mask_bits: torch.Tensor | None  # [num_rows, num_words] int32 packed mask among these rows, None = causal
    logits_rows: Sequence[int]  # rows whose logits come back, in order


def pack_forward_batch(rows: list[SeqRows], block_size: int, device: torch.device) -> ForwardBatch:
    """Concatenate the sequences' rows into one forward; logits come back for each sequence's
    logits_rows, sequences in order. A batch where no sequence has a mask stays causal
    (mask_bits None), which lets the kernels skip the mask.

    The int64 fields are views of one tensor and the int32 ones of another: two tensors built
    instead of eight. On a CPU the step's host work runs right after a forward has streamed the
    weights through the caches, where every torch call costs several times its warm time."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    context_lens: list[int] = []
    cu = [0]
    logits_indices: list[int] = []
    table: list[int] = []  # [len(rows), max_blocks] row-major, zero-padded
    max_blocks = max(len(s.block_ids) for s in rows)
    for s in rows:
        num_rows = len(s.input_ids)
        row = cu[-1]
        table.extend(s.block_ids)
        table.extend([0] * (max_blocks - len(s.block_ids)))
        input_ids.extend(s.input_ids)
        positions.extend(s.positions)
        slots.extend(slot_of(s.block_ids, p, block_size) for p in range(s.start, s.start + num_rows))
        context_lens.append(s.start + num_rows)
        cu.append(row + num_rows)
        logits_indices.extend(row + r for r in s.logits_rows)
    mask_bits = _mask_bits(rows, cu) if any(s.mask_bits is not None for s in rows) else None
    n = cu[-1]
    longs = torch.tensor(input_ids + positions + slots + logits_indices, dtype=torch.int64, device=device)
    ids_t, pos_t, slots_t, logits_t = longs.split([n, n, n, len(logits_indices)])
    ints = torch.tensor(table + context_lens + cu, dtype=torch.int32, device=device)
    table_t, ctx_t, cu_t = ints.split([len(table), len(rows), len(rows) + 1])
    return ForwardBatch(
        input_ids=ids_t, positions=pos_t, slot_mapping=slots_t,
        block_tables=table_t.view(len(rows), max_blocks), context_lens=ctx_t, cu_seqlens_q=cu_t,
        mask_bits=None if mask_bits is None else mask_bits.to(device),
        logits_indices=logits_t,
    )


def build_forward_batch(
    seqs: list,  # list[ScheduledSeq]
    trees: list,  # per seq: None or its DraftTree (node 0 = the last sampled token)
    block_size: int,
    device: torch.device,
    pack=None,  # (rows, block_size, device) -> ForwardBatch; None = pack_forward_batch
) -> ForwardBatch:
    """Flatten the scheduled requests into one forward. A request's new tokens occupy the slots
    of positions `num_computed .. num_computed + n - 1`; draft-tree node i (node 0 = the last
    sampled token) occupies the slot of position `num_computed + i` and has RoPE position
    `num_computed + depth[i]`. Logits come back for every tree node, and for the last new token
    of a request whose step samples (not for an unfinished prefill chunk)."""
    return (pack or pack_forward_batch)(scheduled_rows(seqs, trees), block_size, device)


def scheduled_rows(seqs: list, trees: list) -> list[SeqRows]:
    """build_forward_batch's rows before packing (the CUDA graphs pack them padded to a bucket)."""
    rows = []
    for seq, tree in zip(seqs, trees):
        r = seq.request
        start = r.num_computed_tokens
        if tree is None:
            ids = r.all_token_ids[start:start + seq.num_new_tokens]
            rows.append(SeqRows(ids, range(start, start + len(ids)), start, r.block_ids, None,
                                [len(ids) - 1] if seq.samples else []))
        else:
            rows.append(SeqRows(tree.tokens, [start + d for d in tree.depth], start, r.block_ids,
                                tree.mask_bits(), range(len(tree.tokens))))
    return rows


def _mask_bits(rows: list[SeqRows], cu: list[int]) -> torch.Tensor:
    """Per-query packed masks for a batch that mixes causal and masked sequences: one width for
    all (the widest sequence's), a causal sequence gets its lower triangle. A batch of one
    tree (batch-1 verify, every speculative step of a lone agent) is its tree's bits as they are."""
    if len(rows) == 1:
        return rows[0].mask_bits
    num_words = max(max(-(-len(s.input_ids) // 32) for s in rows),
                    max(s.mask_bits.shape[1] for s in rows if s.mask_bits is not None))
    out = torch.zeros((cu[-1], num_words), dtype=torch.int32)
    for s, row in zip(rows, cu):
        num_rows = len(s.input_ids)
        bits = s.mask_bits
        if bits is None:
            bits = pack_bits(torch.tril(torch.ones(num_rows, num_rows, dtype=torch.bool)))
        out[row:row + num_rows, :bits.shape[1]] = bits
    return out
