"""`prescient bench load`: cold-prompt clients and a long-prompt injector through each server.

N closed-loop clients and the injector reach every system through the same HTTP client.

    prescient bench load --quick --out DIR      # N = 1 and 8, 30 s each (about 3-4 minutes)
    prescient bench load --out DIR              # N = 1, 4, 8, 16, 60 s each
    (`prescient bench --load ...`, the legacy spelling, is the same: suites.py)

Systems, each a server process on the same GGUF (the default: SmolLM2-135M's Q4_1), all cores:

    prescient   `prescient serve` with its default settings (--speculate ngram)
    llamacpp    llama-cpp-python's `llama_cpp.server` (chatml, prompt cache on, requests queue);
                reported as not run, with the reason, when the `peers` extra is not installed

Both are started before the first phase. For each N the systems run one after another, the order
rotating with N, so slow drift of the machine falls on both; a phase starts once every server is
idle (`settle`: a peer may still be computing the requests the last phase cancelled); each phase is
load_driver.run_load
(N closed-loop clients streaming the shared workloads, every prompt with a fresh prefix, plus a
~1500-token prompt every `inject_period_s`) through agent_http's HTTP client; prescient's
speculation counters (/metrics) are read before and after each of its phases, so the report says
how many draft tokens the phase verified and how many were accepted. Writes
DIR/load_report.{json,md} and the ITL / TTFT CDF PNGs (load_report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from prescient.latency_bench.agent_markdown import fmt_ms
from prescient.latency_bench.bench_servers import (LlamaCppServer, PeerMissing, PrescientServer, llamacpp_version,
                                                   model_tokenizer)
from prescient.latency_bench.load_driver import run_load
from prescient.latency_bench.load_report import build_report, phase_figures, phase_samples, spec_delta, write
from prescient.latency_bench.suites import add_shared, suite_parser
from prescient.latency_bench.workloads import load_workloads, long_prompt, with_fresh_prefix
from prescient.runtime.slo import CPU_INTERACTIVE, SLOConfig
from prescient.kernels.cpu_threads import default_threads

SYSTEMS = ("prescient", "llamacpp")


@dataclass(frozen=True)
class LoadBenchConfig:
    out: str = "bench_load"
    quick: bool = True
    model: str | None = None
    workloads_file: str | None = None
    systems: tuple[str, ...] = SYSTEMS
    concurrencies: tuple[int, ...] = (1, 8)
    duration_s: float = 30.0  # per system and N; requests in flight at the end then finish
    inject_period_s: float | None = 10.0  # None: no long prompts
    long_tokens: int = 1500
    long_max_tokens: int = 8
    drain_s: float = 60.0  # most seconds the requests in flight get after the duration
    speculate: str = "ngram"  # prescient serve's default
    slo_ttft_s: float = CPU_INTERACTIVE.ttft_s
    slo_itl_s: float = CPU_INTERACTIVE.itl_emission_p99_s
    peer_threads: int = field(default_factory=default_threads)  # the count prescient's pool takes
    peer_pythonpath: str | None = None  # where llama-cpp-python's server extra is installed, if apart
    plots: bool = True
    progress: bool = True

    @property
    def slo(self) -> SLOConfig:
        return SLOConfig(name="load", ttft_s=self.slo_ttft_s, itl_emission_p99_s=self.slo_itl_s, tpot_s=None,
                         e2e_s=None)


QUICK = LoadBenchConfig()
FULL = replace(QUICK, quick=False, concurrencies=(1, 4, 8, 16), duration_s=60.0, inject_period_s=15.0, drain_s=120.0)


def _log(cfg: LoadBenchConfig, t0: float, msg: str) -> None:
    if cfg.progress:
        print(f"[load {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


#: A server is idle when its processes use under this share of a core over IDLE_WINDOW_S.
IDLE_CORE_SHARE = 0.1
IDLE_WINDOW_S = 0.5


async def settle(servers: dict, limit_s: float) -> float:
    """Wait until every server is idle (IDLE_CORE_SHARE of a core over IDLE_WINDOW_S), at most
    limit_s; the seconds waited. A phase's cancelled requests may still run in their server (a
    peer keeps prefilling a prompt whose client left at the drain limit): the next phase, on any
    system, must not share the cores with them."""
    w0 = time.perf_counter()
    last = {name: s.cpu_seconds() for name, s in servers.items()}
    while time.perf_counter() - w0 < limit_s:
        await asyncio.sleep(IDLE_WINDOW_S)
        now = {name: s.cpu_seconds() for name, s in servers.items()}
        if all(now[n] - last[n] < IDLE_CORE_SHARE * IDLE_WINDOW_S for n in now):
            break
        last = now
    return time.perf_counter() - w0


def start_servers(cfg: LoadBenchConfig, t0: float) -> tuple[dict, dict, dict]:
    """({system: server}, {system: info}, {system: why it is not run}); never raises for a system
    that cannot start."""
    servers, info, not_run = {}, {}, {}
    if "prescient" in cfg.systems:
        _log(cfg, t0, f"starting prescient serve --speculate {cfg.speculate}")
        try:
            # started (and calibrated: bench_servers.prescient_command) before the peer
            servers["prescient"] = PrescientServer(cfg.model, cfg.speculate)
            info["prescient"] = {"server": servers["prescient"].name}
        except PeerMissing as e:
            not_run["prescient"] = str(e)
    if "llamacpp" in cfg.systems:
        _log(cfg, t0, "starting llama_cpp.server")
        try:
            from prescient.runtime.loader import default_model_path

            model = cfg.model or default_model_path()
            server = LlamaCppServer(model, cfg.peer_threads, chat_format="chatml", pythonpath=cfg.peer_pythonpath)
            servers["llamacpp"] = server
            info["llamacpp"] = {"server": server.name, "version": llamacpp_version(cfg.peer_pythonpath), "threads": cfg.peer_threads}
        except PeerMissing as e:
            not_run["llamacpp"] = str(e)
        except Exception as e:  # noqa: BLE001 - e.g. no default model: the peer is not run, named
            not_run["llamacpp"] = f"{type(e).__name__}: {e}"
    return servers, info, not_run


def _long_messages(cfg: LoadBenchConfig, workloads) -> tuple[list[dict] | None, dict]:
    if not cfg.inject_period_s:
        return None, {"tokens": None, "period_s": None}
    try:
        tokenizer = model_tokenizer(cfg.model)
    except Exception:  # noqa: BLE001 - sized by characters instead, and the report says so
        tokenizer = None
    messages = long_prompt(workloads, cfg.long_tokens, tokenizer)
    tokens = len(tokenizer.apply_chat_template(messages)) if tokenizer is not None else None
    return messages, {"tokens": tokens, "requested_tokens": cfg.long_tokens, "period_s": cfg.inject_period_s,
                      "max_tokens": cfg.long_max_tokens, "sized_by": "tokenizer" if tokenizer else "characters"}


async def _phases(cfg: LoadBenchConfig, servers: dict, not_run: dict, workloads, long_messages, t0: float):
    from prescient.latency_bench.agent_http import ChatHTTPTransport

    rows, samples = [], {}
    transports = {name: ChatHTTPTransport(servers[name].url, "hermes", 96) for name in cfg.systems if name in servers}
    try:
        for name, transport in list(transports.items()):
            # first-request costs (lazy initialization, the long prompt's first large prefill) fall here
            try:
                await transport.stream(with_fresh_prefix(workloads[0].messages, f"warm-{t0}"), "warm", 8)
                if long_messages:
                    await transport.stream(with_fresh_prefix(long_messages, f"warm-long-{t0}"), "warm-long", 1)
            except Exception as e:  # noqa: BLE001
                died = servers[name].exit_reason()  # a dead server says how (SIGILL: a build for another CPU)
                not_run[name] = f"warm-up request failed: {type(e).__name__}: {e}" + (f"; {died}" if died else "")
                await transports.pop(name).aclose()
        names = list(transports)
        for i, n in enumerate(cfg.concurrencies):
            order = names[i % len(names):] + names[:i % len(names)] if names else []
            for position, name in enumerate(order):
                server = servers[name]
                waited = await settle({s: servers[s] for s in names}, cfg.drain_s)
                _log(cfg, t0, f"N = {n}: {name}, {cfg.duration_s:g} s"
                              + (f" (after {waited:.1f} s for the servers to go idle)" if waited > 2 * IDLE_WINDOW_S else ""))
                cpu0, spec0 = server.cpu_seconds(), server.spec_counters()
                run = await run_load(transports[name], workloads, long_messages, n, cfg.duration_s, cfg.slo,
                                     f"{name}-n{n}", cfg.inject_period_s, cfg.long_max_tokens, cfg.drain_s)
                row = {"system": name, "clients": n, "order": position, "wall_s": run.wall_s, "settle_s": waited,
                       "server_cpu_s": server.cpu_seconds() - cpu0,
                       "speculation": spec_delta(spec0, server.spec_counters()), **phase_figures(run)}
                rows.append(row)
                samples.setdefault(name, {})[str(n)] = phase_samples(run)
                _log(cfg, t0, f"N = {n}: {name}: {row['num_met_slo']}/{row['num_requests']} in SLO, ITL p99 "
                              f"{fmt_ms(row['itl_emission_s']['p99'])} ms, long TTFT p50 "
                              f"{fmt_ms(row['long']['ttft_s']['p50'])} ms")
    finally:  # the SDK's connections belong to this event loop: close them in it
        for transport in transports.values():
            await transport.aclose()
    return rows, samples


def run_load_bench(cfg: LoadBenchConfig, command: list[str]) -> dict:
    t0 = time.perf_counter()
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads, wmeta = load_workloads(cfg.workloads_file)
    servers, info, not_run = start_servers(cfg, t0)
    rows, samples = [], {}
    try:
        long_messages, long_meta = _long_messages(cfg, workloads)
        rows, samples = asyncio.run(_phases(cfg, servers, not_run, workloads, long_messages, t0))
    finally:
        for server in servers.values():
            server.stop()
    for name in not_run:
        info.pop(name, None)
    report = build_report(cfg, rows, samples, info, not_run, {"workloads": wmeta, "long_prompt": long_meta})
    report.update(created_utc=created, command=command, wall_s=time.perf_counter() - t0,
                  config={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
                  load_avg_end=list(os.getloadavg()))
    write(report, out, cfg.plots)
    _log(cfg, t0, f"wrote {out / 'load_report.json'} and {out / 'load_report.md'} in {report['wall_s'] / 60:.1f} min")
    return report


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _parser() -> argparse.ArgumentParser:
    p = suite_parser("load", __doc__, quick={"help": "N = 1 and 8, 30 s each (unset: the full run)"},
                     out={"default": "bench_load"}, model={"help": "a .gguf model for every system "
                                                           "(default: SmolLM2-135M-Instruct)"}, workloads=True)
    p.add_argument("--concurrency", default=None, help="closed-loop client counts, comma-separated "
                   f"(default: quick {','.join(map(str, QUICK.concurrencies))}, "
                   f"full {','.join(map(str, FULL.concurrencies))})")
    p.add_argument("--duration", type=float, default=None, help="seconds each system runs at each N "
                   f"(default: quick {QUICK.duration_s:g}, full {FULL.duration_s:g})")
    p.add_argument("--inject-period", type=float, default=None, help="seconds between long prompts, 0 = none "
                   f"(default: quick {QUICK.inject_period_s:g}, full {FULL.inject_period_s:g})")
    p.add_argument("--long-tokens", type=int, default=None, help=f"long prompt tokens (default {QUICK.long_tokens})")
    p.add_argument("--long-max-tokens", type=int, default=None,
                   help=f"max_tokens of each long prompt (default {QUICK.long_max_tokens})")
    p.add_argument("--drain", type=float, default=None, help="most seconds requests in flight get after the "
                   f"duration before they are cancelled (default: quick {QUICK.drain_s:g}, full {FULL.drain_s:g})")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="run llama_cpp.server beside prescient (needs the `peers` extra)")
    p.add_argument("--speculate", default=None, help=f"prescient serve's --speculate (default {QUICK.speculate})")
    add_shared(p, ttft_slo_ms=True, itl_slo_ms=True,
               peer_threads=True, peer_pythonpath=True, no_plots=True, no_progress=True)
    return p


def config_from_args(args: argparse.Namespace) -> LoadBenchConfig:
    cfg = QUICK if args.quick else FULL
    over = {"out": args.out, "model": args.model, "workloads_file": args.workloads,
            "concurrencies": _ints(args.concurrency) if args.concurrency else None, "duration_s": args.duration,
            "long_tokens": args.long_tokens, "long_max_tokens": args.long_max_tokens, "drain_s": args.drain,
            "speculate": args.speculate, "slo_ttft_s": args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else None,
            "slo_itl_s": args.itl_slo_ms / 1e3 if args.itl_slo_ms else None, "peer_threads": args.peer_threads,
            "peer_pythonpath": args.peer_pythonpath}
    cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None})
    if args.inject_period is not None:
        cfg = replace(cfg, inject_period_s=args.inject_period or None)
    if not args.peers:
        cfg = replace(cfg, systems=tuple(s for s in cfg.systems if s != "llamacpp"))
    if not cfg.concurrencies or min(cfg.concurrencies) < 1:
        raise SystemExit(f"prescient bench load: --concurrency needs counts >= 1, got {args.concurrency!r}")
    return replace(cfg, plots=not args.no_plots, progress=not args.no_progress)


def cli(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(_parser().parse_args(argv))
    run_load_bench(cfg, ["prescient", "bench", "load", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(cli())
