"""The tool-calling agent loop: one task turn by turn, N agents in a closed loop, open-loop arrivals.

A task runs as an agent framework runs it: each turn sends the conversation with the turn's
`tool_choice` (task data), every call the reply makes goes to the tool simulator, and the
results go back (after `tool_latency_s`, the tool's own time) for the next turn, until a turn
answers without calling a tool or the turn limit is reached. Markup that did not parse and
calls the simulator refused are recorded as invalid calls (they settle nothing). A transport
error ends the task as failed. The transports (agent_http.py, agent_ws.py) only move turns; the
rules live in agent_tasks.py.

Closed loop: N agents, each taking the next task as soon as its last one ended. Open loop:
tasks start at Poisson arrival times (open_loop.arrival_offsets) whatever the server's state.
"""

from __future__ import annotations

import asyncio
import time

from prescient.latency_bench.agent_tasks import AgentTask, CallRecord, TaskRecord
from prescient.latency_bench.open_loop import arrival_offsets
from prescient.latency_bench.tool_sim import ToolSimulator


async def run_task(transport, task: AgentTask, toolsets: dict, tag: str, tool_latency_s: float = 0.0) -> TaskRecord:
    tools = toolsets[task.toolset]
    sim = ToolSimulator(tools)
    conv = transport.start(task, tools)
    rec = TaskRecord(task, start=time.perf_counter())
    try:
        for i, choice in enumerate(task.tool_choice):
            try:
                turn = await transport.turn(conv, choice, f"{tag}-t{i}")
            except Exception as e:  # noqa: BLE001 - any failure of the request fails the task, named
                rec.error = f"turn {i}: {type(e).__name__}: {e}"
                break
            rec.turns += 1
            rec.turn_traces.append((i, choice, turn.trace))
            rec.calls += [CallRecord(i, "", m, False, "tool-call markup did not parse") for m in turn.malformed]
            if not turn.calls:
                if turn.content.strip() and not turn.malformed:
                    rec.final_answer, rec.final_turn = turn.content, i
                    break
                conv.add_turn(turn, [])
                continue
            results = [sim.call(name, args) for name, args in turn.calls]
            rec.calls += [CallRecord(i, r.name, a, r.valid, r.error) for r, (_, a) in zip(results, turn.calls)]
            if tool_latency_s:
                await asyncio.sleep(tool_latency_s)
            conv.add_turn(turn, [r.content for r in results])
    finally:
        await transport.end(conv)
        rec.end = time.perf_counter()
    return rec


async def closed_loop(transport, tasks: list[AgentTask], toolsets: dict, num_agents: int, tag: str,
                      tool_latency_s: float = 0.0) -> list[TaskRecord]:
    """`num_agents` agents working through `tasks` (each task once), the next one as soon as one ends."""
    queue = list(enumerate(tasks))
    records: list[TaskRecord] = []

    async def agent() -> None:
        while queue:
            i, task = queue.pop(0)
            records.append(await run_task(transport, task, toolsets, f"{tag}-{i}-{task.id}", tool_latency_s))

    await asyncio.gather(*(agent() for _ in range(num_agents)))
    return records


async def open_loop(transport, tasks: list[AgentTask], toolsets: dict, rate_per_s: float, tag: str,
                    tool_latency_s: float = 0.0, seed: int = 0) -> list[TaskRecord]:
    """One task per arrival of a Poisson process at `rate_per_s` tasks a second."""
    offsets = arrival_offsets(rate_per_s, len(tasks), seed=seed)
    start = time.perf_counter()

    async def one(i: int, task: AgentTask) -> TaskRecord:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        return await run_task(transport, task, toolsets, f"{tag}-{i}-{task.id}", tool_latency_s)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))
