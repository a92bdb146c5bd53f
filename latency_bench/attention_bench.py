"""How fast the C tree attention (kernels/cpu_attention.c) reads a paged KV cache: a step's layers
over agent-length contexts, against the read floor measured in the same run.

A decode step calls attention once per layer, each on its own layer's cache, so at long contexts
the step reads every layer's K/V rows from DRAM: 30 layers x 3 kv heads x 64 dims x 2 bytes x
(K, V) = 23 KB a position for the default model in bf16, 94 MB at 4k positions. The kernel is
memory-bound when that read runs near the host's read rate. Each case builds one cache of all the
layers on huge pages (as the engine's, runtime/model.py), hands the sequences shuffled blocks (as
a pool that has served a while does), and times the layers' calls in order:

    ms        median over --reps of the layers' calls (a step's attention)
    GB/s      the K/V bytes the queries see, read once, over that time
    floor ms  the same bytes at torch.sum's rate over a 256 MiB buffer on huge pages, measured
              beside each case (a busy host lowers both)
    x floor   ms / floor ms: 1.0 is memory-bound
    hot ms    the same calls with every block table pointing at 8 blocks (all in L1/L2): the
              compute alone, what the kernel would take were memory free

Shapes are sequences x query tokens (1x1: one agent decoding; 8x1: eight; 8x5: eight verifying a
5-token draft chain). Values are random (speed does not depend on them).

    prescient bench attention [--contexts 256,1024,4096] [--shapes 1x1,8x1,8x5] [--kv bfloat16]
        [--reps 20] [--layers 30] [--tiers ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from prescient.kernels import cpu_attention, cpu_linear, huge_pages
from prescient.latency_bench.efficiency import probe_buffer
from prescient.latency_bench.suites import suite_parser

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16  # SmolLM2-135M's attention, the engine's block size
HOT_BLOCKS = 8
KV_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}


def _median_ms(fn, reps: int) -> float:
    fn()  # warm: first touch, pool start
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


class Cache:
    """Every layer's (k, v) as views of one huge-page stack [layers, 2, blocks, BLOCK, KV_HEADS,
    HEAD_DIM], with per-position scales for an int8 cache."""

    def __init__(self, layers: int, blocks: int, kv: str, g: torch.Generator):
        dt = KV_DTYPES[kv]
        shape = (layers, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
        esz = torch.empty((), dtype=dt).element_size()
        self.stack = huge_pages.zeros(esz * layers * 2 * blocks * BLOCK * KV_HEADS * HEAD_DIM).view(dt).view(shape)
        for i in range(layers):  # one layer at a time: a float copy of the whole stack would double it
            if dt is torch.int8:
                self.stack[i].copy_(torch.randint(-127, 128, shape[1:], dtype=torch.int8, generator=g))
            else:
                self.stack[i].copy_(torch.randn(shape[1:], generator=g).to(dt))
        self.scales = None
        if dt is torch.int8:
            self.scales = [(torch.rand(blocks, BLOCK, KV_HEADS, generator=g) * 0.02 + 0.01,
                            torch.rand(blocks, BLOCK, KV_HEADS, generator=g) * 0.02 + 0.01)
                           for _ in range(layers)]

    def layer(self, i: int) -> tuple:
        k, v = self.stack[i, 0], self.stack[i, 1]
        if self.scales is None:
            return k, v, {}
        return k, v, {"k_scale": self.scales[i][0], "v_scale": self.scales[i][1]}


def read_gbs(buf: torch.Tensor, reps: int) -> float:
    """The host's read rate now: torch.sum over `buf` (efficiency.probe_buffer: float32 ones on
    huge pages, as the cache) on the pool's cores, GB/s."""
    torch.set_num_threads(cpu_linear.kernel_info()["threads"])
    try:
        t = _median_ms(lambda: buf.sum(), reps)
    finally:
        torch.set_num_threads(1)  # the kernel's own pool runs beside no idle torch threads
    return buf.numel() * 4 / t / 1e6


