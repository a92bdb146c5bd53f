"""The tool-call stream parser under any split of the text into deltas, and cut anywhere.

Speculation and grammar-forced spans deliver several tokens a step, so a delta can end inside
`<tool_call>`, inside a call's header or arguments, or inside the separator between calls. However
the text is split: the events are the same as for the whole text, argument deltas concatenate to
the call's arguments, and no content delta carries call markup. A reply cut short (max_tokens)
leaks no markup either; after a natural stop, held-back text that was not markup is content.
"""

from __future__ import annotations

import json
import random

import pytest

from prescient.grammar import (ContentDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart,
                               ToolCallStreamParser, call_header, parse_tool_calls)
from prescient.grammar.tools import CALL_CLOSE, CALL_SEPARATOR

PARIS = {"city": "Paris", "unit": "celsius"}
TRICKY = {"q": 'a "quoted" } { [ <tool_call> \\', "n": [1, {"x": None}]}


def call(name: str, arguments: dict) -> str:
    return call_header(name) + json.dumps(arguments) + CALL_CLOSE


# What the "required" grammar writes: calls and separators, nothing else.
REQUIRED = CALL_SEPARATOR.join([call("get_weather", PARIS), call("search", TRICKY), call("get_weather", PARIS)])
REQUIRED_ARGS = [json.dumps(PARIS), json.dumps(TRICKY), json.dumps(PARIS)]
# "auto": text, a call, text; the text holds a `<tool` that is not markup.
AUTO = "Let me check <toolbox>.\n" + call("search", TRICKY) + "\n\nDone <tool"
AUTO_CONTENT = "Let me check <toolbox>.\n\n\nDone <tool"


def run(pieces: list[str], cut: bool = False) -> tuple[list, ToolCallStreamParser]:
    parser = ToolCallStreamParser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.finish(cut), parser


def content(events) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def arguments(events, index: int) -> str:
    return "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta) and e.index == index)


def splits(text: str, seed: int = 0, samples: int = 300):
    """Every split in two, one delta per character, and seeded random splits in 3 to 12 pieces."""
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(samples):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 11)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def summary(events) -> tuple:
    """What a split must not change: content, each call's name, arguments and end, in order."""
    calls = [(e.index, e.name) for e in events if isinstance(e, ToolCallStart)]
    return (content(events), calls, [arguments(events, i) for i, _ in calls],
            [e.index for e in events if isinstance(e, ToolCallEnd)])


@pytest.mark.parametrize("text", [REQUIRED, AUTO], ids=["required", "auto"])
def test_any_split_gives_the_events_of_the_whole_text(text):
    whole = summary(run([text])[0])
    for pieces in splits(text):
        events, _ = run(pieces)
        assert summary(events) == whole, pieces
        order = [(type(e).__name__, getattr(e, "index", None)) for e in events if not isinstance(e, ContentDelta)]
        for index in range(len(whole[1])):  # each call: its start, then its deltas, then its end
            mine = [kind for kind, i in order if i == index]
            assert mine[0] == "ToolCallStart" and mine[-1] == "ToolCallEnd"
            assert set(mine[1:-1]) == {"ToolCallArgumentsDelta"}


def test_required_output_streams_no_content_and_exact_arguments():
    for pieces in splits(REQUIRED, seed=1, samples=100):
        events, parser = run(pieces)
        assert not [e for e in events if isinstance(e, ContentDelta)], pieces  # the "\n" separators too
        assert [arguments(events, i) for i in range(3)] == REQUIRED_ARGS
        assert [c.arguments for c in parser.calls] == REQUIRED_ARGS and all(c.complete for c in parser.calls)


def test_auto_content_is_the_text_outside_calls_whatever_the_split():
    for pieces in splits(AUTO, seed=2, samples=100):
        events, _ = run(pieces)
        assert content(events) == AUTO_CONTENT, pieces  # `<toolbox>` and the final `<tool` are text
        assert arguments(events, 0) == json.dumps(TRICKY)


def test_a_required_reply_cut_anywhere_leaks_no_markup():
    for stop in range(len(REQUIRED) + 1):
        prefix = REQUIRED[:stop]
        for pieces in ([prefix], list(prefix)):
            events, parser = run(pieces, cut=True)
            assert not [e for e in events if isinstance(e, ContentDelta)], (stop, pieces)
            ended = prefix.count("</tool_call>")
            assert [c.complete for c in parser.calls] == [True] * ended + [False] * (len(parser.calls) - ended)
            for i, c in enumerate(parser.calls):  # a started call's arguments so far: a prefix of the whole
                assert REQUIRED_ARGS[i].startswith(arguments(events, i)) and c.arguments == arguments(events, i)
        parsed = parse_tool_calls(prefix, cut=True)
        assert parsed.content == "" and len(parsed.tool_calls) == prefix.count("</tool_call>")


def test_an_auto_reply_cut_anywhere_streams_only_its_text():
    for stop in range(len(AUTO) + 1):
        events, _ = run(list(AUTO[:stop]), cut=True)
        text = content(events)
        assert AUTO_CONTENT.startswith(text), stop
        assert "<tool_call" not in text and '{"name"' not in text
        whole, _ = run([AUTO[:stop]], cut=True)
        assert content(whole) == text


def test_partial_markup_is_held_until_it_is_known():
    parser = ToolCallStreamParser()
    assert parser.feed("Sure.\n<tool") == [ContentDelta("Sure.\n")]
    assert parser.feed("_call>") == []  # the trigger, split across two deltas: never content
    assert parser.feed(call_header("f")[len("<tool_call>"):] + "{}") == [ToolCallStart(0, "f"),
                                                                          ToolCallArgumentsDelta(0, "{}")]
    assert parser.feed(CALL_CLOSE + CALL_SEPARATOR + "<to") == [ToolCallEnd(0)]  # separator held too
    assert parser.feed("ol") == []
    assert parser.feed("box") == [ContentDelta("\n<toolbox")]  # not markup after all: released whole
    assert parser.finish() == []


@pytest.mark.parametrize("tail, stopped, cut", [
    ("x <tool", "x <tool", "x "),  # a partial trigger: content after a natural stop, dropped when cut
    ("\n\n<tool_c", "\n\n<tool_c", ""),  # the same after whitespace alone
    ("\n  \n", "", ""),  # whitespace alone is never content
    ("\n<tool_call>\n{\"na", "\n<tool_call>\n{\"na", ""),  # an unfinished header
])
def test_what_is_held_at_the_end(tail, stopped, cut):
    head = call("f", {}) if tail.startswith("\n") else ""
    for finish_cut, expected in ((False, stopped), (True, cut)):
        events, parser = run([head, tail], cut=finish_cut)
        assert content(events) == expected
        assert len(parser.calls) == (1 if head else 0)
