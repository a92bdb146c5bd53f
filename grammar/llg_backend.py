"""llguidance as a second grammar backend (CompilerConfig.backend), behind prescient's Matcher.

llguidance compiles in milliseconds (its lexer is built lazily; the first mask, computed here at
compile time, builds most of it), but in strict mode refuses more JSON-schema keywords than
prescient's xgrammar path and fills each mask 2-4x slower. So it is offered as `llguidance`
(every grammar it can serve exactly, the rest refused by name) and `auto` (it first, xgrammar
when it refuses: grammar/compiler.py).

Exactness rules:
- JSON schemas reach it already prepared by GrammarCompiler.prepare_schema (lowered, checked,
  declared objects closed), so both backends enforce the same language where both compile it;
  strict mode only: an error *or a warning* from llguidance refuses the grammar, since a
  warning means something in the schema was not enforced.
- Layout as CompilerConfig says: json.dumps' ", " / ": " and no free whitespace by default.
- Only grammar kinds with an exact translation: json_schema, json_object, regex. xgrammar's
  EBNF dialect and its structural tags (tool calls) have none here and are refused.

`LLGHandle` mimics the part of xgrammar's GrammarMatcher that Matcher uses (accept, rollback,
masks, fork, jump-forward text, draft-tree traversal), so `LLGMatcher` *is* a Matcher: forced
spans, draft paths, tree masks and the engine's calls behave the same on either backend.
"""

from __future__ import annotations

import importlib.util
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from prescient.grammar.errors import GrammarError
from prescient.grammar.llg_schema import for_llguidance
from prescient.grammar.matcher import Matcher, allocate_bitmask
from prescient.grammar.pattern import check_pattern

if TYPE_CHECKING:
    from prescient.grammar.spec import GrammarSpec
    from prescient.grammar.tokenizer import GrammarTokenizer

BACKENDS = ("xgrammar", "llguidance", "auto")
# kinds llguidance translates exactly; the others stay xgrammar's (auto) or are refused
LLG_KINDS = ("json_schema", "json_object", "regex")

def llguidance_available() -> bool:
    """Whether llguidance is installed (an optional dependency: `pip install prescient[llguidance]`)."""
    return importlib.util.find_spec("llguidance") is not None


_tokenizers: "weakref.WeakKeyDictionary[GrammarTokenizer, object]" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def llg_tokenizer(tokenizer: "GrammarTokenizer"):
    """The LLTokenizer of `tokenizer`'s own vocabulary (the bytes xgrammar decodes, special tokens
    blank and flagged special, the same stop tokens), built once per GrammarTokenizer: both
    backends then see the very same token ids and bytes."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    with _tokenizers_lock:
        if tokenizer not in _tokenizers:
            _tokenizers[tokenizer] = llguidance.LLTokenizer(
                TokenizerWrapper(_VocabSource(tokenizer)), n_vocab=tokenizer.vocab_size,
                eos_token=list(tokenizer.stop_token_ids))
        return _tokenizers[tokenizer]


class _VocabSource:
    """What llguidance's TokenizerWrapper reads: tokens as bytes, the specials, an encoder."""

    def __init__(self, tokenizer: "GrammarTokenizer"):
        self.tokens = [bytes(b) for b in tokenizer.info.decoded_vocab]
        self.tokens += [b""] * (tokenizer.vocab_size - len(self.tokens))
        self.eos_token_id = tokenizer.stop_token_ids[0] if tokenizer.stop_token_ids else None
        self.bos_token_id = None
        # blank entries are prescient's special tokens (and padding past the tokenizer):
        # llguidance never lets grammar text use a special token
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if not b]
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


def layout(any_whitespace: bool, max_whitespace: int | None) -> dict:
    """llguidance's JSON options for prescient's layout (CompilerConfig.any_whitespace)."""
    if not any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    options = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}
    if max_whitespace is not None:
        options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{int(max_whitespace)}}}"
    return options


@dataclass(frozen=True, eq=False)
class LLGGrammar:
    """A compiled llguidance grammar: its source and a pristine matcher (first mask computed),
    which every request's matcher is a deep copy of."""
    grammar: str
    pristine: object  # llguidance.LLMatcher

    def new_handle(self, stop_token_ids: tuple[int, ...], vocab_size: int) -> "LLGHandle":
        return LLGHandle(self.pristine.deep_copy(), stop_token_ids, vocab_size)


def compile_llguidance(spec: "GrammarSpec", tokenizer: "GrammarTokenizer", *, json_options: dict,
                       prepare_schema: Callable[[object], object]) -> LLGGrammar:
    """Compile `spec` with llguidance, strictly; GrammarError when it cannot serve it exactly."""
    import json

    import llguidance

    if spec.kind not in LLG_KINDS:
        raise GrammarError(f"the llguidance grammar backend does not support {spec.kind.replace('_', ' ')} "
                           "grammars (use --grammar-backend xgrammar or auto)", feature="llguidance")
    if spec.kind == "json_schema":
        schema = prepare_schema(json.loads(spec.source))  # GrammarError: prescient's own refusal
        if schema is True:  # JSON options apply to object schemas; `true` means `{}`
            schema = {}
        if schema is False or not isinstance(schema, dict):
            raise GrammarError("the llguidance backend needs an object schema", feature="llguidance")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(for_llguidance(schema), defaults=json_options)
    elif spec.kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=json_options)
    else:  # regex, with xgrammar's ASCII meaning of \d \w \s (JSON Schema's, too)
        check_pattern(spec.source)
        lexeme = llguidance.regex_to_lark(spec.source, "dws")
        grammar = llguidance.LLMatcher.grammar_from_lark(f"start: /{lexeme}/")
    matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer), grammar, log_level=0)
    _refuse_if_inexact(matcher, spec)
    # the lexer is built lazily: the first mask here, on the compile thread, not in a step
    scratch = allocate_bitmask(1, tokenizer.vocab_size)
    _fill(matcher, scratch, 0)
    _refuse_if_inexact(matcher, spec)
    return LLGGrammar(grammar, matcher)


