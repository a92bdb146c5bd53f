"""Logits -> next-token distributions and samples.

`target_probs_from_logits` is THE place where temperature, top-k, top-p and min-p are applied;
plain sampling and speculative verification both call it, so a draft is judged against exactly
the distribution plain decoding would sample from. Randomness comes from a per-request
generator: reproducible per seed and independent of the batch a request happens to share.
Plain decoding (`sample_row`) inverts the distribution's CDF at one uniform draw; speculative
verification's tree walks use the exponential race (`argmax(p / E)`, E ~ Exp(1) per vocabulary
entry) for their bonus and recovered tokens, and the device path the race over counter-based
noise (runtime/counter_rng.py). Each is an exact sampler of the same distribution.
"""

from __future__ import annotations

import torch

from prescient.kernels.cpu_argmax import argmax_row, argmax_rows
from prescient.runtime.sampling_params import SamplingParams


def target_probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [num_rows, vocab] (rows of one request) -> probs [num_rows, vocab] in float32.

    For greedy requests (temperature below GREEDY_TEMPERATURE, where dividing would overflow)
    the result is one-hot on the argmax, so the same acceptance rule covers greedy and sampling."""
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, argmax_rows(logits.reshape(-1, logits.shape[-1])).view(*logits.shape[:-1], 1), 1.0)
        return probs
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop_sorted = (cum - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        cutoff = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < cutoff, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def exponential_noise(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """I.i.d. Exp(1) noise for the exponential race; float32 on CPU."""
    u = torch.rand(shape, generator=generator, dtype=torch.float32)
    return (-torch.log1p(-u)).clamp_min(1e-20)


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs, noise: [num_rows, vocab] -> token ids [num_rows]. argmax(p / E) ~ Categorical(p)."""
    return (probs / noise).argmax(-1)


def inverse_cdf(probs: torch.Tensor,  # [vocab] float32, non-negative, a positive sum
                u: float) -> int:
    """The token whose interval [c_(i-1), c_i) of the cumulative sums c (in float64) holds
    u * c_last, u uniform in [0, 1): token i with probability probs[i] / sum. A token of
    probability 0 has an empty interval and is never drawn."""
    c = probs.double().cumsum(0)
    v = torch.tensor([u * float(c[-1])], dtype=torch.float64)
    i = int(torch.searchsorted(c, v, right=True))
    if i >= c.shape[0]:  # u * c_last rounded up to c_last: the last token that has mass
        i = int(probs.nonzero()[-1])
    return i


def sample_row(row_logits: torch.Tensor,  # [1, vocab]
               params: SamplingParams, generator: torch.Generator | None) -> int:
    """Plain decoding's token for one row: the argmax for a greedy request, else the inverse CDF
    of target_probs_from_logits at one uniform draw from `generator` (the exponential race drew
    one Exp(1) per vocabulary entry: ~0.4 ms of torch.rand for a 49k vocabulary, ~0.75 ms a
    token in all, a fifth of a decode step on a 2-core Xeon; this takes ~0.17 ms). A 1-node
    verify tree (speculative/verify.py) draws through here too: the same token."""
    if params.greedy:
        return argmax_row(row_logits)
    probs = target_probs_from_logits(row_logits, params)  # [1, vocab]
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    return inverse_cdf(probs[0].cpu(), u)


def make_generator(seed: int | None) -> torch.Generator:
    """A generator seeded from a SamplingParams seed (signed 64-bit), mapped one to one onto
    torch's unsigned 64-bit seeds; None: a fresh random seed."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed % (1 << 64))
    return g
