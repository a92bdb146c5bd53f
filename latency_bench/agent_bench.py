"""`prescient bench agents`: the tool-calling agent loop against prescient's servers and the peer.

    prescient bench agents --quick --out DIR     # the <= 10 minute run (closed N=1, N=8, one rate)
    prescient bench agents --out DIR             # more tasks, more rounds, three arrival rates
    (`prescient bench --agents ...`, the legacy spelling, is the same: suites.py)

Systems (each a server process on the same GGUF, all started before the first phase):

    prescient-off               `serve --speculate off`, tools rendered, no tool grammar (calls
                                parsed client-side from the hermes markup)
    prescient-ngram             `serve --speculate ngram`, likewise without the grammar
    prescient-ngram-grammar     the same server with `tools` + `tool_choice`: the tool-call grammar
                                (prescient's default for tool calls), chat completions over HTTP
    prescient-ngram-grammar-ws  the same through the Responses WebSocket (previous_response_id)
    llamacpp                    llama_cpp.server (chatml-function-calling, prompt cache on); when
                                it cannot stream tool calls, the hermes text format parsed here

Phases: closed loop at N = 1 and N = 8 agents, then open-loop Poisson task arrivals at each rate.
Each phase's tasks are cut into blocks, and every block runs on every system in a rotated order,
so the machine's noise falls on all systems alike. Writes DIR/agent_report.{json,md} and PNGs.
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

from prescient.latency_bench.agent_tasks import load_tasks, load_toolsets
from prescient.latency_bench.agent_tasks import AgentTask
from prescient.latency_bench.bench_servers import LlamaCppServer, PeerMissing, PrescientServer, llamacpp_version
from prescient.latency_bench.suites import add_shared, suite_parser
from prescient.latency_bench.tool_agents import closed_loop, open_loop, run_task
from prescient.runtime.slo import CPU_INTERACTIVE, SLOConfig
from prescient.kernels.cpu_threads import default_threads

SYSTEMS = ("prescient-off", "prescient-ngram", "prescient-ngram-grammar", "prescient-ngram-grammar-ws", "llamacpp")


@dataclass(frozen=True)
class AgentBenchConfig:
    out: str = "bench_agents"
    quick: bool = True
    model: str | None = None
    tasks_file: str | None = None
    systems: tuple[str, ...] = SYSTEMS
    closed_agents: tuple[int, ...] = (1, 8)
    closed_tasks: tuple[int, ...] = (3, 8)  # tasks per system of each closed phase
    block_tasks: tuple[int, ...] = (3, 8)  # tasks per interleaved block of each closed phase
    open_rates_per_min: tuple[float, ...] = (12.0,)
    open_tasks: int = 6
    max_tokens: int = 96
    tool_latency_s: float = 0.05
    slo_ttft_s: float = CPU_INTERACTIVE.ttft_s
    slo_itl_s: float = CPU_INTERACTIVE.itl_emission_p99_s
    price_per_core_hour: float = 0.05  # USD: about an on-demand cloud vCPU-hour
    peer_threads: int = field(default_factory=default_threads)  # the count prescient's pool takes
    peer_pythonpath: str | None = None  # where llama-cpp-python's server extra is installed, if apart
    plots: bool = True
    progress: bool = True
    seed: int = 0

    @property
    def slo(self) -> SLOConfig:
        return SLOConfig(name="agent", ttft_s=self.slo_ttft_s, itl_emission_p99_s=self.slo_itl_s, tpot_s=None,
                         e2e_s=None)


QUICK = AgentBenchConfig()
FULL = replace(QUICK, quick=False, closed_tasks=(8, 16), block_tasks=(4, 8), open_rates_per_min=(6.0, 12.0, 24.0),
               open_tasks=10)


def _log(cfg: AgentBenchConfig, t0: float, msg: str) -> None:
    if cfg.progress:
        print(f"[agents {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _spread(tasks: list, n: int, offset: int = 0) -> list:
    """`n` tasks spread over the file (every tool set), starting `offset` in."""
    step = max(1, len(tasks) // max(n, 1))
    return [tasks[(offset + i * step) % len(tasks)] for i in range(n)]


class _Systems:
    """The servers and, per system, the transport that drives it (one owner for their lifetimes)."""

    def __init__(self, cfg: AgentBenchConfig, toolsets: dict, t0: float):
        from prescient.latency_bench.agent_http import ChatHTTPTransport
        from prescient.latency_bench.agent_ws import ResponsesWSTransport

        self.servers, self.transports, self.not_run, self.info = {}, {}, {}, {}
        want = set(cfg.systems)
        speculations = [s for s, names in (("off", {"prescient-off"}), ("ngram", {
            "prescient-ngram", "prescient-ngram-grammar", "prescient-ngram-grammar-ws"})) if want & names]
        for spec in speculations:
            _log(cfg, t0, f"starting prescient serve --speculate {spec}")
            try:
                self.servers[spec] = self._prescient(cfg, spec, toolsets)
            except PeerMissing as e:
                for name in SYSTEMS:
                    if name.startswith(f"prescient-{spec}") and name in want:
                        self.not_run[name] = str(e)
        mt = cfg.max_tokens
        for name, spec, make in (
                ("prescient-off", "off", lambda u: ChatHTTPTransport(u, "free", mt)),
                ("prescient-ngram", "ngram", lambda u: ChatHTTPTransport(u, "free", mt)),
                ("prescient-ngram-grammar", "ngram", lambda u: ChatHTTPTransport(u, "native", mt)),
                ("prescient-ngram-grammar-ws", "ngram", lambda u: ResponsesWSTransport(u, mt))):
            if name in want and spec in self.servers:
                self.transports[name] = (make(self.servers[spec].url), self.servers[spec])
                self.info[name] = {"server": self.servers[spec].name, "transport": self.transports[name][0].name,
                                   "tool_format": self.transports[name][0].tool_format}
        if "llamacpp" in want:
            _log(cfg, t0, "starting llama_cpp.server")
            self._peer(cfg, toolsets, ChatHTTPTransport)

    @staticmethod
    def _prescient(cfg: AgentBenchConfig, spec: str, toolsets: dict) -> PrescientServer:
        # calibrated at start-up, before other systems run (bench_servers.prescient_command)
        last = None
        # only the n-gram server serves the grammar modes; the other warms without tools' grammar
        fmt = "native" if spec == "ngram" else "free"
        for _ in range(3):  # a grammar compile that timed out on a loaded machine stays refused: restart
            server = PrescientServer(cfg.model, spec)
            last = _warm(server.url, toolsets, fmt)
            if last is None:
                return server
            server.stop()
        raise PeerMissing(f"prescient serve --speculate {spec}: warm-up failed: {last}")

    def _peer(self, cfg: AgentBenchConfig, toolsets: dict, transport_cls) -> None:
        from prescient.runtime.loader import default_model_path

        model = cfg.model or default_model_path()
        try:
            server = LlamaCppServer(model, cfg.peer_threads, pythonpath=cfg.peer_pythonpath)
        except PeerMissing as e:
            self.not_run["llamacpp"] = str(e)
            return
        problem = _tool_loop_problem(server.url, toolsets, transport_cls, cfg.max_tokens)
        fmt = "native"
        if problem is not None:
            log = [ln for ln in server.lines if "Error" in ln or "error" in ln]
            problem += f" (server log: {log[-1].strip()[:300]})" if log else ""
            # its function-calling format cannot stream tool calls: plain ChatML, calls parsed here
            server.stop()
            try:
                server = LlamaCppServer(model, cfg.peer_threads, chat_format="chatml", pythonpath=cfg.peer_pythonpath)
            except PeerMissing as e:
                self.not_run["llamacpp"] = str(e)
                return
            fmt = "hermes"
        _warm(server.url, toolsets, fmt)
        self.servers["llamacpp"] = server
        self.transports["llamacpp"] = (transport_cls(server.url, fmt, cfg.max_tokens), server)
        self.info["llamacpp"] = {"server": server.name, "transport": "http", "tool_format": fmt,
                                 "version": llamacpp_version(cfg.peer_pythonpath), "tool_stream_problem": problem}

    async def aclose(self) -> None:
        for transport, _ in self.transports.values():
            await transport.aclose()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def _tool_loop_problem(url: str, toolsets: dict, transport_cls, max_tokens: int) -> str | None:
    """Why the server at `url` cannot run the loop with native tool calls (None: it can): one
    probe task as the benchmark sends it (streamed, `required` then `auto`, the call and its
    result in the history)."""
    name, tools = next(iter(toolsets.items()))
    probe = AgentTask("probe", name, "Use a tool for me, please.", (tools[0]["name"],), ("required", "auto"))

    async def main() -> str | None:
        transport = transport_cls(url, "native", max_tokens)
        try:
            return (await run_task(transport, probe, toolsets, "probe")).error
        finally:
            await transport.aclose()

    return asyncio.run(main())


def _warm(url: str, toolsets: dict, fmt: str = "native") -> str | None:
    """One short request per tool set and tool_choice, so grammar compiles and first-request
    costs fall before the measurement; the first error's text, or None."""
    from prescient.latency_bench.agent_http import ChatHTTPTransport
    from prescient.latency_bench.agent_tasks import AgentTask

    async def main() -> str | None:
        transport = ChatHTTPTransport(url, fmt, 2)
        try:
            if fmt == "native":
                # The first compile also starts the compile workers, and on a loaded machine can
                # pass the server's time limit; a timed-out grammar stays refused, so spend that
                # start on throwaway tools, never on the measured tool sets' grammars.
                for i in range(6):
                    primer = [{"name": f"warm_{i}", "description": "-", "parameters": {
                        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}]
                    task = AgentTask(f"primer-{i}", "primer", "Hello", (f"warm_{i}",), ("required", "auto"))
                    try:
                        await transport.turn(transport.start(task, primer), "required", f"primer-{i}")
                        break
                    except Exception:  # noqa: BLE001 - a timed-out primer: the next one finds warm workers
                        continue
            for name, tools in toolsets.items():
                for choice in ("required", "auto"):
                    task = AgentTask(f"warm-{name}", name, "Hello", (tools[0]["name"],), (choice, "auto"))
                    try:
                        await transport.turn(transport.start(task, tools), choice, f"warm-{name}-{choice}")
                    except Exception as e:  # noqa: BLE001
                        return f"{type(e).__name__}: {e}"
                if fmt != "native":
                    break  # no grammar: one request warms the server
        finally:
            await transport.aclose()
        return None

    return asyncio.run(main())


def run_agent_bench(cfg: AgentBenchConfig, command: list[str]) -> dict:
    from prescient.latency_bench.agent_report import build_report, write_report

    t0 = time.perf_counter()
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    toolsets = load_toolsets()
    tasks, tmeta = load_tasks(cfg.tasks_file, toolsets)
    systems = _Systems(cfg, toolsets, t0)
    blocks: list[dict] = []
    try:
        blocks = asyncio.run(_phases(cfg, tasks, toolsets, systems, t0))
    finally:
        systems.stop()
    report = build_report(cfg, blocks, systems.info, systems.not_run, tmeta)
    report.update(created_utc=created, command=command, wall_s=time.perf_counter() - t0,
                  config={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
                  load_avg_end=list(os.getloadavg()))
    write_report(report, out, cfg.plots)
    _log(cfg, t0, f"wrote {out / 'agent_report.json'} and {out / 'agent_report.md'} "
                  f"in {report['wall_s'] / 60:.1f} min")
    return report


async def _phases(cfg: AgentBenchConfig, tasks: list, toolsets: dict, systems: _Systems, t0: float) -> list[dict]:
    names = [n for n in cfg.systems if n in systems.transports]
    phases = [("closed", n, _spread(tasks, k, i), b) for i, (n, k, b) in
              enumerate(zip(cfg.closed_agents, cfg.closed_tasks, cfg.block_tasks))]
    phases += [("open", r, _spread(tasks, cfg.open_tasks, 5 + i), cfg.open_tasks)
               for i, r in enumerate(cfg.open_rates_per_min)]
    blocks: list[dict] = []
    try:
        await _run_blocks(cfg, phases, names, toolsets, systems, t0, blocks)
    finally:  # the SDK's connections belong to this event loop: close them in it
        await systems.aclose()
    return blocks


async def _run_blocks(cfg, phases, names, toolsets, systems, t0, blocks: list[dict]) -> None:
    for kind, param, phase_tasks, block in phases:
        chunks = [phase_tasks[i:i + block] for i in range(0, len(phase_tasks), block)]
        for b, chunk in enumerate(chunks):
            order = names[b % len(names):] + names[:b % len(names)] if names else []
            for name in order:
                transport, server = systems.transports[name]
                label = f"{kind}-{param:g}"
                _log(cfg, t0, f"{label} block {b + 1}/{len(chunks)}: {name}, {len(chunk)} tasks")
                cpu0, w0 = server.cpu_seconds(), time.perf_counter()
                tag = f"{name}-{label}-b{b}"
                if kind == "closed":
                    records = await closed_loop(transport, chunk, toolsets, int(param), tag, cfg.tool_latency_s)
                else:
                    records = await open_loop(transport, chunk, toolsets, param / 60.0, tag, cfg.tool_latency_s,
                                              cfg.seed + b)
                blocks.append({"system": name, "phase": label, "kind": kind, "param": param, "block": b,
                               "wall_s": time.perf_counter() - w0, "server_cpu_s": server.cpu_seconds() - cpu0,
                               "records": records})


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _parser() -> argparse.ArgumentParser:
    p = suite_parser("agents", __doc__, quick={"help": "the <= 10 minute run (unset: the full run)"},
                     out={"default": "bench_agents"}, model={"help": "a .gguf model for every system "
                                                             "(default: SmolLM2-135M-Instruct)"})
    p.add_argument("--tasks", default=None, help="a tasks JSONL (default: latency_bench/agent_tasks.jsonl)")
    p.add_argument("--systems", default=None, help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--no-peer", action="store_true", help="do not start llama_cpp.server")
    p.add_argument("--rates", default=None, help="open-loop task arrival rates per minute, comma-separated "
                   f"(default: quick {','.join(map(str, QUICK.open_rates_per_min))}, "
                   f"full {','.join(map(str, FULL.open_rates_per_min))})")
    p.add_argument("--open-tasks", type=int, default=None, help="tasks per open-loop rate")
    p.add_argument("--max-tokens", type=int, default=None, help=f"max_tokens of each turn (default {QUICK.max_tokens})")
    p.add_argument("--tool-latency", type=float, default=None,
                   help=f"seconds each tool takes to answer (default {QUICK.tool_latency_s})")
    add_shared(p, ttft_slo_ms=True, itl_slo_ms=True)
    p.add_argument("--price-per-core-hour", type=float, default=None,
                   help=f"USD per CPU core-hour for the cost figures (default {QUICK.price_per_core_hour})")
    add_shared(p, peer_threads=True, peer_pythonpath=True, no_plots=True, no_progress=True)
    return p


def config_from_args(args: argparse.Namespace) -> AgentBenchConfig:
    cfg = QUICK if args.quick else FULL
    systems = tuple(s for s in args.systems.split(",") if s) if args.systems else cfg.systems
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"prescient bench agents: unknown systems {unknown} (choose from {', '.join(SYSTEMS)})")
    if args.no_peer:
        systems = tuple(s for s in systems if s != "llamacpp")
    over = {"out": args.out, "model": args.model, "tasks_file": args.tasks, "systems": systems,
            "open_rates_per_min": _floats(args.rates) if args.rates else None, "open_tasks": args.open_tasks,
            "max_tokens": args.max_tokens, "tool_latency_s": args.tool_latency,
            "slo_ttft_s": args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else None,
            "slo_itl_s": args.itl_slo_ms / 1e3 if args.itl_slo_ms else None,
            "price_per_core_hour": args.price_per_core_hour, "peer_threads": args.peer_threads,
            "peer_pythonpath": args.peer_pythonpath}
    cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None})
    return replace(cfg, plots=not args.no_plots, progress=not args.no_progress)


def cli(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(_parser().parse_args(argv))
    run_agent_bench(cfg, ["prescient", "bench", "agents", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(cli())
