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

from prescient.kernels import cpu_layer, ops
from prescient.runtime.batch import ForwardBatch
from prescient.runtime.config import ModelConfig
from prescient.runtime.kv_layer import KVLayer
from prescient.runtime.linear import Linear, QuantizedLinear, QuantWeight, format_name, fused_linear, make_linear
from prescient.runtime.rope import Rope


@dataclass
class _Layer:
    # the linears are runtime/linear.py's Linear (float), QuantizedLinear (blocks) or ConcatLinear
    # (parts in different formats)
    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 fast_linear: bool = True, weights_dtype: torch.dtype | None = None, weights_mode: str = ""):
        """weights: canonical names (runtime/loader.py) -> float tensors or QuantWeight blocks.
        dtype: the activations, norms, biases and KV cache. weights_dtype: the float dtype the
        linear weights and the embedding are held in (None = dtype). Quantized blocks stay blocks
        on CPU (kernels/quant_linear.py reads them); on another device, or with fast_linear=False
        (the reference path), they are dequantized into weights_dtype. weights_mode: how the
        weights were loaded ("native", "--weights bfloat16", ...), for weights_description()."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_layers
        self.weights_mode = weights_mode
        wdtype = weights_dtype or dtype
        keep_blocks = self.device.type == "cpu" and fast_linear

        def w(name: str) -> torch.Tensor:  # norms and biases: the compute dtype
            return weights[name].to(device=self.device, dtype=dtype)

        def lw(name: str) -> torch.Tensor | QuantWeight:  # a matrix: its blocks, or floats in wdtype
            t = weights[name]
            if isinstance(t, QuantWeight):
                return t if keep_blocks else t.dequantize(wdtype).to(self.device)
            return t.to(device=self.device, dtype=wdtype)

        embed = lw("embed")  # [vocab, hidden]
        self._tied = tied = config.tie_word_embeddings or "lm_head" not in weights
        if isinstance(embed, QuantWeight):
            # one copy of the blocks: the lookup dequantizes the rows it is given, the tied LM
            # head multiplies by all of them
            self.embed, self._embed_q = None, QuantizedLinear(embed)
            self.lm_head = self._embed_q if tied else make_linear(lw("lm_head"), fast_path=fast_linear)
        else:
            self.embed, self._embed_q = embed, None
            self.lm_head = make_linear(embed if tied else lw("lm_head"), fast_path=fast_linear)
        self.norm = w("norm")
        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([w(p + "q_bias"), w(p + "k_bias"), w(p + "v_bias")])
            self.layers.append(_Layer(
                attn_norm=w(p + "attn_norm"),
                qkv=fused_linear([lw(p + "q"), lw(p + "k"), lw(p + "v")], qkv_bias, fast_linear),
                o=make_linear(lw(p + "o"), fast_path=fast_linear),
                mlp_norm=w(p + "mlp_norm"),
                gate_up=fused_linear([lw(p + "gate"), lw(p + "up")], fast_path=fast_linear),
                down=make_linear(lw(p + "down"), fast_path=fast_linear),
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
        if self._packed:
            torch.set_num_threads(1 if batch.num_tokens <= cpu_layer.MAX_T else self._torch_threads)
        h = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        cos, sin = self.rope.tables(batch.positions)
        # decode/verify-sized CPU steps: all layers in native calls, no per-op dispatch
        # (kernels/cpu_layer.py; PRESCIENT_FUSED_LAYERS=0 keeps the torch loop below)
        fused = (cpu_layer.fused_layers(self, kv_caches)
                 if 0 < batch.num_tokens <= cpu_layer.MAX_T and self.device.type == "cpu" else None)
        if fused is not None:
            h = fused.forward(h, batch, cos, sin)
            h = fused.final_norm(h, batch.logits_indices, self.norm)
            return self._logits(h)
        h = self._layers(h, batch, kv_caches, cos, sin, 0, self.num_layers)
        return self._logits(self._rms_norm(h[batch.logits_indices], self.norm))

    @torch.inference_mode()
    def forward_layers(self, batch: ForwardBatch, kv_caches, h: torch.Tensor | None, start: int,
                       stop: int) -> torch.Tensor:
        """Part of a prefill forward: layers [start, stop) of the torch loop (the GEMM path;
        never the fused small-M one), from the embeddings when `h` is None (start 0), else from
        the hidden states [num_tokens, hidden] an earlier call returned. The same ops in the same
        order as `forward`, so a chunk split over several steps gets forward's bits; its logits
        then come from `forward_head`. Each layer writes its K/V as it runs."""
        if self._packed:
            torch.set_num_threads(self._torch_threads)
        if h is None:
            h = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.tables(batch.positions)
        return self._layers(h, batch, kv_caches, cos, sin, start, stop)

    @torch.inference_mode()
    def forward_head(self, batch: ForwardBatch, h: torch.Tensor) -> torch.Tensor:
        """The logits [num_logits, vocab] of hidden states that went through every layer."""
        return self._logits(self._rms_norm(h[batch.logits_indices], self.norm))

    def _layers(self, h: torch.Tensor, batch: ForwardBatch, kv_caches, cos, sin, start: int, stop: int) -> torch.Tensor:
        cfg = self.config
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        for layer, kv in zip(self.layers[start:stop], kv_caches[start:stop]):
            k_cache, v_cache = kv
            scales = getattr(kv, "scales", {})  # an int8 cache's (runtime/kv_layer.py)
            x = self._rms_norm(h, layer.attn_norm)
            qkv = layer.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
            # one RoPE pass over the q and k heads together
            qk = self.rope.apply(qkv[:, :q_size + kv_size].view(-1, num_qk_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
            v = qkv[:, q_size + kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            ops.store_kv(k_cache, v_cache, k, v, batch.slot_mapping, **scales)
            attn = ops.tree_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                      batch.cu_seqlens_q, batch.mask_bits, self.scale, **scales)
            h = h + layer.o(attn.reshape(-1, q_size))
            x = self._rms_norm(h, layer.mlp_norm)
            gate_up = layer.gate_up(x)  # [num_tokens, 2 * intermediate]
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        return logits if logits.dtype == torch.float64 else logits.float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None) -> list[KVLayer]:
        """Per layer a KVLayer; `kv_dtype` None = the model dtype, or torch.int8 (+ fp32 scales)."""
        cfg = self.config
        kv_dtype = kv_dtype or self.dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        if kv_dtype != torch.int8:
            return [KVLayer(_zeros(shape, kv_dtype, self.device), _zeros(shape, kv_dtype, self.device))
                    for _ in range(self.num_layers)]
        return [KVLayer(*(_zeros(shape, torch.int8, self.device) for _ in range(2)),
                        *(_zeros(shape[:3], torch.float32, self.device) for _ in range(2)))
                for _ in range(self.num_layers)]

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        cfg = self.config
        kv_dtype = kv_dtype or self.dtype
        if kv_dtype == torch.int8:  # int8 rows + one fp32 scale per token and head
            return 2 * self.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
        return 2 * self.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=kv_dtype).element_size()

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [num_tokens] -> embeddings [num_tokens, hidden] in the compute dtype."""
        if self._embed_q is not None:
            return self._embed_q.lookup(ids, self.dtype)
        h = self.embed[ids]
        return h if h.dtype == self.dtype else h.to(self.dtype)

    def _matrices(self) -> list:
        """Every weight matrix once: the layers' linears, then the embedding and (untied) LM head."""
        mats = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        embed = self._embed_q if self._embed_q is not None else self.embed
        mats.append(embed)
        if not self._tied:
            mats.append(self.lm_head)
        return mats

    def weight_bytes(self) -> int:
        """Bytes of weights held: every matrix once (a tied LM head is the embedding) and the norms."""
        total = sum(m.nbytes if isinstance(m, torch.Tensor) else m.weight_bytes for m in self._matrices())
        norms = [self.norm] + [t for layer in self.layers for t in (layer.attn_norm, layer.mlp_norm)]
        return total + sum(t.nbytes for t in norms)

    def weight_formats(self) -> tuple[str, ...]:
        """The formats the matrices are held in, most used (by bytes) first: ("q4_1", "q8_0")."""
        size: dict[str, int] = {}
        for m in self._matrices():
            if isinstance(m, torch.Tensor):
                size[format_name(m)] = size.get(format_name(m), 0) + m.nbytes
            else:
                parts = getattr(m, "parts", [m])
                for part in parts:
                    size[part.formats[0]] = size.get(part.formats[0], 0) + part.weight_bytes
        return tuple(sorted(size, key=lambda f: -size[f]))

    def weights_description(self) -> str:
        """How the weights are held, as the startup lines and reports name them:
        "q4_1+q8_0 (native)", "bf16 (--weights bfloat16)"."""
        formats = "+".join(self.weight_formats())
        return f"{formats} ({self.weights_mode})" if self.weights_mode else formats


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
