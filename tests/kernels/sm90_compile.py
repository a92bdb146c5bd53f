"""Compile every Triton kernel launch of prescient.kernels for a real GPU (sm_90), without one.

The interpreter accepts code the compiler rejects (Python ints where Triton wants typed scalars,
loop-carried type changes), so CI also lowers each kernel all the way to a cubin: Triton's NVIDIA
backend needs no driver when the target is named. Run as a script with TRITON_INTERPRET unset:
each wrapper is called on small CPU tensors with its kernels swapped for recorders, and every
recorded launch (its argument types and constexprs) is compiled. Prints one line per launch.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
}


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **constexprs)` records the call."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def signature(fn, args, kwargs) -> tuple[dict, dict]:
    sig, constexprs = {}, {}
    for name, value in zip(fn.arg_names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if abs(value) < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    for name, value in kwargs.items():
        sig[name] = "constexpr"
        constexprs[name] = value
    return sig, constexprs


def record_launches() -> list[tuple[Recorder, tuple, dict]]:
    from prescient.kernels import triton_bitmask, triton_kv, triton_rmsnorm, triton_tree_attention, triton_verify
    from prescient.kernels.reference import pack_bits

    recorders = []
    for module in (triton_kv, triton_tree_attention, triton_verify, triton_bitmask, triton_rmsnorm):
        for name in dir(module):
            if isinstance(getattr(module, name), triton.runtime.JITFunction) and name.endswith("_kernel"):
                recorder = Recorder(getattr(module, name))
                setattr(module, name, recorder)
                recorders.append(recorder)

    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        k_cache = torch.zeros(4, 16, 2, 64, dtype=dtype)
        kv = torch.zeros(3, 2, 64, dtype=dtype)
        slots = torch.tensor([0, -1, 17])
        triton_kv.store_kv(k_cache, k_cache.clone(), kv, kv, slots)
        triton_kv.kv_copy(k_cache, k_cache.clone(), slots.abs(), slots.abs())
        q = torch.zeros(3, 6, 64, dtype=dtype)
        block_tables = torch.zeros(1, 4, dtype=torch.int32)
        context_lens = torch.tensor([20], dtype=torch.int32)
        cu = torch.tensor([0, 3], dtype=torch.int32)
        mask = pack_bits(torch.ones(3, 3, dtype=torch.bool).tril())
        scale = 1 / math.sqrt(64)
        for mask_bits, splits in ((mask, 2), (None, 1), (None, 3)):
            triton_tree_attention.tree_attention(
                q, k_cache, k_cache, block_tables, context_lens, cu, mask_bits, scale, splits
            )
        logits = torch.zeros(2, 40, dtype=dtype)
        bitmask = torch.zeros(2, 2, dtype=torch.int32)
        triton_bitmask.apply_token_bitmask(logits, bitmask)
        triton_bitmask.apply_token_bitmask(logits, bitmask[:1], torch.tensor([1]))

    for dtype in (torch.bfloat16, torch.float16):
        triton_rmsnorm.rms_norm(torch.zeros(3, 576, dtype=dtype), torch.ones(576, dtype=dtype), 1e-5)

    tokens = torch.zeros(2, 3, dtype=torch.int64)
    num_nodes = torch.tensor([3, 1])
    probs = torch.full((2, 3, 5), 0.2)
    triton_verify.greedy_verify(tokens, tokens, num_nodes, tokens)
    for draft_probs in (None, probs):
        triton_verify.rejection_sample(
            tokens, tokens, num_nodes, probs, draft_probs, torch.zeros(2, 3), torch.ones(2, 5)
        )
    return [(r, args, kwargs) for r in recorders for args, kwargs in r.calls]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run with TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", 90, 32)
    launches = record_launches()
    for recorder, args, kwargs in launches:
        sig, constexprs = signature(recorder.fn, args, kwargs)
        source = triton.compiler.ASTSource(fn=recorder.fn, signature=sig, constexprs=constexprs)
        compiled = triton.compile(source, target=target)
        print(recorder.fn.__name__, len(compiled.asm["cubin"]), "bytes")
    print(f"compiled {len(launches)} launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
