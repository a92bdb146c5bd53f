"""Conversations kept per response id, so `previous_response_id` can continue them.

A stored `Conversation` is everything the next turn needs: the plain messages so far (without the
system message, which each request rebuilds from its own `instructions` and tools, as OpenAI does)
and the rendered text + token ids the model saw, including its raw output, which the next prompt
extends token for token (server/chat.py). `session_id` is the id of the conversation's first
response and is passed to the engine on every turn, so the engine pins the conversation's KV
blocks between turns (runtime/sessions.py) while the client runs its tools.

The store is bounded (least recently used evicted first) and entries expire after a TTL.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from prescient.server.chat import Rendered


@dataclass(frozen=True)
class Conversation:
    response_id: str
    session_id: str
    messages: tuple[dict, ...]
    rendered: Rendered


class ResponseStore:
    def __init__(self, max_entries: int = 4096, ttl_s: float = 3600.0, clock=time.monotonic):
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_entries >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[Conversation, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, conversation: Conversation) -> None:
        self._entries[conversation.response_id] = (conversation, self.clock() + self.ttl_s)
        self._entries.move_to_end(conversation.response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Conversation | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        conversation, expires = entry
        if expires <= self.clock():
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return conversation
