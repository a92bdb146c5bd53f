"""Conversations -> prompt tokens: both APIs' message shapes to plain chat messages, then the
model's chat template.

Plain messages are `{"role": "system"|"user"|"assistant", "content": str}`. Assistant tool calls
and tool results are written into the content in the hermes format of server/tools.py (tool
results become a user turn), since the default template knows no tool roles. Leading system /
developer messages, the request's `instructions` and the tools block merge into one system
message. A tool result must answer a call made earlier in the conversation (chat: its
`tool_call_id` names an earlier assistant `tool_calls[].id`; Responses: its `call_id` an earlier
`function_call` item's, or a call of the response it continues), as OpenAI requires: a result for
an unknown call is a 400 naming the field, not a turn the model reads without its call.

Before the template renders, the conversation's message count and total characters are checked
(server/limits.py): a template costs ~13 us a message, so one far over the context would
otherwise cost seconds before the length check after rendering refused it.

`ChatRenderer.render(..., prefix=)` keeps an agent conversation's tokens stable: when the new
prompt's text extends the text of the previous turn (prompt + the model's raw output), the
prompt is the previous turn's exact token ids + the tokens of the new text. Re-tokenizing the
whole text could split the model's own output differently and lose the prefix-cache hit from
there on; extending the ids cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from prescient.server.errors import bad_request
from prescient.server.limits import check_messages
from prescient.server.protocol import ChatMessage, InputItem
from prescient.server.tools import render_tool_call, render_tool_results

_SYSTEM_ROLES = ("system", "developer")
_TEXT_PARTS = ("text", "input_text", "output_text")


@dataclass(frozen=True)
class Rendered:
    """A conversation as the model sees it: template text and its token ids."""

    text: str
    token_ids: tuple[int, ...]


class ChatRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self._special = tuple(s for s in tokenizer.hf.all_special_tokens if s)
        # The longest token's text, as an upper bound in characters (a byte-level key spells each
        # byte as one character, so it is never shorter than the text it stands for): a text
        # longer than `max_model_len` of these cannot fit, and is refused without tokenizing it.
        vocab = list(tokenizer.hf.get_vocab()) + list(tokenizer.hf.all_special_tokens)
        self.max_token_chars = max((len(t) for t in vocab), default=1) or 1

    def check_length(self, chars: int, max_model_len: int | None, param: str) -> None:
        """400 `context_length_exceeded` for a text of `chars` characters that cannot fit
        `max_model_len` tokens whatever its tokens are (None: no check)."""
        if max_model_len is not None and chars > max_model_len * self.max_token_chars:
            raise bad_request(f"the prompt is {chars} characters: more than the context of {max_model_len} tokens "
                              f"can hold (at most {self.max_token_chars} characters per token)", param=param,
                              code="context_length_exceeded")

    def render(self, system: list[str], messages: list[dict], *, add_generation_prompt: bool = True,
               prefix: Rendered | None = None, max_model_len: int | None = None,
               param: str = "messages") -> Rendered:
        """The conversation as template text and token ids. Tokenizing costs ~0.6 s per million
        characters, so the server calls this off its event loop (ServerContext.render), and a text
        that cannot fit `max_model_len` is refused before it is tokenized."""
        system_text = "\n\n".join(s for s in system if s)
        full = ([{"role": "system", "content": system_text}] if system_text else []) + messages
        if not full:
            raise bad_request("the conversation is empty", param="messages", code="empty_input")
        # what the template cannot shrink, checked before it walks every message
        check_messages(len(full), param)
        self.check_length(sum(len(m["content"]) for m in full), max_model_len, param)
        try:
            text = self.tokenizer.hf.apply_chat_template(full, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
        except Exception as err:  # a template that refuses the conversation (role order, ...)
            raise bad_request(f"the chat template rejected the conversation: {err}", param="messages") from None
        self.check_length(len(text), max_model_len, param)
        if prefix is not None and text.startswith(prefix.text):
            rest = text[len(prefix.text):]
            # Only where the new text starts at a special token is the split point a token
            # boundary for certain (ChatML: the `<|im_end|>` after the model's output).
            if not rest or rest.startswith(self._special):
                return Rendered(text, prefix.token_ids + tuple(self.tokenizer.encode(rest)))
        return Rendered(text, tuple(self.tokenizer.encode(text)))

    def model_output(self, output_ids: list[int]) -> tuple[list[int], str]:
        """The model's output as the conversation continues it: ids without the final stop
        token (the template writes its own end-of-turn) and their raw text."""
        ids = list(output_ids)
        if ids and ids[-1] in self.eos_token_ids:
            ids.pop()
        return ids, self.tokenizer.decode(ids, skip_special_tokens=False)


def split_system(messages: list[dict]) -> tuple[list[str], list[dict]]:
    """Leading system messages' texts, and the rest of the conversation."""
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        i += 1
    return [m["content"] for m in messages[:i]], messages[i:]


