"""Greedy tokens on CPU: the ctypes wrapper of ``cpu_argmax.c``, torch.argmax(x, -1) for fp32 rows.

torch's CPU argmax reduces a row of logits in scalar code (~57 us a 49152-entry row on a 2-core
Zen 3, one intra-op thread; 1 ms for a 16-node draft tree); the C kernel returns the same index
-- the first maximum, or the first NaN -- in a few microseconds.  ``argmax_rows`` is the one
entry point: a CPU float32 tensor goes to the kernel, anything else (another device or dtype,
no C library) to torch.argmax, so callers never branch.
"""

from __future__ import annotations

import ctypes

import torch

from prescient.kernels import cpu_linear

_ARGMAX = cpu_linear.LazySymbol("px_argmax_rows", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                     ctypes.c_void_p], ctypes.c_int)


def available() -> bool:
    """True when the C kernel is loaded (builds the .so on first call)."""
    return _ARGMAX.get() is not None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [rows] int64
    """x.argmax(-1) for a 2-D tensor: the native kernel for a CPU float32 x whose rows are
    contiguous, torch otherwise."""
    if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0
            or x.stride(1) != 1 or not available()):
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and _ARGMAX.get()(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr()):
        return x.argmax(-1)  # a shape the kernel does not take (a row past 2^31 entries)
    return out


def argmax_row(x: torch.Tensor) -> int:  # [1, n] or [n] (one row, leading dims of 1) -> its argmax
    """argmax_rows for one row, as an int: greedy decoding's token without an output tensor (each
    torch call after a forward, whose weights went through the caches, costs tens of us)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    if x.shape[0] != 1:
        raise ValueError(f"argmax_row takes one row, got {x.shape[0]}")
    if (x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0 or x.stride(1) != 1
            or not available()):
        return int(argmax_rows(x)[0])
    out = ctypes.c_int64()
    if _ARGMAX.get()(x.data_ptr(), 1, x.shape[1], x.stride(0), ctypes.addressof(out)):
        return int(x.argmax())
    return out.value
