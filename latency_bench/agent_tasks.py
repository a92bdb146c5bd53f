"""The agent benchmark's tasks (data, not code) and the rule that settles one.

`agent_tasks.jsonl` (next to this file) holds one task a line: {"id", "toolset", "user",
"expected_calls": [tool names, repeated when a tool is expected more than once], "tool_choice":
[one per turn]}. The turn limit is the length of `tool_choice`; the usual plan is `required`
until the expected calls can have been made, then `auto` for the answer. `agent_tools.json`
holds the tool sets: per set, OpenAI function definitions plus the simulator's `returns`
template (tool_sim.py).

A task is settled when every expected call was made (at least as many schema-valid calls of
each expected tool as the task lists), no invalid call was made (unknown tool, arguments not a
JSON object or failing the schema, tool-call markup that did not parse), and a final answer (a
turn with text and no tool call) came within the turn limit.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
TASKS = _HERE / "agent_tasks.jsonl"
TOOLS = _HERE / "agent_tools.json"
TOOL_CHOICES = ("required", "auto", "none")
SYSTEM = ("You are a helpful assistant with tools. Call the tools you need, one call at a time, with "
          "arguments taken from the user's request; once you have the results, answer the user in one or "
          "two sentences without calling more tools.")


@dataclass(frozen=True)
class AgentTask:
    id: str
    toolset: str
    user: str
    expected_calls: tuple[str, ...]
    tool_choice: tuple[str, ...]

    @property
    def max_turns(self) -> int:
        return len(self.tool_choice)

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.user}]


@dataclass
class CallRecord:
    turn: int
    name: str
    arguments: str
    valid: bool
    error: str | None = None


@dataclass
class TaskRecord:
    """What one run of a task did: every call, whether an answer came, and the turns' timings
    (kept by the loop as RequestTrace objects)."""

    task: AgentTask
    calls: list[CallRecord] = field(default_factory=list)
    final_answer: str | None = None
    final_turn: int | None = None
    turns: int = 0
    error: str | None = None  # a request that failed (transport / server error)
    start: float = 0.0
    end: float = 0.0
    turn_traces: list = field(default_factory=list)  # (turn index, tool_choice, RequestTrace)

    @property
    def num_invalid(self) -> int:
        return sum(not c.valid for c in self.calls)

    @property
    def missing_calls(self) -> list[str]:
        made = Counter(c.name for c in self.calls if c.valid)
        missing = Counter(self.task.expected_calls) - made
        return sorted(missing.elements())

    @property
    def settled(self) -> bool:
        return (self.error is None and not self.missing_calls and self.num_invalid == 0
                and self.final_answer is not None and self.final_turn is not None
                and self.final_turn < self.task.max_turns)

    @property
    def verdict(self) -> str:
        """Why the task settled or not, first reason first."""
        if self.error is not None:
            return "error"
        if self.num_invalid:
            return "invalid call"
        if self.missing_calls:
            return "missing calls"
        if self.final_answer is None:
            return "no final answer"
        return "settled"


def load_toolsets(path: str | Path | None = None) -> dict[str, list[dict]]:
    return json.loads(Path(path or TOOLS).read_text())


def openai_tools(toolset: list[dict]) -> list[dict]:
    """The chat-completions `tools` parameter: the function definitions without `returns`."""
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
            for t in toolset]


def load_tasks(path: str | Path | None = None, toolsets: dict | None = None) -> tuple[list[AgentTask], dict]:
    """Every task of `path` (default: the bundled file), checked against the tool sets; and
    {path, sha256, num_tasks} for the report. A bad task is a ValueError naming its line."""
    p = Path(path or TASKS)
    raw = p.read_bytes()
    toolsets = toolsets if toolsets is not None else load_toolsets()
    tasks = []
    for i, line in enumerate(raw.decode().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        task = AgentTask(d["id"], d["toolset"], d["user"], tuple(d["expected_calls"]), tuple(d["tool_choice"]))
        problem = task_problem(task, toolsets)
        if problem:
            raise ValueError(f"{p}:{i}: task {task.id!r}: {problem}")
        tasks.append(task)
    if len({t.id for t in tasks}) != len(tasks):
        raise ValueError(f"{p}: task ids are not unique")
    return tasks, {"path": str(p), "sha256": hashlib.sha256(raw).hexdigest(), "num_tasks": len(tasks)}


def task_problem(task: AgentTask, toolsets: dict) -> str | None:
    if task.toolset not in toolsets:
        return f"unknown toolset {task.toolset!r}"
    names = {t["name"] for t in toolsets[task.toolset]}
    unknown = [c for c in task.expected_calls if c not in names]
    if unknown:
        return f"expected calls {unknown} are not declared in toolset {task.toolset!r}"
    if not task.expected_calls:
        return "no expected calls"
    bad = [c for c in task.tool_choice if c not in TOOL_CHOICES]
    if bad:
        return f"unknown tool_choice {bad}"
    if task.max_turns <= len(task.expected_calls) or task.tool_choice[-1] == "required":
        return "the turn limit leaves no turn for the final answer"
    return None
