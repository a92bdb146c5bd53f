"""Efficiency figures: measured DRAM read bandwidth and GEMM peak, bytes and FLOPs per step.

Batch-1 decode on CPU is memory-bandwidth bound, so the figure of merit is bytes read per step
over measured read bandwidth: the floor is `weight_bytes / bandwidth` seconds per step (every
weight is read once per forward, whether it verifies 1 token or 11). Bandwidth utilization adds
the KV bytes the step reads (context length x KV bytes per token). MFU divides model FLOPs per
second (2 x matmul parameters per token + attention over the context) by the GEMM rate
measured here, in the same dtype: a measured peak, not a datasheet one, and it says so.
"""

from __future__ import annotations

import os
import platform
import time

import torch


def probe_buffer(num_bytes: int) -> torch.Tensor:
    """float32 ones (num_bytes // 4 of them) in the memory the kernels stream from (huge pages
    where the OS gives them, kernels/huge_pages.py): a read floor on 4 KiB pages would sit below
    what the kernels reach."""
    from prescient.kernels import huge_pages

    return huge_pages.zeros(num_bytes // 4 * 4).view(torch.float32).fill_(1.0)


def measure_read_bandwidth(num_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of torch.sum over a `num_bytes` float32 buffer (best of `reps`), as in
    docs/CPU_PERFORMANCE.md."""
    buf = probe_buffer(num_bytes)
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    del buf
    return num_bytes / best


class BandwidthProbe:
    """Read bandwidth sampled several times in a run. Another process streaming memory or holding
    a core during a sample lowers it (on 2 cores, one thread's bandwidth is about half of two's),
    so each sample is metered (contention.py) and the figure used is the median of the samples
    taken while other processes used at most `max_foreign` of the CPUs (of all when none was)."""

    def __init__(self, num_bytes: int = 1 << 30, max_foreign: float = 0.2, threads: int | None = None):
        self.num_bytes = num_bytes
        self.max_foreign = max_foreign
        self.threads = threads or torch.get_num_threads()  # every sample on the same thread count
        self.samples: list[dict] = []

    def sample(self, label: str) -> None:
        from prescient.latency_bench.contention import CpuMeter
        from prescient.latency_bench.context import torch_threads

        with CpuMeter() as meter, torch_threads(self.threads):
            value = measure_read_bandwidth(self.num_bytes)
        self.samples.append({"at": label, "bytes_s": value, "foreign_cpu": meter.foreign_share})

    def value(self) -> float:
        clean = [s["bytes_s"] for s in self.samples
                 if s["foreign_cpu"] is not None and s["foreign_cpu"] <= self.max_foreign]
        values = sorted(clean or [s["bytes_s"] for s in self.samples])
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def measure_gemm_flops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n x n x n torch.mm in `dtype` (best of `reps`): the 'peak' MFU divides by."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_avg_start": list(os.getloadavg()),
    }


# ---------------------------------------------------------------- model arithmetic

def prescient_model_bytes(model) -> int:
    """Weight bytes one forward reads: every linear (the LM head included; a tied head is the
    embedding table, read in full once) and the norms. Embedding lookups read one row: ignored."""
    total = sum(lin.weight_bytes for layer in model.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    total += sum(t.nbytes for layer in model.layers for t in (layer.attn_norm, layer.mlp_norm))
    return total + model.lm_head.weight.nbytes + model.norm.nbytes


def hf_model_bytes(model) -> int:
    """The same for a transformers model: every parameter once (a tied head shares storage), the
    input embedding excluded unless it is the tied LM head."""
    seen, total = set(), 0
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p is embed and embed.data_ptr() != head.data_ptr():
            continue
        total += p.nbytes
    return total


def matmul_params(cfg) -> int:
    """Parameters in matrix products per token (layers + LM head), from a prescient ModelConfig."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def flops_per_token(cfg, context_len: int) -> float:
    """2 FLOPs per matmul parameter + QK^T and AV over `context_len` keys in every layer."""
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_len
    return 2 * matmul_params(cfg) + attn


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()


def decode_efficiency(steps: list[tuple[int, int]], seconds: float, weight_bytes: int, kv_bytes_tok: int,
                      cfg, bandwidth: float, peak_flops: float) -> dict:
    """From decode steps of one stream: (context_len, tokens emitted) per step, over `seconds`.

    A step reads all weights plus the KV of its context once, whatever number of tokens it
    verifies; every token it emits costs the model FLOPs of one position."""
    if not steps or seconds <= 0:
        return {"bandwidth_util": None, "mfu": None, "bytes_per_step": None}
    read = sum(weight_bytes + ctx * kv_bytes_tok for ctx, _ in steps)
    flops = sum(n * flops_per_token(cfg, ctx) for ctx, n in steps)
    return {
        "bandwidth_util": read / seconds / bandwidth,
        "mfu": flops / seconds / peak_flops,
        "bytes_per_step": read / len(steps),
    }
