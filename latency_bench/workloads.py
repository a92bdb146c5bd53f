"""Benchmark workloads: the shared chat / tool_call / long_edit prompts, the agent loop script,
and the cold (fresh-prefix) and long prompts the load benchmarks send.

The prompts ship with the package as `workloads.jsonl` next to this file (package data), the
default of every benchmark; `--workloads FILE` reads another. The report records which file was
read and its sha256, so two reports can be checked to have measured the same prompts.

An agent session starts from a tool_call prompt. Each turn's reply is treated as a tool call;
after `tool_latency_s` the simulated tool answers with a deterministic JSON result (as a `tool`
message) and the next turn continues the same conversation under the same session id, so the
engine can reuse the conversation's KV and the proposer can copy from earlier turns.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from prescient.latency_bench.bundled import WORKLOADS as BUNDLED_WORKLOADS

KINDS = ("chat", "tool_call", "long_edit")


# What a grammar mode constrains each kind's output to (JSON Schema), from what its prompt asks
# for: a tool call {"name", "arguments"} over the declared tools (each tool's own parameters
# schema when the prompt declares them, see Workload.constraint), or the edited JSON array. Chat
# answers are free text (unconstrained).
CONSTRAINTS = {
    "tool_call": {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search_flights"]},
        "arguments": {"type": "object"}}, "required": ["name", "arguments"]},
    "long_edit": {"type": "array", "items": {"type": "object"}},
}


@dataclass(frozen=True)
class Workload:
    index: int  # line number in the file (stable prompt id across reports)
    kind: str
    messages: tuple  # chat messages (dicts)
    max_tokens: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    @property
    def constraint(self) -> dict | None:
        tools = declared_tools(self.messages) if self.kind == "tool_call" else None
        return tool_call_schema(tools) if tools else CONSTRAINTS.get(self.kind)


def declared_tools(messages) -> list[dict] | None:
    """The OpenAI-style tool list a tool_call prompt declares after 'Tools: ' in its system
    message (the workloads put it there as JSON), or None."""
    for m in messages:
        text = m.get("content") if m.get("role") == "system" else None
        if isinstance(text, str) and "Tools: " in text:
            try:
                tools = json.loads(text.split("Tools: ", 1)[1])
            except json.JSONDecodeError:
                return None
            return [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
                    and t["function"].get("name")] if isinstance(tools, list) else None
    return None


def tool_call_schema(functions: list[dict]) -> dict:
    """{"name", "arguments"} where the arguments follow the named tool's parameters schema: what
    `tool_choice: required` constrains a call to (one branch per declared tool)."""
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions]}


def default_workloads_path() -> Path:
    return BUNDLED_WORKLOADS


def load_workloads(path: str | Path | None = None) -> tuple[list[Workload], dict]:
    """All workloads of `path` (default: the bundled file) in file order, and {path, sha256}
    for the report."""
    p = Path(path) if path else default_workloads_path()
    if not p.exists():
        raise FileNotFoundError(f"workloads file not found: {p}")
    raw = p.read_bytes()
    items = []
    for i, line in enumerate(raw.decode().splitlines()):
        if line.strip():
            w = json.loads(line)
            items.append(Workload(i, w["workload"], tuple(w["messages"]), int(w["max_tokens"])))
    return items, {"path": str(p), "sha256": hashlib.sha256(raw).hexdigest(), "num_workloads": len(items)}


def select(workloads: list[Workload], per_kind: int | None, max_tokens_cap: int | None = None) -> list[Workload]:
    """The first `per_kind` prompts of each kind (all when None), max_tokens capped if asked."""
    out, seen = [], {}
    for w in workloads:
        seen[w.kind] = seen.get(w.kind, 0) + 1
        if per_kind is None or seen[w.kind] <= per_kind:
            cap = min(w.max_tokens, max_tokens_cap) if max_tokens_cap else w.max_tokens
            out.append(Workload(w.index, w.kind, w.messages, cap))
    return out


# ---------------------------------------------------------------- cold and long prompts


def with_fresh_prefix(messages, nonce: str) -> list[dict]:
    """`messages` with `[nonce] ` opening the first message: a prompt no prefix cache holds (the
    chat template's few opening tokens aside), so its prefill is cold on any server."""
    out = [dict(m) for m in messages]
    out[0]["content"] = f"[{nonce}] {out[0]['content']}"
    return out


def filler_text(workloads: list[Workload]) -> str:
    """Every workload's text, joined: the material a long prompt is cut from."""
    return " ".join(m["content"] for w in workloads for m in w.messages if isinstance(m.get("content"), str))


def long_prompt(workloads: list[Workload], num_tokens: int, tokenizer=None) -> list[dict]:
    """A chat of about `num_tokens` prompt tokens (chat template included): a request to summarize
    the workloads' text repeated to length. Cut by `tokenizer` (an object with `encode`, `decode`
    and `apply_chat_template`, as the servers' own) when given, else by ~4 characters a token."""
    head = "Summarize the following notes in one sentence.\n\n"
    text = filler_text(workloads)
    if tokenizer is None:
        body = (text * (4 * num_tokens // max(1, len(text)) + 1))[:max(0, 4 * num_tokens - len(head))]
        return [{"role": "user", "content": head + body}]
    overhead = len(tokenizer.apply_chat_template([{"role": "user", "content": head}]))
    ids = tokenizer.encode(text)
    ids = (ids * ((num_tokens - overhead) // max(1, len(ids)) + 1))[:max(0, num_tokens - overhead)]
    return [{"role": "user", "content": head + tokenizer.decode(ids)}]


# ---------------------------------------------------------------- simulated tools

_WEATHER = {"paris": (14, "light rain"), "oslo": (-3, "snow"), "london": (9, "overcast")}


def tool_result(reply: str, turn: int) -> str:
    """A deterministic tool answer for an agent's reply. The reply is parsed as the tool call
    the workload's system prompt asks for ({"name": ..., "arguments": {...}}); a reply that is
    not one (a small model often drifts) still gets an answer, so every session runs its turns."""
    call = _parse_call(reply)
    name = call.get("name", "")
    args = call.get("arguments", {}) if isinstance(call.get("arguments"), dict) else {}
    if name == "get_weather":
        city = str(args.get("city", "Paris"))
        temp, cond = _WEATHER.get(city.lower(), (21, "clear"))
        if args.get("unit") == "fahrenheit":
            temp = round(temp * 9 / 5 + 32)
        result = {"city": city, "temperature": temp, "unit": args.get("unit", "celsius"), "conditions": cond}
    elif name == "search_flights":
        origin, dest = str(args.get("origin", "SFO")), str(args.get("destination", "JFK"))
        result = {"flights": [{"flight": f"PX{100 + 17 * i + turn}", "origin": origin, "destination": dest,
                               "date": str(args.get("date", "2026-12-24")), "departure": f"{7 + 3 * i:02d}:15",
                               "price_usd": 189 + 40 * i} for i in range(3)]}
    else:
        result = {"error": "no tool call recognised", "hint": "reply with a JSON tool call or a final answer"}
    return json.dumps({"turn": turn, "tool": name or None, "result": result})


def _parse_call(reply: str) -> dict:
    m = re.search(r"\{.*\}", reply, re.S)
    if not m:
        return {}
    try:
        call = json.loads(m.group(0))
    except json.JSONDecodeError:
        return {}
    return call if isinstance(call, dict) else {}
