"""Torch reference for the GGUF block formats that kernels/cpu_qgemv.c runs natively.

The oracle of the quantized linears (kernels/quant_linear.py, tests/kernels/test_quant_linear.py)
and their fallback when the C library is unavailable: ``dequantize`` turns a matrix of blocks
back into fp32, ``quantize`` makes blocks from floats for Q8_0 / Q4_0 / Q4_1 with ggml's
reference rounding (so tests and tools can build GGUF-compatible weights without ggml).

Layouts (ggml facts), 32 weights per block, each row of W = K / 32 blocks, little-endian:

    Q8_0  34 B  fp16 d | int8 q[32]             w_i = d * q_i
    Q4_0  18 B  fp16 d | u8 qs[16]              w_i = d * (q_i - 8)
    Q4_1  20 B  fp16 d | fp16 m | u8 qs[16]     w_i = d * q_i + m
    (q_i = qs[i] & 15 for i < 16, q_{i+16} = qs[i] >> 4)

The K-quants (Q4_K / Q5_K / Q6_K, 256 weights per super-block) are dequantized by
``prescient.kernels.quant_reference_k.dequantize_k``, imported when first needed.  The formats'
codes and block sizes are not written here: ``QTYPES`` reads them from the library's format
table (kernels/cpu_formats.c), the one place they are defined.

Exactness: every value above is computed in fp32 as the reference does (d * q is exact in fp32;
Q4_1's d * q + m rounds once), so the native kernels' dequantized weights equal these bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

#: The formats this module quantizes and dequantizes itself (the 32-element family); the
#: K-quants' reference is quant_reference_k.
BLOCK32 = ("q8_0", "q4_0", "q4_1")
#: The K-quant formats of quant_reference_k.
K_FORMATS = ("q4_k", "q5_k", "q6_k")


class _FormatTable(Mapping):
    """name -> (wdt code, elements per block, bytes per block), read once, on first use, from
    the format table of the kernels' shared library (kernels/cpu_formats.c: pf_count, pf_name,
    pf_code, pf_block_elems, pf_block_bytes), where each format is defined once.

    Fallback, used only when the library cannot be built (no C compiler): the block sizes of the
    formats this reference implements (BLOCK32 + K_FORMATS) from ggml's own table in the
    ``gguf`` package, and code -1 (there is no library to pass a code to).  The test
    tests/kernels/test_format_table.py keeps the two in agreement."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, int, int]] | None = None
        self.source: str | None = None  # "library" or "gguf" once loaded

    def _load(self) -> dict[str, tuple[int, int, int]]:
        if self._rows is None:
            rows = _library_rows()
            self.source = "library"
            if rows is None:
                rows, self.source = _fallback_rows(), "gguf"
            self._rows = rows
        return self._rows

    def __getitem__(self, name: str) -> tuple[int, int, int]:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __repr__(self) -> str:
        return f"QTYPES({self._load()!r})"


def _library_rows() -> dict[str, tuple[int, int, int]] | None:
    """The library's format table, or None when the library cannot be built."""
    import ctypes

    from prescient.kernels import cpu_linear

    lib = cpu_linear.library()
    if lib is None or not hasattr(lib, "pf_count"):
        return None
    lib.pf_count.argtypes = []
    lib.pf_name.argtypes = [ctypes.c_int]
    lib.pf_name.restype = ctypes.c_char_p
    for fn in (lib.pf_count, lib.pf_code, lib.pf_block_elems, lib.pf_block_bytes):
        fn.restype = ctypes.c_int
    for fn in (lib.pf_code, lib.pf_block_elems, lib.pf_block_bytes):
        fn.argtypes = [ctypes.c_int]
    rows = {}
    for i in range(lib.pf_count()):
        name = lib.pf_name(i)
        if name:  # a code without a row (a gap in the table) has no name
            rows[name.decode()] = (lib.pf_code(i), lib.pf_block_elems(i), lib.pf_block_bytes(i))
    return rows


