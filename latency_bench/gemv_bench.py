"""Weight-streaming bandwidth of small-M CPU linears per ISA tier: F.linear vs prescient's cpu_linear.

Batch-1 decode on CPU is bound by how fast weights stream from DRAM, so the figure of merit is
weight bytes read per second.  Each case cycles through enough distinct copies of a matrix
(1536x576: --mats copies, 57 MB bf16 / 113 MB fp32 at the default 32; the 49152x576 LM head: 3
copies) that every call reads its weights from DRAM (the L3 is 32 MB), at M = 1 (decode), 4, 8
and 16 (speculative verify), for fp32 and bf16 weights, and runs the kernel at every ISA tier
this CPU has (``cpu_linear.machine_tiers()``, selected with ``_set_isa_cap``) beside F.linear.
The floors to compare GB/s with are streaming reads of a 256 MiB buffer (on huge pages where the
OS gives them, as the weights are): torch.sum (torch's
threads), and pg_read_probe in the kernels' .so (a vectorised XOR over the kernels' own thread
pool with their software prefetch: the read bandwidth the GEMV can hope for).

Then the per-call overhead on a 64x64 matrix (cache-resident: all fixed cost) and the prefill
of a bf16 weight (512 tokens x 576 @ 576x1536 and @ 576x49152) both ways: torch's bf16 GEMM
(F.linear, oneDNN) and cpu_linear's fp32 row-block GEMM (what PackedLinear runs below the
avx512_bf16 tier), with fp32 weights through F.linear for reference.  oneDNN picks its code from
the real CPU, not from PRESCIENT_ISA; to see what an AVX2-only host does, run with
``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PRESCIENT_ISA=avx2``.

All contenders of one case are timed in alternation, best of --reps passes each, so they see
the same background load; a busy machine (see the load line printed first) lowers all of them.
``--decode`` adds a decode-step simulation (SmolLM2-135M's 30 layers of linears with the small
torch ops between them) under torch intra-op threads 1 and 2, which is how to choose
``torch.set_num_threads`` next to the kernel's own pool (adds ~30 s).

    .venv/bin/python -m prescient.latency_bench.gemv_bench [--reps R] [--mats N] [--decode]
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from prescient.kernels import cpu_linear
from prescient.latency_bench.efficiency import probe_buffer
from prescient.latency_bench.suites import suite_parser

DT_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}
MS = (1, 4, 8, 16)


def _best_of(fns, reps: int) -> list[float]:
    """Best-of-`reps` seconds of each fn, run in alternation so all see the same background."""
    for f in fns:  # warm: first touch, oneDNN primitive creation, pool start
        f()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def cpu_name() -> str:
    """Model name and family/model numbers (a VM's model name is often just 'AMD EPYC')."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" in line:
                    k, v = (s.strip() for s in line.split(":", 1))
                    info.setdefault(k, v)
                if not line.strip():
                    break
    except OSError:
        pass
    return (f"{info.get('model name', platform.processor() or platform.machine())} "
            f"(family {info.get('cpu family', '?')} model {info.get('model', '?')})")


def read_floor_gbs(reps: int = 5) -> float:
    """Streaming-read floor: torch.sum over 256 MiB (8x the L3), torch's current threads."""
    buf = probe_buffer(1 << 28)
    (t,) = _best_of([buf.sum], reps)
    return buf.numel() * 4 / t / 1e9


def probe_floor_gbs(reps: int = 5) -> float | None:
    """Streaming-read floor of the kernels' pool: pg_read_probe over 256 MiB (None: no .so)."""
    lib = cpu_linear.library()
    if lib is None or not hasattr(lib, "pg_read_probe"):
        return None
    lib.pg_read_probe.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.pg_read_probe.restype = ctypes.c_uint64
    buf = probe_buffer(1 << 28)
    (t,) = _best_of([lambda: lib.pg_read_probe(buf.data_ptr(), buf.numel() * 4)], reps)
    return buf.numel() * 4 / t / 1e9


def stream_table(shape, copies: int, tiers: list[str], reps: int) -> list[tuple]:
    """Rows (dtype, M, F.linear GB/s, {tier: GB/s}) streaming `copies` distinct [N, K] weights."""
    N, K = shape
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(copies)]
        packed = [cpu_linear.pack_weight(w) for w in ws]
        nbytes = copies * N * K * ws[0].element_size()
        for M in MS:
            x = torch.randn(M, K, generator=g).to(dtype)
            outs = [torch.empty(M, N, dtype=dtype) for _ in range(copies)]

            def base():
                for w in ws:
                    F.linear(x, w)

            def at(tier):
                def run():
                    cpu_linear._set_isa_cap(tier)
                    for p, o in zip(packed, outs):
                        p(x, out=o)
                return run

            times = _best_of([base, *(at(t) for t in tiers)], reps)
            rows.append((DT_NAME[dtype], M, nbytes / times[0] / 1e9,
                         {t: nbytes / s / 1e9 for t, s in zip(tiers, times[1:])}))
        del ws, packed
    cpu_linear._set_isa_cap(99)
    return rows


