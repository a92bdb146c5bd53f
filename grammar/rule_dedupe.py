"""Merge EBNF rules that define the same language by the same structure, before xgrammar compiles.

xgrammar builds a token-mask cache for every position of every rule, a pass over the whole
vocabulary each (~4-7 ms against SmolLM2's 49k tokens), and its JSON-schema converter emits one
rule set per occurrence: the same `$ref` target, pattern or open object written in several places
becomes several identical copies, and the "any key but the declared ones" trie of an open object
(`additionalProperties: true` beside `properties`) ends in one identical rule per declared name.
On Github_hard that repetition was most of the slow compiles.

`dedupe_rules` finds the coarsest partition of the rules in which every rule's body, with each
reference replaced by its class, reads the same as the bodies of the rest of its class (Moore's
partition refinement, as for minimizing an automaton), and keeps one rule per class. Rules in one
class derive the same strings: a derivation from one member lifts to any other member step by
step, because their bodies differ only in which member of a class they name. So the grammar's
language is unchanged, recursive rules included (`a ::= "x" a | ""` and `b ::= "x" b | ""` merge).
"""

from __future__ import annotations

import re

from prescient.grammar.pattern import ebnf_tokens

_RULE_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")


def dedupe_rules(ebnf: str, root: str = "root") -> str:
    """`ebnf` (one `name ::= body` per line, as xgrammar prints grammars) with the rules that
    define the same language by the same structure merged; `root` keeps its name. Text in any
    other layout is returned unchanged."""
    rules: dict[str, list[str]] = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        m = _RULE_RE.match(line)
        if m is None or m.group(1) in rules:
            return ebnf
        rules[m.group(1)] = ebnf_tokens(m.group(2))
    if root not in rules:
        return ebnf
    names = list(rules)
    # A token is a reference when it names a rule; everything else (literals, classes,
    # operators, repetition bounds, words that are not rule names) is compared as text.
    refs = {name: [i for i, tok in enumerate(toks) if tok in rules] for name, toks in rules.items()}
    cls = {name: 0 for name in names}
    count = 1
    while True:
        signatures: dict[tuple, int] = {}
        new = {}
        for name in names:
            toks = list(rules[name])
            for i in refs[name]:
                toks[i] = cls[toks[i]]
            # the previous class first: a refinement never merges what was apart
            new[name] = signatures.setdefault((cls[name], tuple(toks)), len(signatures))
        cls = new
        if len(signatures) == count:
            break
        count = len(signatures)
    if count == len(names):
        return ebnf
    keep: dict[int, str] = {cls[root]: root}
    for name in names:
        keep.setdefault(cls[name], name)
    out = []
    for name in names:
        if keep[cls[name]] != name:
            continue
        toks = list(rules[name])
        for i in refs[name]:
            toks[i] = keep[cls[toks[i]]]
        out.append(f"{name} ::= {''.join(toks)}")
    return "\n".join(out) + "\n"
