"""`--kv-dtype int8` end to end on the tiny model: the cache is int8 with scales, fewer bytes per
token, every path (prefill, decode, a speculative verify that moves accepted rows) runs, and the
output stays close to the float cache's (the int8 cache changes the model; not held to identity)."""

from __future__ import annotations

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.proposer import make_proposer
from prescient.speculative.speculator import Speculator


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float32)


def engine(model, kv_dtype=None, speculate=False, kv_bytes=None):
    cache = (CacheConfig(block_size=8, kv_cache_bytes=kv_bytes, kv_dtype=kv_dtype) if kv_bytes
             else CacheConfig(block_size=8, num_blocks=128, kv_dtype=kv_dtype))
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    speculator = None
    if speculate:
        adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, prior_acceptance=1.0,
                                                      verify_cost={1: 1.0, 64: 1.0}))
        speculator = Speculator(make_proposer("ngram"), 8, adaptive)
    return Engine(model, None, config, eos_token_ids=(2,), speculator=speculator)


def test_int8_cache_is_int8_with_scales_and_holds_more_tokens(tiny):
    q = engine(tiny, "int8", kv_bytes=1 << 22)
    ref = engine(tiny, kv_bytes=1 << 22)
    k, v = q.kv_caches[0]
    assert k.dtype == v.dtype == torch.int8 and q.kv_caches[0].k_scale.dtype == torch.float32
    assert q.kv_caches[0].k_scale.shape == k.shape[:3] and ref.kv_caches[0].k_scale is None
    assert q.kv_capacity > 3 * ref.kv_capacity  # fp32 -> int8 + a 4-byte scale per head_dim row


def test_int8_cache_decodes_close_to_the_float_cache(tiny):
    prompt = list(range(5, 60))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    a = engine(tiny).generate([prompt], params)[0]
    b = engine(tiny, "int8").generate([prompt], params)[0]
    assert len(b) == 24
    # the first tokens come from nearly the same logits: they agree
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 24)
    assert agree >= 4, (a, b)


def test_int8_cache_with_speculation_matches_plain_int8_decoding(tiny):
    prompt = [7, 8, 9, 10, 11] * 12  # repetitive: the n-gram proposer drafts, the verify moves rows
    params = SamplingParams(max_tokens=32, temperature=0.0)
    spec = engine(tiny, "int8", speculate=True)
    out = spec.generate([prompt], params)[0]
    plain = engine(tiny, "int8").generate([prompt], params)[0]
    assert spec.speculator.stats.num_accepted_tokens > 0
    # verify steps store and read int8 rows as plain steps do (a row's move with its scale: below)
    assert out == plain


def test_kv_copy_moves_an_int8_rows_scales_with_it(tiny):
    from prescient.kernels import ops

    kv = tiny.allocate_kv_cache(4, 8, torch.int8)[0]
    k, v = kv
    k.view(-1, *k.shape[2:])[3] = 5
    kv.k_scale.view(-1, k.shape[2])[3] = 0.25
    kv.v_scale.view(-1, k.shape[2])[3] = 0.5
    ops.kv_copy(k, v, torch.tensor([3]), torch.tensor([9]), **kv.scales)
    assert k.view(-1, *k.shape[2:])[9].eq(5).all()
    assert kv.k_scale.view(-1, k.shape[2])[9].eq(0.25).all() and kv.v_scale.view(-1, k.shape[2])[9].eq(0.5).all()
