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
through `Grammar.from_regex` (regex/dfa.py: the converter's form takes time growing with the
string to match).

Classes and escapes are read by grammar/regex/ (classes.py), the one reading every pattern rule
shares: shorthands (`\\d \\w \\s`, complements) match what ECMA-262 and Python's `re` both put in
them (regex/dialects.py), so an output passes a validator of either dialect. The rewrite emits
the canonical JSON escape for each character (regex/json_escape.py: `\\n`, not `\\u000a`), which
is stricter than JSON and still valid.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import xgrammar as xgr

from prescient.grammar.errors import GrammarError
from prescient.grammar.regex.anchors import strip_anchors
from prescient.grammar.regex.charset import LINE_TERMINATORS, complement, intersect, normalize, subtract
from prescient.grammar.regex.classes import read_class, read_escape
from prescient.grammar.regex.dfa import dfa_ebnf
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.json_escape import UNSAFE, escape_text
from prescient.grammar.regex.parser import Parser
from prescient.grammar.schema.nodes import VALUE_KEYS

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
        # nested repetition matches in time that grows with the string: a DFA instead (regex/dfa.py)
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
        try:
            strip_anchors(Parser(pattern).parse(), True, True)
        except RegexUnsupported as err:
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
                out.append(_emit_set(complement(LINE_TERMINATORS)))
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
        ranges, self.i = self._read(read_escape, self.p, self.i)
        return _emit_set(ranges)

    def _class(self) -> list[tuple[int, int]]:
        ranges, self.i = self._read(read_class, self.p, self.i)
        return ranges

    def _read(self, reader, *args):
        """A grammar/regex/classes.py reader; what it does not read is refused."""
        try:
            return reader(*args)
        except RegexUnsupported as err:
            raise self.fail(str(err)) from None


def _class_char(code: int) -> str:
    ch = chr(code)
    if ch in "\\]^-[":
        return "\\" + ch
    if code <= 0xFFFF and not ch.isprintable():
        return f"\\u{code:04x}"
    return ch


def _emit_set(ranges: list[tuple[int, int]]) -> str:
    """A regex over JSON text matching one character of `ranges`, escaped as JSON requires."""
    ranges = normalize(ranges)
    safe = subtract(ranges, UNSAFE)
    escapes = [code for low, high in intersect(ranges, UNSAFE) for code in range(low, high + 1)]
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
    excluded = complement(safe)
    if len(excluded) < len(safe):
        return "[^" + "".join(_emit_range(r) for r in excluded) + "]"
    return "[" + "".join(_emit_range(r) for r in safe) + "]"


def _emit_range(r: tuple[int, int]) -> str:
    low, high = r
    return _class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}"


def _emit_char(code: int) -> str:
    if any(low <= code <= high for low, high in UNSAFE):
        return f"(?:{_json_escape_regex(code)})"  # grouped, as in _emit_set
    ch = chr(code)
    if ch in "\\.^$|?*+()[]{}/":
        return "\\" + ch
    if code <= 0xFFFF and not ch.isprintable():
        return f"\\u{code:04x}"
    return ch


def _json_escape_regex(code: int) -> str:
    """Regex for the JSON escape of a character that must be escaped: `\\"`, `\\n`, `\\u0001`."""
    return "".join("\\" + ch if ch in '\\"' else ch for ch in escape_text(code))
