"""Triton RMSNorm for half-precision activations: one program per row, one launch per call.

The model's bf16 RMSNorm (kernels/reference.rms_norm) is eight torch ops (upcast, square, mean,
add, rsqrt, multiply, downcast, weight multiply), each a kernel launch and a round trip through
memory, run twice per layer; this kernel reads the row once and writes it once. Its numerics are
the reference's: the row in float32, normalised, rounded to the activation dtype, then multiplied
by the weight and rounded again (one bf16 product). The sum of squares is a tree reduction, not
torch's order, so a result may differ from the reference by one rounding of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to_bf16(y):
    """float32 -> the nearest bfloat16 (ties to even), kept in float32: integer ops only, so the
    interpreter (which cannot compute in bf16) gives the compiled kernel's bits."""
    bits = y.to(tl.uint32, bitcast=True)
    # shifts rather than a 0xFFFF0000 mask: a constant past int32 would widen the integers
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]
    w_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    stride_x,
    stride_o,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    y = x * inv
    if ROUND_BF16:
        y = _round_to_bf16(y)  # the reference rounds the normalised row before the weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] bfloat16 (or float16/float32), weight: [hidden] -> [..., hidden] in x's dtype."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"triton rms_norm takes bfloat16/float16/float32, not {x.dtype}")
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, x2.stride(0), out.stride(0), hidden,
                                         float(eps), BLOCK=triton.next_power_of_2(hidden),
                                         ROUND_BF16=x.dtype == torch.bfloat16)
    return out.view(x.shape)
