"""The characters a JSON string must escape, and the escape this engine writes for each.

A pattern constrains a string's value, but the grammar matches its JSON text, where `"`, `\\`
and the controls appear as escapes. grammar/pattern.py (a regex over that text) and dfa.py (an
EBNF over it) both write one canonical escape per character (`\\n`, not `\\u000a`): stricter
than JSON, still valid, and the two forms of one pattern accept the same text.
"""

from __future__ import annotations

UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # must be escaped inside a JSON string
SHORT_ESCAPES = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x5C: "\\"}


def escape_text(code: int) -> str:
    """The JSON text of the escape of `code` (a character in UNSAFE): `\\"`, `\\n`, `\\u0001`."""
    short = SHORT_ESCAPES.get(code)
    return "\\" + short if short else f"\\u{code:04x}"
