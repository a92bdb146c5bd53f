"""Tensor parallelism as a transformation over the model (as gpt-fast applies it): which rows and
columns of each weight a rank holds, and the layers that join the ranks' partial results.

    plan  = plan_shards(config, weights, world)      # refuses a TP size it cannot serve, saying why
    local = shard_model(config, weights, plan[rank], group, dtype=...)   # a LlamaModel of one shard

Attention is split by KV-head group (a KV head and the query heads that read it), unevenly when
the count does not divide (the default model's 3 groups: 2 on rank 0, 1 on rank 1); the MLP's
intermediate dimension at the weights' block boundaries. Q/K/V and gate/up are column-parallel
(output rows), O and down row-parallel (input columns) followed by an all-reduce; the LM head is
vocab-parallel (rows of the vocabulary, gathered to rank 0, the only rank that reads logits);
the embedding is replicated (each rank embeds the step's tokens itself). The shard is an ordinary
`LlamaModel` over a config with the local head and intermediate counts, so its forward runs
unchanged: the all-reduce and the gather live in the wrapped linears, not in the model.
A wrapped linear has no native descriptor (`packed` None), so TP steps run the torch per-op
layer loop, never kernels/cpu_layer.c's one-call layers (the all-reduce sits between halves).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prescient.runtime.config import ModelConfig
from prescient.runtime.linear import QuantWeight


class TensorParallelError(RuntimeError):
    """A rank that died or stopped answering, or a startup that failed."""


class TensorParallelRefusal(TensorParallelError, ValueError):
    """A TP size this model (or machine) cannot be served with; the message says why."""


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds: half-open ranges over KV heads, the intermediate dim and the vocab."""

    rank: int
    world: int
    kv_heads: tuple[int, int]
    group: int  # query heads per KV head (GQA), the same on every rank
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_chunk: int  # every rank's logits are padded to this many columns for the gather

    @property
    def q_heads(self) -> tuple[int, int]:
        return self.kv_heads[0] * self.group, self.kv_heads[1] * self.group

    def local_config(self, config: ModelConfig) -> ModelConfig:
        return dataclasses.replace(
            config, num_heads=(self.kv_heads[1] - self.kv_heads[0]) * self.group,
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            tie_word_embeddings=False)  # the LM head is this rank's vocab rows, not the embedding


def _split(units: int, world: int) -> list[tuple[int, int]]:
    """[0, units) in `world` consecutive parts, the first ones one larger when it does not divide."""
    base, extra = divmod(units, world)
    bounds, start = [], 0
    for r in range(world):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _column_unit(w) -> int:
    """The granularity a weight's input columns can be cut at: 1 for floats, a block for blocks
    (the native kernel's activation groups never straddle a cut either: they are at most a block)."""
    if not isinstance(w, QuantWeight):
        return 1
    from prescient.kernels.quant_reference import QTYPES

    return QTYPES[w.qtype][1]


