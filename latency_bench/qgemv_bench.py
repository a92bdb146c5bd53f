"""Weight-streaming bandwidth of the GGUF block-format kernels (kernels/cpu_qgemv.c) at decode
sizes, per ISA tier and per path (fp32 activations vs int8 activations), beside bf16
(PackedLinear, kernels/cpu_gemv.c) and torch's own quantized CPU matmuls.

Batch-1 decode is bound by how fast weights stream from DRAM, so the figure is weight bytes (as
stored: blocks with their scales) read per second.  Each case cycles through enough distinct
matrices (--mb MiB, several times the L3) that every call reads its weight from DRAM, at M=1
(decode) and M=8 (speculative verify), on 576x1536, 1536x576 and the 49152x576 LM head.  The
timing includes each call's fixed cost (ctypes, activation prep), as a decode step pays it.
Each shape ends with the pool's worker share: on a busy machine the pool's workers rarely get a
core and the figures are one thread's.

Baselines: ``torch._weight_int8pack_mm`` (int8 weights, one scale per output channel) and
``torch.ops.aten._weight_int4pack_mm_for_cpu`` (int4, group 32, bf16 scales and zeros; weights
packed by ``_convert_weight_to_int4pack_for_cpu``), both with bf16 activations (their fast path)
and torch's intra-op threads = the kernels' pool size; the floor is torch.sum over a 256 MiB
buffer (on huge pages where the OS gives them, as the weight copies are).  Weights are random
bytes with fixed, finite scales (speed does not depend on values).

    .venv/bin/python -m prescient.latency_bench.qgemv_bench [--reps R] [--mb MiB] [--quick]
        [--formats q4_0,...] [--tiers avx2,...] [--threads N]
"""

from __future__ import annotations

import os
import sys
import time

import torch

from prescient.kernels import cpu_linear, quant_linear
from prescient.kernels.quant_reference import QTYPES, row_bytes
from prescient.latency_bench.efficiency import probe_buffer
from prescient.latency_bench.suites import suite_parser

SHAPES = [(576, 1536), (1536, 576), (49152, 576)]  # (N, K): out x in
MS = (1, 8)


def _best(fn, reps: int) -> float:
    fn()  # warm: first touch, pool start
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _copies(each: int, target: int) -> int:
    return max(2, -(-target // each))


def _pool_stats() -> tuple[int, int, int]:
    """(split calls, chunks the workers ran, all chunks) of the shared pool so far."""
    import ctypes
    st = (ctypes.c_uint64 * 3)()
    cpu_linear.library().pg_stats(st)
    return st[0], st[1], st[2]


def floor_gbs(reps: int) -> float:
    buf = probe_buffer(1 << 28)  # 256 MiB, on huge pages as the weights
    t = _best(lambda: buf.sum(), reps)
    return buf.numel() * 4 / t / 1e9


def _random_blocks(qtype: str, N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Random quant bytes with every fp16 scale field set to a small finite value."""
    _, be, bb = QTYPES[qtype]
    b = torch.randint(0, 256, (N * (K // be), bb), dtype=torch.uint8, generator=g)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    scale_fields = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
    for off in scale_fields[qtype]:
        b[:, off:off + 2] = half
    return b.reshape(N, K // be * bb)


def bench_quant(qtype: str, shape, target: int, reps: int, tiers, g) -> list[tuple]:
    """[(tier, path, M, GB/s, us per matrix)] for one format and shape."""
    N, K = shape
    each = N * row_bytes(qtype, K)
    base = _random_blocks(qtype, N, K, g)
    lins = [quant_linear.QuantLinear(base if i == 0 else base.clone(), qtype, N, K)
            for i in range(_copies(each, target))]
    rows = []
    for tier in tiers:
        cpu_linear._set_isa_cap(tier)
        paths = ("float", "int8") if tier != "portable" else ("float",)
        for path in paths:
            quant_linear.set_mode(path)
            for M in MS:
                x = torch.randn(M, K, generator=g)
                outs = [torch.empty(M, N) for _ in range(2)]

                def run():
                    for i, lin in enumerate(lins):
                        lin(x, out=outs[i & 1])

                t = _best(run, reps)
                rows.append((tier, path, M, each * len(lins) / t / 1e9, t / len(lins) * 1e6))
    quant_linear.set_mode("auto")
    cpu_linear._set_isa_cap(99)
    return rows


def bench_bf16(shape, target: int, reps: int, tiers, g) -> list[tuple]:
    N, K = shape
    each = N * K * 2
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    packs = [cpu_linear.pack_weight(w if i == 0 else w.clone()) for i in range(_copies(each, target))]
    rows = []
    for tier in tiers:
        cpu_linear._set_isa_cap(tier)
        for M in MS:
            x = torch.randn(M, K, generator=g).to(torch.bfloat16)
            out = torch.empty(M, N, dtype=torch.bfloat16)
            t = _best(lambda: [p(x, out=out) for p in packs], reps)
            rows.append((tier, "bf16", M, each * len(packs) / t / 1e9, t / len(packs) * 1e6))
    cpu_linear._set_isa_cap(99)
    return rows


def bench_torch(shape, target: int, reps: int, g) -> list[tuple]:
    """torch's int8 (per channel) and int4 (group 32) weight-only matmuls, bf16 activations."""
    N, K = shape
    rows = []
    w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s8 = torch.rand(N, generator=g).to(torch.bfloat16)
    each8 = N * K + N * 2
    w8s = [w8 if i == 0 else w8.clone() for i in range(_copies(each8, target))]
    p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g), 1)
    sz = torch.rand(K // 32, N, 2, generator=g).to(torch.bfloat16)
    each4 = p4.numel() * p4.element_size() + sz.numel() * 2
    p4s = [(p4, sz) if i == 0 else (p4.clone(), sz.clone()) for i in range(_copies(each4, target))]
    for M in MS:
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        t = _best(lambda: [torch._weight_int8pack_mm(x, w, s8) for w in w8s], reps)
        rows.append(("torch", "int8pack", M, each8 * len(w8s) / t / 1e9, t / len(w8s) * 1e6))
        t = _best(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, z) for p, z in p4s], reps)
        rows.append(("torch", "int4pack", M, each4 * len(p4s) / t / 1e9, t / len(p4s) * 1e6))
    return rows


