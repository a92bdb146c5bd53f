"""Tool calls -> grammar, in the hermes format:

    <tool_call>
    {"name": "<fn>", "arguments": {...}}
    </tool_call>

Built as an xgrammar structural tag (one tag per declared tool; the tag's begin string fixes the
name, its content is the tool's argument schema), chosen by `tool_choice`:

- "auto":     free text; the text `<tool_call>` starts a call (a TriggeredTags format), which
              must then be a well-formed call of a declared tool; text may follow.
- "required": one or more calls and nothing else, separated by "\\n" (TagsWithSeparator).
- named:      exactly one call of that tool.
- "none", or "auto" without tools: no grammar.

The argument grammar of each tool is the one `response_format` would build for the same schema
(the compiler passes `args_grammar`), so schema checks and JSON semantics are identical on both
paths. (xgrammar's JSONSchemaFormat content would use its strict mode, which forbids undeclared
keys that the schema allows.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from xgrammar.structural_tag import (
    GrammarFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from prescient.grammar.errors import GrammarError
from prescient.grammar.spec import GrammarSpec, canonical_json

CALL_TRIGGER = "<tool_call>"
CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "}\n</tool_call>"  # closes the {"name": ..., "arguments": ...} wrapper, then the tag
CALL_SEPARATOR = "\n"
# A function declared without parameters takes none.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_header(name: str) -> str:
    """The text of a call up to its arguments: once generated, the function name is fixed."""
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": '


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: Any  # JSON schema of the arguments object


def tools_from_request(tools: Sequence[Mapping[str, Any]] | None) -> list[ToolSpec]:
    """Chat Completions `{"type": "function", "function": {...}}` or Responses API
    `{"type": "function", "name": ..., "parameters": ...}` entries."""
    out: list[ToolSpec] = []
    for tool in tools or []:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise GrammarError(f"unsupported tool {tool!r}; only function tools are supported",
                               feature="tools.type")
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        _check_name(name)
        params = fn.get("parameters")
        out.append(ToolSpec(name, NO_PARAMETERS if params is None else params))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise GrammarError("tool names must be unique", feature="tools.name")
    return out


def spec_from_tool_choice(
    tools: Sequence[ToolSpec],
    tool_choice: str | Mapping[str, Any] | None = "auto",
    *,
    parallel_tool_calls: bool = True,
) -> GrammarSpec | None:
    mode, chosen = _resolve_choice(tools, tool_choice)
    if mode == "none" or not chosen:
        return None
    body = {
        "mode": mode,
        "parallel": bool(parallel_tool_calls),
        # by name: the same tool set in another order is the same grammar (the calls are an
        # alternation), so an agent's later turns find its compile in the cache (memory or disk)
        "tools": [{"name": t.name, "parameters": t.parameters} for t in sorted(chosen, key=lambda t: t.name)],
    }
    return GrammarSpec("tool_calls", canonical_json(body))


def tool_call_structural_tag(source: str, args_grammar: Callable[[Any], str]) -> StructuralTag:
    """The structural tag for a "tool_calls" GrammarSpec; `args_grammar(schema)` returns the
    EBNF of one tool's arguments (and raises GrammarError for a refused schema)."""
    body = json.loads(source)
    tags = []
    for tool in body["tools"]:
        try:
            ebnf = args_grammar(tool["parameters"])
        except GrammarError as err:
            raise GrammarError(f"tool {tool['name']!r}: {err}", feature=err.feature) from err
        tags.append(TagFormat(begin=call_header(tool["name"]),
                              content=GrammarFormat(grammar=ebnf), end=CALL_CLOSE))
    stop_after_first = not body["parallel"]
    if body["mode"] == "auto":
        fmt: Any = TriggeredTagsFormat(triggers=[CALL_TRIGGER], tags=tags,
                                       stop_after_first=stop_after_first)
    elif body["mode"] == "required":
        fmt = TagsWithSeparatorFormat(tags=tags, separator=CALL_SEPARATOR, at_least_one=True,
                                      stop_after_first=stop_after_first)
    else:
        (fmt,) = tags
    return StructuralTag(format=fmt)


def _resolve_choice(
    tools: Sequence[ToolSpec], tool_choice: str | Mapping[str, Any] | None
) -> tuple[str, list[ToolSpec]]:
    if tool_choice is None or tool_choice == "auto":
        return "auto", list(tools)
    if tool_choice == "none":
        return "none", []
    if tool_choice == "required":
        if not tools:
            raise GrammarError("tool_choice 'required' needs at least one tool",
                               feature="tool_choice")
        return "required", list(tools)
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise GrammarError(f"tool_choice names {name!r}, which is not a declared tool",
                               feature="tool_choice")
        return "named", chosen
    raise GrammarError(f"unsupported tool_choice {tool_choice!r}", feature="tool_choice")


def _check_name(name: Any) -> None:
    # The name is spliced into the grammar's literal begin string and into the JSON wrapper,
    # so it must need no JSON escaping.
    if not isinstance(name, str) or not name or any(c in name for c in '"\\') or any(
        ord(c) < 0x20 for c in name
    ):
        raise GrammarError(f"invalid tool name {name!r}", feature="tools.name")
