"""One character class or escape of a pattern's text as the code points it matches.

The EBNF rewrite (grammar/pattern.py) reads a pattern left to right and the DFA (dfa.py) reads
the leaves of parser.py's tree; both go through these functions, so a class means one set of
characters whichever path compiles it. Shorthands read as both dialects do (dialects.py; inside
a negated class as either does, so the complement is what both agree on). Positions are indexes
into the pattern text; each reader returns the set and the index after what it read.
"""

from __future__ import annotations

from prescient.grammar.regex.charset import LINE_TERMINATORS, Ranges, complement, normalize
from prescient.grammar.regex.dialects import shorthand
from prescient.grammar.regex.errors import RegexUnsupported

CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}


def read_escape(p: str, i: int, over: bool = False) -> tuple[Ranges, int]:
    """`\\x...` at p[i]: the character set it matches (a shorthand class as both regex dialects
    read it, or with `over` either) and the index after it."""
    if i + 1 >= len(p):
        raise RegexUnsupported("trailing backslash")
    c = p[i + 1]
    i += 2
    if c in "dDwWsS":
        return shorthand(c, over), i
    if c in CHAR_ESCAPES:
        return [(CHAR_ESCAPES[c], CHAR_ESCAPES[c])], i
    if c in "xu":
        width = 2 if c == "x" else 4
        digits = p[i : i + width]
        if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
            raise RegexUnsupported(f"'\\{c}' escape")
        code = int(digits, 16)
        return [(code, code)], i + width
    if c.isalnum():
        raise RegexUnsupported(f"'\\{c}' escape")  # \b \B \p \1 \c ...: not a plain character
    return [(ord(c), ord(c))], i


def read_class(p: str, i: int) -> tuple[Ranges, int]:
    """`[...]` at p[i] (a leading `]` is a literal): its characters, normalized, and the index
    after its `]`."""
    i += 1
    negated = p.startswith("^", i)
    i += negated
    ranges: list[tuple[int, int]] = []
    first = True
    while True:
        if i >= len(p):
            raise RegexUnsupported("unterminated character class")
        if p[i] == "]" and not first:
            i += 1
            break
        first = False
        atom, i = _class_atom(p, i, over=negated)
        single = len(atom) == 1 and atom[0][0] == atom[0][1]
        if single and p.startswith("-", i) and i + 1 < len(p) and p[i + 1] != "]":
            high, i = _class_atom(p, i + 1, over=negated)
            if len(high) != 1 or high[0][0] != high[0][1] or high[0][0] < atom[0][0]:
                raise RegexUnsupported("character class range")
            ranges.append((atom[0][0], high[0][0]))
        else:
            ranges += atom
    return (complement(ranges) if negated else normalize(ranges)), i


def _class_atom(p: str, i: int, over: bool = False) -> tuple[Ranges, int]:
    c = p[i]
    if c != "\\":
        return [(ord(c), ord(c))], i + 1
    if p.startswith("\\b", i):
        return [(0x08, 0x08)], i + 2  # [\b] is backspace
    return read_escape(p, i, over)


def leaf_ranges(text: str) -> Ranges:
    """The characters one leaf of parser.py's tree matches: `[...]`, `\\x`, `.` or a literal."""
    if text.startswith("["):
        return read_class(text, 0)[0]
    if text.startswith("\\"):
        return normalize(read_escape(text, 0)[0])
    if text == ".":
        return complement(LINE_TERMINATORS)
    return [(ord(text), ord(text))]
