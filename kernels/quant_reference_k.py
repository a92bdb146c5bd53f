"""Reference (pure torch) for the GGUF K-quant weight formats Q4_K, Q5_K and Q6_K, and for the
int8 activation quantization of their SIMD kernels (kernels/cpu_qgemv_k.c).

The native kernels are tested against this module (tests/kernels/test_qgemv_k.py), and this
module against ``gguf.quants`` (ggml's own layout, via the ``gguf`` package).

Formats (256 values per super-block; fp16 d / dmin; little-endian):

* ``q4_k`` (144 B): d, dmin, 12 B packing 6-bit scales sc[8] and mins m[8] of the eight
  32-value sub-blocks, 128 B of nibbles; value = d*sc_j*q - dmin*m_j, q in 0..15.
* ``q5_k`` (176 B): as q4_k plus 32 B of fifth bits (bit j of byte l: value l of sub-block j)
  between the scales and the nibbles; q in 0..31.
* ``q6_k`` (210 B): 128 B low 4 bits, 64 B high 2 bits, 16 int8 scales (sub-blocks of 16),
  fp16 d; value = d*sc_i*(q - 32), q in 0..63.

Public API::

    dequantize_k(blocks, qtype, N, K, dtype=torch.float32) -> [N, K]
    dequantize_k_parts(blocks, qtype, N, K) -> (a, o) fp64 [N, K], w = a - o exactly
    quantize_k(w, qtype) -> uint8 [N, K/256 * block_bytes]   (round-to-nearest; tests only)
    quantize_x_q8k(x) -> (q int8 [M, K], d fp32 [M, K/256], bsums int16 [M, K/16])

``dequantize_k`` in fp32 rounds exactly as ggml does (d*sc, then *q, minus dmin*m), so the C
dequantizer can be compared bit for bit; in fp64 every value is exact.
"""

from __future__ import annotations

import torch

QK = 256
_FORMATS = ("q4_k", "q5_k", "q6_k")


def __getattr__(name: str):
    """BLOCK_BYTES (name -> bytes per super-block) and DT_CODES (name -> wdt code): views of
    quant_reference.QTYPES, which reads them from the library's format table."""
    if name in ("BLOCK_BYTES", "DT_CODES"):
        from prescient.kernels.quant_reference import QTYPES

        return {q: QTYPES[q][2 if name == "BLOCK_BYTES" else 0] for q in _FORMATS}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _block_bytes(qtype: str) -> int:
    if qtype not in _FORMATS:
        raise ValueError(f"qtype must be one of {sorted(_FORMATS)}, got {qtype!r}")
    from prescient.kernels.quant_reference import QTYPES

    return QTYPES[qtype][2]


