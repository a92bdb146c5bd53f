"""A Llama-family decoder (Llama, SmolLM2, Qwen2) in plain torch, driven by a `ForwardBatch`.

`LlamaModel.forward` is the reference forward: RMSNorm, RoPE (with scaling configs), grouped-query
attention over the paged KV cache through `prescient.kernels.ops.tree_attention` (so prefill
chunks, decode tokens and draft trees all go through one call with a per-query mask), SwiGLU MLP,
tied or untied embeddings. Q/K/V and gate/up are fused into one matrix each so a decode step makes
5 matrix-vector calls per layer. Logits are computed only for `batch.logits_indices` (the LM head
is the largest GEMV). The forward itself takes no decision by token count, device or environment
(the linears, runtime/linear.py, and kernels/ops.py still pick their kernel per call).

Transformations are applied to a built model, as gpt-fast applies them, and leave this forward
as it is written:

    prepare_for_cpu(model)        # below: decode/verify-sized CPU forwards in the native layers
                                  # (kernels/cpu_layer.c) and the torch thread policy
    shard_model(...)              # runtime/tensor_parallel.py: a rank's shard (wrapped linears), then prepared

(Quantization is still chosen at load, runtime/loader.quantize_linears, and by `fast_linear` here:
blocks kept for the quantized kernels, or dequantized.)

`LlamaModel(...)` applies `prepare_for_cpu` itself unless `prepare=False` (the reference alone);
prescient/build.py applies it explicitly. Every model the engine can hold (a LlamaModel, prepared
or not, and runtime/tp_worker.TensorParallelModel) is a `ModelRunner`.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from prescient.kernels import cpu_layer, huge_pages, ops
from prescient.runtime.batch import ForwardBatch
from prescient.runtime.config import ModelConfig
from prescient.runtime.env import RuntimeEnv, runtime_env
from prescient.runtime.kv_layer import KVLayer, StackedKV
from prescient.runtime.linear import (Linear, QuantizedLinear, QuantWeight, column_split, format_name, fused_linear,
                                      make_linear)
from prescient.runtime.rope import Rope
from prescient.runtime.tensor_parallel import column_cuts


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


class ModelRunner(Protocol):
    """What the engine, the speculator and prescient/build.py use of a model: a LlamaModel
    (prepared or not) or runtime/tp_worker.TensorParallelModel. Code asks `is_sharded` where it
    must tell a tensor-parallel model apart, never hasattr."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    num_layers: int
    weights_mode: str
    is_sharded: bool  # a tensor-parallel shard, or the model over them: every forward involves all ranks

    def forward(self, batch: ForwardBatch, kv_caches) -> torch.Tensor: ...

    def early_exit(self, num_layers: int) -> "ModelRunner": ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                          stacked: bool = False) -> list: ...

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int: ...

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor: ...

    def weight_bytes(self) -> int: ...

    def weight_formats(self) -> tuple[str, ...]: ...

    def weights_description(self) -> str: ...


