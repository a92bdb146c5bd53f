"""The one dispatch point for every kernel op (signatures in docs/CONTRACTS.md).

CUDA tensors run the Triton kernels, CPU tensors the pure-torch reference, except
`tree_attention` on float32/bfloat16 CPU tensors, which runs the C kernel of cpu_attention.py
(built with the CPU GEMV's .so; the reference when it cannot be built, and for float64/float16),
and `apply_token_bitmask` on float32 CPU logits (cpu_bitmask.c, the same switches).
int8 KV caches (`store_kv`/`tree_attention` with `k_scale`/`v_scale`, see reference.quantize_kv)
run the C kernels on CPU (store and attention) and the reference elsewhere: there is no Triton
int8 path yet.
The environment variable PRESCIENT_KERNELS overrides that per call: `triton` forces Triton (on
CPU tensors that needs TRITON_INTERPRET=1 set before the first Triton kernel is imported),
`reference` forces the reference (the C attention kernel included); PRESCIENT_CPU_ATTENTION=0
turns the C kernels here off (attention, the int8 KV store, the grammar mask), not the linears.
Triton is imported lazily, so the package works where it is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from prescient.kernels import reference

_BACKEND_ENV = "PRESCIENT_KERNELS"
_CPU_ATTENTION_ENV = "PRESCIENT_CPU_ATTENTION"
_triton_missing_warned = False
_cpu_attention: ModuleType | None = None  # prescient.kernels.cpu_attention, once imported
_C_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def _triton_module(name: str) -> ModuleType:
    # importlib caches modules; the Triton kernels compile (or get interpreted) on first launch.
    return importlib.import_module(f"prescient.kernels.{name}")


def use_triton(device: torch.device) -> bool:
    """Whether an op on tensors of `device` runs the Triton kernel."""
    forced = os.environ.get(_BACKEND_ENV, "")
    if forced == "reference":
        return False
    if forced == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"{_BACKEND_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 set before "
                "Triton kernels are imported"
            )
        return True
    if forced not in ("", "auto"):
        raise ValueError(f"{_BACKEND_ENV} must be 'triton', 'reference' or unset, not {forced!r}")
    if device.type != "cuda":
        return False
    if importlib.util.find_spec("triton") is None:
        # The reference runs on CUDA too (slower); say so once rather than fail.
        global _triton_missing_warned
        if not _triton_missing_warned:
            import warnings

            warnings.warn("triton is not installed; CUDA kernels fall back to the torch reference")
            _triton_missing_warned = True
        return False
    return True


def store_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 cache
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 cache
) -> None:
    if k_cache.dtype == torch.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("store_kv: an int8 cache needs k_scale and v_scale")
        if _use_cpu_kernel(k_cache) and k.dtype in _C_ATTENTION_DTYPES:
            return _cpu_attention.store_kv_int8(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
        return reference.store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    if use_triton(k_cache.device):
        return _triton_module("triton_kv").store_kv(k_cache, v_cache, k, v, slot_mapping)
    return reference.store_kv(k_cache, v_cache, k, v, slot_mapping)


def tree_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], roped
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, KV length after this step's tokens
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    mask_bits: torch.Tensor | None,  # [num_tokens, num_words] int32, None = causal
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 cache
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, int8 cache
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    args = (q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, mask_bits, scale)
    if k_cache.dtype == torch.int8:
        if _use_cpu_attention(q, k_cache, v_cache):
            return _cpu_attention.tree_attention(*args, k_scale=k_scale, v_scale=v_scale)
        return reference.tree_attention(*args, k_scale=k_scale, v_scale=v_scale)
    if _use_cpu_attention(q, k_cache, v_cache):
        impl = _cpu_attention
    elif use_triton(q.device):
        impl = _triton_module("triton_tree_attention")
    else:
        impl = reference
    if k_scale is not None or v_scale is not None:  # the impl raises; Triton has no scales
        return impl.tree_attention(*args, k_scale=k_scale, v_scale=v_scale)
    return impl.tree_attention(*args)


def _use_cpu_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """CPU float32/bfloat16 tree_attention (caches of q's dtype, or int8) runs the C kernel
    unless PRESCIENT_KERNELS forces a backend, PRESCIENT_CPU_ATTENTION=0, autograd needs the
    graph, or the kernel could not be built.  Called once per layer: an unset variable costs
    ~0.5 us to read, so each is read once, and only for calls the kernel could take."""
    dtype = q.dtype
    kv_dtype = k_cache.dtype if k_cache.dtype is torch.int8 else dtype
    if (not q.is_cpu or dtype not in _C_ATTENTION_DTYPES or k_cache.dtype is not kv_dtype
            or v_cache.dtype is not kv_dtype or (q.requires_grad and torch.is_grad_enabled())):
        return False
    return _use_cpu_kernel(k_cache)


def _use_cpu_kernel(t: torch.Tensor) -> bool:
    """A CPU tensor's op may run the C kernels of cpu_attention.py (loads them on first use)."""
    global _cpu_attention
    if not t.is_cpu:
        return False
    env = os.environ
    if env.get(_BACKEND_ENV, "auto") not in ("", "auto"):
        return False  # "reference" or "triton" (use_triton validates the name)
    if env.get(_CPU_ATTENTION_ENV, "1") in ("0", "false", "off"):
        return False
    if _cpu_attention is None:
        _cpu_attention = importlib.import_module("prescient.kernels.cpu_attention")
    return _cpu_attention.available()


def kv_copy(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # [n] int64
    dst_slots: torch.Tensor,  # [n] int64
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32, an int8 cache's
    v_scale: torch.Tensor | None = None,
) -> None:
    impl = _triton_module("triton_kv") if use_triton(k_cache.device) else reference
    impl.kv_copy(k_cache, v_cache, src_slots, dst_slots)
    if k_scale is not None:  # an int8 row means nothing without its scale: move them together
        for scale in (k_scale, v_scale):
            flat = scale.view(-1, scale.shape[-1])  # [slots, num_kv_heads]
            flat[dst_slots] = flat[src_slots]


def greedy_verify(
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64, node 0 = root, padding -1
    parents: torch.Tensor,  # [num_seqs, max_nodes] int64, parents[:, 0] = -1
    num_nodes: torch.Tensor,  # [num_seqs] int64
    target_argmax: torch.Tensor,  # [num_seqs, max_nodes] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # accept_len, accepted_nodes, next_token
    impl = _triton_module("triton_verify") if use_triton(draft_tokens.device) else reference
    return impl.greedy_verify(draft_tokens, parents, num_nodes, target_argmax)


def rejection_sample(
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64, node 0 = root, padding -1
    parents: torch.Tensor,  # [num_seqs, max_nodes] int64
    num_nodes: torch.Tensor,  # [num_seqs] int64
    target_probs: torch.Tensor,  # [num_seqs, max_nodes, vocab]
    draft_probs: torch.Tensor | None,  # [num_seqs, max_nodes, vocab] or None = one-hot drafts
    uniform: torch.Tensor,  # [num_seqs, max_nodes] float32 in [0, 1)
    recovery_noise: torch.Tensor,  # [num_seqs, vocab] float32, i.i.d. Exp(1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # accept_len, accepted_nodes, next_token
    impl = _triton_module("triton_verify") if use_triton(draft_tokens.device) else reference
    return impl.rejection_sample(
        draft_tokens, parents, num_nodes, target_probs, draft_probs, uniform, recovery_noise
    )


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab]
    bitmask: torch.Tensor,  # [num_selected, ceil(vocab / 32)] int32, bit set = allowed
    indices: torch.Tensor | None = None,  # [num_selected] int64 logits rows; None = all rows
) -> None:
    if use_triton(logits.device):
        return _triton_module("triton_bitmask").apply_token_bitmask(logits, bitmask, indices)
    if _use_cpu_kernel(logits):
        from prescient.kernels import cpu_bitmask

        if cpu_bitmask.apply(logits, bitmask, indices):  # fp32 rows: cpu_bitmask.c
            return None
    return reference.apply_token_bitmask(logits, bitmask, indices)


def rms_norm(
    x: torch.Tensor,  # [..., hidden], bfloat16 / float16 (a float32 model calls F.rms_norm)
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden], x's dtype
    """RMSNorm in half precision: one fused Triton launch on CUDA (kernels/triton_rmsnorm.py), the
    reference's eight torch ops elsewhere (the CPU's bits are the reference's)."""
    if x.dtype in (torch.bfloat16, torch.float16) and use_triton(x.device):
        return _triton_module("triton_rmsnorm").rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)
