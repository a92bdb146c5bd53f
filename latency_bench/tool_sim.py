"""The agent benchmark's deterministic tool simulator: a call's arguments checked, then answered.

Each declared tool (latency_bench/agent_tools.json) carries its parameters schema and a
`returns` template; `ToolSimulator.call(name, arguments)` answers from the arguments alone (a hash
of their canonical JSON seeds every generated field), so the same call gets the same result in
every mode and run. A call naming no declared tool, whose arguments are not a JSON object, or
whose arguments fail the schema gets an error result and is marked invalid; the agent loop
counts those against the task.

`schema_errors` checks the subset of JSON Schema the tool files use (SUPPORTED_KEYWORDS); the
task-file test refuses a schema using any other keyword, so no constraint is silently skipped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

SUPPORTED_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "enum", "minimum",
                                "maximum", "minLength", "maxLength", "description"})
_TYPES = {"object": dict, "string": str, "boolean": bool, "array": list}


def _type_ok(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def schema_errors(value, schema: dict, path: str = "$") -> list[str]:
    """Why `value` fails `schema` (empty: it validates), for the SUPPORTED_KEYWORDS subset."""
    errors = []
    kind = schema.get("type")
    if kind is not None and not _type_ok(value, kind):
        return [f"{path}: expected {kind}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{path}: missing required {k!r}" for k in schema.get("required", ()) if k not in value]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected property {k!r}")
    return errors


def unsupported_keywords(schema: dict) -> set[str]:
    """Keywords of `schema` (recursively, through properties) outside SUPPORTED_KEYWORDS."""
    bad = set(schema) - SUPPORTED_KEYWORDS
    for sub in schema.get("properties", {}).values():
        bad |= unsupported_keywords(sub)
    return bad


@dataclass(frozen=True)
class ToolResult:
    name: str
    valid: bool
    content: str  # the JSON text the tool message carries
    error: str | None = None


class ToolSimulator:
    def __init__(self, tools: list[dict]):
        self.tools = {t["name"]: t for t in tools}

    def call(self, name: str, arguments: str | dict) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return self._error(name, f"unknown tool {name!r} (declared: {sorted(self.tools)})")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return self._error(name, f"arguments are not JSON: {e.msg}")
        if not isinstance(arguments, dict):
            return self._error(name, "arguments are not a JSON object")
        errors = schema_errors(arguments, tool["parameters"])
        if errors:
            return self._error(name, "; ".join(errors))
        return ToolResult(name, True, json.dumps({"tool": name, "result": self._answer(tool, arguments)}))

    @staticmethod
    def _error(name: str, why: str) -> ToolResult:
        return ToolResult(name, False, json.dumps({"tool": name, "error": why}), why)

    @staticmethod
    def _answer(tool: dict, args: dict) -> dict:
        seed = hashlib.sha256(json.dumps([tool["name"], args], sort_keys=True).encode()).digest()
        out = {}
        for i, (field, spec) in enumerate(tool.get("returns", {}).items()):
            r = int.from_bytes(seed[2 * i % 32:2 * i % 32 + 2], "big")
            if "arg" in spec:
                out[field] = args.get(spec["arg"])
            elif "int" in spec:
                lo, hi = spec["int"]
                out[field] = lo + r % (hi - lo + 1)
            elif "choice" in spec:
                out[field] = spec["choice"][r % len(spec["choice"])]
            elif "id" in spec:
                out[field] = f"{spec['id']}{100 + r % 900}"
            else:
                raise ValueError(f"tool {tool['name']!r}: unknown returns spec {spec!r} for {field!r}")
        return out
