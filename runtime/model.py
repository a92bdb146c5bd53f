"""A Llama-family decoder (Llama, SmolLM2, Qwen2) in plain torch, driven by a `ForwardBatch`.

RMSNorm, RoPE (with scaling configs), grouped-query attention over the paged KV cache through
`prescient.kernels.ops.tree_attention` (so prefill chunks, decode tokens and draft trees all go
through one call with a per-query mask), SwiGLU MLP, tied or untied embeddings. Q/K/V and
gate/up are fused into one matrix each so a decode step makes 5 matrix-vector calls per layer.
Logits are computed only for `batch.logits_indices` (the LM head is the largest GEMV).
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np
import torch
import torch.nn.functional as F

from prescient.kernels import ops
from prescient.runtime.batch import ForwardBatch
from prescient.runtime.config import ModelConfig
from prescient.runtime.linear import Linear
from prescient.runtime.rope import Rope


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 fast_linear: bool = True):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_layers

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("embed")  # [vocab, hidden]
        self.norm = w("norm")
        lm_head = self.embed if config.tie_word_embeddings or "lm_head" not in weights else w("lm_head")
        self.lm_head = Linear(lm_head, fast_path=fast_linear)
        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([w(p + "q_bias"), w(p + "k_bias"), w(p + "v_bias")])
            self.layers.append(_Layer(
                attn_norm=w(p + "attn_norm"),
                qkv=Linear(torch.cat([w(p + "q"), w(p + "k"), w(p + "v")]), qkv_bias, fast_linear),
                o=Linear(w(p + "o"), fast_path=fast_linear),
                mlp_norm=w(p + "mlp_norm"),
                gate_up=Linear(torch.cat([w(p + "gate"), w(p + "up")]), fast_path=fast_linear),
                down=Linear(w(p + "down"), fast_path=fast_linear),
            ))
        self.rope = Rope(config, dtype)
        self.rope.cos = self.rope.cos.to(self.device)
        self.rope.sin = self.rope.sin.to(self.device)
        self.scale = config.head_dim ** -0.5
        # The packed GEMV kernel runs its own 2-thread pool; torch's OpenMP workers would fight it
        # for the second core, so forwards small enough for that kernel (decode, draft trees)
        # run torch's own ops on one thread, and larger ones (prefill) get torch's threads back.
        self._packed = self.lm_head.packed is not None
        self._torch_threads = torch.get_num_threads()

    def early_exit(self, num_layers: int) -> "LlamaModel":
        """A model made of this one's first `num_layers` layers, final norm and LM head, sharing
        every tensor (no copy): the self-speculative draft when no draft model is given."""
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"early-exit depth must be in [1, {self.num_layers}], got {num_layers}")
        draft = object.__new__(LlamaModel)
        draft.__dict__.update(self.__dict__)
        draft.layers = self.layers[:num_layers]
        draft.num_layers = num_layers
        return draft

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's fused kernel: one op instead of six
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        # Normalise in float32 (as the reference does for half types), scale in the model dtype.
        xf = x.float() if x.dtype != torch.float64 else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """-> logits [num_logits, vocab] float32 (float64 for a float64 model)."""
        cfg = self.config
        if self._packed:
            torch.set_num_threads(1 if batch.num_tokens <= 16 else self._torch_threads)
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        h = self.embed[batch.input_ids]  # [num_tokens, hidden]
        cos, sin = self.rope.tables(batch.positions)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self._rms_norm(h, layer.attn_norm)
            qkv = layer.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
            # one RoPE pass over the q and k heads together
            qk = self.rope.apply(qkv[:, :q_size + kv_size].view(-1, num_qk_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
            v = qkv[:, q_size + kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            ops.store_kv(k_cache, v_cache, k, v, batch.slot_mapping)
            attn = ops.tree_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                      batch.cu_seqlens_q, batch.mask_bits, self.scale)
            h = h + layer.o(attn.reshape(-1, q_size))
            x = self._rms_norm(h, layer.mlp_norm)
            gate_up = layer.gate_up(x)  # [num_tokens, 2 * intermediate]
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        h = self._rms_norm(h[batch.logits_indices], self.norm)
        logits = self.lm_head(h)
        return logits if logits.dtype == torch.float64 else logits.float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [(_zeros(shape, self.dtype, self.device), _zeros(shape, self.dtype, self.device))
                for _ in range(self.num_layers)]

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        return 2 * self.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=self.dtype).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, align: int = 64) -> torch.Tensor:
    """Zeros that cost nothing until touched: on CPU numpy's calloc hands out zero pages lazily,
    where torch.zeros writes every byte (1.4 s for a 1 GiB KV cache, paid at every start). The
    start is moved to a cache-line boundary (calloc gives 16 bytes), so no K/V head row of the
    attention kernel's loads straddles two lines."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    offset = -raw.ctypes.data % align
    return torch.from_numpy(raw[offset:offset + nbytes]).view(dtype).view(shape)
