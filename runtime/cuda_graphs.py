"""CUDA graphs for decode and verify forwards over bucketed batch shapes (EngineConfig.cuda_graphs).

A decode step of a small model on a GPU is launch-bound: ~31 launches a layer, each a few
microseconds of host time, where the kernels themselves take less. A CUDA graph replays the
whole forward as one launch. A graph is fixed in its shapes and addresses, so:

- a step is padded to a bucket: `Bucket(seqs, tokens, mask_words)`, batch sizes from
  BATCH_BUCKETS, verify rows from TOKEN_BUCKETS, mask widths 1 or 2 words (trees of up to 64
  nodes); decode steps (every sequence one token, no mask) have tokens == seqs;
- padding is a dummy sequence holding every pad token (slots -1: its K/V is never stored, block
  table row 0: its reads stay in bounds, mask bit 0: each row sees a token, so no NaN) plus empty
  sequences (q_len 0, allowed by the tree_attention contract); its logits rows are dropped;
- the block table is padded to the engine's full width (max_seq_len / block_size), so the
  attention kernel's grid and KV splits, decided from shapes, never change between replays;
- all inputs live in one static int64 tensor per bucket, filled by the staging buffer's one
  non-blocking copy (`StagingBuffer.upload_into`); the int32 views are made inside the graph.

Prefill chunks, chunks split by layers and handed-off rows run eagerly (`try_forward` returns
None). Decode buckets up to max_num_seqs are captured when the engine is built, verify buckets on
first use (at most MAX_GRAPHS). Requires the device path on CUDA; off by default until a GPU run
has validated it. The padding (`pack_bucketed` + `batch_from_flat`) is plain torch and is checked
on the CPU (tests/runtime/test_device_path.py); capture and replay have only CUDA.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from prescient.runtime.batch import ForwardBatch, SeqRows, _mask_bits, scheduled_rows, slot_of

log = logging.getLogger("prescient.cuda_graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_MASK_WORDS = 2
MAX_GRAPHS = 64


@dataclass(frozen=True)
class Bucket:
    seqs: int
    tokens: int
    mask_words: int  # 0: a decode bucket (causal, one token a sequence)


def _ceil(values: tuple[int, ...], n: int) -> int | None:
    return next((v for v in values if v >= n), None)


def bucket_for(num_seqs: int, num_tokens: int, mask_words: int) -> Bucket | None:
    """The smallest bucket that holds a step, or None (run it eagerly). A padded step needs one
    sequence more than it has, for the dummy that holds the pad tokens."""
    if mask_words == 0:
        seqs = _ceil(BATCH_BUCKETS, num_seqs)
        return None if seqs is None else Bucket(seqs, seqs, 0)
    if mask_words > MAX_MASK_WORDS:
        return None
    tokens = _ceil(TOKEN_BUCKETS, num_tokens)
    if tokens is None:
        return None
    seqs = _ceil(BATCH_BUCKETS, num_seqs + (tokens > num_tokens))
    return None if seqs is None else Bucket(seqs, tokens, MAX_MASK_WORDS)


def flat_size(b: Bucket, max_blocks: int) -> int:
    return 4 * b.tokens + 2 * b.seqs + 1 + b.seqs * max_blocks + b.tokens * b.mask_words


def pack_bucketed(rows: list[SeqRows], block_size: int, b: Bucket, max_blocks: int) -> tuple[list, int]:
    """The padded step as flat int64 parts, in batch_from_flat's layout, and its real logits
    row count: [input_ids, positions, slots, logits_indices] (each b.tokens), context_lens
    (b.seqs), cu_seqlens (b.seqs + 1), block table (b.seqs x max_blocks), mask (b.tokens x words)."""
    ids, pos, slots, ctx, cu, logit_rows = [], [], [], [], [0], []
    table = torch.zeros(b.seqs, max_blocks, dtype=torch.int64)
    for i, s in enumerate(rows):
        n, row = len(s.input_ids), cu[-1]
        table[i, :len(s.block_ids)] = torch.as_tensor(list(s.block_ids), dtype=torch.int64)
        ids.extend(s.input_ids)
        pos.extend(s.positions)
        slots.extend(slot_of(s.block_ids, p, block_size) for p in range(s.start, s.start + n))
        ctx.append(s.start + n)
        cu.append(row + n)
        logit_rows.extend(row + r for r in s.logits_rows)
    num_logits, pad = len(logit_rows), b.tokens - cu[-1]
    if pad:  # the dummy: every pad token, its K/V never stored, reading block 0
        ids += [0] * pad
        pos += range(pad)
        slots += [-1] * pad
        ctx.append(pad)
        cu.append(cu[-1] + pad)
    while len(ctx) < b.seqs:  # empty sequences
        ctx.append(0)
        cu.append(cu[-1])
    logit_rows += [0] * (b.tokens - num_logits)
    parts = [ids, pos, slots, logit_rows, ctx, cu, table.reshape(-1)]
    if b.mask_words:
        mask = torch.zeros(b.tokens, b.mask_words, dtype=torch.int64)
        real = _mask_bits(rows, cu[:len(rows) + 1]) if any(s.mask_bits is not None for s in rows) else None
        if real is not None:
            mask[:real.shape[0], :real.shape[1]] = real.to(torch.int64)
        mask[cu[len(rows)]:, 0] = 1  # pad rows see their sequence's token 0
        parts.append(mask.reshape(-1))
    return parts, num_logits


def batch_from_flat(flat: torch.Tensor, b: Bucket, max_blocks: int) -> ForwardBatch:
    """The ForwardBatch over a bucket's static int64 tensor (views; int32 fields converted)."""
    t, s = b.tokens, b.seqs
    o = [0]

    def take(n):
        o[0] += n
        return flat[o[0] - n:o[0]]

    ids, pos, slots, logit_rows = take(t), take(t), take(t), take(t)
    ctx, cu, table = take(s), take(s + 1), take(s * max_blocks)
    mask = take(t * b.mask_words).view(t, b.mask_words).to(torch.int32) if b.mask_words else None
    return ForwardBatch(input_ids=ids, positions=pos, slot_mapping=slots,
                        block_tables=table.view(s, max_blocks).to(torch.int32), context_lens=ctx.to(torch.int32),
                        cu_seqlens_q=cu.to(torch.int32), mask_bits=mask, logits_indices=logit_rows)


