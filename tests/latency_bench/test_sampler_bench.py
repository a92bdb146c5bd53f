"""pytest-benchmark microbenchmarks for the sampler (prescient.runtime.sampler), the CPU work every
decode step does after the forward, at the default model's vocabulary (49152): one row (plain
decode) and 16 rows (a draft tree verified in one step). With the project's default
`--benchmark-disable` each runs once as a correctness smoke test; time them with

    .venv/bin/python -m pytest tests/latency_bench/test_sampler_bench.py --benchmark-enable
"""

from __future__ import annotations

import pytest
import torch

from prescient.runtime.sampler import exponential_noise, make_generator, sample_from_probs, target_probs_from_logits
from prescient.runtime.sampling_params import SamplingParams

VOCAB = 49152
GREEDY = SamplingParams(temperature=0)
FILTERED = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05)


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 3


@pytest.mark.parametrize("rows", [1, 16])
def test_bench_greedy_probs(benchmark, rows):
    logits = _logits(rows)
    probs = benchmark(target_probs_from_logits, logits, GREEDY)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.all(probs.sum(-1) == 1)


@pytest.mark.parametrize("rows", [1, 16])
def test_bench_filtered_probs(benchmark, rows):
    logits = _logits(rows)
    probs = benchmark(target_probs_from_logits, logits, FILTERED)
    assert torch.allclose(probs.sum(-1), torch.ones(rows))
    assert int((probs > 0).sum(-1).max()) <= 50  # top-k held


@pytest.mark.parametrize("rows", [1, 16])
def test_bench_sample(benchmark, rows):
    probs = target_probs_from_logits(_logits(rows), FILTERED)
    gen = make_generator(0)

    def sample():
        return sample_from_probs(probs, exponential_noise(tuple(probs.shape), gen))

    tokens = benchmark(sample)
    assert tokens.shape == (rows,) and bool((probs.gather(-1, tokens[:, None]) > 0).all())
