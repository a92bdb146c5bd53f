"""Weight-streaming bandwidth of small-M CPU linears: F.linear vs prescient's cpu_linear kernel.

Batch-1 decode on CPU is bound by how fast weights stream from DRAM, so the figure of merit is
weight bytes read per second.  As in shared/design/CPU_PERFORMANCE.md, it streams 60 distinct
3072x576 matrices (212 MB bf16 / 425 MB fp32, far beyond the L3) one after another, so every
call reads its weights from DRAM, at M=1 (decode) and M=8 (speculative verify); then the
49152x576 LM head alone; then the per-call overhead on a 64x64 matrix (cache-resident, so it
is all fixed cost).  A DRAM read-bandwidth reference (torch.sum over 1 GiB) gives the floor.

    .venv/bin/python -m prescient.latency_bench.gemv_bench [--torch-threads N] [--reps R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from prescient.kernels import cpu_linear


def _time_stream(fns, reps: int) -> float:
    """Best-of-`reps` seconds for one pass calling every fn in `fns` once (after a warm pass)."""
    for f in fns:
        f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for f in fns:
            f()
        best = min(best, time.perf_counter() - t0)
    return best


def dram_reference_gbs() -> float:
    buf = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    buf.sum()
    t = min(_timeit(lambda: buf.sum(), 1) for _ in range(5))
    return buf.numel() * 4 / t / 1e9


def _timeit(f, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def stream_gbs(dtype, M: int, use_kernel: bool, n_mats: int, shape, reps: int) -> float:
    N, K = shape
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(n_mats)]
    x = torch.randn(M, K, generator=g).to(dtype)
    if use_kernel:
        packed = [cpu_linear.pack_weight(w) for w in ws]
        fns = [lambda p=p: p(x) for p in packed]
    else:
        fns = [lambda w=w: F.linear(x, w) for w in ws]
    t = _time_stream(fns, reps)
    return n_mats * N * K * ws[0].element_size() / t / 1e9


def overhead_us(dtype, use_kernel: bool, n: int = 20000) -> float:
    w = torch.randn(64, 64).to(dtype)
    x = torch.randn(1, 64).to(dtype)
    f = (lambda p=cpu_linear.pack_weight(w): p(x)) if use_kernel else (lambda: F.linear(x, w))
    _timeit(f, 1000)
    return statistics.median(_timeit(f, n) for _ in range(5)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads before measuring (default: leave torch's)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mats", type=int, default=60)
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    info = cpu_linear.kernel_info()
    print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}; "
          f"cpu_linear: {info}")
    print(f"DRAM read reference (torch.sum over 1 GiB): {dram_reference_gbs():.1f} GB/s")
    print()
    rows = []
    for label, shape, mats in [(f"{args.mats} x 3072x576", (3072, 576), args.mats),
                               ("LM head 49152x576", (49152, 576), 1)]:
        reps = args.reps if mats > 1 else args.reps * 3
        for M in (1, 8):
            for dtype in (torch.float32, torch.bfloat16):
                dn = "fp32" if dtype == torch.float32 else "bf16"
                base = stream_gbs(dtype, M, False, mats, shape, reps)
                ours = stream_gbs(dtype, M, True, mats, shape, reps)
                rows.append((label, M, dn, base, ours))
    print(f"{'workload':<20} {'M':>2} {'dtype':<5} {'F.linear GB/s':>14} {'cpu_linear GB/s':>16}"
          f" {'speedup':>8}")
    for label, M, dn, base, ours in rows:
        print(f"{label:<20} {M:>2} {dn:<5} {base:>14.1f} {ours:>16.1f} {ours / base:>7.2f}x")
    print()
    print("per-call overhead, 64x64, M=1 (us/call):")
    for dtype in (torch.float32, torch.bfloat16):
        dn = "fp32" if dtype == torch.float32 else "bf16"
        print(f"  {dn}: F.linear {overhead_us(dtype, False):.2f}  "
              f"cpu_linear {overhead_us(dtype, True):.2f}")


if __name__ == "__main__":
    main()