def cli(argv: list[str] | None = None) -> int:
    ap = suite_parser("qgemv", __doc__.split("\n\n")[0], reps={"help": "passes per measurement (best is kept)"},
                      quick={"help": "only the 1536x576 shape"})
    ap.add_argument("--mb", type=int, default=96, help="MiB of distinct weights per case (> L3)")
    ap.add_argument("--formats", default=None, help="comma list (default: every native format)")
    ap.add_argument("--tiers", default=None, help="comma list (default: every tier this CPU runs)")
    ap.add_argument("--threads", type=int, default=None, help="kernel pool size (default: as configured)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    info = cpu_linear.kernel_info()
    if not info["available"]:
        raise SystemExit(f"C kernels unavailable: {info['reason']}")
    if args.threads:
        cpu_linear.set_num_threads(args.threads)
        info = cpu_linear.kernel_info()
    threads = info["threads"]  # the pool size in use
    tiers = cpu_linear.machine_tiers()
    if args.tiers:
        tiers = [t for t in args.tiers.split(",") if t in tiers]
    fmts = args.formats.split(",") if args.formats else [q for q in QTYPES if quant_linear.native_available(q)]
    target = args.mb << 20
    shapes = [SHAPES[1]] if args.quick else SHAPES
    g = torch.Generator().manual_seed(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"cpu: {cpu_linear._cpu_signature().splitlines()[0] if cpu_linear._cpu_signature() else '?'}")
    print(f"tiers: {', '.join(tiers)} (best in use: {info['isa']}); pool threads {threads}; "
          f"load {load:.2f}; formats {', '.join(fmts)}")
    torch.set_num_threads(threads)
    print(f"floor: torch.sum over 256 MiB: {floor_gbs(args.reps):.1f} GB/s")
    torch.set_num_threads(1)  # next to the kernels' own pool (see cpu_linear's docstring)
    for shape in shapes:
        N, K = shape
        print(f"\n== {N}x{K} (out x in): GB/s of weight bytes as stored (us per matrix) ==")
        st0 = _pool_stats()
        results = {}
        fmts_here = [q for q in fmts if K % QTYPES[q][1] == 0]  # K-quants need K % 256 == 0
        for q in fmts_here:
            results[q] = bench_quant(q, shape, target, args.reps, tiers, g)
        bf = bench_bf16(shape, target, args.reps, tiers, g)
        torch.set_num_threads(threads)
        tr = bench_torch(shape, target, args.reps, g)
        torch.set_num_threads(1)
        hdr = f"{'tier':12s} {'format':7s} " + " ".join(f"{p + ' M=' + str(m):>19s}"
                                                       for p in ("float", "int8") for m in MS)
        print(hdr + "   faster")
        for tier in tiers:
            for q in fmts_here:
                cells, best = [], {}
                for p in ("float", "int8"):
                    for m in MS:
                        r = [x for x in results[q] if x[0] == tier and x[1] == p and x[2] == m]
                        if r:
                            cells.append(f"{r[0][3]:8.1f} ({r[0][4]:7.1f})")
                            best.setdefault(m, []).append((r[0][3], p))
                        else:
                            cells.append(f"{'-':>19s}")
                win = ", ".join(f"M={m}: {max(v)[1]}" for m, v in best.items())
                print(f"{tier:12s} {q:7s} " + " ".join(f"{c:>19s}" for c in cells) + f"   {win}")
            b = [x for x in bf if x[0] == tier]
            print(f"{tier:12s} {'bf16':7s} " + " ".join(f"{x[3]:8.1f} ({x[4]:7.1f})" for x in b)
                  + "   (PackedLinear: M=1, M=8)")
        for x in tr:
            print(f"{'torch':12s} {x[1]:9s} M={x[2]}: {x[3]:6.1f} GB/s ({x[4]:8.1f} us)")
        st1 = _pool_stats()
        calls, chunks = st1[0] - st0[0], st1[2] - st0[2]
        if threads > 1 and chunks:
            share = (st1[1] - st0[1]) / chunks
            print(f"pool: {calls} split calls, worker share of their chunks {share:.2f} "
                  f"(~{(threads - 1) / threads:.2f} when the workers keep up; near 0: they rarely "
                  f"got a core, and the figures above are one thread's)")
        else:
            print("pool: one thread")
    print(f"\n({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
