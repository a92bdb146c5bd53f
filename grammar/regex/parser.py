"""A `pattern` parsed into a small tree, and the lengths of the strings a tree matches.

Tree nodes (tuples, so they hash and compare):

    ("char", text)         one character: its text in the pattern (`a`, `\\d`, `[^a-z]`, `.`);
                           classes.leaf_ranges gives its code points
    ("cat", [node, ...])   concatenation (empty: the empty string)
    ("alt", [node, ...])   alternation
    ("rep", node, lo, hi)  repeat lo..hi times (hi INF: unbounded); `?` `*` `+` `{m,n}`, lazy or not
    ("group", node)        `(...)`, `(?:...)`, `(?<name>...)`
    ("bol",) ("eol",)      `^` and `$`

The parser reads the ECMA-262 subset the rest of the engine compiles; anything else (lookaround,
group modifiers, `\\b`, backreferences, a `{` that is no counted repeat) raises RegexUnsupported,
so a caller never acts on a misread pattern.
"""

from __future__ import annotations

from prescient.grammar.regex.errors import RegexUnsupported

INF = None  # an unbounded length / count


class Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0

    def parse(self):
        node = self._alt()
        if self.i != len(self.p):
            raise RegexUnsupported(f"unbalanced ')' in pattern {self.p!r}")
        return node

    def _alt(self):
        branches = [self._cat()]
        while self.i < len(self.p) and self.p[self.i] == "|":
            self.i += 1
            branches.append(self._cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _cat(self):
        items = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            atom = self._atom()
            items.append(self._quantified(atom))
        return items[0] if len(items) == 1 else ("cat", items)

    def _atom(self):
        p, i = self.p, self.i
        c = p[i]
        if c == "(":
            if p.startswith("(?:", i):
                self.i += 3
            elif p.startswith("(?<", i) and not p.startswith(("(?<=", "(?<!"), i):
                close = p.find(">", i)
                if close < 0:
                    raise RegexUnsupported("unterminated group name")
                self.i = close + 1
            elif p.startswith("(?", i):
                raise RegexUnsupported("lookaround or group modifier")
            else:
                self.i += 1
            inner = self._alt()
            if self.i >= len(p) or p[self.i] != ")":
                raise RegexUnsupported("unterminated group")
            self.i += 1
            return ("group", inner)
        if c == "^":
            self.i += 1
            return ("bol",)
        if c == "$":
            self.i += 1
            return ("eol",)
        if c == "[":
            j = i + 1
            if j < len(p) and p[j] == "^":
                j += 1
            if j < len(p) and p[j] == "]":
                j += 1  # a leading ']' is a literal (as classes.read_class reads it)
            while j < len(p) and p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            if j >= len(p):
                raise RegexUnsupported("unterminated character class")
            self.i = j + 1
            return ("char", p[i:j + 1])
        if c == "\\":
            if i + 1 >= len(p):
                raise RegexUnsupported("trailing backslash")
            e = p[i + 1]
            width = {"x": 2, "u": 4}.get(e, 0)
            if e.isalnum() and e not in "dDwWsSnrtfv0xu":
                raise RegexUnsupported(f"escape '\\{e}'")  # \b \B \1 \p ...: not one character
            self.i = i + 2 + width
            return ("char", p[i:self.i])
        if c in "*+?{":
            raise RegexUnsupported("quantifier without an atom")
        self.i += 1
        return ("char", c)

    def _quantified(self, atom):
        p = self.p
        while self.i < len(p) and p[self.i] in "*+?{":
            c = p[self.i]
            if c == "{":
                close = p.find("}", self.i)
                body = p[self.i + 1:close] if close > 0 else ""
                lo_s, comma, hi_s = body.partition(",")
                # ASCII digits only: `{٣}` is literal text to ECMA-262 and to Python's re
                if not (lo_s.isascii() and lo_s.isdigit()) or (hi_s and not (hi_s.isascii() and hi_s.isdigit())):
                    raise RegexUnsupported("'{' that is not a counted repeat")
                lo, hi = int(lo_s), (int(hi_s) if hi_s else (INF if comma else int(lo_s)))
                if hi is not INF and hi < lo:
                    raise RegexUnsupported("a counted repeat whose bounds are out of order")
                self.i = close + 1
            else:
                lo, hi = {"*": (0, INF), "+": (1, INF), "?": (0, 1)}[c]
                self.i += 1
            if self.i < len(p) and p[self.i] == "?":
                self.i += 1  # lazy: the same strings under a whole-string match
            if atom[0] in ("bol", "eol"):
                raise RegexUnsupported("quantified anchor")
            atom = ("rep", atom, lo, hi)
        return atom


def lengths(node) -> tuple[int, int | None]:
    """(shortest, longest or INF) of the strings `node` matches (anchors are zero-width)."""
    kind = node[0]
    if kind == "char":
        return 1, 1
    if kind in ("bol", "eol"):
        return 0, 0
    if kind == "group":
        return lengths(node[1])
    if kind == "rep":
        m, big = lengths(node[1])
        lo, hi = node[2], node[3]
        return m * lo, (0 if hi == 0 or big == 0 else None if hi is INF or big is INF else big * hi)
    ranges = [lengths(x) for x in node[1]]
    if kind == "cat":
        return (sum(r[0] for r in ranges),
                None if any(r[1] is INF for r in ranges) else sum(r[1] for r in ranges))
    if not ranges:
        return 0, 0
    return (min(r[0] for r in ranges),
            None if any(r[1] is INF for r in ranges) else max(r[1] for r in ranges))
