"""Grammar masks on CPU: the ctypes wrapper of ``cpu_bitmask.c``, kernels/ops.apply_token_bitmask for
fp32 logits on the CPU.

The reference's torch ops (unpack the bits, build +-inf bounds, a minimum) took ~80 us a
49152-token row hot, several times that right after a forward: about half a millisecond of a
grammar-constrained speculative step. ``apply`` returns False where the kernel does not take the
call (another dtype or device, rows not contiguous along the vocabulary, no C library), and the
caller runs the reference.
"""

from __future__ import annotations

import ctypes

import torch

from prescient.kernels import cpu_linear

_i64, _p = ctypes.c_int64, ctypes.c_void_p
_APPLY = cpu_linear.LazySymbol("px_apply_bitmask", [_p, _i64, _i64, _i64, _p, _i64, _i64, _p], ctypes.c_int)


def available() -> bool:
    """True when the C kernel is loaded (builds the .so on first call)."""
    return _APPLY.get() is not None


def apply(
    logits: torch.Tensor,  # [num_rows, vocab] float32, CPU
    bitmask: torch.Tensor,  # [num_selected, num_words] int32, bit set = allowed
    indices: torch.Tensor | None = None,  # [num_selected] int64 logits rows; None = rows 0 ..
) -> bool:
    """Banned logits to -inf in place; False (nothing done) where the kernel does not take it:
    besides the dtypes and devices, rows that overlap (a stride below the row length), logits
    autograd tracks, and indices the reference reads otherwise (bool masks, negative or repeated
    rows: its one indexed assignment keeps one row's mask, Python's wrap-around)."""
    rows, cols = logits.shape if logits.dim() == 2 else (0, 0)
    if (logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cpu or logits.stride(1) != 1
            or (rows > 1 and logits.stride(0) < cols) or (logits.requires_grad and torch.is_grad_enabled())
            or bitmask.dim() != 2 or bitmask.dtype != torch.int32 or not bitmask.is_cpu or not available()):
        return False
    bitmask = bitmask.contiguous()
    nsel = bitmask.shape[0]
    if indices is not None:
        if indices.dtype == torch.bool:
            return False
        indices = indices.to(device="cpu", dtype=torch.int64).contiguous()
        if indices.shape != (nsel,):
            raise ValueError(f"apply_token_bitmask: {tuple(indices.shape)} indices for {nsel} bitmask rows")
        if nsel and (int(indices.min()) < 0 or indices.unique().numel() < nsel):
            return False
    elif nsel > rows:
        raise ValueError(f"apply_token_bitmask: {nsel} bitmask rows for {rows} logits rows")
    ld = logits.stride(0) if rows > 1 else cols  # one row: any stride(0) (a transposed column's)
    if _APPLY.get()(logits.data_ptr(), rows, cols, ld, bitmask.data_ptr(), nsel, bitmask.shape[1],
           None if indices is None else indices.data_ptr()):
        raise IndexError(f"apply_token_bitmask: an index outside [0, {rows})")
    return True