def run_case(cache: Cache, layers: int, seqs: int, qlen: int, ctx: int, dt: torch.dtype, reps: int,
             g: torch.Generator, probe: torch.Tensor) -> dict:
    """One shape at one context: ms, GB/s, floor ms, hot ms."""
    per = -(-ctx // BLOCK)
    blocks = cache.stack.shape[2]
    tables = torch.randperm(blocks, generator=g)[: seqs * per].to(torch.int32).view(seqs, per)
    hot = (torch.arange(seqs * per) % HOT_BLOCKS).to(torch.int32).view(seqs, per)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    cu = torch.arange(0, (seqs + 1) * qlen, qlen, dtype=torch.int32)
    q = torch.randn(seqs * qlen, HEADS, HEAD_DIM, generator=g).to(dt)
    scale = HEAD_DIM ** -0.5
    layer = [cache.layer(i) for i in range(layers)]

    def step(bt):
        for k, v, sc in layer:  # causal: the new tokens a chain, as a verify of a draft chain
            cpu_attention.tree_attention(q, k, v, bt, lens, cu, None, scale, **sc)

    ms = _median_ms(lambda: step(tables), reps)
    hot_ms = _median_ms(lambda: step(hot), reps)
    esz = cache.stack.element_size()
    nbytes = layers * seqs * ctx * KV_HEADS * HEAD_DIM * esz * 2
    if cache.scales is not None:
        nbytes += layers * seqs * ctx * KV_HEADS * 4 * 2
    floor = nbytes / read_gbs(probe, max(3, reps // 4)) / 1e6
    return {"ms": ms, "gbs": nbytes / ms / 1e6, "floor_ms": floor, "hot_ms": hot_ms}


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        s, _, t = part.partition("x")
        if not (s.isdigit() and t.isdigit() and int(s) > 0 and int(t) > 0):
            raise SystemExit(f"--shapes: {part!r} is not SEQUENCESxTOKENS (e.g. 8x1)")
        out.append((int(s), int(t)))
    return out


def cli(argv: list[str] | None = None) -> int:
    ap = suite_parser("attention", __doc__.split("\n\n")[0], reps={"default": 20, "help": "timed passes per case"})
    ap.add_argument("--contexts", default="256,1024,4096", help="cached positions per sequence, comma-separated")
    ap.add_argument("--shapes", default="1x1,8x1,8x5", help="SEQUENCESxTOKENS, comma-separated")
    ap.add_argument("--kv", default="bfloat16", choices=list(KV_DTYPES), help="the cache's dtype")
    ap.add_argument("--layers", type=int, default=30, help="layers (distinct caches) per step")
    ap.add_argument("--tiers", default=None, help="ISA tiers, comma-separated (default: the best this CPU runs)")
    args = ap.parse_args(argv)
    if not cpu_attention.available():
        raise SystemExit(f"C attention unavailable: {cpu_attention.why_not()}")
    contexts = [int(c) for c in args.contexts.split(",") if c.isdigit()]
    if len(contexts) != len(args.contexts.split(",")) or min(contexts) < 1:
        raise SystemExit(f"--contexts: {args.contexts!r} is not a comma list of positive integers")
    shapes = _shapes(args.shapes)
    if max(t for _, t in shapes) > min(contexts):  # a context counts the step's own tokens
        raise SystemExit(f"--shapes: {max(t for _, t in shapes)} tokens do not fit a context of {min(contexts)}")
    tiers = args.tiers.split(",") if args.tiers else [cpu_linear.kernel_info()["isa"]]
    unknown = [t for t in tiers if t not in cpu_linear.machine_tiers()]
    if unknown:
        raise SystemExit(f"--tiers: {', '.join(unknown)} not run by this CPU ({', '.join(cpu_linear.machine_tiers())})")
    dt = torch.float32 if args.kv == "float32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    blocks = max(s for s, _ in shapes) * -(-max(contexts) // BLOCK) + HOT_BLOCKS
    t_start = time.perf_counter()
    cache = Cache(args.layers, blocks, args.kv, g)
    probe = probe_buffer(1 << 28)  # 256 MiB, past the L3
    torch.set_num_threads(1)
    print(f"C tree attention, {args.layers} layers x {KV_HEADS} kv heads x {HEAD_DIM} dims ({HEADS} query heads), "
          f"{args.kv} cache, blocks of {BLOCK}; pool threads {cpu_linear.kernel_info()['threads']}")
    print(f"{'tier':12s} {'shape':>6s} {'context':>8s} {'ms':>8s} {'GB/s':>7s} {'floor ms':>9s} {'x floor':>8s} "
          f"{'hot ms':>8s}")
    try:
        for tier in tiers:
            cpu_linear._set_isa_cap(tier)
            for ctx in contexts:
                for seqs, qlen in shapes:
                    r = run_case(cache, args.layers, seqs, qlen, ctx, dt, args.reps, g, probe)
                    print(f"{tier:12s} {f'{seqs}x{qlen}':>6s} {ctx:8d} {r['ms']:8.2f} {r['gbs']:7.1f} "
                          f"{r['floor_ms']:9.2f} {r['ms'] / r['floor_ms']:8.2f} {r['hot_ms']:8.2f}", flush=True)
    finally:
        cpu_linear._set_isa_cap(99)
    print(f"\n({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