def _fallback_rows() -> dict[str, tuple[int, int, int]]:
    """No library: ggml's block sizes (gguf.GGML_QUANT_SIZES) of the formats implemented here."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return {name: (-1, *GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]])
            for name in (*BLOCK32, *K_FORMATS)}


#: name -> (wdt code of kernels/cpu_formats.h, elements per block, bytes per block), from the
#: library's format table (see _FormatTable).
QTYPES: Mapping[str, tuple[int, int, int]] = _FormatTable()


def row_bytes(qtype: str, K: int) -> int:
    """Bytes of one row of K weights in ``qtype``."""
    _, be, bb = QTYPES[qtype]
    if K % be:
        raise ValueError(f"{qtype}: K={K} is not a multiple of the block size {be}")
    return K // be * bb


def _blocks_view(blocks: torch.Tensor, qtype: str, N: int, K: int) -> torch.Tensor:
    """blocks (any shape, N * row_bytes uint8) -> [N * K / 32, block_bytes] uint8."""
    _, be, bb = QTYPES[qtype]
    if blocks.dtype != torch.uint8:
        raise ValueError(f"blocks must be uint8, got {blocks.dtype}")
    if blocks.numel() != N * row_bytes(qtype, K):
        raise ValueError(f"{qtype} [{N}, {K}] needs {N * row_bytes(qtype, K)} bytes, got {blocks.numel()}")
    return blocks.contiguous().reshape(N * (K // be), bb)


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian IEEE half) -> [...] fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 16] uint8 -> [nb, 32] int32: low nibbles are elements 0..15, high ones 16..31."""
    return torch.cat([qs & 15, qs >> 4], dim=1).to(torch.int32)


def dequantize(blocks: torch.Tensor, qtype: str, N: int, K: int) -> torch.Tensor:
    """blocks uint8 [N, row_bytes] (or any shape of that many bytes) -> fp32 [N, K]."""
    qtype = qtype.lower()
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {', '.join(QTYPES)}")
    if qtype in K_FORMATS:
        from prescient.kernels.quant_reference_k import dequantize_k
        return dequantize_k(blocks, qtype, N, K)
    if qtype not in BLOCK32:
        raise ValueError(f"no reference dequantizer for {qtype!r}")
    b = _blocks_view(blocks, qtype, N, K)           # [nb, bb]
    d = _half(b[:, 0:2]).unsqueeze(1)               # [nb, 1]
    if qtype == "q8_0":
        q = b[:, 2:34].contiguous().view(torch.int8).to(torch.float32)
        w = d * q
    elif qtype == "q4_0":
        w = d * (_nibbles(b[:, 2:18]) - 8).to(torch.float32)
    elif qtype == "q4_1":
        m = _half(b[:, 2:4]).unsqueeze(1)
        w = d * _nibbles(b[:, 4:20]).to(torch.float32) + m
    else:  # a format of the library's table that this reference does not know
        raise ValueError(f"no reference dequantizer for {qtype!r}")
    return w.reshape(N, K)


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """w [N, K] float -> uint8 [N, K // 32 * block_bytes] in ``qtype`` (q8_0, q4_0 or q4_1),
    rounding as ggml's reference quantizers: Q8_0 d = amax / 127, q = round half away from zero;
    Q4_0 d = (the value of largest magnitude, signed) / -8, q = min(15, trunc(x / d + 8.5));
    Q4_1 d = (max - min) / 15, m = min, q = min(15, trunc((x - min) / d + 0.5)).  The scale is
    used in fp32 for rounding and stored as fp16."""
    qtype = qtype.lower()
    if qtype not in BLOCK32:
        raise ValueError(f"quantize supports {', '.join(BLOCK32)}, not {qtype!r}")
    if w.dim() != 2:
        raise ValueError(f"w must be [N, K], got {tuple(w.shape)}")
    N, K = w.shape
    _, be, bb = QTYPES[qtype]
    if K % be:
        raise ValueError(f"K={K} is not a multiple of {be}")
    x = w.detach().to(torch.float32).reshape(N * (K // be), be)   # [nb, 32]

    def inv(d: torch.Tensor) -> torch.Tensor:
        return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)

    def half_bytes(v: torch.Tensor) -> torch.Tensor:
        return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)

    def pack(q: torch.Tensor) -> torch.Tensor:
        q = q.to(torch.uint8)
        return q[:, :16] | (q[:, 16:] << 4)

    if qtype == "q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        v = x * inv(d)
        q = torch.sign(v) * torch.floor(v.abs() + 0.5)   # |v| <= 127: the sum is exact
        out = torch.cat([half_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)
    elif qtype == "q4_0":
        imax = x.abs().argmax(dim=1, keepdim=True)        # first of equal magnitudes, as numpy
        d = torch.gather(x, 1, imax) / -8
        q = torch.trunc(x * inv(d) + 8.5).clamp(0, 15)
        out = torch.cat([half_bytes(d), pack(q)], dim=1)
    else:  # q4_1
        mn = x.amin(dim=1, keepdim=True)
        d = (x.amax(dim=1, keepdim=True) - mn) / 15
        q = torch.trunc((x - mn) * inv(d) + 0.5).clamp(0, 15)
        out = torch.cat([half_bytes(d), half_bytes(mn), pack(q)], dim=1)
    return out.reshape(N, K // be * bb)