def overhead_us(dtype, n: int = 5000) -> tuple[float, float, float]:
    """Median us/call on a 64x64 weight: F.linear, cpu_linear, cpu_linear with out=."""
    w = torch.randn(64, 64).to(dtype)
    x = torch.randn(1, 64).to(dtype)
    p = cpu_linear.pack_weight(w)
    out = torch.empty(1, 64, dtype=dtype)
    res = []
    for f in (lambda: F.linear(x, w), lambda: p(x), lambda: p(x, out=out)):
        for _ in range(500):
            f()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            times.append((time.perf_counter() - t0) / n * 1e6)
        res.append(statistics.median(times))
    return tuple(res)


def prefill_ms(N: int, reps: int, M: int = 512, K: int = 576) -> tuple[float, float, float]:
    """Best ms of x [M, K] @ W^T for W [N, K]: bf16 F.linear, bf16 fp32-row-block, fp32 F.linear."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    lin = cpu_linear.pack_weight(w)
    w32, x32 = w.float(), x.float()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    times = _best_of([lambda: F.linear(x, w), lambda: lin._blocked_fp32(x, out),
                      lambda: F.linear(x32, w32)], reps)
    return tuple(t * 1e3 for t in times)


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

    (t,) = _best_of([step], reps)
    return t * 1e3


def cli(argv: list[str] | None = None) -> int:
    ap = suite_parser("gemv", __doc__, reps={"default": 4, "help": "passes per measurement (best is kept)"})
    ap.add_argument("--mats", type=int, default=32, help="distinct 1536x576 matrices streamed")
    ap.add_argument("--decode", action="store_true", help="add the decode-step simulation")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    info = cpu_linear.kernel_info()
    tiers = cpu_linear.machine_tiers()
    if info.get("isa") in tiers:  # PRESCIENT_ISA caps the sweep too
        tiers = tiers[:tiers.index(info["isa"]) + 1]
    print(f"CPU {cpu_name()}, {len(os.sched_getaffinity(0))} CPUs usable; torch {torch.__version__}, "
          f"intra-op threads {torch.get_num_threads()}")
    print(f"cpu_linear: available={info['available']} isa in use={info.get('isa')} "
          f"tiers run here={','.join(tiers) or '-'} threads={info.get('threads')} "
          f"{info['reason'] or ''}")
    print(f"load average (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])} "
          f"(anything well above 0 means shared, noisy figures)")
    probe = probe_floor_gbs()
    print(f"streaming-read floors over 256 MiB: torch.sum {read_floor_gbs():.1f} GB/s, "
          f"pg_read_probe ({info.get('threads')} threads) "
          f"{'-' if probe is None else f'{probe:.1f}'} GB/s\n")

    head = f"{'weights streamed':<22} {'dtype':<5} {'M':>2} {'F.linear':>9}" + "".join(
        f" {t:>11}" for t in tiers)
    print("GB/s of weights read (cpu_linear at each ISA tier):")
    print(head)
    for label, shape, copies, reps in [
            (f"{args.mats} x 1536x576", (1536, 576), args.mats, args.reps),
            # 3 distinct copies in turn: one 57 MB bf16 head alone is partly served from
            # the 32 MB L3 on repeats, which would flatter every column.
            ("3 x LM head 49152x576", (49152, 576), 3, args.reps)]:
        for dn, M, base, ours in stream_table(shape, copies, tiers, reps):
            print(f"{label:<22} {dn:<5} {M:>2} {base:>9.1f}" + "".join(
                f" {ours[t]:>11.1f}" for t in tiers))
    share = cpu_linear.kernel_info().get("worker_share")
    if share is not None:
        print(f"(pool worker ran {share:.0%} of the row chunks; ~50% means it kept up, much less "
              f"means it was short of CPU)")

    print("\nper-call overhead, 64x64 weight, M=1 (median us/call, tier in use):")
    for dtype in (torch.float32, torch.bfloat16):
        fl, ck, ck_out = overhead_us(dtype)
        print(f"  {DT_NAME[dtype]}: F.linear {fl:.2f}   cpu_linear {ck:.2f}   "
              f"cpu_linear(out=) {ck_out:.2f}")

    print(f"\nprefill 512x576 @ 576xN, bf16 weights (best ms; PackedLinear runs "
          f"'{cpu_linear.prefill_mode()}' at the tier in use):")
    for N in (1536, 49152):
        bf, blk, f32 = prefill_ms(N, max(2, args.reps // 2))
        print(f"  N={N:<6} F.linear bf16 {bf:8.1f}   fp32 row blocks {blk:8.1f}   "
              f"(F.linear fp32 weights {f32:8.1f})")

    if args.decode:
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
    print(f"\n({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
