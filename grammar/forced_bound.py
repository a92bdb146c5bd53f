"""How long a run of forced text a grammar can hold: an upper bound, read from its EBNF.

xgrammar's `find_jump_forward_string` walks the forced text character by character, keeping
every step for its rollback: ~0.14 us and ~130 bytes per character on the 2-core machine, with
no length limit. `(c{1000}){1000}` forces a million characters (0.14 s and ~130 MB per call,
on the engine thread, every step); `((c{1000}){1000}){100}` would need ~13 GB. So a matcher looks
up forced spans only for grammars whose forced runs are provably short (`forced_spans_safe`);
other grammars decode token by token under their masks (forced spans only save steps).

The bound: a forced run is a prefix of every completion, so of the shortest one, which is the
sum over the matcher's stack frames of the shortest completion of each frame's rest. From upper
bounds `M` on each rule's shortest expansion (a fixpoint), `_eval` bounds the innermost frame's
rest (`I`) and each outer frame's rest once the frame nested in it returns (`A`); the bound is
the largest sum down one chain of nested rules. A recursive rule's further levels are ones the
model's own output built, and one level around a cycle may leave at most `MAX_RECURSIVE_RUN`
characters. Any text this module cannot read counts as unbounded (forced spans off).
"""

from __future__ import annotations

import math
import re

INF = math.inf
MAX_FORCED_RUN = 16384  # characters; one lookup of this many: ~2 ms, ~2 MB
MAX_RECURSIVE_RUN = 256  # characters one level of a recursive rule may force

_RULE = re.compile(r"^([A-Za-z_][\w.\-]*) ::= ", re.M)
_TOKEN = re.compile(r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])(?P<star>\*)?
  | \{\s*(?P<lo>-?\d+)\s*(?:,\s*(?P<hi>-?\d+)\s*)?\}
  | (?P<ahead>\(=)
  | (?P<op>[()|*+?])
  | (?P<id>[A-Za-z_][\w.\-]*)
)""", re.X)
_ESCAPE = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)")


def forced_spans_safe(ebnf: str) -> bool:
    """Whether every forced run of the grammar (printed by xgrammar: `str(grammar)`) is at most
    MAX_FORCED_RUN characters, per level of the model's own nesting."""
    try:
        return forced_run_bound(ebnf) <= MAX_FORCED_RUN
    except (ValueError, RecursionError):
        return False


def forced_run_bound(ebnf: str) -> float:
    """Upper bound on a forced run (INF when one level of recursion may force more than
    MAX_RECURSIVE_RUN); raises ValueError on text it cannot read."""
    rules = _parse(ebnf)
    if "root" not in rules:
        raise ValueError("no root rule")
    shortest = {name: INF for name in rules}
    for _ in range(len(rules) + 1):  # decreasing from INF: every round's values are upper bounds
        new = {name: _eval(body, shortest)[0] for name, body in rules.items()}
        if new == shortest:
            break
        shortest = new
    # per rule: the rest of its own frame (I), and for each rule it refers to, the most of its
    # frame left once that rule's frame returns (`after`)
    rest, after = {}, {}
    for name, body in rules.items():
        _, rest[name], refs = _eval(body, shortest)
        after[name] = {ref: a for ref, a in refs.items() if ref in rules}
    # chain[r]: the most a stack from a frame of r down can leave, = max(own rest, after[c] +
    # chain[c]); depth first without recursion (expanded regexes nest thousands of rules)
    chain: dict[str, float] = {}
    path, edge_after, on_path = ["root"], [0.0], {"root"}
    pending = [iter(after["root"].items())]
    while pending:
        for child, a in pending[-1]:
            if child in on_path:  # recursion: what one level around this cycle leaves
                level = sum(edge_after[path.index(child) + 1:]) + a
                if level > MAX_RECURSIVE_RUN:
                    return INF
            elif child not in chain:
                path.append(child)
                edge_after.append(a)
                on_path.add(child)
                pending.append(iter(after[child].items()))
                break
        else:
            name = path.pop()
            edge_after.pop()
            on_path.discard(name)
            pending.pop()
            chain[name] = max([rest[name]] + [a + chain[c] for c, a in after[name].items() if c in chain])
    return chain["root"]


# --- the EBNF xgrammar prints: `name ::= ((seq) | (seq)) (=(lookahead))`, TagDispatch(...) ---


def _parse(ebnf: str) -> dict[str, list]:
    starts = list(_RULE.finditer(ebnf))
    rules = {}
    for i, m in enumerate(starts):
        body = ebnf[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(ebnf)].strip()
        rules[m.group(1)] = _dispatch(body) if body.startswith("TagDispatch(") else _Parser(body).rule()
    return rules


