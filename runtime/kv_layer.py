"""One layer's paged KV cache: the (k, v) pair every caller unpacks, plus, for an int8 cache, the
per-token-and-head fp32 scales (`--kv-dtype int8`; kernels/cpu_attention.c dequantizes inside
attention). A tuple subclass so `k, v = layer_kv` keeps working where scales do not matter."""

from __future__ import annotations

import torch


class KVLayer(tuple):
    """(k_cache, v_cache) [num_blocks, block_size, num_kv_heads, head_dim] with `k_scale` /
    `v_scale` [num_blocks, block_size, num_kv_heads] fp32 when the caches are int8, else None."""

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None):
        self = super().__new__(cls, (k, v))
        if (k.dtype == torch.int8) != (k_scale is not None) or (k_scale is None) != (v_scale is None):
            raise ValueError("an int8 KV cache needs its k/v scales, and only an int8 cache has them")
        self.k_scale, self.v_scale = k_scale, v_scale
        return self

    @property
    def scales(self) -> dict:
        """The keyword arguments of ops.store_kv / tree_attention / kv_copy for this layer."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def tensors(self) -> list[torch.Tensor]:
        return [*self, *(t for t in (self.k_scale, self.v_scale) if t is not None)]


class StackedKV(list):
    """Every layer's KVLayer as views of one tensor [num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim] (both step paths' cache, runtime/step_path.py, unless int8 or a
    tensor-parallel shard): the KV moves after a verify step are then one gather and one scatter
    over all layers (`copy_slots`, the hook the speculator calls, as it does a tensor-parallel
    cache's) instead of one op pair per layer. Each layer's k and v stay contiguous views."""

    def __init__(self, stack: torch.Tensor):
        super().__init__(KVLayer(stack[i, 0], stack[i, 1]) for i in range(stack.shape[0]))
        self.stack = stack

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """src_slots, dst_slots: [n] int64 on the cache's device. Every source is read (the
        gather copies) before any destination is written, so overlapping moves are safe."""
        num_layers, two, num_blocks, block_size = self.stack.shape[:4]
        flat = self.stack.view(num_layers, two, num_blocks * block_size, *self.stack.shape[4:])
        flat[:, :, dst_slots] = flat[:, :, src_slots]
