"""The logits -> distribution transform on hand-built logits with known answers, and the
exponential-race sampler's empirical distribution."""

from __future__ import annotations

import math

import pytest
import torch

from prescient.runtime.sampler import exponential_noise, make_generator, sample_from_probs, target_probs_from_logits
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
