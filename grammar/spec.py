"""GrammarSpec: what a request constrains its output to, as a hashable (kind, source) pair.

`source` is canonical text (compact JSON for schemas and tool lists, the raw text for regex and
EBNF), so two requests asking for the same grammar share one compile-cache entry. Builders live in
formats.py (response formats) and tools.py (tool calls); the compiler dispatches on `kind`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "tool_calls"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf", "tool_calls")


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {GRAMMAR_KINDS}")
        if not isinstance(self.source, str):
            raise TypeError("GrammarSpec.source must be a str")


def canonical_json(value: Any) -> str:
    """Compact JSON that keeps key order: property order is meaningful to xgrammar (it emits
    object properties in declared order), so keys must not be sorted."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
