"""The `Proposer` protocol: who guesses the next tokens, as a `DraftTree` per request.

Engine.step asks the proposer once per step for every request that speculates, with a node
budget per request (from `adaptive.AdaptiveSpeculation`); a proposer may return None for a
request (nothing worth guessing: it decodes plainly this step). Proposers keep incremental state
per request (an index over its tokens, a draft model's KV), so the engine tells them when tokens
were committed and when a request ends. Variants are picked by name from `PROPOSERS`.

Optional capabilities, looked up with getattr: `drafts_past_unverified` (it can draft after
tokens not yet verified, a grammar's forced span) and `learn_output(tenant, prompt, output)`
(a finished request's output, for a pool shared by the tenant's later requests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from prescient.speculative.tree import DraftTree


@dataclass(frozen=True)
class ProposalContext:
    """What a proposer may know about one request at one step."""

    request_id: str
    # The agent conversation this request is a turn of (None: a one-off request). Earlier turns'
    # prompts, tool outputs and answers are what agents copy from.
    session_id: str | None
    # Prompt + output so far; the last token is the tree's root (the last verified token).
    # A list the engine owns: proposers read it during propose() and never keep or mutate it.
    token_ids: Sequence[int]
    # Most nodes below the root the tree may have (0: do not propose).
    max_draft_tokens: int
    # Whose shared suffix pool (speculative/suffix_pool.py) may draft for it: one API key's
    # sessions; None: no pool (the request sees its own text and its session's only).
    tenant: str | None = None


@runtime_checkable
class Proposer(Protocol):
    def propose(self, contexts: Sequence[ProposalContext]) -> list[DraftTree | None]:
        """One tree (root = context.token_ids[-1], at most max_draft_tokens nodes below it) or
        None per context, in order."""
        ...

    def on_tokens_appended(self, request_id: str, session_id: str | None, token_ids: Sequence[int]) -> None:
        """The request's committed sequence is now `token_ids` (prompt + output). Optional for
        the engine to call: propose() catches up on its own; calling it right after prefill
        moves a proposer's one-off indexing of the prompt out of the first decode step."""
        ...

    def on_request_finished(self, request_id: str) -> None:
        """The request ended (finished or aborted); free its state. A session-aware proposer
        keeps what it learned for the session's later turns."""
        ...

    def on_session_closed(self, session_id: str) -> None:
        """The agent session ended: forget its history."""
        ...


# name -> factory(config or None for defaults) -> Proposer; each variant takes its own small
# frozen config. Modules register themselves when imported.
ProposerFactory = Callable[[Any], Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register_proposer(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def register(factory: ProposerFactory) -> ProposerFactory:
        if name in PROPOSERS:
            raise ValueError(f"proposer {name!r} is already registered")
        PROPOSERS[name] = factory
        return factory

    return register


def make_proposer(name: str, config: Any = None) -> Proposer:
    """Build a registered proposer by name (e.g. "ngram") from its config (None = defaults)."""
    # Importing the built-in proposers registers them; done here so that importing this module
    # stays cheap and cycle-free.
    import prescient.speculative.draft_model  # noqa: F401
    import prescient.speculative.eagle  # noqa: F401
    import prescient.speculative.ngram  # noqa: F401

    try:
        factory = PROPOSERS[name]
    except KeyError:
        raise ValueError(f"unknown proposer {name!r}; known: {sorted(PROPOSERS)}") from None
    return factory(config)
