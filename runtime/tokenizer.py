"""Tokenizer and chat template through transformers, plus incremental detokenization.

`IncrementalDetokenizer` emits text only once it is stable: it decodes a short window of recent
tokens and holds back output that ends in U+FFFD (an unfinished multi-byte character), so a
stream never splits a character and the concatenated deltas equal a full decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        eos = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids = tuple(eos)
        self.vocab_size = len(hf_tokenizer)
        self._backend_decode = _backend_decode(hf_tokenizer)

    @classmethod
    def load(cls, tokenizer_dir: str, gguf_file: str | None = None, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        return cls(AutoTokenizer.from_pretrained(tokenizer_dir, **kwargs), eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None and type(token_ids) is list:
            return self._backend_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools)
        return self.encode(text)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)


def _backend_decode(hf_tokenizer: Any):
    """The `tokenizers` backend's own decode where transformers' decode is only that call (a fast
    tokenizer without clean_up_tokenization_spaces), else None. The stream decodes twice per
    emitted token, right after a forward has evicted transformers' Python from the caches, where
    its argument handling costs more than the decode."""
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(hf_tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    mro = type(hf_tokenizer).__mro__
    owner = next((k for k in mro if "_decode" in vars(k)), None)
    public = next((k for k in mro if "decode" in vars(k)), None)
    if (owner is None or owner.__module__ not in ("transformers.tokenization_utils_tokenizers",
                                                  "transformers.tokenization_utils_fast")
            or public is None or public.__module__ != "transformers.tokenization_utils_base"):
        return None  # a tokenizer class with a decode of its own
    return backend.decode


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    prompt_tail: list[int] = field(default_factory=list)  # context for the first tokens' spacing
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent: int = 0  # characters of `text` already streamed (the rest is held back)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_tail[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly stable text."""
        self.token_ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character (or nothing visible yet): wait for more bytes
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
