"""Where a CPU decode step's time goes: GEMV, attention, other kernels and host overhead, for the
torch layer loop and the native fused layers (kernels/cpu_layer.py), plus chain verify steps.

    prescient bench step-profile [--isa TIER] [--weights W] [--context 1024] [--verify 8]
    (= python -m prescient.latency_bench.step_profile ...)

One sequence with `--context` cached positions (random K/V, written once, so attention reads real
pages) takes a 1-token decode step and chain verify steps of `--verify` tokens (default 8; a list such
as 2,4,8,16 gives the verify / step ratio per size), in three modes timed in
alternation (so background load hits all alike): `torch` (PRESCIENT_FUSED_LAYERS=0, ~30 torch ops
per layer), `fused` (one native call for all layers) and `fused/layer` (one native call per
layer). Reported per mode and step size:

  step        the forward's wall time (median of --reps; min beside it)
  gemv        time inside the matrix-vector kernels during the step
  attention   time inside the attention kernel during the step
  other       the elementwise work between them (norms, RoPE, KV store, SiLU, residual adds):
              the native glue's own timers in the fused modes; in the torch mode that work is
              done by torch ops whose arithmetic is the same, so the fused figure stands for it
              (marked ~) and the rest of those ops' time -- their dispatch -- falls to host
  host        step - gemv - attention - other: Python, torch dispatch, ctypes, allocation

The split comes from separate instrumented steps (medians; host is each instrumented step's wall
time less its own kernel time): timers around the ctypes kernel calls (torch mode, and the LM
head in the fused/layer mode; they include ~0.3 us of ctypes per call, and their own ~0.2 us
lands in host) and the native layers' section timers (kernels/cpu_layer.c pl_profile; in the
fused mode one call, pl_forward, runs the embedding, every layer, the final norm and the LM
head, and its timers count the head as gemv and the rest as other). Then every kernel is timed alone
at the step's shapes, cold as in a real step: the GEMVs over all the model's weights in step
order (the weights are ~8x the L3, so each comes from DRAM), the attention layer by layer with a
64 MiB buffer streamed between calls, and the torch elementwise ops of one layer (what the torch
loop pays for them, dispatch included). The header names the ISA tier, threads and weights.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from prescient.latency_bench.suites import suite_parser

MODES = {"torch": "0", "fused": "1", "fused/layer": "layer"}


def _batch(model, context: int, t: int, block_size: int = 16):
    """A ForwardBatch of t new tokens (t > 1: a chain draft, as verification sends it) after
    `context` cached positions, on blocks 0, 1, ..."""
    from prescient.runtime.batch import SeqRows, pack_forward_batch
    from prescient.speculative.tree import DraftTree

    blocks = list(range(-(-(context + t) // block_size)))
    mask = DraftTree.chain(1, [1] * (t - 1)).mask_bits() if t > 1 else None
    rows = [SeqRows([1] * t, range(context, context + t), context, blocks, mask, range(t))]
    return pack_forward_batch(rows, block_size, model.device)


def _kv_cache(model, context: int, block_size: int = 16):
    """A KV cache whose first `context` + 16 positions hold random values (untouched pages of the
    lazily zeroed cache would all read the one shared zero page: far too cache-friendly)."""
    num_blocks = -(-(context + 16) // block_size) + 1
    kv = model.allocate_kv_cache(num_blocks, block_size)
    g = torch.Generator().manual_seed(0)
    for k, v in kv:
        for c in (k, v):
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    return kv


class _TimedLib:
    """A stand-in for quant_linear's CDLL whose pg_linear_w is timed (the rest passes through)."""

    def __init__(self, lib, timed):
        self._lib, self.pg_linear_w = lib, timed

    def __getattr__(self, name):
        return getattr(self._lib, name)