def _refuse_if_inexact(matcher, spec: "GrammarSpec") -> None:
    if matcher.is_error():
        raise GrammarError(f"llguidance refused the {spec.kind.replace('_', ' ')}: "
                           f"{_first_line(matcher.get_error())}", feature="llguidance")
    warnings = matcher.get_grammar_warnings()
    if warnings:  # strict: a warning says some constraint is not enforced as written
        raise GrammarError(f"llguidance would not enforce the {spec.kind.replace('_', ' ')} exactly: "
                           f"{_first_line(warnings[0])}", feature="llguidance")


def _first_line(message: str) -> str:
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else "unknown error"


def _fill(matcher, bitmask: torch.Tensor, row: int) -> None:
    v = bitmask[row]
    if not v.is_contiguous():
        raise ValueError("bitmask rows must be contiguous")
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


class LLGHandle:
    """An llguidance LLMatcher behind the xgrammar GrammarMatcher methods Matcher calls.

    Stop tokens never reach llguidance: accepting one (where the grammar is complete) only marks
    the handle terminated, and rolling it back clears the mark. llguidance counts a stop token in
    its history only sometimes (not once its grammar can go no further), so handling it here
    keeps rollback counts exact. A refused token is checked before it is consumed: llguidance
    would enter a permanent error state, xgrammar leaves the state unchanged, and so must we."""

    def __init__(self, matcher, stop_token_ids: tuple[int, ...], vocab_size: int, terminated: bool = False):
        self._m = matcher
        self._stops = frozenset(stop_token_ids)
        self._vocab = vocab_size
        self._terminated = terminated

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._vocab:
            return False
        if token_id in self._stops:
            if self._m.is_accepting():
                self._terminated = True
                return True
            return False
        if self._m.validate_tokens([token_id]) != 1:
            return False
        if not self._m.consume_token(token_id):  # validated: cannot happen, but never go on broken
            raise RuntimeError(f"llguidance refused a validated token: {self._m.get_error()}")
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self._m.get_error()}")

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._terminated or self._m.is_accepting()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        if self._terminated:  # nothing may follow a stop token
            bitmask[index] = 0
            return True
        _fill(self._m, bitmask, index)
        if self._m.is_error():  # a lexer limit met mid-output: allow nothing rather than guess
            bitmask[index] = 0
        return True

    def fork(self) -> "LLGHandle":
        return LLGHandle(self._m.deep_copy(), tuple(self._stops), self._vocab, self._terminated)

    def find_jump_forward_string(self) -> str:
        if self._terminated:
            return ""
        forced = self._m.compute_ff_bytes()
        # a forced run may stop inside a UTF-8 character: keep the whole characters only
        for cut in range(len(forced), max(-1, len(forced) - 4), -1):
            try:
                return forced[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""

    def traverse_draft_tree(self, first_child: torch.Tensor, next_sibling: torch.Tensor,
                            tokens: torch.Tensor, bitmask: torch.Tensor, time_limit_s: float) -> bool:
        """xgrammar's traversal, same contract: depth-first from node 0 (already accepted), each
        reached node's row gets the mask after its path, a child is entered only if its token is
        allowed there, and the handle ends as it began. False when the time limit (> 0) cut it."""
        first, sibling, toks = first_child.numpy(), next_sibling.numpy(), tokens.numpy()
        words = bitmask.numpy()
        deadline = time.monotonic() + time_limit_s if time_limit_s > 0 else None

        def visit(node: int) -> bool:  # recursion depth is the tree's depth (a few dozen)
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.fill_next_token_bitmask(bitmask, node)
            child = int(first[node])
            while child >= 0:
                token = int(toks[child])
                if (int(words[node, token >> 5]) >> (token & 31)) & 1 and self.accept_token(token):
                    try:
                        if not visit(child):
                            return False
                    finally:
                        self.rollback(1)
                child = int(sibling[child])
            return True

        return visit(0)


class LLGMatcher(Matcher):
    """A Matcher over an llguidance grammar: every Matcher method works unchanged on LLGHandle."""

    def __init__(self, compiled: LLGGrammar, tokenizer: "GrammarTokenizer", _handle: LLGHandle | None = None,
                 forced_spans: bool = True):
        handle = _handle or compiled.new_handle(tokenizer.stop_token_ids, tokenizer.vocab_size)
        super().__init__(compiled, tokenizer, _handle=handle, forced_spans=forced_spans)
