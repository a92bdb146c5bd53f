"""gpu_check section: tensor parallel TP=2 on two GPUs (runtime/tp_worker.py, NCCL all-reduces).

A random-init model with the default model's config (9 query / 3 KV heads: 2 groups on GPU 0,
1 on GPU 1) runs one prefill and a batch-1 decode loop at TP=1 (GPU 0 alone) and at TP=2 (this
process is rank 0 on GPU 0, one spawned worker on GPU 1). Measured error: max |logits TP=2 -
TP=1| over the prefill and decode steps, relative to the largest logit; figures: decode ms/token
of each. Skipped, with a line saying so, on a machine with fewer than two GPUs; --cpu-smoke
runs it on a tiny config as two CPU processes over gloo.
"""

from __future__ import annotations

import time

from prescient.latency_bench.gpu_sections_common import failure, fmt, fmt_err, sync, table

# the ranks' partial sums are added in another order: bf16 rounding of 30 layers, fp32 far less
TOLERANCE = {"bfloat16": 5e-2, "float32": 1e-4}


def run(ctx, dtype, device: str = "cuda", config=None, prompt_len: int = 256, new_tokens: int = 64) -> dict:
    """device "cuda": GPUs 0 and 1 (NCCL); "cpu" (--cpu-smoke): two CPU processes over gloo."""
    import torch

    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"status": "skipped",
                "reason": f"TP=2 needs two GPUs; this machine has {torch.cuda.device_count()}"}
    from prescient.latency_bench.gpu_sections_decode import random_weights, smollm2_135m_config
    from prescient.runtime import tp_worker
    from prescient.runtime.batch import SeqRows, pack_forward_batch
    from prescient.runtime.model import LlamaModel

    config = config or smollm2_135m_config()
    block = 16
    weights = random_weights(config, torch.device("cpu"), dtype)
    out: dict = {"model": config.name, "dtype": str(dtype).replace("torch.", ""), "rows": [], "errors": []}
    n_blocks = -(-(prompt_len + new_tokens) // block) + 1
    blocks = list(range(n_blocks))
    ids = torch.randint(0, config.vocab_size, (prompt_len + new_tokens,), generator=torch.Generator().manual_seed(0))

    def measure(model, device) -> tuple[list, float]:
        kv = model.allocate_kv_cache(n_blocks, block)
        logits = [model.forward(pack_forward_batch([SeqRows(ids[:prompt_len].tolist(), range(prompt_len), 0, blocks,
                                                             None, [prompt_len - 1])], block, device), kv)]
        sync(device)
        t0 = time.perf_counter()
        for i in range(prompt_len, prompt_len + new_tokens):
            b = pack_forward_batch([SeqRows([int(ids[i])], [i], i, blocks, None, [0])], block, device)
            logits.append(model.forward(b, kv))
        sync(device)
        return [t.float().cpu() for t in logits], (time.perf_counter() - t0) * 1e3 / new_tokens

    tp = None
    try:
        dev0 = torch.device("cuda:0" if device == "cuda" else "cpu")
        one = LlamaModel(config, weights, dtype=dtype, device=dev0)
        ref, ms1 = measure(one, dev0)
        del one
        out["rows"].append({"mode": "TP=1 (GPU 0)" if device == "cuda" else "TP=1", "ms_per_token": ms1})
        ctx.checkpoint(out)
        tp = tp_worker.launch(tp_worker.GivenWeights(config, weights), 2, {"dtype": dtype}, device=device)
        got, ms2 = measure(tp, tp.device)
        out["rows"].append({"mode": "TP=2 (GPUs 0+1, NCCL)" if device == "cuda" else "TP=2 (gloo)",
                            "ms_per_token": ms2})
        scale = max(r.abs().max().item() for r in ref)
        out["measured_error"] = max((g - r).abs().max().item() for g, r in zip(got, ref)) / scale
        out["greedy_equal"] = all(bool((g.argmax(-1) == r.argmax(-1)).all()) for g, r in zip(got, ref))
    except Exception as e:  # noqa: BLE001 - recorded, the next section runs
        out["errors"].append(failure(e))
    finally:
        if tp is not None:
            tp.close()
    return out


def render(d: dict) -> list[str]:
    if not d.get("rows"):
        return []
    lines = [f"{d['model']}, {d['dtype']}, batch-1 decode after a prefill; relative logit error TP=2 vs TP=1: "
             f"{fmt_err(d.get('measured_error'))}, greedy argmax equal: {d.get('greedy_equal', '–')}", ""]
    lines.append(table(["mode", "ms/token"], [[r["mode"], fmt(r["ms_per_token"], 2)] for r in d["rows"]]))
    return lines