def graphable(seqs: list, trees: list) -> bool:
    """A decode or verify step: every sequence a tree, or one sampled token; no chunk."""
    return all(getattr(s, "layers", None) is None and getattr(s, "logits", None) is None
               and (t is not None or (s.num_new_tokens == 1 and s.samples)) for s, t in zip(seqs, trees))


class GraphRunner:
    """The captured forwards of one engine (model, KV cache, staging buffer)."""

    def __init__(self, model, kv_caches, staging, max_blocks: int, max_num_seqs: int):
        self.model, self.kv_caches, self.staging = model, kv_caches, staging
        self.max_blocks = max_blocks
        self.graphs: dict[Bucket, tuple] = {}  # bucket -> (graph, static flat, static logits)
        self.pool = torch.cuda.graph_pool_handle()
        self.num_replays = self.num_eager = 0
        for seqs in BATCH_BUCKETS:
            if seqs <= max_num_seqs:
                self._capture(Bucket(seqs, seqs, 0))

    @classmethod
    def for_engine(cls, engine) -> "GraphRunner":
        if engine.model.device.type != "cuda" or not engine.path.device_side:
            raise ValueError("cuda_graphs needs a CUDA model and the device step path")
        block_size = engine.block_manager.block_size
        return cls(engine.model, engine.kv_caches, engine.path.staging, math.ceil(engine.max_seq_len / block_size),
                   engine.config.scheduler.max_num_seqs)

    def _capture(self, b: Bucket) -> None:
        device = self.model.device
        flat = torch.zeros(flat_size(b, self.max_blocks), dtype=torch.int64, device=device)
        # safe inputs while warming up and capturing: one sequence owning every token, nothing stored
        parts, _ = pack_bucketed([], 1, b, self.max_blocks)
        parts[2] = [-1] * b.tokens
        self.staging.upload_into(parts, flat)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton compiles, cuBLAS picks its kernels: outside the capture
                self.model.forward(batch_from_flat(flat, b, self.max_blocks), self.kv_caches)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(batch_from_flat(flat, b, self.max_blocks), self.kv_caches)
        self.graphs[b] = (graph, flat, logits)

    def try_forward(self, seqs: list, trees: list, block_size: int) -> torch.Tensor | None:
        """The step's logits [num_logits, vocab] from a graph replay, or None: not a decode or
        verify step, no bucket holds it, or no more graphs may be captured."""
        if not seqs or not graphable(seqs, trees):
            return None
        rows = scheduled_rows(seqs, trees)
        num_tokens = sum(len(r.input_ids) for r in rows)
        words = max((r.mask_bits.shape[1] for r in rows if r.mask_bits is not None), default=0)
        b = bucket_for(len(rows), num_tokens, words)
        if b is None or max(len(r.block_ids) for r in rows) > self.max_blocks:
            self.num_eager += 1
            return None
        if b not in self.graphs:
            if len(self.graphs) >= MAX_GRAPHS:
                self.num_eager += 1
                return None
            log.info("capturing a CUDA graph for %s", b)
            self._capture(b)
        graph, flat, logits = self.graphs[b]
        parts, num_logits = pack_bucketed(rows, block_size, b, self.max_blocks)
        self.staging.upload_into(parts, flat)
        graph.replay()
        self.num_replays += 1
        return logits[:num_logits].clone()  # the next replay rewrites the static output
