"""What the engine asks of speculation: the protocol an `Engine(speculator=...)` argument meets.

runtime/ defines it and never imports speculative/ beyond the leaf `speculative/tree.py`; the
speculative layer (speculative/speculator.py) implements it, and the builder (prescient/build.py)
hands one to the engine. `Engine.step` calls, in order:

    drafts  = speculator.propose(seqs)                     # a tree (or None) and forced span per seq
    speculator.observe_hidden(seqs, trees, hidden)         # only if speculator.wants_hidden
    results = speculator.verify(seqs, trees, logits, kv)   # a SeqResult (or None) per seq
    speculator.on_committed(request, first)                # after a step's tokens are committed
    speculator.release(request)                            # when a request ends

and `idle_work()` whenever the engine has nothing to run (a background calibration's next
forward). The speculator is the one writer of `request.spec_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from prescient.runtime.request import Request
from prescient.runtime.step_result import SeqResult
from prescient.speculative.tree import DraftTree


@dataclass
class Drafts:
    trees: list[DraftTree | None]  # per scheduled seq; node 0 = its last token
    forced: list[int]  # per seq: its tree starts with a grammar-forced span of this many tokens


class Speculation(Protocol):
    # True: the proposer drafts from the target's hidden states (an EAGLE head); the engine then
    # runs its forwards with model.keep_hidden and hands each sequence's rows to observe_hidden
    wants_hidden: bool

    def propose(self, seqs) -> Drafts: ...

    def observe_hidden(self, seqs, trees: list[DraftTree | None],
                       hidden: list[torch.Tensor | None]) -> None: ...  # per seq [rows, hidden] or None

    # path: the engine's runtime/step_path.DeviceStepPath on the device path (its uploads, its
    # counter-RNG keys, its one read), passed only there
    def verify(self, seqs, trees: list[DraftTree | None], logits: torch.Tensor,  # [num_logits, vocab]
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]], path=None) -> list[SeqResult | None]: ...

    def on_committed(self, request: Request, first: bool) -> None: ...

    def release(self, request: Request) -> None: ...

    def idle_work(self) -> bool: ...
