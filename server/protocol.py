"""Inbound wire types: the request bodies and WebSocket client events, as msgspec Structs.

Decoding a body with `decode(data, Type)` checks types and ranges in one pass and fails with a
message naming the field (`Expected `float` <= 2.0 - at `$.temperature``), which handlers return
as a 400 / `error` event. Fields a Struct does not declare are dropped: OpenAI fields that
cannot change the output (`user`, `service_tier`, `prompt_cache_key`...) and fields in no
OpenAI schema. Every OpenAI field that could change the output is declared, and those prescient
cannot honour are refused by name when set (server/fields.py); docs/CONTRACTS.md ("Request
fields") has the table. Fields marked "extension" are prescient's, not OpenAI's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from prescient.server.errors import from_decode_error
from prescient.server.limits import check_values, deep_field, depth_error, too_deep

Temperature = Annotated[float, Meta(ge=0, le=2)]  # 0 = greedy
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=0)]  # 0 = off
MinP = Annotated[float, Meta(ge=0, le=1)]
MaxTokens = Annotated[int, Meta(ge=1)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
OnlyOne = Annotated[int, Meta(ge=1, le=1)]  # n / best_of: one choice per request


class ContentPart(Struct, kw_only=True):
    """Chat `{"type": "text", "text"}`; Responses `input_text` / `output_text`."""

    type: str
    text: str | None = None


class FunctionDef(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef


class ToolCallFunction(Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class ToolCallIn(Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # ignored: the chat template has no place for it (docs/CONTRACTS.md)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant turn's refusal text: its content when it has none
    function_call: ToolCallFunction | None = None  # legacy assistant call: rendered as a tool call
    audio: Any = None  # refused: no audio output to refer to


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: padding only, the content is the same


class RequestSLO(Struct, kw_only=True, forbid_unknown_fields=True):
    """extension: the request's own latency bound. `itl_ms` bounds the gap between its
    deliveries; the draft planner keeps its verify steps within it."""

    itl_ms: Annotated[float, Meta(gt=0, le=3_600_000)] | None = None
    # bounds the time to its first token: waiting prompts start earliest deadline first
    ttft_ms: Annotated[float, Meta(gt=0, le=3_600_000)] | None = None


class SamplingFields(Struct, kw_only=True):
    """Sampling fields shared by every generation request."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extension
    min_p: MinP | None = None  # extension
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # token id (a decimal string) -> bias in [-100, 100], added to the logits (ServerContext.sampling);
    # an extension on the Responses API, which has no logit_bias
    logit_bias: dict[str, float] | None = None
    speculate: bool | None = None  # extension: false decodes this request without speculation
    slo: RequestSLO | None = None  # extension


class ChatCompletionRequest(SamplingFields, kw_only=True):
    model: str
    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    n: OnlyOne = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    ignore_eos: bool = False  # extension
    # OpenAI fields prescient cannot honour: refused when set (server/fields.py)
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    model: str
    prompt: str | list[int]
    max_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    n: OnlyOne = 1
    best_of: OnlyOne | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: TopLogprobs | None = None
    ignore_eos: bool = False  # extension


class InputItem(Struct, kw_only=True):
    """One Responses `input` item: a message (`type` "message" or omitted), a `function_call`
    the model made earlier, or a `function_call_output` with the tool's result."""

    type: str | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class ResponsesTool(Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # refused unless "medium" (server/fields.py)


class ResponseCreateParams(SamplingFields, kw_only=True):
    """`POST /v1/responses` body; over the WebSocket, the fields of a `response.create` event."""

    model: str | None = None  # None: the served model
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    previous_response_id: str | None = None
    generate: bool | None = None  # False: prefill (warm) the conversation, generate nothing
    stream: bool | None = None
    stream_id: str | None = None  # WebSocket lane, echoed on every event of the response
    metadata: dict[str, str] | None = None
    store: bool | None = None  # False: not kept for previous_response_id (and no KV pin)
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" honoured; see server/fields.py
    # "auto" accepted: a conversation that fits is not truncated, one that does not is refused saying so
    truncation: Literal["auto", "disabled"] | None = None
    # OpenAI fields prescient cannot honour: refused when set (server/fields.py)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None


class ResponseCreateEvent(ResponseCreateParams, tag="response.create", tag_field="type", kw_only=True):
    pass


class ResponseCancelEvent(Struct, tag="response.cancel", tag_field="type", kw_only=True):
    response_id: str | None = None  # None: every response in flight on this connection


ClientEvent = ResponseCreateEvent | ResponseCancelEvent

T = TypeVar("T")


def decode(data: bytes | str, type: type[T]) -> T:
    """Decode JSON into a wire type; raises APIError(400) naming the offending field, also for
    JSON nested deeper than `MAX_JSON_DEPTH` or holding more than `MAX_JSON_VALUES` values
    (server/limits.py; the latter checked before msgspec builds them)."""
    check_values(data)
    try:
        value = msgspec.json.decode(data, type=type)
    except msgspec.MsgspecError as err:
        raise from_decode_error(err) from None
    except RecursionError:  # past msgspec's own depth limit: too deep to find the field
        raise depth_error(None) from None
    if too_deep(data):
        raise depth_error(deep_field(value))
    return value
