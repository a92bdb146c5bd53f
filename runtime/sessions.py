"""Pinned KV for agent sessions: a conversation's blocks stay while the client runs its tools.

When a turn of a session finishes, its full (prefix-cached) blocks get one extra reference held
by the session, replacing the previous turn's pin, until the TTL passes. The next turn of the
same conversation then hits them in the prefix cache and prefills only its new tokens. Pins are
the first thing given up under memory pressure (oldest first), before any running request is
preempted, so they never cost a live request its memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from prescient.runtime.kv_cache import BlockManager


class SessionPins:
    def __init__(self, blocks: BlockManager, ttl_s: float = 300.0, clock=time.perf_counter):
        self.blocks = blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self._pins: OrderedDict[str, tuple[list[int], float]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, session_id: str, block_ids: list[int]) -> None:
        for b in block_ids:
            self.blocks._hold(b)
        self.unpin(session_id)  # after holding: shared blocks never drop to zero in between
        self._pins[session_id] = (list(block_ids), self.clock() + self.ttl_s)

    def unpin(self, session_id: str) -> None:
        entry = self._pins.pop(session_id, None)
        if entry is not None:
            self.blocks.free_blocks(entry[0])

    def expire(self) -> None:
        now = self.clock()
        for session_id in [s for s, (_, exp) in self._pins.items() if exp <= now]:
            self.unpin(session_id)

    def evict_oldest(self) -> bool:
        """Give up the oldest pin to free memory; False when there is none."""
        if not self._pins:
            return False
        self.unpin(next(iter(self._pins)))
        return True

    def pinned_blocks(self, session_id: str) -> list[int]:
        entry = self._pins.get(session_id)
        return list(entry[0]) if entry else []

    def clear(self) -> None:
        for session_id in list(self._pins):
            self.unpin(session_id)
