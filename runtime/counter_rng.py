"""Counter-based random numbers for the device path: noise as a pure function of (seed, offset, index).

The CPU path draws each request's randomness from its own torch.Generator on the host and copies
it over row by row. On a device that is a copy per request per step, and a generator's state is
a sequence: what a request draws depends on everything it drew before. Here a draw is a hash of
its coordinates instead (the idea of Philox and of Salmon et al.'s counter-based generators):

    u(seed, offset, stream, j) = hash32(j, key(seed, offset, stream)) -> (0, 1)

`offset` is the request's position (tokens generated so far) and `stream` tells the exponential
race's noise apart from the acceptance uniforms, so a verify step at position p draws exactly
what plain decoding at p draws for its bonus token, and no two steps of one request ever reuse a
coordinate (positions only grow). The per-row key is computed on the host (a few integer ops per
request), the [rows, n] draws on the device by torch integer ops, so a whole batch takes one
pass and no host work per element; the bits are the same on every device (integer arithmetic),
so the CPU tests see what a GPU computes.

hash32 is two rounds of MurmurHash3's 32-bit finalizer. The arithmetic stays below 2^63 in int64
tensors: a 32-bit product is split into 16-bit halves, so nothing relies on signed overflow
wrapping.
"""

from __future__ import annotations

import torch

NOISE = 1  # the exponential race's Exp(1) noise over the vocabulary (bonus / recovered / plain)
UNIFORM = 2  # one acceptance uniform per draft-tree node (column c judges node c)

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _fmix_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, offset: int, stream: int) -> tuple[int, int]:
    """The two 32-bit words keying one request's draws at one offset of one stream (host)."""
    s = seed % (1 << 64)
    a = _fmix_py((s & _M32) ^ _fmix_py((s >> 32) ^ _fmix_py((stream * _GOLDEN) & _M32)))
    k0 = _fmix_py(a ^ (offset & _M32))
    k1 = _fmix_py(k0 ^ _fmix_py(((offset >> 32) & _M32) ^ 0x68E31DA4))
    return k0, k1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) (int64 tensor), c < 2^32: products below 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def counter_uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys: [rows, 2] int64 (row_key words) -> [rows, n] float32 uniforms, strictly inside (0, 1):
    23 random bits plus a half, exact in float32 (never 0, never 1)."""
    j = torch.arange(n, dtype=torch.int64, device=keys.device)
    x = _fmix(_mul32(j, _GOLDEN)[None, :] ^ keys[:, :1])
    x = _fmix(x ^ keys[:, 1:])
    return ((x >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def counter_exponential(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys: [rows, 2] int64 -> [rows, n] float32 i.i.d. Exp(1), all > 0 (u < 1)."""
    return -torch.log(counter_uniform(keys, n))
