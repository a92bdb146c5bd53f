"""prescient.grammar.schema: JSON schemas made into a form xgrammar enforces exactly.

Every JSON schema bound for xgrammar (response formats and tool argument schemas) goes through
`GrammarCompiler.prepare_schema`, in three steps:

    lower  (lower.py)           references made simple (refs.py), then shapes xgrammar
                                would weaken rewritten into equivalent or narrower ones; the
                                rules live in merge.py (keywords beside `$ref`/combinators
                                merged, enums filtered), objects.py, scalars.py (with
                                regex_length.py: pattern x length), one_of.py and
                                one_of_singletons.py, fractional_step.py, formats.py,
                                conditionals.py, unique_items.py and not_rules.py, over the
                                helpers in nodes.py; refuses a schema it
                                proves unsatisfiable and names every narrowing rule it used
    check  (check.py)           refuse, with GrammarError naming the feature, whatever is left
                                that xgrammar would silently drop; a `oneOf` passes when
                                disjoint.py (with regex_overlap.py for patterns) proves its
                                branches share no instance
    close  (closed_objects.py)  additionalProperties: false on objects that declare properties

Narrower is allowed (every output still validates against the original schema), looser never.
The compiler then turns the result into a grammar; a schema with a `pattern` is compiled as
EBNF through grammar/pattern.py, which stays outside this package because regex formats use it
too. The rules that read patterns (regex_length.py, regex_overlap.py, not_rules.py) parse them
with grammar/regex/, the leaf below both.
"""
