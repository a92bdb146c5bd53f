"""Our model's logits equal Hugging Face transformers' on the same weights.

Tiny random Llama and Qwen2 in float64 and the real default model in float32. Tolerances: tiny
models 1e-4 absolute (transformers computes its RoPE table and RMSNorm in float32 even for a
float64 model, ~1e-5 apart from our float64 math; a wrong RoPE layout or GQA mapping is off by
O(1)); the real model in float32 1e-3 absolute on logits of
magnitude ~20 (summation order differs between our fused projections and theirs)."""

from __future__ import annotations

import pytest
import torch

from prescient.runtime.batch import build_forward_batch
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.request import Request
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.scheduler import ScheduledSeq
from tests.conftest import make_tiny_checkpoint


def full_forward(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """All-position logits of one sequence through the paged path. -> [len, vocab]"""
    num_blocks = -(-len(token_ids) // block_size) + 1
    kv = model.allocate_kv_cache(num_blocks, block_size)
    req = Request("r", list(token_ids), SamplingParams(), (), 0.0)
    req.block_ids = list(range(num_blocks))
    batch = build_forward_batch([ScheduledSeq(req, len(token_ids), 0)], [None], block_size, model.device)
    batch.logits_indices = torch.arange(len(token_ids))
    return model.forward(batch, kv)


def hf_logits(path, token_ids, dtype=torch.float64, **kw) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    with torch.no_grad():
        return m(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {}),
])
def test_tiny_matches_transformers_float64(tmp_path, model_type, extra):
    path = make_tiny_checkpoint(tmp_path / "m", model_type, **extra)
    ckpt = load_checkpoint(str(path))
    model = LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)
    tokens = torch.randint(0, ckpt.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = full_forward(model, tokens)
    ref = hf_logits(str(path), tokens)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_paged_incremental_decode_equals_full_forward(tmp_path):
    """Prefill in chunks then decode token by token through the paged cache == one full forward."""
    path = make_tiny_checkpoint(tmp_path / "m")
    ckpt = load_checkpoint(str(path))
    model = LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)
    tokens = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    full = full_forward(model, tokens, block_size=8)
    kv = model.allocate_kv_cache(16, 8)
    req = Request("r", tokens, SamplingParams(), (), 0.0)
    req.block_ids = [5, 2, 9, 0, 11, 3, 7, 1, 4, 6]  # scattered blocks
    rows = []
    for chunk in [13, 20, 7] + [1] * 30:
        seq = ScheduledSeq(req, chunk, 0)
        batch = build_forward_batch([seq], [None], 8, model.device)
        start = req.num_computed_tokens
        batch.logits_indices = torch.arange(chunk)
        rows.append(model.forward(batch, kv))
        req.num_computed_tokens = start + chunk
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-9, rtol=1e-9)


@pytest.mark.slow
def test_default_model_matches_transformers(default_engine):
    from prescient.runtime.loader import default_model_path
    import os

    path = default_model_path()
    tok = default_engine.tokenizer
    tokens = tok.apply_chat_template([{"role": "user", "content": "Explain what a hash table is in two sentences."}])
    ours = full_forward(default_engine.model, tokens)
    ref = hf_logits(os.path.dirname(path), tokens, dtype=torch.float32, gguf_file=os.path.basename(path))
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
