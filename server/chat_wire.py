"""Outbound wire types of Chat Completions and (legacy) Completions, as msgspec Structs.

Stream chunk types omit unset fields (`omit_defaults`), as OpenAI's chunks do: a tool-call
argument delta carries only `index` and `function.arguments`. Chunks with tokens also carry
prescient's timing extension, `token_times` (engine time of each token, seconds since the
request was submitted) and `token_sources` (target / draft / forced); the SDK keeps unknown
fields, so `chunk.token_times` works there.
"""

from __future__ import annotations

from msgspec import Struct


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob]


class FunctionOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class MessageOut(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | None = None


class Choice(Struct):
    index: int
    message: MessageOut
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str  # no default: omit_defaults would drop it
    usage: Usage | None = None
    token_times: list[float] | None = None  # extension
    token_sources: list[str] | None = None  # extension


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct, omit_defaults=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str  # no default: omit_defaults would drop it
    usage: Usage | None = None
    token_times: list[float] | None = None  # extension (stream chunks)
    token_sources: list[str] | None = None  # extension (stream chunks)


def usage(u) -> Usage:
    """From generation.Usage."""
    return Usage(u.prompt_tokens, u.output_tokens, u.total_tokens, PromptTokensDetails(u.cached_tokens))


def chat_logprobs(entries: list[dict], token_text) -> ChoiceLogprobs:
    """Engine logprob entries ({token_id, logprob, top: [(id, logprob)]}) -> OpenAI's shape."""
    out = []
    for e in entries:
        text = token_text(e["token_id"])
        top = [TopLogprob(token_text(i), lp, list(token_text(i).encode())) for i, lp in e.get("top", [])]
        out.append(TokenLogprob(text, e["logprob"], list(text.encode()), top))
    return ChoiceLogprobs(out)


def completion_logprobs(entries: list[dict], token_text, offset: int) -> CompletionLogprobs:
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(e["token_id"])
        tokens.append(text)
        lps.append(e["logprob"])
        tops.append({token_text(i): lp for i, lp in e.get("top", [])})
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens, lps, tops, offsets)
