"""Conversations kept per response id, so `previous_response_id` can continue them.

A stored `Conversation` is everything the next turn needs: the plain messages so far (without the
system message, which each request rebuilds from its own `instructions` and tools, as OpenAI does)
and the rendered text + token ids the model saw, including its raw output, which the next prompt
extends token for token (server/chat.py), and the ids of the tool calls made in it, which the
next turn's `function_call_output` items must answer. `session_id` is the id of the conversation's first
response and is passed to the engine on every turn, so the engine pins the conversation's KV
blocks between turns (runtime/sessions.py) while the client runs its tools.

The store is bounded in entries and in bytes (least recently used evicted first) and entries
expire after a TTL (`--response-store-size`, `--response-store-mb`, `--response-ttl-s`). Each
entry holds its whole conversation, so an agent's N turns hold O(N^2) tokens between them: the
byte bound, not the count, is what keeps the server's memory flat under long agent sessions.
Token ids are kept as 4-byte machine ints (a tuple of Python ints costs ~36 bytes a token).

Who may continue a stored response is the store's `scope` (`--response-scope`):

    key         the API key that created it (over HTTP or any WebSocket); the default
    connection  a response made on a WebSocket: only that connection; one made over HTTP: its key
    global      any client that knows the id

The server has one `--api-key`, which every authorized client holds, so today `key` lets any
client that may connect and knows the id continue it (as `global` does), except on a server
without a key, where clients presenting different bearer tokens are kept apart; `connection`
keeps a WebSocket's conversations from every other connection and from HTTP. An id the
requester may not continue is answered exactly as an unknown one (nothing tells it exists).
`key` is the default because it is OpenAI's model (a stored response belongs to the credentials
that made it) and an agent that reconnects after a dropped socket can still continue its turn.
"""

from __future__ import annotations

import hashlib
import sys
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from prescient.server.chat import Rendered

RESPONSE_SCOPES = ("connection", "key", "global")


@dataclass(frozen=True)
class Client:
    """The sender of a request as the store sees it: a digest of the bearer token it presented
    (the raw key is not kept) and its WebSocket connection (None over HTTP)."""

    key: str = ""
    connection: str | None = None

    @classmethod
    def of(cls, headers, connection: str | None = None) -> "Client":
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        return cls(hashlib.sha256(token.encode()).hexdigest() if token else "", connection)


@dataclass(frozen=True)
class Conversation:
    response_id: str
    session_id: str
    messages: tuple[dict, ...]
    rendered: Rendered
    call_ids: frozenset[str] = frozenset()  # the conversation's tool calls (function_call call_ids)


def _nbytes(conversation: Conversation, ids: array) -> int:
    """An entry's memory, roughly (upper side): its text, ids and message strings."""
    n = 256 + sys.getsizeof(conversation.rendered.text) + ids.itemsize * len(ids)
    for message in conversation.messages:
        n += 64 + sum(sys.getsizeof(v) for v in message.values() if isinstance(v, str))
    return n + sum(64 + sys.getsizeof(c) for c in conversation.call_ids)


@dataclass(frozen=True)
class _Entry:
    response_id: str
    session_id: str
    messages: tuple[dict, ...]
    text: str
    ids: array  # the rendered token ids, int32
    call_ids: frozenset[str]
    nbytes: int
    expires: float
    owner: tuple | None

    def conversation(self) -> Conversation:
        return Conversation(self.response_id, self.session_id, self.messages, Rendered(self.text, tuple(self.ids)),
                            self.call_ids)


class ResponseStore:
    def __init__(self, max_entries: int = 4096, ttl_s: float = 3600.0, scope: str = "key", clock=time.monotonic,
                 max_bytes: int = 256 << 20):
        if max_entries < 1 or ttl_s <= 0 or max_bytes < 1:
            raise ValueError("the response store needs max_entries >= 1, max_bytes >= 1 and ttl_s > 0")
        if scope not in RESPONSE_SCOPES:
            raise ValueError(f"scope must be one of {', '.join(RESPONSE_SCOPES)}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.scope = scope
        self.clock = clock
        self.nbytes = 0  # sum of the entries' nbytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _owner(self, client: Client) -> tuple | None:
        if self.scope == "global":
            return None
        if self.scope == "connection" and client.connection is not None:
            return ("connection", client.connection)
        return ("key", client.key)

    def put(self, conversation: Conversation, client: Client = Client()) -> None:
        ids = array("i", conversation.rendered.token_ids)
        entry = _Entry(conversation.response_id, conversation.session_id, conversation.messages,
                       conversation.rendered.text, ids, conversation.call_ids, _nbytes(conversation, ids),
                       self.clock() + self.ttl_s,
                       self._owner(client))
        self._drop(entry.response_id)
        self._entries[entry.response_id] = entry
        self.nbytes += entry.nbytes
        # The newest entry always stays, even alone over the byte bound: its turn must continue.
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def get(self, response_id: str, client: Client = Client()) -> Conversation | None:
        """The conversation, if it is stored, unexpired and `client` may continue it."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry.expires <= self.clock():
            self._drop(response_id)
            return None
        if entry.owner is not None and entry.owner not in (("key", client.key), ("connection", client.connection)):
            return None
        self._entries.move_to_end(response_id)
        return entry.conversation()
