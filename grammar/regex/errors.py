"""RegexUnsupported: a pattern, or a part of one, that the readers in grammar/regex/ do not take.

The toolkit has no view on what that means for a request, so it raises its own error and each
caller decides: the schema rules treat it as "cannot rewrite" (Unmergeable), the EBNF rewrite as
a refusal (GrammarError), the DFA as "use xgrammar's form". `str(err)` names what was not read.
"""

from __future__ import annotations


class RegexUnsupported(Exception):
    """Syntax the reader here does not read (`\\b`, a group modifier, an unterminated class),
    or an anchor that is no no-op under whole-string matching."""