def _silu_mul(gate_up: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; on the CPU the fused native layer's own SiLU (kernels/cpu_layer.silu_mul:
    its exp is correctly rounded, torch's vectorised one an ulp off now and then), so that the
    torch loop (TP ranks, forwards the native layers do not take) and the fused layer agree bit
    for bit in fp32 too."""
    act = cpu_layer.silu_mul(gate_up)  # None where the native layer does not take it
    return act if act is not None else F.silu(gate) * up


class LlamaModel:
    is_sharded = False  # ModelRunner; runtime/tensor_parallel.shard_model sets it on a rank's shard
    prepared: "CpuForward | None" = None  # the CPU transformation installed on this model, if any

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 fast_linear: bool = True, weights_dtype: torch.dtype | None = None, weights_mode: str = "",
                 prepare: bool = True, tp_invariant: bool = True):
        """weights: canonical names (runtime/loader.py) -> float tensors or QuantWeight blocks.
        dtype: the activations, norms, biases and KV cache. weights_dtype: the float dtype the
        linear weights and the embedding are held in (None = dtype). Quantized blocks stay blocks
        on CPU (kernels/quant_linear.py reads them); on another device, or with fast_linear=False
        (the reference path), they are dequantized into weights_dtype. weights_mode: how the
        weights were loaded ("native", "--weights bfloat16", ...), for weights_description().
        prepare: apply `prepare_for_cpu` (a no-op off the CPU); False = the reference forward
        only, for a caller that applies its transformations itself (prescient/build.py, TP).
        tp_invariant: on the CPU fast path, hold O and down as the column groups a TP=2 split
        makes (runtime/linear.ColumnGroups), so that TP=1 sums what TP=2's all-reduce sums and
        greedy output is the same bits at either degree; False for a TP shard (one group)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_layers
        huge_pages.fresh_arena()  # this model's copies in arenas of their own
        # every forward keeps its hidden states in last_hidden (forward_head): set by run_forward
        # for the duration of a step whose proposer drafts from them (an EAGLE head)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
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
            if tied and fast_linear:  # the head streams it: one copy for both, on huge pages
                embed = huge_pages.adopt(embed)
            self.embed, self._embed_q = embed, None
            self.lm_head = make_linear(embed if tied else lw("lm_head"), fast_path=fast_linear)
        self.norm = w("norm")
        self.layers: list[_Layer] = []
        cuts = column_cuts(config, weights) if tp_invariant and keep_blocks else None

        def row_parallel(name: str, which: str):
            if cuts is None:
                return make_linear(lw(name), fast_path=fast_linear)
            return column_split(lw(name), cuts[which], fast_path=fast_linear)

        for i in range(self.num_layers):
            p = f"layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([w(p + "q_bias"), w(p + "k_bias"), w(p + "v_bias")])
            self.layers.append(_Layer(
                attn_norm=w(p + "attn_norm"),
                qkv=fused_linear([lw(p + "q"), lw(p + "k"), lw(p + "v")], qkv_bias, fast_linear),
                o=row_parallel(p + "o", "o"),
                mlp_norm=w(p + "mlp_norm"),
                gate_up=fused_linear([lw(p + "gate"), lw(p + "up")], fast_path=fast_linear),
                down=row_parallel(p + "down", "down"),
            ))
        self.rope = Rope(config, dtype)
        self.rope.cos = self.rope.cos.to(self.device)
        self.rope.sin = self.rope.sin.to(self.device)
        self.scale = config.head_dim ** -0.5
        if prepare:
            prepare_for_cpu(self)

    def early_exit(self, num_layers: int) -> "LlamaModel":
        """A model made of this one's first `num_layers` layers, final norm and LM head, sharing
        every tensor (no copy): the self-speculative draft when no draft model is given. The one
        way a draft is made from a model (a TensorParallelModel's goes through its shard's): a
        shallow copy, with this model's transformation (if any) bound to the draft."""
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"early-exit depth must be in [1, {self.num_layers}], got {num_layers}")
        # shares every attribute: the tensors, the linears and the fused-layers
        # cache (kernels/cpu_layer.fused_layers tells the draft's entries apart by their layers)
        draft = copy.copy(self)
        draft.layers = self.layers[:num_layers]
        draft.num_layers = num_layers
        if self.prepared is not None:
            CpuForward(draft, self.prepared.env).install()
        return draft

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's fused kernel: one op instead of six
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        # Normalise in float32 (as the reference does for half types), scale in the model dtype:
        # kernels/reference.rms_norm on CPU (the same ops as ever), one fused Triton launch on CUDA
        return ops.rms_norm(x, weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The reference forward -> logits [num_logits, vocab] float32 (float64 for a float64
        model). A prepared model's `forward` is CpuForward.forward (installed on the instance);
        `LlamaModel.forward(model, ...)` is always this one."""
        h = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        cos, sin = self.rope.tables(batch.positions)
        h = self._layers(h, batch, kv_caches, cos, sin, 0, self.num_layers)
        return self.forward_head(batch, h)

    @torch.inference_mode()
    def forward_layers(self, batch: ForwardBatch, kv_caches, h: torch.Tensor | None, start: int,
                       stop: int) -> torch.Tensor:
        """Part of a prefill forward: layers [start, stop) of the torch loop (never the fused
        native layers; its linears call the same kernels), from the embeddings when `h` is None
        (start 0), else from the hidden states [num_tokens, hidden] an earlier call returned. The
        same ops in the same order as `forward`, so a chunk split over several steps gets
        forward's bits; its logits then come from `forward_head`. Each layer writes its K/V as it
        runs."""
        if h is None:
            h = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.tables(batch.positions)
        return self._layers(h, batch, kv_caches, cos, sin, start, stop)

    @torch.inference_mode()
    def forward_head(self, batch: ForwardBatch, h: torch.Tensor) -> torch.Tensor:
        """The logits [num_logits, vocab] of hidden states [num_tokens, hidden] that went
        through every layer. With `keep_hidden` set, `last_hidden` keeps them (every row, before
        the final norm): an EAGLE head drafts from them (speculative/eagle.py)."""
        if self.keep_hidden:
            self.last_hidden = h
        return self._logits(self._rms_norm(h[batch.logits_indices], self.norm))

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] from `last_hidden` -> the features the LM head reads
        (after the final norm), fp32 [n, hidden]."""
        return self._rms_norm(h, self.norm).float()

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
            h = h + layer.down(_silu_mul(gate_up, gate, up))
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [num_logits, hidden] -> logits [num_logits, vocab] float32 (float64 for float64).

        A CPU kernel head is given fp32 activations (it converts them to its own input dtype
        anyway, a few hundred values a row) so its fp32 sums reach the logits unrounded: logits
        rounded to bf16 keep 8 bits of mantissa, and near-equal candidates tie. Measured on the
        AVX2 tier, greedy SmolLM2 on "What is the capital of France?" had 'The' and 'L' tied
        exactly in bf16 (0.08 apart in fp32) and the tie went to the lower id."""
        if h.dtype == torch.bfloat16 and getattr(self.lm_head, "packed", None) is not None:
            h = h.float()
        logits = self.lm_head(h)
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                          stacked: bool = False) -> list[KVLayer]:
        """Per layer a KVLayer; `kv_dtype` None = the model dtype, or torch.int8 (+ fp32 scales).
        stacked: the layers as views of one tensor (runtime/kv_layer.StackedKV, the engine's: its
        verify KV moves are one copy for all layers); an int8 cache is never stacked."""
        cfg = self.config
        kv_dtype = kv_dtype or self.dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        if stacked and kv_dtype != torch.int8:
            return StackedKV(_zeros((self.num_layers, 2, *shape), kv_dtype, self.device))
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
        h = self.embed.index_select(0, ids)  # (a negative id raises, as the block table's lookup)
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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until touched: on CPU zero pages handed out lazily, where
    torch.zeros writes every byte (1.4 s for a 1 GiB KV cache, paid at every start), on huge pages
    where the OS gives them (kernels/huge_pages.py: the attention kernel streams the cache), from
    a cache-line boundary, so no K/V head row of the attention kernel's loads straddles two lines."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_pages.zeros(nbytes).view(dtype).view(shape)


# ---------------------------------------------------------------- the CPU transformation

class CpuForward:
    """What `prepare_for_cpu` installs on a CPU model: its `forward` and `forward_layers`. They
    run the reference's ops, plus the two CPU-only decisions, taken here and nowhere else:

    * threads: the GEMV kernels (every linear, at every row count: runtime/linear.py) and the
      attention kernel run on the kernels' own pool; torch's OpenMP workers would fight it for
      the cores, so every forward, prefill chunks and `forward_layers` included, runs torch's
      own ops (norms, RoPE, residual adds) on one thread. (Prefill chunks once ran a tiled GEMM
      on torch's threads: 1.5-1.6x the TTFT, 2-core Zen 3.) Only a model whose LM head runs
      the GEMV kernels (the library loaded, its format native) sets threads at all. The pool
      has one thread per usable physical core by default (kernels/cpu_threads.py;
      PRESCIENT_GEMV_THREADS overrides): on a host with more cores prefill and decode take
      them all, as torch's GEMM once did for prefill (measured only on 2 cores).
    * the native layers: a forward of 1..MAX_T tokens (decode steps, verify trees, prefill
      chunks) runs every layer and the final norm in kernels/cpu_layer.c (no per-op dispatch;
      for a prefill chunk 1.04-1.27x the torch loop's speed, avx2) when the env allows it
      (RuntimeEnv.fused_layers) and the model can take it (kernels/cpu_layer.fused_layers:
      float32/bfloat16, every linear with a native descriptor, the kernels' own switches);
      otherwise the reference forward. `forward_layers` (a chunk split by layers) likewise.
      Where the embedding and the LM head are native too and no caller keeps the hidden
      states, that native call takes the forward from token ids to logits
      (FusedLayers.logits, pl_forward).

    A bfloat16 model's results are the reference's bit for bit (the same kernels, the same
    roundings between them; the torch loop uses the native layer's SiLU); so are a float32
    one's on the models tested (tests/runtime/test_batch_invariance.py). `env` None: follow the
    environment (runtime.env.runtime_env(), looked up per forward). The model is held weakly:
    it holds this object's methods, and must stay free to go when dropped."""

    def __init__(self, model: LlamaModel, env: RuntimeEnv | None = None):
        self._model = weakref.ref(model)
        self.env = env
        packed = model.lm_head.packed
        self.packed = packed is not None and getattr(packed, "native", True)

    def install(self) -> None:
        model = self._model()
        model.prepared, model.forward, model.forward_layers = self, self.forward, self.forward_layers

    def _prepare(self, model: LlamaModel, batch: ForwardBatch, kv_caches) -> "cpu_layer.FusedLayers | None":
        """The two decisions of the class for one forward: torch's threads, and the native
        layers to run it on (None: the reference's loop)."""
        if self.packed and torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        env = runtime_env() if self.env is None else self.env
        if not (0 < batch.num_tokens <= cpu_layer.MAX_T and env.fused_layers):
            return None
        return cpu_layer.fused_layers(model, kv_caches, env.fused_per_layer)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches) -> torch.Tensor:
        """The model's forward -> logits [num_logits, vocab] (see the class)."""
        model = self._model()
        fused = self._prepare(model, batch, kv_caches)
        if fused is None:
            return LlamaModel.forward(model, batch, kv_caches)
        if not model.keep_hidden:
            # one native call, token ids to logits, where the model's ends allow it: the same
            # bits as the calls below, without their ~40 torch and ctypes calls
            logits = fused.logits(model, batch)
            if logits is not None:
                return logits
        h = model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        cos, sin = model.rope.tables(batch.positions)
        h = fused.forward(h, batch, cos, sin)
        if model.keep_hidden:
            model.last_hidden = h.clone()  # final_norm may work in h's buffer
        return model._logits(fused.final_norm(h, batch.logits_indices, model.norm))

    def forward_layers(self, batch: ForwardBatch, kv_caches, h: torch.Tensor | None, start: int,
                       stop: int) -> torch.Tensor:
        """LlamaModel.forward_layers (a chunk split by layers) on the native layers where
        `forward` would take them, torch on one thread as there: the same bits either way, and
        the same speed as the whole chunk's forward (the time budget prices both alike)."""
        model = self._model()
        fused = self._prepare(model, batch, kv_caches)
        if fused is None:
            return LlamaModel.forward_layers(model, batch, kv_caches, h, start, stop)
        if h is None:
            h = model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        cos, sin = model.rope.tables(batch.positions)
        return fused.forward(h, batch, cos, sin, start, stop)


def prepare_for_cpu(model: LlamaModel, env: RuntimeEnv | None = None) -> LlamaModel:
    """Install the CPU transformation (CpuForward) on `model`, in place, and return it; a model
    on another device is returned as it is (its forward is the reference). env: the switches to
    use; None = the environment's, followed per forward (parsed here once first, so that a
    malformed variable fails at build rather than at the first forward)."""
    if model.device.type != "cpu":
        return model
    if env is None:
        runtime_env()
    CpuForward(model, env).install()
    return model
