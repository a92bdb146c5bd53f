"""`\\d \\w \\s` and their complements as both regex dialects a schema meets read them.

JSON Schema reads a `pattern` as ECMA-262, where `\\d` and `\\w` are ASCII and `\\s` is a fixed
Unicode list; most validators in Python (jsonschema among them) use `re`, where `\\d` is every
Unicode decimal digit, `\\w` every alphanumeric and `\\s` adds \\x1c-\\x1f and \\x85 (and lacks
\\ufeff). A generated string should pass either validator, so a shorthand is read as the
characters *both* dialects put in it (`under`), and inside a negated class as those *either*
puts in it (`over`), whose complement is then again what both agree on. Found by a random walk:
`^\\S+@\\S+$` let through \\x1d, which `re` calls a space.
"""

from __future__ import annotations

import re
from functools import cache

from prescient.grammar.regex.charset import Ranges, complement, intersect, normalize

_ECMA = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF)],
}


def shorthand(letter: str, over: bool = False) -> Ranges:
    """`letter` in dDwWsS; `over`: what either dialect matches (for a negated class's atoms),
    else what both do."""
    kind = letter.lower()
    ecma, python = _ECMA[kind], _python(kind)
    either, both = normalize(ecma + python), intersect(ecma, python)
    if letter.isupper():  # the complement: in it for both = outside for either
        return complement(both) if over else complement(either)
    return either if over else both


@cache
def _python(kind: str) -> Ranges:
    """Python's `re` reading of \\d / \\w / \\s on str: the runs it matches in all of Unicode."""
    return [(m.start(), m.end() - 1) for m in re.finditer(f"\\{kind}+", _every_character())]


@cache
def _every_character() -> str:
    return "".join(map(chr, range(0x110000)))