def _text(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise bad_request(f"content part type {part.type!r} is not supported (text only)",
                              param=f"{param}[{j}].type", code="unsupported_content")
        out.append(part.text)
    return "".join(out)


class _Builder:
    """Appends turns, merging consecutive tool results and an assistant's text with its calls."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self._results: list[str] = []

    def _flush(self) -> None:
        if self._results:
            self.messages.append({"role": "user", "content": render_tool_results(self._results)})
            self._results = []

    def add(self, role: str, content: str) -> None:
        self._flush()
        self.messages.append({"role": role, "content": content})

    def add_call(self, name: str, arguments: str) -> None:
        self._flush()
        call = render_tool_call(name, arguments)
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last["content"] = f"{last['content']}\n{call}" if last["content"] else call
        else:
            self.messages.append({"role": "assistant", "content": call})

    def add_result(self, output: str) -> None:
        self._results.append(output)

    def done(self) -> list[dict]:
        self._flush()
        return self.messages


def _answers(call_id: str | None, calls: set[str], param: str, what: str) -> None:
    """400 unless `call_id` names a call made earlier in the conversation."""
    if call_id is None:
        raise bad_request(f"a {what} needs the id of the tool call it answers", param=param,
                          code="missing_required_parameter")
    if call_id not in calls:
        raise bad_request(f"{param} {call_id!r:.80} matches no tool call made earlier in the conversation",
                          param=param, code="invalid_tool_call_id")


def messages_from_chat(messages: list[ChatMessage]) -> list[dict]:
    check_messages(len(messages), "messages")
    b = _Builder()
    calls: set[str] = set()  # ids of the assistant tool calls so far
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        role = "system" if m.role in _SYSTEM_ROLES else m.role
        if role == "tool":
            _answers(m.tool_call_id, calls, f"{param}.tool_call_id", "tool message")
            b.add_result(_text(m.content, f"{param}.content"))
        elif role in ("system", "user"):
            b.add(role, _text(m.content, f"{param}.content"))
        elif role == "assistant":
            if m.audio is not None:
                raise bad_request("assistant audio is not supported (text only)", param=f"{param}.audio",
                                  code="unsupported_parameter")
            text = _text(m.content, f"{param}.content") or m.refusal or ""
            legacy = [m.function_call] if m.function_call is not None else []  # the pre-tools shape
            if text or not (m.tool_calls or legacy):
                b.add("assistant", text)
            for call in m.tool_calls or []:
                if call.id is not None:
                    calls.add(call.id)
                b.add_call(call.function.name, call.function.arguments)
            for fn in legacy:
                b.add_call(fn.name, fn.arguments)
        else:
            raise bad_request(f"unknown role {m.role!r}", param=f"{param}.role", code="invalid_role")
    return b.done()


def messages_from_items(items: str | list[InputItem] | None, param: str = "input",
                        calls: set[str] | None = None) -> list[dict]:
    """`calls`: the call ids of the conversation so far (a previous response's); this input's
    `function_call` items' ids are added to it."""
    calls = set() if calls is None else calls
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    check_messages(len(items), param)
    b = _Builder()
    for i, item in enumerate(items):
        p = f"{param}[{i}]"
        kind = item.type or ("message" if item.role else None)
        if kind == "message":
            role = "system" if item.role in _SYSTEM_ROLES else item.role
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"unknown role {item.role!r}", param=f"{p}.role", code="invalid_role")
            b.add(role, _text(item.content, f"{p}.content"))
        elif kind == "function_call":
            if not item.name:
                raise bad_request("a function_call item needs a name", param=f"{p}.name")
            if item.call_id is not None:
                calls.add(item.call_id)
            b.add_call(item.name, item.arguments or "{}")
        elif kind == "function_call_output":
            _answers(item.call_id, calls, f"{p}.call_id", "function_call_output item")
            if item.output is None:
                raise bad_request("a function_call_output item needs an output", param=f"{p}.output")
            b.add_result(item.output if isinstance(item.output, str) else _text(item.output, f"{p}.output"))
        else:
            raise bad_request(f"input item type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", param=f"{p}.type", code="unsupported_item")
    return b.done()
