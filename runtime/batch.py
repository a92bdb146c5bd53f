"""`ForwardBatch`: everything one target forward needs, as flat tensors (vLLM vocabulary).

The new tokens of all scheduled requests (prefill chunks, plain decode tokens, draft-tree nodes)
are concatenated; `cu_seqlens_q` marks where each request's rows start. Data reaches the model
through this argument only: no globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def build_forward_batch(
    seqs: list,  # list[ScheduledSeq]
    trees: list,  # per seq: None or its DraftTree (node 0 = the last sampled token)
    block_size: int,
    device: torch.device,
) -> ForwardBatch:
    """Flatten the scheduled requests into one forward. A request's new tokens occupy the slots
    of positions `num_computed .. num_computed + n - 1`; draft-tree node i (node 0 = the last
    sampled token) occupies the slot of position `num_computed + i` and has RoPE position
    `num_computed + depth[i]`."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    context_lens: list[int] = []
    cu = [0]
    logits_indices: list[int] = []
    mask_rows: list[tuple[int, int, list[int] | None]] = []  # (row start, q_len, tree mask words)
    any_tree = False
    max_blocks = max(len(s.request.block_ids) for s in seqs)
    table = torch.zeros((len(seqs), max_blocks), dtype=torch.int32)
    for i, (seq, tree) in enumerate(zip(seqs, trees)):
        r = seq.request
        start = r.num_computed_tokens
        table[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        if tree is None:
            ids = r.all_token_ids[start:start + seq.num_new_tokens]
            pos = list(range(start, start + len(ids)))
        else:
            ids = list(tree.tokens)
            pos = [start + d for d in tree.depth]
            any_tree = True
        row = len(input_ids)
        input_ids.extend(ids)
        positions.extend(pos)
        for p in range(start, start + len(ids)):
            slots.append(r.block_ids[p // block_size] * block_size + p % block_size)
        context_lens.append(start + len(ids))
        cu.append(len(input_ids))
        if tree is not None:
            logits_indices.extend(range(row, row + len(ids)))
        elif seq.samples:
            logits_indices.append(row + len(ids) - 1)
        mask_rows.append((row, len(ids), None if tree is None else tree.mask_bits()))
    mask_bits = _mask_bits(mask_rows, len(input_ids)) if any_tree else None
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=as_long(input_ids), positions=as_long(positions), slot_mapping=as_long(slots),
        block_tables=table.to(device), context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        mask_bits=None if mask_bits is None else mask_bits.to(device),
        logits_indices=as_long(logits_indices),
    )


def _mask_bits(rows: list[tuple[int, int, torch.Tensor | None]], num_tokens: int) -> torch.Tensor:
    """Per-query packed masks for a batch that mixes causal rows and tree rows."""
    num_words = max(-(-q_len // 32) for _, q_len, _ in rows)
    out = torch.zeros((num_tokens, num_words), dtype=torch.int32)
    for row, q_len, tree_bits in rows:
        if tree_bits is not None:
            out[row:row + q_len, :tree_bits.shape[1]] = tree_bits
        else:
            causal = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))
            out[row:row + q_len, :] = F.pad(pack_bits(causal), (0, num_words - (q_len + 31) // 32))
    return out

