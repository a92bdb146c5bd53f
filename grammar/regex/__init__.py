"""prescient.grammar.regex: the regex toolkit every pattern rule of grammar/ stands on.

A JSON Schema `pattern` is read here once, the same way for every use: compiled to EBNF
(grammar/pattern.py, with dfa.py for nested repetition), cut to a length (schema/regex_length.py),
compared with another pattern (schema/regex_overlap.py), complemented (schema/not_rules.py),
rid of a few strings (finite.py: `not: {enum}` beside a pattern, patternProperties' keys),
intersected with another (product.py: allOf parts with two patterns).
It is a leaf: it imports nothing from the rest of grammar/, which imports its public names
downward, so no reader of a pattern reaches into another's private helpers. One concern a file:

    errors.py       RegexUnsupported: what the reader here does not take
    charset.py      sets of code points as sorted ranges: normalize, complement, intersect
    dialects.py     `\\d \\w \\s` as ECMA-262 and Python's `re` both (or either) read them
    classes.py      one class or escape of a pattern's text (`[^a-z]`, `\\x41`, `.`) as code points
    parser.py       a pattern as a small tree (char, cat, alt, rep, group, anchors) and its lengths
    anchors.py      the tree read as a whole-string match (no-op anchors dropped) or as a search
    json_escape.py  the characters a JSON string must escape, and their escapes
    dfa.py          a pattern with nested repetition as a minimal-DFA grammar
    derivatives.py  a tree one character at a time (partial derivatives), and written back
    finite.py       a pattern's strings but a few (and all of them, when few)
    product.py      the strings two patterns both match, as one pattern
"""
