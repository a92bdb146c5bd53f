"""JSON Schema `pattern` through xgrammar's regex-to-EBNF converter instead of its pattern FSM.

xgrammar 0.2.9 compiles a schema's `pattern` with a dedicated FSM (`Regex(..., json_string=true)`)
that accepts strings the pattern forbids: `^(a+b)?$` accepts "a", `^(a|a{0,2})$` accepts "aaaa",
and the ISO-8601 duration pattern accepts "P8". Its regex-to-EBNF converter (the one behind
`Grammar.from_regex`) gets all of those right, so a schema with patterns is compiled as EBNF:

1. every `pattern` is replaced by an alphanumeric placeholder and the schema converted to EBNF;
2. each pattern is rewritten to match the *JSON text* of the string body (`"` becomes `\\"`,
   a newline `\\n`, ...; anchors at the ends dropped: the match is always whole-string) and
   converted with `Grammar.from_regex`;
3. its rules, renamed, replace the placeholder's `Regex(...)` element.

A pattern with nested repetition (`([a-z]+ ?)*`) is written as its minimal DFA instead of
through `Grammar.from_regex` (regex_dfa.py: the converter's form takes time growing with the
string to match).

Shorthand classes (`\\d \\w \\s`, complements) match what ECMA-262 and Python's `re` both put in
them (class_dialects.py), so an output passes a validator of either dialect.

The rewrite emits the canonical JSON escape for each character (`\\n`, not `\\u000a`), which
is stricter than JSON and still valid.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import xgrammar as xgr

from prescient.grammar.class_dialects import shorthand
from prescient.grammar.errors import GrammarError
from prescient.grammar.regex_dfa import dfa_ebnf
from prescient.grammar.schema.nodes import VALUE_KEYS

_MAX_CHAR = 0x10FFFF
_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # must be escaped inside a JSON string
_SHORT_ESCAPES = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x5C: "\\"}
_CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
_LINE_TERMINATORS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_PLACEHOLDER = "prescientpattern{}x"
_PLACEHOLDER_RE = re.compile(r'Regex\("prescientpattern(\d+)x", json_string=true\)')
_RULE_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")


def has_pattern(schema: Any) -> bool:
    patterns: list[str] = []
    _collect_patterns(schema, patterns)
    return bool(patterns)


def schema_ebnf_with_patterns(schema: Any, to_ebnf: Callable[[str], str]) -> str:
    """EBNF for `schema` whose patterns use the regex converter; `to_ebnf(schema_json)` is the
    caller's JSON-schema-to-EBNF conversion (its whitespace and strictness options)."""
    patterns: list[str] = []
    masked = _collect_patterns(schema, patterns, replace=True)
    ebnf = to_ebnf(json.dumps(masked))
    rules = []
    for i, pattern in enumerate(patterns):
        regex = json_text_regex(pattern)  # also refuses what the engine cannot read exactly
        # nested repetition matches in time that grows with the string: a DFA instead (regex_dfa.py)
        regex_ebnf = dfa_ebnf(pattern) or str(xgr.Grammar.from_regex(regex))
        rules.append(_renamed_rules(regex_ebnf, f"prescient_pattern_{i}_"))
    ebnf = _PLACEHOLDER_RE.sub(lambda m: f"prescient_pattern_{m.group(1)}_root", ebnf)
    # A pattern in an unused $defs entry never reaches the grammar; one that reached it in
    # another form would leave the placeholder text behind.
    if "prescientpattern" in ebnf:
        raise GrammarError("internal: a pattern reached the grammar in an unexpected form",
                           feature="pattern")
    return ebnf.rstrip("\n") + "\n" + "\n".join(rules) + "\n"


def _collect_patterns(node: Any, patterns: list[str], replace: bool = False) -> Any:
    """Walk schema positions (not enum/const/default values); with `replace`, return a copy
    whose string patterns are placeholders, appending the originals to `patterns`."""
    if isinstance(node, list):
        return [_collect_patterns(x, patterns, replace) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = _PLACEHOLDER.format(len(patterns)) if replace else value
            patterns.append(value)
        elif key in VALUE_KEYS:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: _collect_patterns(v, patterns, replace) for k, v in value.items()}
        else:
            out[key] = _collect_patterns(value, patterns, replace)
    return out


def _renamed_rules(ebnf: str, prefix: str) -> str:
    lines = [ln for ln in ebnf.strip().splitlines() if ln.strip()]
    parsed = [_RULE_RE.match(ln) for ln in lines]
    if not all(parsed):
        raise GrammarError("internal: unexpected regex grammar layout", feature="pattern")
    names = {m.group(1) for m in parsed}
    return "\n".join(f"{prefix}{m.group(1)} ::= {_rename_refs(m.group(2), names, prefix)}"
                     for m in parsed)


