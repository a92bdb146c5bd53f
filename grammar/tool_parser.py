"""Extract hermes-style tool calls from generated text, whole or streamed.

The server streams a call as: its function name once the name is fixed, then argument deltas.
`ToolCallStreamParser.feed(delta)` turns generated text deltas into those events; the name is
reported when the header `<tool_call>\\n{"name": "<fn>", "arguments": ` is complete (under the
tool-call grammar the name can no longer change), and the arguments text is everything up to
the wrapper's closing brace, tracked by JSON nesting depth so the wrapper's own `}` is never
part of the arguments. `parse_tool_calls(text)` runs the same parser over a finished output, so
streamed and non-streamed results agree by construction.

Content never carries call markup, however the text is split into deltas (speculation and forced
spans deliver several tokens a step, so `<tool` may end one delta and `_call>` start the next):
- a tail that may begin `<tool_call>` is held back until it is known not to (then it is content);
- whitespace with no other text between calls (the separator of "required"), before the first
  call or after the last is markup too: such a run is held while it is all whitespace;
- at the end, `finish(cut=True)` (the reply was stopped by max_tokens, an abort, an error)
  drops what is held, a partial `<tool_call` or an unfinished call header: it was the start of a
  call that did not get written. After a natural stop what is held was not markup: content.

Text that does not form a call (possible only without the grammar) is returned as content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

from prescient.grammar.tools import CALL_TRIGGER

_CALL_END = "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_MAX_HEADER_CHARS = 4096  # a header longer than this is not a call


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


StreamEvent = Union[ContentDelta, ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]


@dataclass
class ToolCall:
    name: str
    arguments: str = ""  # JSON text as generated (so far, while streaming)
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, cut: bool = False) -> ParsedOutput:
    """`cut`: the output was stopped before its natural end (see `ToolCallStreamParser.finish`)."""
    parser = ToolCallStreamParser()
    events = parser.feed(text) + parser.finish(cut)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [c for c in parser.calls if c.complete]
    return ParsedOutput(content=content if content.strip() else "", tool_calls=calls)


@dataclass
class ToolCallStreamParser:
    calls: list[ToolCall] = field(default_factory=list)
    _state: str = "text"  # text -> header -> arguments -> tail -> text
    _pending: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _held_ws: str = ""  # whitespace after the arguments value, not yet known to be inside it
    _blank: bool = True  # the text since the start or the last call is all whitespace, none emitted
    _lead_ws: str = ""  # that whitespace, when a trigger followed it (content again if no call)

    def feed(self, delta: str) -> list[StreamEvent]:
        self._pending += delta
        events: list[StreamEvent] = []
        while True:
            before = (self._state, len(self._pending))
            getattr(self, f"_step_{self._state}")(events)
            if (self._state, len(self._pending)) == before:
                return events

    def finish(self, cut: bool = False) -> list[StreamEvent]:
        """Flush at the end of generation. An unfinished call stays `complete=False`. `cut`: the
        output was stopped before its natural end, so a held-back partial trigger or call header
        is the start of a call and is dropped; otherwise it is content (it turned out not to be
        a call). Whitespace with no other text since the last call is never content."""
        events: list[StreamEvent] = []
        if self._state == "text":
            text = self._pending[: len(self._pending) - self._partial_trigger()] if cut else self._pending
            if not (self._blank and not text.strip()):
                self._emit_content(events, text)
        elif self._state == "header" and not cut:
            self._emit_content(events, self._lead_ws + CALL_TRIGGER + self._pending)
        self._pending = ""
        return events

    # --- states -------------------------------------------------------------------------------

    def _step_text(self, events: list[StreamEvent]) -> None:
        at = self._pending.find(CALL_TRIGGER)
        if at >= 0:
            before = self._pending[:at]
            if self._blank and not before.strip():
                self._lead_ws = before  # a separator: part of the markup if a call follows
            else:
                self._emit_content(events, before)
                self._lead_ws = ""
            self._pending = self._pending[at + len(CALL_TRIGGER):]
            self._state = "header"
            return
        # Hold back a tail that may be the start of "<tool_call>", and all of a blank run.
        release = len(self._pending) - self._partial_trigger()
        if self._blank and not self._pending[:release].strip():
            return
        self._emit_content(events, self._pending[:release])
        self._blank = False
        self._pending = self._pending[release:]

    def _step_header(self, events: list[StreamEvent]) -> None:
        m = _HEADER.match(self._pending)
        # The trailing \s* must have seen the first non-space character of the arguments.
        if m and m.end() < len(self._pending):
            self.calls.append(ToolCall(name=m.group(1)))
            events.append(ToolCallStart(len(self.calls) - 1, m.group(1)))
            self._pending = self._pending[m.end():]
            self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
            self._held_ws = ""
        elif _CALL_END in self._pending or len(self._pending) > _MAX_HEADER_CHARS:
            self._emit_content(events, self._lead_ws + CALL_TRIGGER)
            self._state, self._blank = "text", False

    def _step_arguments(self, events: list[StreamEvent]) -> None:
        out = []
        for i, c in enumerate(self._pending):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif self._depth == 0 and c == "}":
                self._emit_arguments(events, "".join(out))
                self._pending = self._pending[i + 1:]
                self._state = "tail"
                return
            elif self._depth == 0 and c.isspace():
                self._held_ws += c
                continue
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
            out.append(self._held_ws + c)
            self._held_ws = ""
        self._emit_arguments(events, "".join(out))
        self._pending = ""

    def _step_tail(self, events: list[StreamEvent]) -> None:
        at = self._pending.find(_CALL_END)
        if at >= 0:
            self.calls[-1].complete = True
            events.append(ToolCallEnd(len(self.calls) - 1))
            self._pending = self._pending[at + len(_CALL_END):]
            self._state, self._blank = "text", True

    # --- helpers ------------------------------------------------------------------------------

    def _partial_trigger(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of the trigger."""
        return next((n for n in range(min(len(CALL_TRIGGER) - 1, len(self._pending)), 0, -1)
                     if CALL_TRIGGER.startswith(self._pending[-n:])), 0)

    def _emit_content(self, events: list[StreamEvent], text: str) -> None:
        if text:
            events.append(ContentDelta(text))

    def _emit_arguments(self, events: list[StreamEvent], text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            events.append(ToolCallArgumentsDelta(len(self.calls) - 1, text))
