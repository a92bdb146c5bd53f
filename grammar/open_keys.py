"""Cheaper key tries for open objects: the same "any key but the declared ones", shared free tails.

For an object with declared `properties` and `additionalProperties` allowed, xgrammar writes the
additional key as a trie over the declared names. Every trie node (one per character of the
names, less shared prefixes) has its own "any other character, then any string" alternative,
`[^...c] basic_string_sub`, and the token-mask cache walks the whole vocabulary through each of
those: ~4-7 ms a node against SmolLM2's 49k tokens, so 74 long property names cost 2-5 s.

`share_key_tails` rewrites each node whose characters are plain printable ASCII. With A the
characters that the rewritten nodes branch on anywhere in the grammar, a node that branches on
C (a subset of A) becomes

    ("\\"")? | not_C | "c" child for each c in C
    not_C  ::= other | tail_a for each a in A but not C
    other  ::= [^...A] basic_string_sub | "\\\\" basic_escape basic_string_sub
    tail_a ::= "a" basic_string_sub

`other` and `tail_a` are shared by every node, and `not_C` by every node branching on C, so
the vocabulary walk for them happens once; a node's own alternatives start with one literal
character each. The first characters allowed before and after are the same ([^...C] is [^...A]
plus A minus C, each followed by the same `basic_string_sub`), so each node's language, and the
grammar's, is unchanged. Nodes written any other way (escaped or non-ASCII characters, ranges)
are left as they are.
"""

from __future__ import annotations

import re

_RULE_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_BASE = r'[^\0-\x1f\"\\\r\n'  # the class prefix xgrammar writes for a JSON string character
_FREE = r'] basic_string_sub) | ("\\" basic_escape basic_string_sub)'
_CHILD = re.compile(r' \| \("((?:[^"\\]|\\.)+)" ([A-Za-z_][A-Za-z0-9_]*)\)')
_CLASS_ESCAPED = set("'-[]^")  # what xgrammar escapes inside a character class
_OTHER = "prescient_key_other"


def share_key_tails(ebnf: str) -> str:
    """`ebnf` (one `name ::= body` per line, xgrammar's layout) with the key-trie nodes of open
    objects rewritten to share their free tails; anything else is returned unchanged."""
    lines = [ln for ln in ebnf.splitlines() if ln.strip()]
    parsed = [_RULE_RE.match(ln) for ln in lines]
    if not all(parsed) or "basic_string_sub ::=" not in ebnf:
        return ebnf
    names = {m.group(1) for m in parsed}
    nodes = {}
    for m in parsed:
        node = _trie_node(m.group(2))
        if node is not None:
            nodes[m.group(1)] = node
    alphabet = sorted({c for _, children in nodes.values() for c, _ in children})
    tails = {c: f"prescient_key_{ord(c)}" for c in alphabet}
    if not alphabet or any(n.startswith("prescient_key_") for n in names):
        return ebnf
    # one shared "any other first character" rule per set of branch characters (most nodes
    # branch on one): a node keeps a few alternatives, not |A| (forced_bound.py reads every one)
    others: dict[frozenset, str] = {}
    out = []
    for m in parsed:
        name, body = m.group(1), m.group(2)
        if name not in nodes:
            out.append(f"{name} ::= {body}")
            continue
        ends, children = nodes[name]
        other = others.setdefault(frozenset(c for c, _ in children), f"prescient_key_not_{len(others)}")
        alts = (['"\\""'] if ends else []) + [other] + [f"{_literal(c)} {child}" for c, child in children]
        out.append(f"{name} ::= (" + " | ".join(f"({a})" for a in alts) + ")")
    for branch, other in others.items():
        alts = [_OTHER] + [tails[c] for c in alphabet if c not in branch]
        out.append(f"{other} ::= (" + " | ".join(f"({a})" for a in alts) + ")")
    out.append(f"{_OTHER} ::= (({_BASE}{''.join(_class_char(c) for c in alphabet)}{_FREE})")
    out += [f"{tails[c]} ::= (({_literal(c)} basic_string_sub))" for c in alphabet]
    return "\n".join(out) + "\n"


def _trie_node(body: str):
    """(whether the key may end here, [(character, child rule)]) if `body` is a trie node in
    xgrammar's form with only plain printable ASCII characters, else None."""
    end = '(("\\"") | '
    ends = body.startswith(end)
    rest = "(" + body[len(end):] if ends else body
    if not rest.startswith("((" + _BASE):
        return None
    rest = rest[len("((" + _BASE):]
    close = _class_end(rest)
    if close is None:
        return None
    excluded = _class_chars(rest[:close])
    rest = rest[close:]
    if excluded is None or not rest.startswith(_FREE) or not rest.endswith(")"):
        return None
    rest = rest[len(_FREE):-1]
    children = []
    for m in _CHILD.finditer(rest):
        char = _literal_char(m.group(1))
        if char is None:
            return None
        children.append((char, m.group(2)))
    if "".join(m.group(0) for m in _CHILD.finditer(rest)) != rest:
        return None
    if sorted(excluded) != sorted(c for c, _ in children):
        return None  # the class must exclude exactly the characters the node branches on
    return ends, children


def _class_end(text: str):
    i = 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == "]":
            return i
        else:
            i += 1
    return None


def _class_chars(text: str):
    """The characters of a class body, each plain printable ASCII other than `"` and `\\`
    (written bare or backslash-escaped); None for anything else (ranges, other escapes)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1] not in _CLASS_ESCAPED:
                return None
            c = text[i + 1]
            i += 2
        else:
            if c == "-" or not (" " <= c <= "~") or c in '"\\':
                return None
            i += 1
        out.append(c)
    return out


def _literal_char(text: str):
    """The one character of a literal's body: plain printable ASCII other than `"` and `\\`
    (`'` written escaped, as xgrammar does), else None."""
    if text == "\\'":
        return "'"
    return text if len(text) == 1 and " " <= text <= "~" and text not in "\"\\'" else None


def _class_char(c: str) -> str:
    return "\\" + c if c in _CLASS_ESCAPED else c


def _literal(c: str) -> str:
    return '"\\\'"' if c == "'" else f'"{c}"'