class _KernelTimer:
    """Times the ctypes kernel calls the torch path makes -- cpu_linear._fn (float GEMVs),
    quant_linear._qlib.pg_linear_w (block-format GEMVs), cpu_attention._fn (the attention) -- by
    swapping timing wrappers into those module globals."""

    def __init__(self):
        import importlib

        from prescient.kernels import cpu_attention, cpu_linear

        self.seconds = {"gemv": 0.0, "attention": 0.0}
        self.calls = {"gemv": 0, "attention": 0}
        self._slots = [(cpu_linear, "_fn", "gemv"), (cpu_attention, "_fn", "attention")]
        try:
            quant = importlib.import_module("prescient.kernels.quant_linear")
        except ImportError:
            quant = None
        if quant is not None and getattr(quant, "_qlib", None) is not None:
            self._slots.append((quant, "_qlib", "gemv"))
        self._saved = []

    def _wrap(self, fn, name):
        clock = time.perf_counter

        def timed(*args):
            t0 = clock()
            rc = fn(*args)
            self.seconds[name] += clock() - t0
            self.calls[name] += 1
            return rc

        return timed

    def __enter__(self):
        for mod, attr, name in self._slots:
            orig = getattr(mod, attr)
            self._saved.append((mod, attr, orig))
            if attr == "_qlib":
                setattr(mod, attr, _TimedLib(orig, self._wrap(orig.pg_linear_w, name)))
            else:
                setattr(mod, attr, self._wrap(orig, name))
        return self

    def __exit__(self, *exc):
        for mod, attr, orig in self._saved:
            setattr(mod, attr, orig)
        self._saved = []


def _time_steps(model, kv, batches, reps: int) -> dict:
    """{(mode, t): [seconds]}: every mode and size once per round, rounds repeated."""
    out = {(m, t): [] for m in MODES for t in batches}
    for _ in range(2):  # warm-up: FusedLayers built, pool started, pages touched
        for m, env in MODES.items():
            os.environ["PRESCIENT_FUSED_LAYERS"] = env
            for b in batches.values():
                model.forward(b, kv)
    for _ in range(reps):
        for m, env in MODES.items():
            os.environ["PRESCIENT_FUSED_LAYERS"] = env
            for t, b in batches.items():
                t0 = time.perf_counter()
                model.forward(b, kv)
                out[(m, t)].append(time.perf_counter() - t0)
    return out


def _split(model, kv, batch, mode: str, reps: int) -> dict:
    """Median seconds per step in gemv / attention / glue / host, from instrumented steps of
    `mode` (host: each step's wall time less its kernels' time, so both come from one step)."""
    from prescient.kernels import cpu_layer

    os.environ["PRESCIENT_FUSED_LAYERS"] = MODES[mode]
    fused = mode != "torch"
    model.forward(batch, kv)
    rows = []
    with _KernelTimer() as kt:
        for _ in range(reps):
            kt.seconds = {"gemv": 0.0, "attention": 0.0}
            if fused:
                cpu_layer.profile(True)
            t0 = time.perf_counter()
            model.forward(batch, kv)
            wall = time.perf_counter() - t0
            native = cpu_layer.profile(False) if fused else {"gemv": 0.0, "attention": 0.0, "glue": 0.0}
            gemv, attn = kt.seconds["gemv"] + native["gemv"], kt.seconds["attention"] + native["attention"]
            rows.append((gemv, attn, native["glue"], wall - gemv - attn - native["glue"]))
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    return {"gemv": med[0], "attention": med[1], "glue": med[2] if fused else None, "host": med[3]}


def _linears(model) -> list:
    """(descriptor address, in, out, weight bytes) of every linear a step runs, in step order."""
    out = []
    lins = [x for layer in model.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]
    # a row-parallel linear held as TP-invariant column groups (runtime/linear.ColumnGroups): its parts
    lins = [p for lin in lins for _, p in (getattr(lin, "column_groups", None) or [(0, lin)])]
    for lin in lins:
        packed = getattr(lin, "packed", None)
        dptr = getattr(packed, "_dptr", None)
        if dptr is None:
            return []
        nbytes = getattr(lin, "weight_bytes", None) or lin.weight.nbytes
        out.append((dptr, lin.in_features, lin.out_features, nbytes))
    return out


def _gemv_alone(model, t: int, reps: int) -> tuple[float, int, int] | None:
    """(median seconds of one step's GEMVs alone, calls, weight bytes): a sweep over every
    weight of the model in step order, each call timed on its own."""
    from prescient.kernels import cpu_linear

    lins = _linears(model)
    if not lins:
        return None
    lib = cpu_linear.library()
    dt = {torch.float32: 0, torch.bfloat16: 1}[model.dtype]
    bufs = {}
    for _, k, n, _ in lins:
        bufs.setdefault(k, torch.randn(t, k).to(model.dtype))
        bufs.setdefault(("y", n), torch.empty(t, n, dtype=model.dtype))
    calls = [(d, bufs[k].data_ptr(), bufs[("y", n)].data_ptr()) for d, k, n, _ in lins]
    fn = lib.pg_linear_w
    clock = time.perf_counter
    sweeps = []
    for _ in range(reps + 1):
        total = 0.0
        for d, x, y in calls:
            t0 = clock()
            if fn(d, x, y, t, dt):  # e.g. t > the kernels' MAX_M: no small-M figure to give
                return None
            total += clock() - t0
        sweeps.append(total)
    return statistics.median(sweeps[1:]), len(calls), sum(x[3] for x in lins)


