"""Incremental detokenization and stop strings with the real default tokenizer (no model):
streamed deltas concatenate to the full decode, never split a multi-byte character, and a stop
string cuts the text exactly where it starts (text that may become a stop is held back)."""

from __future__ import annotations

import pytest

from prescient.runtime.loader import load_checkpoint
from prescient.runtime.request import Request
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.step_result import SeqResult, commit_tokens
from prescient.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    import os
    from prescient.runtime.loader import default_model_path

    path = default_model_path()
    return Tokenizer.load(os.path.dirname(path), os.path.basename(path), (2,))


TEXTS = ["Hello, world! Ünïcödé ✓ 日本語のテキスト 🚀🚀 done.", "  leading spaces\n\ttabs and 'quotes' \"x\"",
         "emoji families 👨‍👩‍👧 and flags 🇫🇷"]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_one_token_at_a_time(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt:"))
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def _run(tokenizer, text, stop, chunk=1):
    ids = tokenizer.encode(text)
    req = Request("r", [1, 2], SamplingParams(stop=stop, max_tokens=len(ids), ignore_eos=True), (2,), 0.0)
    detok = IncrementalDetokenizer(tokenizer, [1, 2])
    streamed = ""
    for i in range(0, len(ids), chunk):
        out = commit_tokens(req, SeqResult(ids[i:i + chunk], ["target"] * len(ids[i:i + chunk]), 0), detok, 10_000, 0.0)
        streamed += out.new_text
        if out.finished:
            break
    return streamed, req


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_cuts_text_and_finishes(tokenizer, chunk):
    streamed, req = _run(tokenizer, "The answer is 42. END and more text after", ("END",), chunk)
    assert streamed == "The answer is 42. "
    assert req.finish_reason == "stop" and req.stop_reason == "END"


def test_partial_stop_is_held_back_then_released(tokenizer):
    text = "A B C D E"
    ids = tokenizer.encode(text)
    req = Request("r", [1, 2], SamplingParams(stop=("C D X",), max_tokens=len(ids), ignore_eos=True), (2,), 0.0)
    detok = IncrementalDetokenizer(tokenizer, [1, 2])
    deltas = [commit_tokens(req, SeqResult([t], ["target"], 0), detok, 10_000, 0.0).new_text for t in ids]
    assert "".join(deltas[:-1]) == "A B"  # " C D E" could still grow into "C D X": held back
    assert "".join(deltas) == text  # finishing (by length) releases it
    assert req.finish_reason == "length"


def test_decode_is_transformers_decode(tokenizer):
    """The tokenizer decodes through the backend directly (a fast path) with transformers'
    results: ordinary text, special tokens kept or skipped, partial UTF-8 byte tokens."""
    import random

    assert tokenizer._backend_decode is not None  # the default model's tokenizer takes the path
    rng = random.Random(0)
    seqs = [tokenizer.encode(t) for t in TEXTS] + [[1, 2, 0] + tokenizer.encode("a<|im_end|>b")]
    seqs += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    for ids in seqs:
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)
