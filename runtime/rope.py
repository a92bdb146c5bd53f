"""Rotary position embeddings (rotate-half layout) with the HF scaling variants we support.

The cos/sin table is computed once for `max_position_embeddings` positions and indexed by each
token's position id, so tree tokens (position = prefix length + depth) need nothing special.
"""

from __future__ import annotations

import math

import torch

from prescient.runtime.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim // 2] float64, attention scaling applied to cos/sin)."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = config.rope_scaling
    if s.rope_type == "default":
        return inv_freq, 1.0
    if s.rope_type == "linear":
        return inv_freq / s.factor, 1.0
    orig = s.original_max_position_embeddings or config.max_position_embeddings
    if s.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = orig / s.low_freq_factor
        high_wavelen = orig / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled), 1.0
    # yarn (Peng et al. 2023): interpolate low frequencies, extrapolate high ones, ramp between,
    # and scale attention by 0.1 ln(factor) + 1.
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolation_weight = 1 - ramp.clamp(0, 1)
    inv = (inv_freq / s.factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv, 0.1 * math.log(s.factor) + 1.0


class Rope:
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        inv_freq, scale = inv_frequencies(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(pos, inv_freq)  # [max_pos, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(dtype)  # [max_pos, head_dim]
        self.sin = (emb.sin() * scale).to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] -> (cos, sin) [num_tokens, 1, head_dim], gathered once per
        forward and shared by every layer."""
        # index_select, not cos[positions]: the same gather through fewer of torch's layers
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim] (q and k heads together) -> rotated copy."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return torch.addcmul(x * cos, rotated, sin)
