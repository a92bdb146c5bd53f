"""gpu_check section 2: `prescient.kernels.ops.tree_attention` (Triton on CUDA) against PyTorch SDPA.

SDPA runs over KV gathered from the paged cache into contiguous tensors, SmolLM2-135M attention
shapes, bf16 on the GPU, timed with CUDA events (median of N per-call latencies). The section's
error measure is the largest |tree_attention - SDPA| over all cases; each case is checked
against the section's deadline before it starts and checkpointed into the report when done.
"""

from __future__ import annotations

import math
import random
import statistics
import time

from prescient.latency_bench.gpu_sections_common import fmt, sync, table

# Largest |tree_attention - SDPA| allowed, by dtype: the kernel tests' own bounds
# (tests/kernels/test_kernels_ops.py) for bf16; float32 is the reference path on CPU.
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}


def _random_tree_parents(size: int, rng: random.Random) -> list[int]:
    # A bushy chain, the shape n-gram and draft-model trees have: each node hangs below one of
    # the 3 nodes before it.
    return [-1] + [rng.randint(max(0, i - 3), i - 1) for i in range(1, size)]


def _ancestor_mask(parents: list[int]):
    import torch

    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def _time_calls(fn, num_layers: int, iters: int, warmup: int, device) -> dict:
    """Median per-call latency (µs) and the mean over back-to-back calls, cycling over the
    per-layer caches as a decode step does (so a long context is not served from L2)."""
    import torch

    for i in range(warmup):
        fn(i % num_layers)
    sync(device)
    per_call = []
    if device.type == "cuda":
        # An event pair around each call: the latency a decode step pays, launch overhead
        # included (the CPU issues each call, the GPU waits for it).
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(i % num_layers)
            end.record()
        torch.cuda.synchronize(device)
        per_call = [start.elapsed_time(end) * 1e3 for start, end in events]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i % num_layers)
        end.record()
        torch.cuda.synchronize(device)
        back_to_back = start.elapsed_time(end) * 1e3 / iters
    else:
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i % num_layers)
            per_call.append((time.perf_counter() - t0) * 1e6)
        back_to_back = statistics.fmean(per_call)
    return {"median_us": statistics.median(per_call), "back_to_back_us": back_to_back}


