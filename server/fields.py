"""The request-field audit: OpenAI fields prescient cannot honour, refused by name when set.

Each endpoint's request Struct (server/protocol.py) declares every OpenAI field that could change
the output. Those prescient honours are used by the handlers; those it cannot honour are listed
here with the values that change nothing (unset, or the default), and any other value is a 400
naming the field, code "unsupported_parameter", before any work is done. What a Struct does not
declare is dropped, which is only right for fields that cannot change the output (`user`,
`service_tier`, `prompt_cache_key`...) and for fields in no OpenAI schema. docs/CONTRACTS.md
("Request fields") has the whole table per endpoint.
"""

from __future__ import annotations

from prescient.server.errors import bad_request


def _unset(v) -> bool:
    return v is None


def _not_true(v) -> bool:
    return v is None or v is False


def _text_only(v) -> bool:
    return v is None or set(v) <= {"text"}


def _no_reasoning(v) -> bool:  # "none" asks for what this model does: no reasoning
    return v is None or v == "none"


def _default_verbosity(v) -> bool:
    return v is None or v == "medium"


# (field, accepted, why not): a dotted field is looked up through Structs and dicts
CHAT = (
    ("audio", _unset, "audio output is not supported (text only)"),
    ("modalities", _text_only, "only text output is supported"),
    ("web_search_options", _unset, "web search is not supported"),
    ("functions", _unset, "the legacy functions API is not supported; declare them as tools"),
    ("function_call", _unset, "the legacy functions API is not supported; use tool_choice"),
    ("reasoning_effort", _no_reasoning, "the served model does not reason"),
    ("verbosity", _default_verbosity, "output verbosity cannot be set for the served model"),
)
RESPONSES = (
    ("background", _not_true, "background responses are not supported"),
    ("conversation", _unset, "conversation objects are not supported; use previous_response_id"),
    ("prompt", _unset, "prompt templates are not supported; send input and instructions"),
    ("reasoning.effort", _no_reasoning, "the served model does not reason"),
    ("reasoning.summary", _unset, "the served model does not reason"),
    ("reasoning.generate_summary", _unset, "the served model does not reason"),
    ("text.verbosity", _default_verbosity, "output verbosity cannot be set for the served model"),
)

# `include` values: logprobs are honoured; the others ask for parts of items prescient never
# produces (reasoning, built-in tool calls, image inputs: each refused where it would appear),
# so there is nothing to include and the output is the same.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_VALUES = frozenset({
    INCLUDE_LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"})


def _get(obj, path: str):
    for name in path.split("."):
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def refuse_unsupported(req, rules) -> None:
    """400 "unsupported_parameter" naming the first field of `rules` set to a value it refuses."""
    for field, accepted, why in rules:
        value = _get(req, field)
        if not accepted(value):
            raise bad_request(f"{field} is not supported: {why} (got {value!r:.60})", param=field,
                              code="unsupported_parameter")


def check_include(include: list[str] | None) -> None:
    for i, value in enumerate(include or ()):
        if value not in INCLUDE_VALUES:
            raise bad_request(f"include value {value!r:.60} is not supported (known: {', '.join(sorted(INCLUDE_VALUES))})",
                              param=f"include[{i}]", code="unsupported_parameter")