def _rename_refs(body: str, names: set[str], prefix: str) -> str:
    """Prefix rule references in an EBNF body, leaving string literals and classes alone."""
    return "".join(prefix + t if t in names else t for t in ebnf_tokens(body))


def ebnf_tokens(body: str) -> list[str]:
    """Split an EBNF rule body into identifiers, string literals, character classes and single
    characters (joined, they give the body back), so a reference is one token, never part of a
    literal."""
    out, i, n = [], 0, len(body)
    while i < n:
        c = body[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and body[j] != close:
                j += 2 if body[j] == "\\" else 1
            out.append(body[i : j + 1])
            i = j + 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (body[j].isalnum() or body[j] == "_"):
                j += 1
            out.append(body[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return out


def check_pattern(pattern: Any, path: str = "#") -> None:
    """Refuse what xgrammar ignores with only a log line: lookaround assertions, and anchors
    anywhere but the ends of a top-level alternative (where whole-string matching makes them
    no-ops; elsewhere dropping one would accept more, as in `(a$|c)b`)."""
    if not isinstance(pattern, str):
        raise GrammarError("'pattern' must be a string", feature="pattern", path=path)
    i, in_class, depth, n = 0, False, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(" and pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            raise GrammarError(f"lookaround assertion in pattern {pattern!r} is not supported "
                               "(xgrammar would ignore it)", feature="pattern:lookaround",
                               path=path)
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "^" and not (depth == 0 and (i == 0 or pattern[i - 1] == "|")
                               or re.fullmatch(r"(\((\?:)?)*", pattern[:i])):
            raise GrammarError(f"anchor '^' in the middle of pattern {pattern!r} is not "
                               "supported (xgrammar would ignore it)", feature="pattern:anchor",
                               path=path)
        elif c == "$" and not (depth == 0 and (i + 1 == n or pattern[i + 1] == "|")
                               or re.fullmatch(r"\)*", pattern[i + 1:])):
            raise GrammarError(f"anchor '$' in the middle of pattern {pattern!r} is not "
                               "supported (xgrammar would ignore it)", feature="pattern:anchor",
                               path=path)
        i += 1
    if "^" in pattern or "$" in pattern:  # an end anchor in a repeated group: `(^a|b)*` is no no-op
        from prescient.grammar.schema.merge import Unmergeable
        from prescient.grammar.schema.regex_length import _Parser, _strip_anchors

        try:
            _strip_anchors(_Parser(pattern).parse(), True, True)
        except Unmergeable as err:
            if "inside the pattern" in str(err):
                raise GrammarError(f"anchor inside a repeated part of pattern {pattern!r} is not "
                                   "supported (xgrammar would ignore it)", feature="pattern:anchor",
                                   path=path) from None
        except (RecursionError, IndexError, ValueError):
            pass  # the parser here reads less than the converter: its checks above stand


# --- pattern -> regex over the JSON text of the string body -----------------------------------


def json_text_regex(pattern: str) -> str:
    return _Rewriter(pattern).run()


class _Rewriter:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0

    def fail(self, what: str) -> GrammarError:
        return GrammarError(f"{what} in pattern {self.p!r} is not supported",
                            feature=f"pattern:{what}")

    def run(self) -> str:
        out = []
        n = len(self.p)
        while self.i < n:
            c = self.p[self.i]
            if c == "\\":
                out.append(self._escape_outside_class())
            elif c == "[":
                out.append(_emit_set(self._class()))
            elif c == ".":
                self.i += 1
                out.append(_emit_set(_complement(_LINE_TERMINATORS)))
            elif c == "(":
                out.append(self._group_open())
            elif c in "^$":
                # check_pattern allows anchors only at branch ends, where a whole-string
                # match makes them no-ops
                self.i += 1
            elif c in ")|*+?{}":
                out.append(c)
                self.i += 1
            else:
                self.i += 1
                out.append(_emit_char(ord(c)))
        return "".join(out)

    def _group_open(self) -> str:
        rest = self.p[self.i:]
        if rest.startswith("(?:"):
            self.i += 3
            return "(?:"
        if rest.startswith("(?<") and not rest.startswith(("(?<=", "(?<!")):
            close = rest.find(">")
            if close < 0:
                raise self.fail("unterminated group name")
            self.i += close + 1
            return "("
        if rest.startswith("(?"):
            raise self.fail("group modifier")
        self.i += 1
        return "("

    def _escape_outside_class(self) -> str:
        ranges = self._escape()
        return _emit_set(ranges)

    def _escape(self, over: bool = False) -> list[tuple[int, int]]:
        """Parse `\\x...` at self.i; return the character set it matches (a shorthand class as
        both regex dialects read it, or with `over` either: class_dialects.py)."""
        if self.i + 1 >= len(self.p):
            raise self.fail("trailing backslash")
        c = self.p[self.i + 1]
        self.i += 2
        if c in "dDwWsS":
            return shorthand(c, over)
        if c in _CHAR_ESCAPES:
            return [(_CHAR_ESCAPES[c], _CHAR_ESCAPES[c])]
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"'\\{c}' escape")
            self.i += width
            code = int(digits, 16)
            return [(code, code)]
        if c.isalnum():
            raise self.fail(f"'\\{c}' escape")  # \b \B \p \1 \c ...: not a plain character
        return [(ord(c), ord(c))]

    def _class(self) -> list[tuple[int, int]]:
        self.i += 1
        negated = self.p.startswith("^", self.i)
        self.i += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise self.fail("unterminated character class")
            if self.p[self.i] == "]" and not first:
                self.i += 1
                break
            first = False
            atom = self._class_atom(over=negated)
            single = len(atom) == 1 and atom[0][0] == atom[0][1]
            if (single and self.p.startswith("-", self.i) and self.i + 1 < len(self.p)
                    and self.p[self.i + 1] != "]"):
                self.i += 1
                high = self._class_atom(over=negated)
                if len(high) != 1 or high[0][0] != high[0][1] or high[0][0] < atom[0][0]:
                    raise self.fail("character class range")
                ranges.append((atom[0][0], high[0][0]))
            else:
                ranges += atom
        return _complement(ranges) if negated else _normalize(ranges)

    def _class_atom(self, over: bool = False) -> list[tuple[int, int]]:
        c = self.p[self.i]
        if c != "\\":
            self.i += 1
            return [(ord(c), ord(c))]
        if self.p.startswith("\\b", self.i):
            self.i += 2
            return [(0x08, 0x08)]  # [\b] is backspace
        return self._escape(over)


def _normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for low, high in _normalize(ranges):
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= _MAX_CHAR:
        out.append((start, _MAX_CHAR))
    return out


def _subtract(ranges, remove):
    return _intersect(ranges, _complement(remove))


def _intersect(a, b):
    out, i, j = [], 0, 0
    a, b = _normalize(a), _normalize(b)
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if low <= high:
            out.append((low, high))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _class_char(code: int) -> str:
    ch = chr(code)
    if ch in "\\]^-[":
        return "\\" + ch
    if code <= 0xFFFF and not ch.isprintable():
        return f"\\u{code:04x}"
    return ch


def _emit_set(ranges: list[tuple[int, int]]) -> str:
    """A regex over JSON text matching one character of `ranges`, escaped as JSON requires."""
    ranges = _normalize(ranges)
    safe = _subtract(ranges, _UNSAFE)
    escapes = [code for low, high in _intersect(ranges, _UNSAFE) for code in range(low, high + 1)]
    parts = []
    if safe:
        parts.append(_emit_class(safe))
    parts += [_json_escape_regex(code) for code in escapes]
    if not parts:
        raise GrammarError("pattern with an empty character class is not supported",
                           feature="pattern:empty class")
    # an escape is several characters of JSON text: grouped, so a quantifier takes all of them
    return parts[0] if len(parts) == 1 and safe else "(?:" + "|".join(parts) + ")"


def _emit_class(safe: list[tuple[int, int]]) -> str:
    if len(safe) == 1 and safe[0][0] == safe[0][1]:
        return _emit_char(safe[0][0])
    # A set covering most of Unicode is shorter as a negated class.
    excluded = _complement(safe)
    if len(excluded) < len(safe):
        return "[^" + "".join(_emit_range(r) for r in excluded) + "]"
    return "[" + "".join(_emit_range(r) for r in safe) + "]"


def _emit_range(r: tuple[int, int]) -> str:
    low, high = r
    return _class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}"


def _emit_char(code: int) -> str:
    if any(low <= code <= high for low, high in _UNSAFE):
        return f"(?:{_json_escape_regex(code)})"  # grouped, as in _emit_set
    ch = chr(code)
    if ch in "\\.^$|?*+()[]{}/":
        return "\\" + ch
    if code <= 0xFFFF and not ch.isprintable():
        return f"\\u{code:04x}"
    return ch


def _json_escape_regex(code: int) -> str:
    """Regex for the JSON escape of a character that must be escaped: `\\"`, `\\n`, `\\u0001`."""
    short = _SHORT_ESCAPES.get(code)
    text = "\\" + short if short else f"\\u{code:04x}"
    return "".join("\\" + ch if ch in '\\"' else ch for ch in text)
