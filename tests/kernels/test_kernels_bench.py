"""Microbenchmarks of the CPU reference ops (the CPU hot path), with pytest-benchmark.

They run as plain one-shot tests under the default --benchmark-disable; time them with
`pytest tests/kernels/test_kernels_bench.py --benchmark-enable`. Shapes follow SmolLM2-135M
(9 query heads, 3 kv heads, head_dim 64, vocab 49152) at a 1K-token context, block size 16.
"""

from __future__ import annotations

import pytest
import torch

from prescient.kernels import reference
from prescient.kernels.reference import pack_bits

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, VOCAB = 9, 3, 64, 16, 49152
CONTEXT = 1024


@pytest.fixture(scope="module")
def cache():
    torch.manual_seed(0)
    shape = (CONTEXT // BLOCK_SIZE + 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape), torch.randn(shape)


def _table(contiguous: bool) -> torch.Tensor:  # [1, max_blocks] int32
    blocks = torch.arange(CONTEXT // BLOCK_SIZE + 1, dtype=torch.int32)
    return (blocks if contiguous else blocks.flip(0))[None]


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous_blocks", "scattered_blocks"])
def test_bench_decode_attention(benchmark, cache, contiguous):
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    args = (q, *cache, _table(contiguous), torch.tensor([CONTEXT], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), None, HEAD_DIM**-0.5)
    out = benchmark(reference.tree_attention, *args)
    assert out.shape == q.shape


def test_bench_tree_attention_16_nodes(benchmark, cache):
    parents = [-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 10, 12]
    bits = torch.zeros(16, 16, dtype=torch.bool)
    for node, parent in enumerate(parents):
        bits[node] = bits[parent] if parent >= 0 else bits[node]
        bits[node, node] = True
    q = torch.randn(16, NUM_HEADS, HEAD_DIM)
    args = (q, *cache, _table(True), torch.tensor([CONTEXT], dtype=torch.int32),
            torch.tensor([0, 16], dtype=torch.int32), pack_bits(bits), HEAD_DIM**-0.5)
    assert benchmark(reference.tree_attention, *args).shape == q.shape


def test_bench_store_kv_decode(benchmark, cache):
    k_cache, v_cache = (c.clone() for c in cache)
    kv = torch.randn(1, NUM_KV_HEADS, HEAD_DIM)
    benchmark(reference.store_kv, k_cache, v_cache, kv, kv, torch.tensor([CONTEXT - 1]))
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[CONTEXT - 1], kv[0])


def test_bench_kv_copy_path(benchmark, cache):
    k_cache, v_cache = (c.clone() for c in cache)
    src, dst = torch.tensor([1000, 1003, 1009]), torch.tensor([999, 1000, 1001])
    benchmark(reference.kv_copy, k_cache, v_cache, src, dst)


def test_bench_greedy_verify(benchmark):
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 10, 12]])
    tokens = torch.arange(16)[None]
    result = benchmark(reference.greedy_verify, tokens, parents, torch.tensor([16]), tokens)
    assert result[0].shape == (1,)


def test_bench_rejection_sample(benchmark):
    torch.manual_seed(1)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 10, 12]])
    tokens = torch.randint(0, VOCAB, (1, 16))
    target = torch.randn(1, 16, VOCAB).softmax(-1)
    noise = torch.empty(1, VOCAB).exponential_()
    result = benchmark(
        reference.rejection_sample, tokens, parents, torch.tensor([16]), target, None, torch.rand(1, 16), noise
    )
    assert 0 <= int(result[2]) < VOCAB


def test_bench_apply_token_bitmask(benchmark):
    logits = torch.randn(16, VOCAB)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, VOCAB // 32), dtype=torch.int32)
    benchmark(reference.apply_token_bitmask, logits, bitmask)
    assert torch.isinf(logits).any()