def plan_shards(config: ModelConfig, weights: dict, world: int) -> list[ShardPlan]:
    """One ShardPlan per rank, or TensorParallelError naming why `world` ranks cannot hold it."""
    if world < 1:
        raise TensorParallelRefusal(f"--tp must be >= 1, got {world}")
    kv = config.num_kv_heads
    if kv < world:
        raise TensorParallelRefusal(
            f"--tp {world}: the model has {kv} KV head{'s' * (kv != 1)}; attention is split by KV-head "
            f"group, so at most --tp {kv} (each rank needs at least one group)")
    group = config.num_heads // kv
    head_cols = config.head_dim * group  # o's input columns per KV group
    unit = max(_column_unit(weights[f"layers.{i}.down"]) for i in range(config.num_layers))
    if config.intermediate_size % unit:
        raise TensorParallelRefusal(f"--tp {world}: intermediate size {config.intermediate_size} is not a "
                                  f"multiple of the down projection's block ({unit})")
    inter_units = config.intermediate_size // unit
    if inter_units < world:
        raise TensorParallelRefusal(f"--tp {world}: the MLP has {inter_units} blocks of {unit} columns, fewer "
                                  "than the ranks")
    kv_bounds = _split(kv, world)
    o_unit = max(_column_unit(weights[f"layers.{i}.o"]) for i in range(config.num_layers))
    for k0, _ in kv_bounds:
        if (k0 * head_cols) % o_unit:
            fmt = weights["layers.0.o"].qtype
            raise TensorParallelRefusal(
                f"--tp {world}: the attention output projection is {fmt} (blocks of {o_unit} input columns) "
                f"and a rank's heads would start at column {k0 * head_cols}, inside a block; run with "
                "--weights float32 or --weights bfloat16 (dequantized at load) to shard this model")
    chunk = -(-config.vocab_size // world)
    plans = []
    for r, ((k0, k1), (i0, i1)) in enumerate(zip(kv_bounds, _split(inter_units, world))):
        v0, v1 = min(r * chunk, config.vocab_size), min((r + 1) * chunk, config.vocab_size)
        plans.append(ShardPlan(r, world, (k0, k1), group, (i0 * unit, i1 * unit), (v0, v1), chunk))
    return plans


def column_cuts(config: ModelConfig, weights: dict) -> dict[str, list[int]] | None:
    """The input-column groups of the row-parallel linears at a TP=2 split: {"o": [0, c_o],
    "down": [0, c_down]}, which a TP=1 model sums as two fp32 partials (runtime/linear.ColumnGroups)
    so that its output is TP=2's bit for bit. None when TP=2 cannot split this model (one KV
    head, a block format whose cut falls inside a block): there is nothing to be invariant to."""
    try:
        plans = plan_shards(config, weights, 2)
    except TensorParallelRefusal:
        return None
    second = plans[1]
    return {"o": [0, second.q_heads[0] * config.head_dim], "down": [0, second.intermediate[0]]}


def _rows(w, ranges: list[tuple[int, int]]):
    """The rows [a, b) of each range, concatenated (blocks: whole rows of blocks)."""
    if isinstance(w, QuantWeight):
        blocks = torch.cat([w.blocks[a:b] for a, b in ranges]) if len(ranges) > 1 else w.blocks[ranges[0][0]:ranges[0][1]]
        return QuantWeight(blocks, w.qtype, (sum(b - a for a, b in ranges), w.shape[1]))
    return torch.cat([w[a:b] for a, b in ranges]) if len(ranges) > 1 else w[ranges[0][0]:ranges[0][1]]


def _cols(w, a: int, b: int):
    """The input columns [a, b) (blocks: cut at block boundaries, plan_shards checked them)."""
    if isinstance(w, QuantWeight):
        from prescient.kernels.quant_reference import QTYPES

        _, elems, nbytes = QTYPES[w.qtype]
        blocks = w.blocks[:, a // elems * nbytes:b // elems * nbytes].contiguous()
        return QuantWeight(blocks, w.qtype, (w.shape[0], b - a))
    return w[:, a:b].contiguous()


def shard_weights(config: ModelConfig, weights: dict, plan: ShardPlan) -> tuple[ModelConfig, dict]:
    """(the local config, this rank's weights under the canonical names, runtime/loader.py)."""
    d = config.head_dim
    (h0, h1), (k0, k1), (i0, i1) = plan.q_heads, plan.kv_heads, plan.intermediate
    out = {"embed": weights["embed"], "norm": weights["norm"]}
    head = weights["embed"] if config.tie_word_embeddings or "lm_head" not in weights else weights["lm_head"]
    out["lm_head"] = _rows(head, [plan.vocab])
    for i in range(config.num_layers):
        p = f"layers.{i}."
        out[p + "attn_norm"], out[p + "mlp_norm"] = weights[p + "attn_norm"], weights[p + "mlp_norm"]
        out[p + "q"] = _rows(weights[p + "q"], [(h0 * d, h1 * d)])
        out[p + "k"] = _rows(weights[p + "k"], [(k0 * d, k1 * d)])
        out[p + "v"] = _rows(weights[p + "v"], [(k0 * d, k1 * d)])
        if config.attention_bias:
            out[p + "q_bias"] = weights[p + "q_bias"][h0 * d:h1 * d]
            out[p + "k_bias"] = weights[p + "k_bias"][k0 * d:k1 * d]
            out[p + "v_bias"] = weights[p + "v_bias"][k0 * d:k1 * d]
        out[p + "o"] = _cols(weights[p + "o"], h0 * d, h1 * d)
        out[p + "gate"] = _rows(weights[p + "gate"], [(i0, i1)])
        out[p + "up"] = _rows(weights[p + "up"], [(i0, i1)])
        out[p + "down"] = _cols(weights[p + "down"], i0, i1)
    return plan.local_config(config), out


class RowParallel:
    """A linear over this rank's input columns whose partial outputs are summed over the ranks."""

    def __init__(self, inner, group):
        self.inner, self.group = inner, group
        self.packed = None  # no native descriptor: the fused C layer cannot place the all-reduce

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, local in_features] -> [num_tokens, out_features], summed over ranks.
        A half-type x is multiplied as fp32 (an exact widening) so each rank's partial sum stays
        fp32 and the total is rounded once, as the unsharded layer rounds it: two bf16-rounded
        halves added would be off by a bf16 ulp of the result, enough to flip near-tied tokens."""
        if x.dtype in (torch.bfloat16, torch.float16) and dist.get_backend(self.group) == "gloo":
            y = self.inner(x.float()).contiguous()
            dist.all_reduce(y, group=self.group)
            return y.to(x.dtype)
        y = self.inner(x).contiguous()
        dist.all_reduce(y, group=self.group)
        return y

    def __getattr__(self, name):  # weight_bytes, formats, parts, weight, ...: the shard's own
        return getattr(self.inner, name)


class VocabParallelHead:
    """The LM head over this rank's vocab rows; rank 0 gathers every rank's logits (the others
    get their own slice back, which nothing reads)."""

    def __init__(self, inner, plan: ShardPlan, vocab_size: int, group):
        self.inner, self.plan, self.vocab_size, self.group = inner, plan, vocab_size, group
        self.packed = inner.packed  # the CPU thread policy reads it (runtime/model.CpuForward)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [num_logits, hidden] -> rank 0: [num_logits, vocab]; others: [num_logits, local vocab]."""
        local = self.inner(h)
        if h.shape[0] == 0:  # every rank sees the same batch, so all skip the gather together
            return local.new_empty((0, self.vocab_size))
        pad = self.plan.vocab_chunk - local.shape[1]
        if pad:
            local = torch.nn.functional.pad(local, (0, pad))
        local = local.contiguous()
        if self.plan.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return local
        parts = [torch.empty_like(local) for _ in range(self.plan.world)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1)[:, :self.vocab_size]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def shard_model(config: ModelConfig, weights: dict, plan: ShardPlan, group, **model_kwargs):
    """This rank's LlamaModel: the sharded weights, O/down wrapped with the all-reduce and the
    LM head with the gather, then prepared for the CPU (runtime/model.prepare_for_cpu: its thread
    policy; the wrapped linears keep it off the native layers). model_kwargs: LlamaModel's
    (dtype, device, weights_dtype, ...)."""
    from prescient.runtime.model import LlamaModel, prepare_for_cpu

    local_config, local_weights = shard_weights(config, weights, plan)
    # one column group per rank: the all-reduce adds the groups (tp_invariant is TP=1's side)
    model = LlamaModel(local_config, local_weights, **model_kwargs, prepare=False, tp_invariant=False)
    for layer in model.layers:
        layer.o, layer.down = RowParallel(layer.o, group), RowParallel(layer.down, group)
    model.lm_head = VocabParallelHead(model.lm_head, plan, config.vocab_size, group)
    model.is_sharded = True
    return prepare_for_cpu(model)


def describe_plan(config: ModelConfig, plans: list[ShardPlan]) -> str:
    """"rank 0: KV heads 0-1 (6 query heads), MLP 0-767; rank 1: ..." for the startup line."""
    parts = []
    for p in plans:
        k0, k1 = p.kv_heads
        parts.append(f"rank {p.rank}: KV heads {k0}-{k1 - 1} ({(k1 - k0) * p.group} query heads), "
                     f"MLP {p.intermediate[0]}-{p.intermediate[1] - 1}, vocab {p.vocab[0]}-{p.vocab[1] - 1}")
    return "; ".join(parts)


def default_threads(world: int) -> int:
    """Threads per rank: the usable physical cores (kernels/cpu_threads.usable_cores) shared
    out (two ranks on 2 cores: one each)."""
    from prescient.kernels.cpu_threads import usable_cores

    return max(1, usable_cores() // world)


__all__ = ["ShardPlan", "TensorParallelError", "TensorParallelRefusal", "plan_shards", "column_cuts", "shard_weights", "shard_model", "RowParallel",
           "VocabParallelHead", "describe_plan", "default_threads"]