def run(ctx, device, dtype, tree_sizes, contexts, num_heads, num_kv_heads, head_dim,
        block_size, num_layers, iters, warmup, seed=0) -> dict:
    import torch
    import torch.nn.functional as F

    from prescient.kernels import ops
    from prescient.kernels.reference import pack_bits

    backend = "triton" if ops.use_triton(device) else "reference"
    scale = head_dim ** -0.5
    group = num_heads // num_kv_heads
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = []
    result = {"backend": backend, "dtype": str(dtype).replace("torch.", ""),
              "shapes": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                         "block_size": block_size, "layers_cycled": num_layers},
              "iters": iters, "cases_planned": len(contexts) * len(tree_sizes), "rows": rows}
    truncated = False
    for ctx_len in contexts:
        if ctx.expired():
            truncated = True
            break
        max_len = ctx_len + max(tree_sizes)
        blocks_needed = -(-max_len // block_size)
        num_blocks = blocks_needed + 1  # a spare block: the table is a strict subset, as in a server
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # One cache pair per layer, as the model has; filled with noise so softmax is not flat.
        caches = [(torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype))
                  for _ in range(num_layers)]
        # Shuffled blocks: a paged cache after some churn (Triton reads them in place, the
        # SDPA path has to gather them).
        order = list(range(num_blocks))
        rng.shuffle(order)
        block_table = torch.tensor([order[:blocks_needed]], dtype=torch.int32, device=device)
        for size in tree_sizes:
            if ctx.expired():
                truncated = True
                break
            context_len = ctx_len + size
            q = torch.randn(size, num_heads, head_dim, device=device).to(dtype)
            context_lens = torch.tensor([context_len], dtype=torch.int32, device=device)
            cu = torch.tensor([0, size], dtype=torch.int32, device=device)
            if size == 1:
                mask_bits, sdpa_mask = None, None  # plain decode: the engine passes no mask
            else:
                tree = _ancestor_mask(_random_tree_parents(size, rng))
                mask_bits = pack_bits(tree).to(device)
                sdpa_mask = torch.ones(size, context_len, dtype=torch.bool)
                sdpa_mask[:, ctx_len:] = tree
                sdpa_mask = sdpa_mask.to(device)
            used_blocks = block_table[0, : -(-context_len // block_size)].long()

            def gather(layer: int):
                k_cache, v_cache = caches[layer]
                k = k_cache.index_select(0, used_blocks).flatten(0, 1)[:context_len]
                v = v_cache.index_select(0, used_blocks).flatten(0, 1)[:context_len]
                # [1, num_kv_heads, context_len, head_dim], contiguous for SDPA's fused kernels
                return k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous()

            q4 = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, size, head_dim]

            def sdpa(k, v):
                return F.scaled_dot_product_attention(q4, k, v, attn_mask=sdpa_mask, scale=scale,
                                                      enable_gqa=group > 1)

            def run_tree(layer: int):
                k_cache, v_cache = caches[layer]
                return ops.tree_attention(q, k_cache, v_cache, block_table, context_lens, cu, mask_bits, scale)

            def run_gather_sdpa(layer: int):
                return sdpa(*gather(layer))

            gathered = [gather(layer) for layer in range(num_layers)]
            # The same KV with each kv head repeated for its query heads: SDPA without GQA, which
            # every fused backend accepts (with enable_gqa torch may fall back to its math path).
            expanded = [(k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
                        for k, v in gathered]

            def run_sdpa_only(layer: int):
                return sdpa(*gathered[layer])

            def run_sdpa_expanded(layer: int):
                k, v = expanded[layer]
                return F.scaled_dot_product_attention(q4, k, v, attn_mask=sdpa_mask, scale=scale)

            # Each variant on its own: one that fails (a backend rejecting a shape) leaves the
            # others' numbers standing.
            row = {"tree_size": size, "context": ctx_len, "backend": backend, "errors": {}}
            variants = {"tree_attention": run_tree, "gather_sdpa": run_gather_sdpa, "sdpa_only": run_sdpa_only,
                        "sdpa_expanded": run_sdpa_expanded}
            for name, fn in variants.items():
                try:
                    timing = _time_calls(fn, num_layers, iters, warmup, device)
                except Exception as e:
                    timing = {"median_us": None, "back_to_back_us": None}
                    row["errors"][name] = f"{type(e).__name__}: {e}"[:500]
                row[f"{name}_us"], row[f"{name}_b2b_us"] = timing["median_us"], timing["back_to_back_us"]
            try:
                want = run_sdpa_only(0)[0].transpose(0, 1).float()
                row["max_abs_err"] = (run_tree(0).float() - want).abs().max().item()
            except Exception as e:
                row["max_abs_err"] = None
                row["errors"].setdefault("compare", f"{type(e).__name__}: {e}"[:500])
            ok = row["tree_attention_us"] and row["gather_sdpa_us"]
            row["speedup_vs_gather_sdpa"] = row["gather_sdpa_us"] / row["tree_attention_us"] if ok else None
            rows.append(row)
            del gathered, expanded
            ctx.checkpoint({**result, **_summarise(rows)})
        del caches
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if truncated:
            break
    if not rows:
        return {**result, "status": "skipped", "reason": "time limit before the first case"}
    return {**result, **_summarise(rows), "truncated": "time limit" if truncated else None}


def _summarise(rows: list[dict]) -> dict:
    errs = [r["max_abs_err"] for r in rows if r["max_abs_err"] is not None]
    # NaN stays NaN (max() would drop it depending on order): it must fail the tolerance check.
    measured = (math.nan if any(math.isnan(e) for e in errs) else max(errs)) if errs else None
    errors = {f"tree {r['tree_size']}, context {r['context']}, {name}": err
              for r in rows for name, err in r["errors"].items()}
    return {"measured_error": measured, "errors": errors, "cases_done": len(rows)}


def render(a: dict) -> list[str]:
    if not a.get("rows"):
        return []
    sh = a["shapes"]
    out = [f"`ops.tree_attention` ({a['backend']}) vs `F.scaled_dot_product_attention` (enable_gqa, tree "
           f"mask) on KV gathered from shuffled paged blocks; {a['dtype']}, {sh['num_heads']} q heads, "
           f"{sh['num_kv_heads']} kv heads, head_dim {sh['head_dim']}, block {sh['block_size']}, cycling "
           f"{sh['layers_cycled']} per-layer caches. Median of {a['iters']} per-call latencies in µs "
           "(launch overhead included); the SDPA-only columns have the KV pre-gathered (KV contiguous: "
           "enable_gqa, as the torch reference path runs it; heads expanded: kv heads repeated, no GQA); "
           "b2b: mean over back-to-back calls, closer to pure GPU time.", ""]
    out.append(table(
        ["tree", "context", "tree_attention µs", "gather+SDPA µs", "SDPA µs (KV contiguous)",
         "SDPA µs (heads expanded)", "speedup vs gather+SDPA", "b2b µs tree / gather+SDPA", "max abs err"],
        [[r["tree_size"], r["context"], fmt(r["tree_attention_us"]), fmt(r["gather_sdpa_us"]),
          fmt(r["sdpa_only_us"]), fmt(r["sdpa_expanded_us"]),
          fmt(r["speedup_vs_gather_sdpa"], 2) + "x" if r["speedup_vs_gather_sdpa"] else "–",
          f"{fmt(r['tree_attention_b2b_us'])} / {fmt(r['gather_sdpa_b2b_us'])}",
          "–" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e}"]
         for r in a["rows"]]))
    if a.get("truncated"):
        out.append(f"Stopped at the time limit: {a.get('cases_done')} of {a.get('cases_planned')} cases ran.")
    for r in a["rows"]:
        for name, err in r["errors"].items():
            out.append(f"Failed: tree {r['tree_size']}, context {r['context']}, {name}: {err}")
    return out
