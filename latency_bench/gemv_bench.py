"""Weight-streaming bandwidth of small-M CPU linears: F.linear vs prescient's cpu_linear kernel.

Batch-1 decode on CPU is bound by how fast weights stream from DRAM, so the figure of merit is
weight bytes read per second.  As in docs/CPU_PERFORMANCE.md, it streams 60 distinct
3072x576 matrices (212 MB bf16 / 425 MB fp32, far beyond the 32 MB L3) one after another, so
every call reads its weights from DRAM, at M=1 (decode) and M=8 (speculative verify); then the
49152x576 LM head (three copies in turn, so that it too comes from DRAM); then the per-call
overhead on a 64x64 matrix (cache-resident, so it is all fixed cost); then a decode-step
simulation (SmolLM2-135M's 30 layers of linears with the small torch ops between them) under
torch intra-op threads 1 and 2, which is how to choose ``torch.set_num_threads`` next to the
kernel's own pool.

F.linear and the kernel are timed in alternation, best of --reps passes each, so both see the
same background load; a busy machine (see the load line printed first) lowers both.

    .venv/bin/python -m prescient.latency_bench.gemv_bench [--reps R] [--no-decode]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from prescient.kernels import cpu_linear

DT_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _best_pair(fa, fb, reps: int) -> tuple[float, float]:
    """Best-of-`reps` seconds of fa() and fb(), alternated so both see the same background."""
    fa(), fb()  # warm: first-touch, oneDNN primitive creation, pool start
    ta = tb = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta, tb = min(ta, t1 - t0), min(tb, t2 - t1)
    return ta, tb


def dram_reference_gbs() -> float:
    """torch.sum over 1 GiB (the reference used in CPU_PERFORMANCE.md)."""
    buf = torch.ones(1 << 28, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def stream_gbs(dtype, M: int, n_mats: int, shape, reps: int) -> tuple[float, float]:
    """(F.linear GB/s, cpu_linear GB/s) streaming n_mats distinct [N, K] weights once each."""
    N, K = shape
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(n_mats)]
    packed = [cpu_linear.pack_weight(w) for w in ws]
    x = torch.randn(M, K, generator=g).to(dtype)
    outs = [torch.empty(M, N, dtype=dtype) for _ in range(n_mats)]

    def base():
        for w in ws:
            F.linear(x, w)

    def ours():
        for p, o in zip(packed, outs):
            p(x, out=o)

    ta, tb = _best_pair(base, ours, reps)
    nbytes = n_mats * N * K * ws[0].element_size()
    return nbytes / ta / 1e9, nbytes / tb / 1e9


def overhead_us(dtype, n: int = 20000) -> tuple[float, float, float]:
    """Median us/call on a 64x64 weight: F.linear, cpu_linear, cpu_linear with out=."""
    w = torch.randn(64, 64).to(dtype)
    x = torch.randn(1, 64).to(dtype)
    p = cpu_linear.pack_weight(w)
    out = torch.empty(1, 64, dtype=dtype)
    res = []
    for f in (lambda: F.linear(x, w), lambda: p(x), lambda: p(x, out=out)):
        for _ in range(1000):
            f()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            times.append((time.perf_counter() - t0) / n * 1e6)
        res.append(statistics.median(times))
    return tuple(res)


def decode_sim_ms(dtype, use_kernel: bool, reps: int, ctx: int = 256) -> float:
    """Best ms for one simulated SmolLM2-135M decode step: per layer q/k/v/o and gate/up/down
    linears with an RMSNorm-like op, RoPE-sized elementwise work, SDPA over `ctx` cached
    positions and SiLU-mul between them, then the tied 49152x576 LM head."""
    g = torch.Generator().manual_seed(1)
    H, D, KV, HD, I = 576, 9, 3, 64, 1536
    shapes = [(H, H), (KV * HD, H), (KV * HD, H), (H, H), (I, H), (I, H), (H, I)]
    layers = [[torch.randn(n, k, generator=g).to(dtype) * 0.02 for n, k in shapes]
              for _ in range(30)]
    head = torch.randn(49152, H, generator=g).to(dtype) * 0.02
    if use_kernel:
        layers = [[cpu_linear.pack_weight(w) for w in ws] for ws in layers]
        head_fn = cpu_linear.pack_weight(head)
        lin = lambda p, x: p(x)  # noqa: E731
    else:
        head_fn = lambda x: F.linear(x, head)  # noqa: E731
        lin = lambda w, x: F.linear(x, w)  # noqa: E731
    kc = torch.randn(1, D, ctx, HD, generator=g).to(dtype)
    vc = torch.randn(1, D, ctx, HD, generator=g).to(dtype)
    x0 = torch.randn(1, H, generator=g).to(dtype)

    def step():
        x = x0
        for q, k, v, o, gt, up, dn in layers:
            h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(dtype)
            qq, kk, vv = lin(q, h), lin(k, h), lin(v, h)
            kk = kk * 1.0001  # stand-in for RoPE / cache write
            a = F.scaled_dot_product_attention(qq.view(1, D, 1, HD), kc, vc)
            x = x + lin(o, a.reshape(1, H))
            h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(dtype)
            x = x + lin(dn, F.silu(lin(gt, h)) * lin(up, h))
        return head_fn(x)

    step()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="passes per measurement (best is kept)")
    ap.add_argument("--mats", type=int, default=60, help="distinct 3072x576 matrices streamed")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step simulation")
    args = ap.parse_args()

    info = cpu_linear.kernel_info()
    print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}; "
          f"cpu_linear: available={info['available']} isa={info.get('isa')} "
          f"threads={info.get('threads')} {info['reason'] or ''}")
    print(f"load average (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])} "
          f"on {os.cpu_count()} CPUs  (anything well above 0 means shared, noisy figures)")
    print(f"DRAM read reference (torch.sum over 1 GiB): {dram_reference_gbs():.1f} GB/s\n")

    rows = []
    for label, shape, mats, reps in [
            (f"{args.mats} x 3072x576", (3072, 576), args.mats, args.reps),
            # 3 distinct copies in turn: one 57 MB bf16 head alone is partly served from
            # the 32 MB L3 on repeats, which would flatter both columns.
            ("LM head 49152x576", (49152, 576), 3, args.reps * 2)]:
        for M in (1, 8):
            for dtype in (torch.float32, torch.bfloat16):
                rows.append((label, M, DT_NAME[dtype], *stream_gbs(dtype, M, mats, shape, reps)))
    print(f"{'weights streamed':<20} {'M':>2} {'dtype':<5} {'F.linear GB/s':>14} "
          f"{'cpu_linear GB/s':>16} {'speedup':>8}")
    for label, M, dn, base, ours in rows:
        print(f"{label:<20} {M:>2} {dn:<5} {base:>14.1f} {ours:>16.1f} {ours / base:>7.2f}x")
    share = cpu_linear.kernel_info().get("worker_share")
    if share is not None:
        print(f"(pool worker ran {share:.0%} of the row chunks; ~50% means it kept up, much less "
              f"means it was short of CPU)")

    print("\nper-call overhead, 64x64 weight, M=1 (median us/call):")
    for dtype in (torch.float32, torch.bfloat16):
        fl, ck, ck_out = overhead_us(dtype)
        print(f"  {DT_NAME[dtype]}: F.linear {fl:.2f}   cpu_linear {ck:.2f}   "
              f"cpu_linear(out=) {ck_out:.2f}")

    if not args.no_decode:
        print("\ndecode-step simulation, SmolLM2-135M shapes, 256 cached positions (best ms/step):")
        saved = torch.get_num_threads()
        for dtype in (torch.bfloat16, torch.float32):
            for tt in (1, 2):
                torch.set_num_threads(tt)
                base = decode_sim_ms(dtype, False, max(3, args.reps // 2))
                ours = decode_sim_ms(dtype, True, max(3, args.reps // 2))
                print(f"  {DT_NAME[dtype]} torch threads {tt}: F.linear {base:6.1f}   "
                      f"cpu_linear {ours:6.1f}")
        torch.set_num_threads(saved)


if __name__ == "__main__":
    main()
