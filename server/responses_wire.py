"""Outbound wire types of the Responses API (HTTP SSE and WebSocket mode), as msgspec Structs.

Shapes follow the `openai` SDK's types (openai/types/responses/): the `Response` object, the
`message` and `function_call` output items, and the stream events, each tagged by `type`.
Every event has a `sequence_number` (set by the transport when the event is sent: increasing per
WebSocket connection, or per response over SSE) and `stream_id` (the client's WebSocket lane,
if it named one).

Extension (prescient): text and function-argument delta events carry `token_times` (engine
time of each token in the delta, seconds since the response was submitted), `num_tokens`, and
`token_sources` (`target`: sampled from the target model, `draft`: an accepted speculative draft
token, `forced`: a grammar-forced span). The terminal event carries the tokens no delta
reported (the stop token) the same way, and `ttft_s`.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType, field


class OutputText(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


class OutputMessage(Struct, tag="message", tag_field="type"):
    id: str
    status: str  # in_progress | completed | incomplete
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(Struct):
    code: str
    message: str


class IncompleteDetails(Struct):
    reason: str  # max_output_tokens | cancelled


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | failed | cancelled
    output: list[OutputItem] = field(default_factory=list)
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict] = field(default_factory=list)
    parallel_tool_calls: bool = True
    text: dict | None = None
    usage: ResponseUsage | None = None
    metadata: dict = field(default_factory=dict)
    completed_at: int | None = None


class Event(Struct, kw_only=True):
    sequence_number: int = -1  # set by the transport when sent
    stream_id: str | None = None


class ResponseCreated(Event, tag="response.created", tag_field="type", kw_only=True):
    response: ResponseObject


class ResponseInProgress(Event, tag="response.in_progress", tag_field="type", kw_only=True):
    response: ResponseObject


class Terminal(Event, kw_only=True):
    response: ResponseObject
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    token_sources: list[str] = field(default_factory=list)
    ttft_s: float | None = None


class ResponseCompleted(Terminal, tag="response.completed", tag_field="type", kw_only=True):
    pass


class ResponseIncomplete(Terminal, tag="response.incomplete", tag_field="type", kw_only=True):
    pass


class ResponseFailed(Terminal, tag="response.failed", tag_field="type", kw_only=True):
    pass


class OutputItemAdded(Event, tag="response.output_item.added", tag_field="type", kw_only=True):
    output_index: int
    item: OutputItem


class OutputItemDone(Event, tag="response.output_item.done", tag_field="type", kw_only=True):
    output_index: int
    item: OutputItem


class ContentPartAdded(Event, tag="response.content_part.added", tag_field="type", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(Event, tag="response.content_part.done", tag_field="type", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TimedDelta(Event, kw_only=True):
    item_id: str
    output_index: int
    delta: str
    token_times: list[float]
    num_tokens: int
    token_sources: list[str]


class OutputTextDelta(TimedDelta, tag="response.output_text.delta", tag_field="type", kw_only=True):
    content_index: int = 0
    logprobs: list = field(default_factory=list)


class OutputTextDone(Event, tag="response.output_text.done", tag_field="type", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list = field(default_factory=list)


class FunctionCallArgumentsDelta(TimedDelta, tag="response.function_call_arguments.delta", tag_field="type",
                                 kw_only=True):
    pass


class FunctionCallArgumentsDone(Event, tag="response.function_call_arguments.done", tag_field="type",
                                kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorBody(Struct):
    type: str
    code: str | None
    message: str
    param: str | None = None
    retry_after: float | UnsetType = UNSET  # seconds; only on a refusal for load (code "overloaded")


class ErrorEvent(Event, tag="error", tag_field="type", kw_only=True):
    error: ErrorBody
    status: int | None = None


def error_event(err, stream_id: str | None = None) -> ErrorEvent:
    """From an APIError."""
    retry_after = UNSET if err.retry_after_s is None else err.retry_after_s
    return ErrorEvent(error=ErrorBody(err.type, err.code, err.message, err.param, retry_after), status=err.status,
                      stream_id=stream_id)
