"""Tools in the prompt and in the output, in one format: hermes-style tool calls.

The default model's chat template does not render tools, so prescient always renders them
itself, into the system message (after the request's instructions), as:

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    </tools>

    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

A call the model makes is `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
(exactly what the grammar in prescient.grammar.tools constrains it to), several calls are
separated by a newline, and tool results go back as a user turn of
`<tool_response>\\n...\\n</tool_response>` blocks. Tools are rendered whatever `tool_choice` says,
so the system message, and with it the cached KV prefix, stays the same across the turns of an
agent loop that switches `tool_choice`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prescient.grammar import GrammarError, GrammarSpec, spec_from_tool_choice, tools_from_request
from prescient.grammar.tools import CALL_CLOSE, CALL_SEPARATOR, call_header
from prescient.server.errors import bad_request

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class FunctionTool:
    """A declared function, from either API's tool shape."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None


@dataclass(frozen=True)
class ToolSetup:
    tools: tuple[FunctionTool, ...]
    grammar: GrammarSpec | None  # the tool-call grammar tool_choice asks for (None: free text)
    parse_calls: bool  # whether output is scanned for calls (tools declared, tool_choice != none)

    def system_text(self) -> str | None:
        return tools_system_text(self.tools) if self.tools else None


def tools_system_text(tools: tuple[FunctionTool, ...]) -> str:
    lines = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        fn["parameters"] = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
        lines.append(json.dumps({"type": "function", "function": fn}, ensure_ascii=False))
    return _TOOLS_PREAMBLE + "\n".join(lines) + _TOOLS_POSTAMBLE


def render_tool_call(name: str, arguments: str) -> str:
    """One call as the model writes it. Arguments that are not JSON are embedded as a JSON
    string, so the rendered call is always well-formed."""
    try:
        json.loads(arguments)
        args = arguments
    except (ValueError, TypeError):
        args = json.dumps(arguments, ensure_ascii=False)
    return call_header(name) + args + CALL_CLOSE


def render_tool_calls(calls: list[tuple[str, str]]) -> str:
    return CALL_SEPARATOR.join(render_tool_call(name, args) for name, args in calls)


def render_tool_results(outputs: list[str]) -> str:
    return "\n".join(f"<tool_response>\n{out}\n</tool_response>" for out in outputs)


def tool_setup(tools: list[FunctionTool], tool_choice: str | dict | None, parallel: bool | None,
               param: str = "tools") -> ToolSetup:
    """Validate the declared tools and `tool_choice` and pick the grammar; bad input is a 400
    naming the field."""
    declared = [{"type": "function", "name": t.name, "parameters": t.parameters} for t in tools]
    try:
        specs = tools_from_request(declared)
        grammar = spec_from_tool_choice(specs, tool_choice if tool_choice is not None else "auto",
                                        parallel_tool_calls=parallel is not False)
    except GrammarError as err:
        field = "tool_choice" if (err.feature or "").startswith("tool_choice") else param
        raise bad_request(str(err), param=field, code="invalid_tools") from None
    for i, t in enumerate(tools):
        if t.parameters is not None and not isinstance(t.parameters, dict):
            raise bad_request("parameters must be a JSON schema object", param=f"{param}[{i}].parameters")
    return ToolSetup(tuple(tools), grammar, bool(tools) and tool_choice != "none")
