"""Closed-loop agent load: N concurrent agents, each running multi-turn tool-calling sessions.

An agent starts a session from a tool_call prompt. Every turn streams a reply; unless it was the
last turn, the simulated tool answers after `tool_latency_s` (workloads.tool_result) and the next
turn continues the same conversation with the same session id. An agent starts its next session
as soon as one completes (closed loop: the offered load follows the service rate). A completed
session is a settled agent task; its cost is reported as CPU-seconds (process time of this
process, the engine thread included) per task.

This free-text loop is the in-process load shape of `prescient bench`'s load phases. The agent
benchmark proper (`tools` + `tool_choice`, a tool simulator, settlement rules, servers and the
peer) is `prescient bench agents`: tool_agents.py, agent_bench.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prescient.latency_bench.workloads import Workload, tool_result
from prescient.runtime.slo import distribution


@dataclass(frozen=True)
class AgentLoadConfig:
    num_agents: int = 2
    sessions_per_agent: int = 1
    turns: int = 3
    tool_latency_s: float = 0.2
    max_tokens: int = 96


async def _session(client, script: Workload, cfg: AgentLoadConfig, agent: int, index: int, tag: str) -> float:
    session_id = f"{tag}-a{agent}-s{index}"
    messages = [dict(m) for m in script.messages]
    t0 = time.perf_counter()
    for turn in range(cfg.turns):
        reply = await client.chat(messages, cfg.max_tokens, f"{session_id}-t{turn}", session_id,
                                  workload="agent", turn=turn)
        messages.append({"role": "assistant", "content": reply})
        if turn == cfg.turns - 1:
            break
        await asyncio.sleep(cfg.tool_latency_s)
        messages.append({"role": "tool", "content": tool_result(reply, turn)})
    await client.end_session(session_id)
    return time.perf_counter() - t0


async def _agent(client, scripts: list[Workload], cfg: AgentLoadConfig, agent: int, tag: str,
                 durations: list[float], progress) -> None:
    for s in range(cfg.sessions_per_agent):
        script = scripts[(agent + s) % len(scripts)]
        durations.append(await _session(client, script, cfg, agent, s, tag))
        if progress is not None:
            progress.update(1)


def run_agents(client, scripts: list[Workload], cfg: AgentLoadConfig, tag: str, progress=None) -> dict:
    """Run the closed loop to completion; returns task-level figures (request-level ones are in
    the client's tracker)."""
    durations: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()

    async def main() -> None:
        await asyncio.gather(*(_agent(client, scripts, cfg, a, tag, durations, progress)
                               for a in range(cfg.num_agents)))

    asyncio.run(main())
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = len(durations)
    return {
        "num_agents": cfg.num_agents, "turns": cfg.turns, "tool_latency_s": cfg.tool_latency_s,
        "completed_tasks": n, "wall_s": wall, "cpu_s": cpu,
        "cpu_s_per_task": cpu / n if n else None,
        "tasks_per_s": n / wall if wall else None,
        "task_latency_s": distribution(durations),
    }