def _dispatch(body: str) -> list:
    """A TagDispatch rule: free text until a tag, then the tag's rule; its own forced text is at
    most its quoted strings (tags, stop strings), its rules are frames of their own."""
    strings = re.findall(r'"(?:[^"\\]|\\.)*"', body)
    names = re.findall(r'\(\s*"(?:[^"\\]|\\.)*"\s*,\s*([A-Za-z_][\w.\-]*)\s*\)', body)
    size = sum(_length(s) for s in strings)
    return ["dispatch", size, names]


class _Parser:
    def __init__(self, text: str):
        self.tokens = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                if text[pos:].strip() == "":
                    break
                raise ValueError(f"unreadable grammar text at {text[pos:pos + 20]!r}")
            self.tokens.append(m)
            pos = m.end()
        self.i = 0

    def rule(self) -> list:
        node = self.choice()
        while self.i < len(self.tokens) and self.tokens[self.i].group("ahead"):
            self.i += 1
            self.choice()  # a lookahead matches nothing itself
            self.expect(")")
        if self.i != len(self.tokens):
            raise ValueError("trailing grammar text")
        return node

    def peek(self, op: str) -> bool:
        return self.i < len(self.tokens) and self.tokens[self.i].group("op") == op

    def expect(self, op: str) -> None:
        if not self.peek(op):
            raise ValueError(f"expected {op!r}")
        self.i += 1

    def choice(self) -> list:
        alts = [self.seq()]
        while self.peek("|"):
            self.i += 1
            alts.append(self.seq())
        return ["choice", alts]

    def seq(self) -> list:
        items = []
        while self.i < len(self.tokens) and not (self.peek("|") or self.peek(")")
                                                  or self.tokens[self.i].group("ahead")):
            items.append(self.atom())
        return ["seq", items]

    def atom(self) -> list:
        t = self.tokens[self.i]
        self.i += 1
        if t.group("str"):
            node = ["lit", _length(t.group("str"))]
        elif t.group("cls"):
            node = ["lit", 0] if t.group("star") else ["lit", 1]
        elif t.group("id"):
            node = ["ref", t.group("id")]
        elif t.group("op") == "(":
            node = self.choice()
            self.expect(")")
        else:
            raise ValueError(f"unexpected {t.group(0)!r}")
        while self.i < len(self.tokens):  # postfix repetition
            t = self.tokens[self.i]
            if t.group("op") in ("*", "?"):
                node = ["rep", node, 0]
            elif t.group("op") == "+":
                node = ["rep", node, 1]
            elif t.group("lo") is not None:
                node = ["rep", node, max(0, int(t.group("lo")))]
            else:
                break
            self.i += 1
        return node


def _length(quoted: str) -> int:
    """Characters of a quoted literal (each escape one character)."""
    return len(_ESCAPE.sub("x", quoted[1:-1]))


def _eval(node: list, shortest: dict[str, float]) -> tuple[float, float, dict[str, float]]:
    """(M, I, A): upper bounds on the node's shortest expansion, on the shortest completion of its
    rest from any position inside it that is not inside a nested rule, and for each rule it
    refers to, on that rest once the nested rule's frame has returned."""
    kind = node[0]
    if kind == "lit":
        return node[1], node[1], {}
    if kind == "ref":
        m = shortest.get(node[1], INF)
        return m, m, {node[1]: 0.0}
    if kind == "seq":
        parts = [_eval(n, shortest) for n in node[1]]
        refs: dict[str, float] = {}
        tail = rest = 0.0  # tail: the shortest expansion of the parts after the current one
        for m, i, inner in reversed(parts):
            rest = max(rest, i + tail)
            for ref, a in inner.items():
                refs[ref] = max(refs.get(ref, 0.0), a + tail)
            tail += m
        return tail, rest, refs
    if kind == "choice":
        parts = [_eval(n, shortest) for n in node[1]]
        refs = {}
        for _, _, inner in parts:
            for ref, a in inner.items():
                refs[ref] = max(refs.get(ref, 0.0), a)
        return min(p[0] for p in parts), max(p[1] for p in parts), refs
    if kind == "rep":  # inside an iteration: its rest, then at most `count - 1` more
        m, i, inner = _eval(node[1], shortest)
        count = node[2]
        more = (count - 1) * m if count > 1 else 0  # (0 * INF would be NaN)
        return count * m if count else 0, i + more, {ref: a + more for ref, a in inner.items()}
    if kind == "dispatch":
        return node[1], node[1], {name: node[1] for name in node[2]}
    raise ValueError(kind)
