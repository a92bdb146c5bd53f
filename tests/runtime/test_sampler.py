"""The logits -> distribution transform on hand-built logits with known answers, and the
samplers' empirical distributions: plain decoding's inverse CDF, the exponential race."""

from __future__ import annotations


import pytest
import torch

from prescient.runtime.sampler import (exponential_noise, inverse_cdf, make_generator, sample_from_probs, sample_row,
                                      target_probs_from_logits)
from prescient.runtime.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))


def test_greedy_is_one_hot():
    p = target_probs_from_logits(LOGITS, SamplingParams(temperature=0))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=1.0), [0.5, 0.25, 0.15, 0.1]),
    (SamplingParams(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0, 0]),
    (SamplingParams(temperature=1.0, top_p=0.7), [2 / 3, 1 / 3, 0, 0]),  # 0.5 < 0.7: the crossing token stays
    (SamplingParams(temperature=1.0, top_p=0.5), [1.0, 0, 0, 0]),
    (SamplingParams(temperature=1.0, min_p=0.3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
])
def test_filters(params, expected):
    p = target_probs_from_logits(LOGITS, params)
    torch.testing.assert_close(p[0], torch.tensor(expected), atol=1e-6, rtol=0)


def test_temperature_sharpens():
    p = target_probs_from_logits(LOGITS, SamplingParams(temperature=0.5))
    raw = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 2
    torch.testing.assert_close(p[0], raw / raw.sum(), atol=1e-6, rtol=0)


def test_exponential_race_matches_distribution():
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).expand(200_000, 4)
    tokens = sample_from_probs(probs, exponential_noise((200_000, 4), make_generator(0)))
    freq = torch.bincount(tokens, minlength=4).float() / 200_000
    assert (freq - probs[0]).abs().sum() / 2 < 0.01


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.3)])
def test_plain_sampling_matches_the_distribution(params):
    """sample_row (plain decoding: the inverse CDF at one uniform per token) draws each token with
    target_probs_from_logits' probability, and never one the filters removed."""
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))
    want = target_probs_from_logits(logits, params)[0]
    g = make_generator(3)
    n = 40_000
    freq = torch.bincount(torch.tensor([sample_row(logits, params, g) for _ in range(n)]), minlength=6).float() / n
    assert (freq - want).abs().sum() / 2 < 0.012, (freq, want)
    assert (freq[want == 0] == 0).all()


def test_inverse_cdf_edges():
    """u = 0 takes the first token with mass, u just below 1 the last; zero-mass tokens (at either
    end or between) are never drawn; an unnormalised row works as its normalised one."""
    p = torch.tensor([0.0, 0.0, 2.0, 0.0, 1.0, 0.0])
    assert inverse_cdf(p, 0.0) == 2
    assert inverse_cdf(p, 1.0 - 2 ** -53) == 4
    assert inverse_cdf(p, 0.5) == 2 and inverse_cdf(p, 0.7) == 4
    assert inverse_cdf(p, 1.0) == 4  # u * total rounded up to the total: the last token with mass


def test_plain_sampling_is_reproducible_per_seed():
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.95)
    draw = lambda seed: [sample_row(logits, params, g) for g in [make_generator(seed)] for _ in range(50)]  # noqa: E731
    assert draw(11) == draw(11) and draw(11) != draw(12)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_tiny_temperature_is_greedy_not_nan(temperature):
    """Issue 13: 1e-300 used to overflow logits / T to inf and give NaN probabilities (the server
    then emitted one garbage token every step); below 1e-5 is greedy."""
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    p = target_probs_from_logits(LOGITS * 50, params)
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_temperature_at_the_threshold_still_samples_finitely():
    params = SamplingParams(temperature=1e-5)
    assert not params.greedy
    p = target_probs_from_logits(LOGITS * 50, params)
    assert torch.isfinite(p).all() and p.argmax().item() == 0


@pytest.mark.parametrize("seed", [2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 30, True])
def test_seed_out_of_range_is_a_value_error_naming_seed(seed):
    """Issue 13: an out-of-range seed reached torch ("Overflow when unpacking long long")."""
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
        SamplingParams(seed=seed)


def test_seed_range_maps_one_to_one_onto_torch():
    def draws(seed):
        return torch.rand(4, generator=make_generator(SamplingParams(seed=seed).seed)).tolist()

    assert draws(-2 ** 63) != draws(2 ** 63 - 1)
    assert draws(-1) != draws(1)
    assert draws(-1) == torch.rand(4, generator=torch.Generator().manual_seed(2 ** 64 - 1)).tolist()
    assert draws(7) == draws(7)