def _attention_alone(model, kv, batch, reps: int) -> float:
    """Median seconds of one step's attention calls alone (all layers), each on a cold cache."""
    from prescient.kernels import ops

    cfg = model.config
    q = torch.randn(batch.num_tokens, cfg.num_heads, cfg.head_dim).to(model.dtype)
    flush = torch.ones(16 << 20)  # 64 MiB, twice the L3
    sweeps = []
    for _ in range(reps):
        total = 0.0
        for k_cache, v_cache in kv:
            flush.sum()
            with _KernelTimer() as kt:
                ops.tree_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                   batch.cu_seqlens_q, batch.mask_bits, model.scale)
            total += kt.seconds["attention"]
        sweeps.append(total)
    return statistics.median(sweeps)


def _torch_glue_alone(model, kv, batch, reps: int) -> float:
    """Seconds per step of the torch loop's elementwise ops (everything of a layer but the
    linears and the attention), timed alone on one layer's tensors and times the layer count."""
    from prescient.kernels import ops

    cfg, layer = model.config, model.layers[0]
    T, H, KVH, D = batch.num_tokens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = torch.randn(T, cfg.hidden_size).to(model.dtype)
    qkv = torch.randn(T, (H + 2 * KVH) * D).to(model.dtype)
    attn_out = torch.randn(T, cfg.hidden_size).to(model.dtype)
    gate_up = torch.randn(T, 2 * cfg.intermediate_size).to(model.dtype)
    cos, sin = model.rope.tables(batch.positions)
    k_cache, v_cache = kv[0]

    def glue():
        x = model._rms_norm(h, layer.attn_norm)
        qk = model.rope.apply(qkv[:, :(H + KVH) * D].view(-1, H + KVH, D), cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + KVH) * D:].view(-1, KVH, D)
        ops.store_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        h2 = h + attn_out
        x = model._rms_norm(h2, layer.mlp_norm)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        return h2 + attn_out, x, q, act

    with torch.inference_mode():
        for _ in range(50):
            glue()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(20):
                glue()
            times.append((time.perf_counter() - t0) / 20)
    return statistics.median(times) * len(model.layers)


def _ms(x: float | None, mark: str = "") -> str:
    return "-" if x is None else f"{mark}{x * 1e3:.2f}"


