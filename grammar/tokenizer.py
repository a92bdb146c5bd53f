"""GrammarTokenizer: the vocabulary as xgrammar sees it, plus the encoder used for forced spans.

Built once per model tokenizer and shared by its compiler and every matcher. Special tokens
(`<|im_start|>`, ...) get an empty string in the vocabulary given to xgrammar, which makes it
treat them as special and never allow them inside a grammar: a constrained string could
otherwise contain a control token that the detokenizer later drops. Stop tokens keep working
as stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Sequence

import xgrammar as xgr


@dataclass(frozen=True, eq=False)
class GrammarTokenizer:
    info: xgr.TokenizerInfo
    encode: Callable[[str], list[int]]  # text -> token ids, no BOS/EOS added
    stop_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @cached_property
    def token_texts(self) -> list[str]:
        """Each token's text as xgrammar decodes it ("" for special tokens), built once."""
        return [b.decode("utf-8", errors="replace") for b in self.info.decoded_vocab]

    @staticmethod
    def from_huggingface(
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> "GrammarTokenizer":
        """`vocab_size` is the model's logits width when it differs from the tokenizer's."""
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        stops = tuple(int(t) for t in stop_token_ids)
        # Reuse xgrammar's detection of the vocabulary encoding (byte-level, byte-fallback, raw),
        # then rebuild the TokenizerInfo with the special tokens blanked out.
        detected = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops)
        )
        encoded = [""] * detected.vocab_size
        for token, idx in tokenizer.get_vocab().items():
            if idx < len(encoded):
                encoded[idx] = token
        for idx in tokenizer.all_special_ids:
            if idx < len(encoded):
                encoded[idx] = ""
        info = xgr.TokenizerInfo(
            encoded,
            detected.vocab_type,
            vocab_size=detected.vocab_size,
            stop_token_ids=list(stops),
            add_prefix_space=detected.add_prefix_space,
        )

        # Forced spans repeat (a schema's keys and punctuation, request after request), and
        # the tokenizer's Python wrapper costs ~0.1-0.25 ms a call: half a call a grammar step on
        # the tool_call workloads. Remembered per text (a tuple: callers get their own list).
        @lru_cache(maxsize=4096)
        def encode_cached(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        def encode(text: str) -> list[int]:
            return list(encode_cached(text))

        return GrammarTokenizer(info=info, encode=encode, stop_token_ids=stops)

    @staticmethod
    def from_vocab(
        vocab: Sequence[str],
        *,
        stop_token_ids: Sequence[int],
        encode: Callable[[str], list[int]] | None = None,
    ) -> "GrammarTokenizer":
        """A raw (already decoded) vocabulary; "" marks a special token. Without `encode`,
        text is tokenized by greedy longest match, which is enough for toy vocabularies."""
        stops = tuple(int(t) for t in stop_token_ids)
        info = xgr.TokenizerInfo(list(vocab), xgr.VocabType.RAW, stop_token_ids=list(stops))
        return GrammarTokenizer(
            info=info, encode=encode or _greedy_encoder(vocab), stop_token_ids=stops
        )


def _greedy_encoder(vocab: Sequence[str]) -> Callable[[str], list[int]]:
    ids = {tok: i for i, tok in enumerate(vocab) if tok}
    max_len = max((len(t) for t in ids), default=0)

    def encode(text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for n in range(min(max_len, len(text) - i), 0, -1):
                if text[i : i + n] in ids:
                    out.append(ids[text[i : i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"toy vocabulary cannot encode {text[i:]!r}")
        return out

    return encode
