"""Cost of a k-token verify step relative to a 1-token decode step, measured on the model itself.

Speculation pays only if verifying k draft tokens costs much less than k decode steps. On a
bandwidth-bound CPU a forward reads every weight once however many rows it carries, so the
ratio should stay near 1 until the GEMMs turn compute bound. This times `LlamaModel.forward`
directly after a prefill of `context_len` tokens: k = 1 as plain decoding runs it (causal, one
logits row), k > 1 as a chain draft is verified (a per-query mask as the engine builds for a
draft tree, logits for every row). The ks are interleaved within each repetition, so machine
noise hits them alike; the median per k is reported.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from prescient.kernels.reference import pack_bits
from prescient.runtime.batch import ForwardBatch


def _batch(tokens: list[int], start: int, block_table: list[int], block_size: int, tree_mask: bool,
           all_logits: bool) -> ForwardBatch:
    n = len(tokens)
    positions = list(range(start, start + n))
    slots = [block_table[p // block_size] * block_size + p % block_size for p in positions]
    mask = pack_bits(torch.tril(torch.ones(n, n, dtype=torch.bool))) if tree_mask else None
    return ForwardBatch(
        input_ids=torch.tensor(tokens, dtype=torch.int64), positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        context_lens=torch.tensor([start + n], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        mask_bits=mask, logits_indices=torch.arange(n) if all_logits else torch.tensor([n - 1]),
    )


def measure_verify_cost(model, context_len: int = 512, ks: tuple[int, ...] = (1, 2, 4, 8, 11, 16),
                        reps: int = 7, block_size: int = 16, seed: int = 0) -> dict:
    ks = tuple(sorted(set(ks) | {1}))  # every ratio is against the 1-token step
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    num_blocks = -(-(context_len + max(ks)) // block_size)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    table = list(range(num_blocks))
    prompt = [rng.randrange(vocab) for _ in range(context_len)]
    for start in range(0, context_len, 256):  # prefill in chunks, as the scheduler would
        chunk = prompt[start:start + 256]
        model.forward(_batch(chunk, start, table, block_size, False, False), kv)
    batches = {k: _batch([rng.randrange(vocab) for _ in range(k)], context_len, table, block_size,
                         tree_mask=k > 1, all_logits=k > 1) for k in ks}
    for k in ks:  # warm-up: first calls pay for allocations and kernel dispatch
        model.forward(batches[k], kv)
    times: dict[int, list[float]] = {k: [] for k in ks}
    order = list(ks)
    for _ in range(reps):
        rng.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            model.forward(batches[k], kv)
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times[1])
    rows = []
    for k in ks:
        med = statistics.median(times[k])
        rows.append({"k": k, "ms": med * 1e3, "ms_min": min(times[k]) * 1e3, "ratio_vs_1": med / base,
                     "ms_per_token": med * 1e3 / k})
    del kv
    return {"dtype": str(model.dtype).replace("torch.", ""), "context_len": context_len, "reps": reps, "rows": rows}