def cli(argv: list[str] | None = None) -> int:
    from prescient.build import EngineSpec, load_model
    from prescient.kernels import cpu_layer, cpu_linear

    p = suite_parser("step-profile", __doc__, weights={"default": EngineSpec.weights}, dtype=True, model=True,
                     reps={"default": 20, "help": "timed steps per mode and size"})
    p.add_argument("--isa", choices=cpu_linear.ISA_TIERS, default=None, help="cap the kernels' ISA tier (unset: none)")
    p.add_argument("--context", type=int, default=1024, help="cached positions before the step")
    p.add_argument("--verify", default="8", help="verify step sizes in tokens, comma-separated (e.g. 2,4,8,16)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = p.parse_args(argv)
    try:
        sizes = sorted({int(x) for x in args.verify.split(",") if x.strip()})
    except ValueError:
        p.error(f"--verify takes token counts such as 2,4,8, got {args.verify!r}")
    if not sizes or min(sizes) < 2:
        p.error("--verify sizes must be >= 2 tokens")

    t_start = time.perf_counter()
    loaded = load_model(EngineSpec(model=args.model, dtype=args.dtype, weights=args.weights, speculate="off",
                                   progress=False))
    model = loaded.model
    if model.device.type != "cpu":
        print("step_profile measures CPU steps", file=sys.stderr)
        return 2
    if args.isa:
        cpu_linear._set_isa_cap(args.isa)
    info = cpu_linear.kernel_info()
    describe = getattr(model, "weights_description", None)
    weights = describe() if describe else str(model.dtype)
    if not cpu_layer.available():
        print(f"native layers unavailable ({cpu_layer.why_not()}): the fused modes run the torch loop",
              file=sys.stderr)
    kv = _kv_cache(model, args.context)
    batches = {1: _batch(model, args.context, 1), **{t: _batch(model, args.context, t) for t in sizes}}
    fused_ok = cpu_layer.fused_layers(model, kv) is not None
    os.environ.pop("PRESCIENT_FUSED_LAYERS", None)

    # the host now: compute-bound rows (a verify's) move with the core's clock and with what else
    # shares its vector pipes, memory-bound ones (a decode step's weight stream) less
    host_before = cpu_linear.core_speed()
    steps = _time_steps(model, kv, batches, args.reps)
    split = {(m, t): _split(model, kv, b, m, max(3, args.reps // 4)) for m in MODES for t, b in batches.items()}
    torch.set_num_threads(1)  # as the model's decode-sized forwards run
    alone = {t: {"gemv": _gemv_alone(model, t, 5), "attention": _attention_alone(model, kv, b, 3),
                 "torch_glue": _torch_glue_alone(model, kv, b, 5)} for t, b in batches.items()}
    os.environ.pop("PRESCIENT_FUSED_LAYERS", None)
    host_after = cpu_linear.core_speed()

    cfg = model.config
    print(f"{cfg.name or 'model'}: {cfg.num_layers} layers, hidden {cfg.hidden_size}; weights {weights}; "
          f"activations {args.dtype}; ISA {info.get('isa')}, {info.get('threads')} threads; context {args.context}; "
          f"native layers {'on' if fused_ok else 'UNAVAILABLE: ' + str(cpu_layer.why_not())}")
    if all(host_before) and all(host_after):
        print(f"host: one core at {host_before[0]:.2f} GHz, {host_before[1]:.0f} GFLOP/s of fp32 FMAs before; "
              f"{host_after[0]:.2f} GHz, {host_after[1]:.0f} after (a verify's compute-bound rows follow the "
              "FMA rate, which a host's other hyperthread shares; a decode step's weight stream less)")
    report = {"model": cfg.name, "weights": weights, "dtype": args.dtype, "isa": info.get("isa"),
              "threads": info.get("threads"), "context": args.context, "fused_available": fused_ok,
              "clock_ghz": [host_before[0], host_after[0]], "fma_gflops": [host_before[1], host_after[1]],
              "steps": {}}
    for t in batches:
        print(f"\n{'1-token decode' if t == 1 else f'{t}-token verify'} step, ms   "
              + "".join(f"{m:>13}" for m in MODES))
        rows = {"step (median)": [], "step (min)": [], "  gemv": [], "  attention": [], "  other": [], "  host": []}
        for m in MODES:
            med, lo = statistics.median(steps[(m, t)]), min(steps[(m, t)])
            s = split[(m, t)]
            glue = s["glue"] if s["glue"] is not None else split[("fused", t)]["glue"]
            mark = "~" if s["glue"] is None else ""
            host = s["host"] - (glue if s["glue"] is None else 0.0)
            rows["step (median)"].append(_ms(med))
            rows["step (min)"].append(_ms(lo))
            rows["  gemv"].append(_ms(s["gemv"]))
            rows["  attention"].append(_ms(s["attention"]))
            rows["  other"].append(_ms(glue, mark))
            rows["  host"].append(_ms(host))
            report["steps"][f"{m}|{t}"] = {"ms": med * 1e3, "ms_min": lo * 1e3, "gemv_ms": s["gemv"] * 1e3,
                                           "attention_ms": s["attention"] * 1e3,
                                           "other_ms": None if glue is None else glue * 1e3,
                                           "other_estimated": s["glue"] is None, "host_ms": host * 1e3}
        for name, cells in rows.items():
            print(f"  {name:<28}" + "".join(f"{c:>13}" for c in cells))
        a = alone[t]
        g = a["gemv"]
        gemv_txt = "-" if g is None else (f"{g[0] * 1e3:.2f} ms ({g[1]} calls, {g[2] / 2**20:.0f} MiB, "
                                          f"{g[2] / g[0] / 1e9:.1f} GB/s)")
        print(f"  alone, cold: gemv {gemv_txt}; attention {a['attention'] * 1e3:.2f} ms "
              f"({len(kv)} calls); torch elementwise ops {a['torch_glue'] * 1e3:.2f} ms")
        report["steps"][f"alone|{t}"] = {"gemv_ms": None if g is None else g[0] * 1e3,
                                         "gemv_bytes": None if g is None else g[2],
                                         "attention_ms": a["attention"] * 1e3, "torch_glue_ms": a["torch_glue"] * 1e3}
    print("\nverify cost vs a 1-token step (median step times):")
    report["verify_ratio"] = {}
    for t in sizes:
        ratios = {m: statistics.median(steps[(m, t)]) / statistics.median(steps[(m, 1)]) for m in MODES}
        report["verify_ratio"][t] = ratios
        print(f"  {t:>3} tokens: " + ", ".join(f"{m} {r:.2f}x" for m, r in ratios.items()))
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
