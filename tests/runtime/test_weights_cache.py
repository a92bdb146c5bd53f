"""The converted-weights cache: the second load of a GGUF memory-maps what the first converted,
with the same weights, config, eos ids and tokenizer; the key is the file's content, so an edited
file is converted again; a Hugging Face folder loads directly."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from prescient.runtime import weights_cache
from prescient.runtime.loader import load_checkpoint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_content_hash_follows_the_content(tmp_path, cache):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 1000)
    first = weights_cache.content_hash(str(f))
    assert weights_cache.content_hash(str(f)) == first  # remembered per (path, size, mtime)
    f.write_bytes(b"b" * 1000)
    os.utime(f, ns=(1, 1))  # another mtime, same size: the stamp changes, so it is hashed again
    assert weights_cache.content_hash(str(f)) != first


def test_a_folder_checkpoint_is_loaded_directly(tiny_llama_dir, cache, monkeypatch):
    # the tiny checkpoint has no tokenizer files; this test is about the weights
    monkeypatch.setattr(weights_cache.Tokenizer, "load", classmethod(lambda cls, *a: None))
    files = weights_cache.load_model_files(str(tiny_llama_dir), "float32")
    ckpt = load_checkpoint(str(tiny_llama_dir))
    assert not files.from_cache and not cache.exists()
    assert all(torch.equal(files.weights[k], ckpt.weights[k]) for k in ckpt.weights)


@pytest.mark.slow
def test_the_default_gguf_is_converted_once_then_memory_mapped(cache):
    first = weights_cache.load_model_files(None, "bfloat16")
    second = weights_cache.load_model_files(None, "bfloat16")
    assert not first.from_cache and second.from_cache
    assert first.identity == second.identity and first.identity.endswith("|bfloat16")
    assert first.config == second.config and first.eos_token_ids == second.eos_token_ids
    assert first.weights.keys() == second.weights.keys()
    assert all(torch.equal(first.weights[k], second.weights[k]) for k in first.weights)
    assert all(t.dtype == torch.bfloat16 for t in second.weights.values())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo wörld 😀 {\"a\": 1}"}]
    assert first.tokenizer.apply_chat_template(messages) == second.tokenizer.apply_chat_template(messages)
    assert first.tokenizer.eos_token_ids == second.tokenizer.eos_token_ids
    assert len(first.tokenizer.hf) == len(second.tokenizer.hf)
    entries = [p.name for p in (cache / "weights").iterdir() if p.is_dir()]
    assert len(entries) == 1 and entries[0].endswith(f"-bfloat16-{weights_cache.converter_version()}")


def test_an_unreadable_entry_is_replaced(tiny_llama_dir, cache, monkeypatch):
    # a stand-in tokenizer (the tiny checkpoint has none) and GGUF (this test is about the entry)
    fake = SimpleNamespace(hf=SimpleNamespace(save_pretrained=lambda d: os.makedirs(d, exist_ok=True)))
    monkeypatch.setattr(weights_cache.Tokenizer, "load", classmethod(lambda cls, *a: fake))
    monkeypatch.setattr(weights_cache, "load_checkpoint", lambda path, progress=False: load_checkpoint(str(tiny_llama_dir)))
    gguf = cache.parent / "m.gguf"
    gguf.write_bytes(b"not read: load_checkpoint is the tiny folder's")
    monkeypatch.setattr(weights_cache, "_read_entry", _broken_then_real(weights_cache._read_entry))
    assert not weights_cache.load_model_files(str(gguf), "float32").from_cache  # first: converted, written
    assert not weights_cache.load_model_files(str(gguf), "float32").from_cache  # damaged: removed, rewritten
    assert weights_cache.load_model_files(str(gguf), "float32").from_cache  # now read from the new entry


def _broken_then_real(read):
    calls = []

    def read_entry(entry, identity):
        calls.append(entry)
        if len(calls) == 1:
            raise ValueError("damaged")
        return read(entry, identity)

    return read_entry