def _check(blocks: torch.Tensor, qtype: str, N: int, K: int) -> torch.Tensor:
    bb = _block_bytes(qtype)
    if K % QK:
        raise ValueError(f"K = {K} is not a multiple of {QK}")
    nbytes = K // QK * bb
    if blocks.dtype != torch.uint8 or blocks.numel() != N * nbytes:
        raise ValueError(f"blocks must be uint8 with {N} x {nbytes} bytes, got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    return blocks.reshape(N * (K // QK), bb)  # [N * K/256, block_bytes]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> float64 [...] (exact)."""
    return b.contiguous().view(torch.float16)[..., 0].double()


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, 12] -> (sc [B, 8], m [B, 8]) int64: bytes 0-3 hold sc[0..3] (low 6 bits) and
    bits 4-5 of sc[4..7] (top 2), bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of
    sc[4..7] (low nibble) and of m[4..7] (high nibble)."""
    s = s.long()
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], 1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], 1)
    return sc, mn


def _codes(blk: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Super-blocks [B, bytes] -> (q [B, 256] unsigned codes, scale [B, 256], offset [B, 256])
    in float64 with value = scale * q - offset (all exact)."""
    B = blk.shape[0]
    if qtype in ("q4_k", "q5_k"):
        d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        sc, mn = _k4_scales(blk[:, 4:16])
        qs = blk[:, 48:176] if qtype == "q5_k" else blk[:, 16:144]
        qs = qs.long().reshape(B, 4, 1, 32)
        q = ((qs >> torch.tensor([0, 4]).reshape(1, 1, 2, 1)) & 15).reshape(B, 8, 32)  # sub-block j = 2c + s
        if qtype == "q5_k":
            qh = blk[:, 16:48].long().reshape(B, 1, 32)
            q = q | (((qh >> torch.arange(8).reshape(1, 8, 1)) & 1) << 4)
        scale = (d[:, None] * sc.double())[:, :, None].expand(B, 8, 32)
        offset = (dmin[:, None] * mn.double())[:, :, None].expand(B, 8, 32)
    else:
        ql, qh = blk[:, 0:128].long(), blk[:, 128:192].long()
        sc = blk[:, 192:208].contiguous().view(torch.int8).double()
        d = _f16(blk[:, 208:210])
        # value 128h + 64s + i (i < 64): nibble s of ql[64h + i]; value 128h + 32g + l: bits
        # 2g, 2g+1 of qh[32h + l].
        lo = (ql.reshape(B, 2, 1, 64) >> torch.tensor([0, 4]).reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(B, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3
        q = lo.reshape(B, 256) | (hi.reshape(B, 256) << 4)
        s = (d[:, None] * sc)[:, :, None].expand(B, 16, 16)
        scale, offset = s, 32 * s
    return q.reshape(B, QK).double(), scale.reshape(B, QK), offset.reshape(B, QK)


def dequantize_k(blocks: torch.Tensor, qtype: str, N: int, K: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [N, K/256 * block_bytes] -> W [N, K] in ``dtype``.  float32 rounds as ggml
    (q4_k/q5_k: fl(fl(d*sc) * q) - fl(dmin*m); q6_k: fl(d*sc) * (q - 32)); float64 is exact."""
    blk = _check(blocks, qtype, N, K)
    q, scale, offset = _codes(blk, qtype)
    if dtype == torch.float64:
        w = scale * q - offset
    else:
        if qtype == "q6_k":
            w = scale.float() * (q - 32).float()
        else:
            w = scale.float() * q.float() - offset.float()
        w = w.to(dtype)
    return w.reshape(N, K)


def dequantize_k_parts(blocks: torch.Tensor, qtype: str, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, o), float64 [N, K], with W = a - o exactly: a = scale * (unsigned code), o = the
    per-sub-block offset (dmin*m, or 32*d*sc for q6_k).  The int8 kernels sum the two parts
    separately, so |a| + |o| bounds what their fp32 roundings act on."""
    blk = _check(blocks, qtype, N, K)
    q, scale, offset = _codes(blk, qtype)
    return (scale * q).reshape(N, K), offset.reshape(N, K).contiguous()


def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # torch.round rounds half to even


def _pack_k4_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """sc, m int64 [B, 8] (0..63) -> uint8 [B, 12] (inverse of _k4_scales)."""
    s = torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
                   (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                   (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], 1)
    return s.to(torch.uint8)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float [B] -> uint8 [B, 2] (fp16, little-endian)."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def quantize_k(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w [N, K] (K a multiple of 256) -> blocks uint8 [N, K/256 * block_bytes].

    A plain round-to-nearest quantizer to make realistic test blocks, *not* ggml's optimizing
    quantizer (which searches scales and mins to minimise the error); real model blocks come
    from the GGUF file.  q4_k/q5_k: each 32-value sub-block spans [min(x, 0), max(x)] with
    15 / 31 steps, its scale and min rounded to 6 bits of d / dmin.  q6_k: each 16-value
    sub-block's largest-magnitude value maps to q - 32 = -32 (so scales take both signs, as in
    ggml), the scale rounded to int8 of d."""
    bb = _block_bytes(qtype)
    N, K = w.shape
    if K % QK:
        raise ValueError(f"K = {K} is not a multiple of {QK}")
    B = N * (K // QK)
    x = w.detach().double().reshape(B, QK)
    if qtype in ("q4_k", "q5_k"):
        qmax = 15 if qtype == "q4_k" else 31
        xs = x.reshape(B, 8, 32)
        lo = xs.amin(-1).clamp(max=0)
        hi = xs.amax(-1)
        s, o = (hi - lo) / qmax, -lo                                     # [B, 8] scale, offset
        d = (s.amax(-1) / 63).to(torch.float16).double()                 # as stored
        dmin = (o.amax(-1) / 63).to(torch.float16).double()
        sc = torch.where(d[:, None] > 0, _round_half_even(s / d[:, None].clamp(min=1e-300)), 0).clamp(0, 63).long()
        mn = torch.where(dmin[:, None] > 0, _round_half_even(o / dmin[:, None].clamp(min=1e-300)), 0).clamp(0, 63).long()
        step = (d[:, None] * sc)[:, :, None]
        q = torch.where(step > 0, _round_half_even((xs + (dmin[:, None] * mn)[:, :, None]) / step.clamp(min=1e-300)), 0)
        q = q.clamp(0, qmax).long()                                      # [B, 8, 32]
        nib = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)               # [B, 4, 32]: chunk c
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k4_scales(sc, mn)]
        if qtype == "q5_k":
            qh = ((q >> 4) & 1) << torch.arange(8).reshape(1, 8, 1)
            parts.append(qh.sum(1).to(torch.uint8))                      # [B, 32]
        parts.append(nib.reshape(B, 128).to(torch.uint8))
    else:
        xs = x.reshape(B, 16, 16)
        idx = xs.abs().argmax(-1, keepdim=True)
        s = xs.gather(-1, idx)[..., 0] / -32                             # [B, 16], signed
        d = (s.abs().amax(-1) / 127).to(torch.float16).double()
        sc = torch.where(d[:, None] > 0, _round_half_even(s / d[:, None].clamp(min=1e-300)), 0).clamp(-128, 127).long()
        step = (d[:, None] * sc)[:, :, None]
        q = torch.where(step != 0, _round_half_even(xs / torch.where(step != 0, step, 1.0)), 0)
        q = (q.clamp(-32, 31) + 32).long().reshape(B, 2, 4, 32)          # [B, h, g, l]
        ql = torch.cat([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                        (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], 2)  # [B, 2, 64]
        qh = (((q >> 4) & 3) << (2 * torch.arange(4)).reshape(1, 1, 4, 1)).sum(2)  # [B, 2, 32]
        parts = [ql.reshape(B, 128).to(torch.uint8), qh.reshape(B, 64).to(torch.uint8),
                 sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)]
    return torch.cat(parts, 1).reshape(N, K // QK * bb).contiguous()


def quantize_x_q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SIMD kernels' activation quantization.  x [M, K] fp32 -> q int8 [M, K],
    d fp32 [M, K/256], bsums int16 [M, K/16]: per 256 values d = absmax / 127 and
    q = round_half_even(x * (127 / absmax)) (fp32 arithmetic; an all-zero block gives 0),
    bsums the sums of each 16 q.  xhat = q * d differs from x by at most d/2 (+ fp32 rounding)."""
    M, K = x.shape
    if K % QK:
        raise ValueError(f"K = {K} is not a multiple of {QK}")
    xb = x.float().reshape(M, K // QK, QK)
    amax = xb.abs().amax(-1)
    iscale = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = _round_half_even(xb * iscale[..., None]).clamp(-127, 127)
    d = amax / torch.tensor(127.0)
    bsums = q.reshape(M, K // 16, 16).sum(-1).to(torch.int16)
    return q.to(torch.int8).reshape(M, K), d, bsums
