"""What a prefill/decode split moves, as transport-free frames: a prompt to prefill, and the KV
pages plus the last position's logits that come back (runtime/prefill_worker.py computes them,
runtime/disaggregated.py receives them).

    message  = int64 header [op, args..., payload bytes] + a uint8 payload
    request  = [OP_PREFILL, request_num, num_tokens, skip_blocks] + the prompt's int64 ids
    handoff  = [OP_KV, request_num, num_blocks, -, timings (ns)...]
               + one uint8 payload: for each layer's tensors (k, v[, k_scale, v_scale]) the
                 pages [num_blocks, block_size, ...] in order, then the logits row [vocab] fp32

Only the KV and the logits row cross: the request (its grammar matcher, penalty counts, the
proposer's index, its RNG) has one owner, the decode worker, which samples the first token
from that row exactly as a co-located engine samples it from its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OP_PREFILL, OP_ABORT, OP_STOP = 1, 2, 3  # decode -> prefill
OP_KV, OP_FAILED, OP_READY = 11, 12, 13  # prefill -> decode
HEADER = 16  # int64 slots of every message's fixed header
PAYLOAD = HEADER - 1  # its last slot: the bytes of the uint8 payload that follows (0: none)
# timings in the handoff header, ns: the prompt's wait in the prefill worker, its prefill
# (first chunk scheduled -> logits), the pages' gather into the payload
T_QUEUE, T_PREFILL, T_GATHER = 4, 5, 6
ROW_DTYPE = 7  # the logits row's dtype, an index into ROW_DTYPES (sent as the model made it: exact)
ROW_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def header(op: int, *args: int) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[0] = op
    h[1:1 + len(args)] = torch.tensor(args, dtype=torch.int64)
    return h


def page_layout(kv_caches) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(page shape, dtype) of each tensor a block holds, in payload order: what two workers
    compare at startup, since a handoff is only meaningful between equal layouts."""
    return [(tuple(t.shape[1:]), t.dtype) for layer in kv_caches for t in layer.tensors()]


def gather_pages(kv_caches, block_ids: list[int], logits_row: torch.Tensor) -> torch.Tensor:
    """-> uint8 payload: every layer's pages of `block_ids`, then `logits_row` [vocab] in its own
    dtype. Each tensor's pages are gathered straight into their slice of the payload."""
    tensors = [t for layer in kv_caches for t in layer.tensors()]
    sizes = [len(block_ids) * t[0].numel() * t.element_size() for t in tensors]
    row = logits_row.detach().reshape(-1)
    payload = torch.empty(sum(sizes) + row.numel() * row.element_size(), dtype=torch.uint8)
    at = 0
    for t, n in zip(tensors, sizes):
        out = payload[at:at + n].view(t.dtype).view(len(block_ids), *t.shape[1:])
        idx = torch.tensor(block_ids, dtype=torch.int64, device=t.device)
        if t.device.type == "cpu":
            torch.index_select(t, 0, idx, out=out)
        else:  # only the chosen pages cross to the host
            out.copy_(t.index_select(0, idx))
        at += n
    payload[at:].view(row.dtype).copy_(row)
    return payload


def scatter_pages(kv_caches, block_ids: list[int], payload: torch.Tensor, vocab_size: int,
                  row_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Write a payload's pages into `block_ids` of this worker's cache -> the logits row [1, vocab].
    A payload of the wrong size raises ValueError before anything is written."""
    tensors = [t for layer in kv_caches for t in layer.tensors()]
    sizes = [len(block_ids) * t[0].numel() * t.element_size() for t in tensors]
    row_bytes = vocab_size * torch.empty((), dtype=row_dtype).element_size()
    if payload.numel() != sum(sizes) + row_bytes:
        raise ValueError(f"a KV handoff of {payload.numel()} bytes does not hold {len(block_ids)} pages "
                         f"and a logits row of {vocab_size}")
    at = 0
    for t, n in zip(tensors, sizes):
        pages = payload[at:at + n].view(t.dtype).view(len(block_ids), *t.shape[1:])
        t.index_copy_(0, torch.tensor(block_ids, dtype=torch.int64, device=t.device), pages.to(t.device))
        at += n
    return payload[at:].view(row_dtype).reshape(1, vocab_size).clone()


@dataclass
class HandoffTiming:
    """Where a split request's time to first token went (seconds)."""

    # submit -> the prefill worker's header here, less its prefill and gather: the send queue,
    # the link and the prompt's wait in the prefill worker's scheduler
    queue_s: float = 0.0
    prefill_s: float = 0.0  # the prefill worker's forwards of the prompt (first chunk -> logits)
    transfer_s: float = 0.0  # gather + the payload's receipt + scatter of the pages
    # the payload here -> the first token committed, less the scatter: waiting for the engine
    # thread's next step, then sampling and commit (the four parts add up to the TTFT after submit)
    first_decode_s: float = 0.0

    def as_dict(self) -> dict:
        return {"queue_s": self.queue_s, "prefill_s": self.prefill_s, "transfer_s": self.transfer_s,
                "first_decode_s": self.first_decode_s}
