"""GrammarError: the one exception grammar/ raises for a request it cannot honor exactly.

A request's grammar is refused (never silently weakened) when the schema uses a feature xgrammar
would drop, when the grammar text is invalid, or when compiling takes longer than the time limit.
The server maps it to a 400 with `str(error)` as the message.
"""

from __future__ import annotations


class GrammarError(ValueError):
    """A constraint that cannot be enforced exactly; `feature` names the offending keyword."""

    def __init__(self, message: str, *, feature: str | None = None, path: str | None = None):
        where = f" at {path}" if path else ""
        super().__init__(f"{message}{where}")
        self.feature = feature
        self.path = path
