"""prescient.grammar.schema: JSON schemas made into a form xgrammar enforces exactly.

Every JSON schema bound for xgrammar (response formats and tool argument schemas) goes through
`GrammarCompiler.prepare_schema`, in three steps:

    lower  (lower.py)           references made simple (refs.py), then shapes xgrammar
                                would weaken rewritten into equivalent or narrower ones; the
                                rules live in merge.py (keywords beside `$ref`/combinators
                                merged, enums filtered), objects.py, scalars.py (with
                                regex_length.py: pattern x length) and one_of.py, over the
                                helpers in nodes.py; refuses a schema it proves unsatisfiable
                                and names every narrowing rule it used
    check  (check.py)           refuse, with GrammarError naming the feature, whatever is left
                                that xgrammar would silently drop
    close  (closed_objects.py)  additionalProperties: false on objects that declare properties

Narrower is allowed (every output still validates against the original schema), looser never.
The compiler then turns the result into a grammar; a schema with a `pattern` is compiled as
EBNF through grammar/pattern.py, which stays outside this package because regex formats use it
too.
"""
