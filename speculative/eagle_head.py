"""The EAGLE draft head: one decoder layer that predicts the target's next feature.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
drafts from the target's own last hidden state (after its final norm: the vector its LM head
reads, "the feature") rather than from tokens alone:

    x_t       = fc([embed(token_{t+1}), f_t])        # [2 * hidden] -> [hidden]
    f^_{t+1}  = decoder_layer(x_t | x_<=t)            # causal attention over the head's own K/V
    logits    = lm_head[draft_ids] @ f^_{t+1}         # the target's LM head rows of the draft vocab

f_t is the target's at committed positions and the head's own prediction below them in a draft
tree. The draft vocabulary is the target's most frequent output tokens (EAGLE-3's reduced vocab):
its LM head rows are the target's, so a head file holds only fc, the layer and the id list.

`EagleHead` is the torch module (training: `forward_train`, causal over whole sequences; the
reference for inference); `HeadRunner` is the same arithmetic for drafting, its matrices on the
native small-M kernels (runtime/linear.make_linear) and its K/V in the caller's tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from prescient.kernels.cpu_head import HeadStep
from prescient.runtime.config import ModelConfig
from prescient.runtime.linear import make_linear
from prescient.runtime.rope import Rope

FORMAT = "prescient-eagle-head/1"


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape; attention and RoPE follow the target's (its features, its positions)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    draft_vocab: int  # rows of the draft LM head (len(draft_ids))
    target: str  # the target's fingerprint (target_fingerprint): a head only fits its target

    @classmethod
    def for_target(cls, cfg: ModelConfig, fingerprint: str, draft_vocab: int,
                   intermediate_size: int | None = None) -> "HeadConfig":
        return cls(cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.num_heads,
                   cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, draft_vocab, fingerprint)


def target_fingerprint(cfg: ModelConfig, embed_row: torch.Tensor) -> str:
    """Which target a head was trained on: its shape and a hash of one embedding row rounded to
    bf16 (the weights, not the file's name). One checkpoint gives one fingerprint whatever
    --weights and --dtype hold it in (a bf16 row, or an fp32 one rounded to bf16, has the same
    bits); another checkpoint of the model (an fp32 original beside its Q8_0 GGUF) has other
    embedding values, so it needs its own head, trained on it."""
    shape = f"{cfg.architecture}:{cfg.vocab_size}x{cfg.hidden_size}x{cfg.num_layers}"
    row = embed_row.detach().float().cpu().to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return shape + ":" + hashlib.sha256(row).hexdigest()[:16]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


class EagleHead(torch.nn.Module):
    def __init__(self, cfg: HeadConfig, rope_config: ModelConfig, draft_ids: torch.Tensor):
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.cfg = cfg
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.q = torch.nn.Linear(h, q, bias=False)
        self.k = torch.nn.Linear(h, kv, bias=False)
        self.v = torch.nn.Linear(h, kv, bias=False)
        self.o = torch.nn.Linear(q, h, bias=False)
        self.mlp_norm = torch.nn.Parameter(torch.ones(h))
        self.gate = torch.nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = torch.nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = torch.nn.Linear(cfg.intermediate_size, h, bias=False)
        self.register_buffer("draft_ids", draft_ids.to(torch.int64).clone())  # [draft_vocab]
        self.rope = Rope(rope_config, torch.float32)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [..., T, hidden] -> q [..., T, heads, d], k/v [..., T, kv_heads, d], RoPE applied."""
        c = self.cfg
        cos, sin = self.rope.tables(positions)  # [T, 1, d]
        q = self.q(x).unflatten(-1, (c.num_heads, c.head_dim))
        k = self.k(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        return Rope.apply(q, cos, sin), Rope.apply(k, cos, sin), self.v(x).unflatten(-1, (c.num_kv_heads, c.head_dim))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        x = _rms(h, self.mlp_norm, self.cfg.rms_norm_eps)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))

    def forward_train(self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds: [B, T, hidden] (token t+1's), feats: [B, T, hidden] (f_t) -> f^ [B, T, hidden],
        row t the prediction of f_{t+1}; causal attention within each sequence."""
        c = self.cfg
        x = self.fc(torch.cat([embeds, feats], dim=-1))
        q, k, v = self._qkv(x, positions)  # [B, T, heads, d]
        rep = c.num_heads // c.num_kv_heads
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                             v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True)
        h = x + self.o(att.transpose(1, 2).flatten(-2))
        return self._mlp(h)

    def save(self, path: str, meta: dict | None = None) -> None:
        """Weights (bf16), the draft ids and the config in one safetensors file."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()
                   if k != "draft_ids"}
        tensors["draft_ids"] = self.draft_ids.to(torch.int32).contiguous()
        info = {"format": FORMAT, "config": json.dumps(asdict(self.cfg)), "meta": json.dumps(meta or {})}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        save_file(tensors, tmp, metadata=info)
        os.replace(tmp, path)


def load_head(path: str, rope_config: ModelConfig) -> tuple[EagleHead, dict]:
    """-> (the head in fp32, its meta); ValueError for a file that is not a head."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        info = f.metadata() or {}
        if info.get("format") != FORMAT:
            raise ValueError(f"{path} is not a prescient EAGLE head (format {info.get('format')!r})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = HeadConfig(**json.loads(info["config"]))
    head = EagleHead(cfg, rope_config, tensors.pop("draft_ids"))
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if k != "draft_ids"]  # loaded apart (int32 in the file)
    if missing or unexpected:
        raise ValueError(f"{path}: the head's tensors do not match its config (missing {missing}, "
                         f"unexpected {unexpected})")
    return head.eval(), json.loads(info.get("meta", "{}"))


class HeadRunner:
    """Drafting with a head: `EagleHead`'s arithmetic on the native kernels, for a few rows at a
    time attending to K/V the caller keeps (the committed context's rows, then a draft tree's).

    lm_head: the draft LM head, a linear [hidden] -> [draft_vocab] (the target's rows of
    `head.draft_ids`, in the target's own format: speculative/eagle.draft_lm_head), or a float
    matrix [draft_vocab, hidden] of them. weights: how the head's matrices are held; q8_0 (the
    default) reads a quarter of fp32's bytes per draft depth, which on a CPU is what a depth
    costs; activations are fp32 throughout."""

    def __init__(self, head: EagleHead, lm_head, weights: str | torch.dtype = "q8_0", native: bool = True):
        from prescient.kernels.quant_reference import quantize
        from prescient.runtime.linear import QuantWeight

        self.cfg = head.cfg
        sd = {k: v.detach() for k, v in head.state_dict().items()}

        def lin(*names):
            w = torch.cat([sd[n + ".weight"] for n in names]).float().contiguous()  # [out, in]
            if isinstance(weights, str) and w.shape[1] % 32 == 0:  # blocks of 32 along a row
                return make_linear(QuantWeight(torch.as_tensor(quantize(w, weights)), weights, tuple(w.shape)))
            return make_linear(w.to(weights if isinstance(weights, torch.dtype) else torch.bfloat16))

        self.fc, self.qkv, self.o = lin("fc"), lin("q", "k", "v"), lin("o")
        self.gate_up, self.down = lin("gate", "up"), lin("down")
        self.mlp_norm = sd["mlp_norm"].float()
        self.lm_head = make_linear(lm_head.float().contiguous()) if isinstance(lm_head, torch.Tensor) else lm_head
        self.draft_ids = head.draft_ids  # [draft_vocab] int64: draft row -> target token id
        self.rope = head.rope
        c = self.cfg
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        # step_at in one native call where the kernels allow (None: the torch ops)
        self.native = HeadStep.build(self) if native else None

    @torch.inference_mode()
    def step(self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
             past_k: torch.Tensor, past_v: torch.Tensor, attend: torch.Tensor,
             logits_rows: list[int] | None = None):
        """Rows of the head: embeds, feats [n, hidden] (token t+1's embedding, f_t), positions [n]
        (t, the RoPE position); past_k/past_v [P, kv_heads * d] the K/V rows they may attend to
        (RoPE applied), attend [n, P + n] bool (the rows' own K/V last); logits_rows: the rows
        whose draft logits are wanted (None: all; the draft LM head is the costly matrix).
        -> (f^ [n, hidden] fp32, k [n, kv], v [n, kv], draft logits [len(logits_rows), V] fp32)."""
        c = self.cfg
        x = self.fc(torch.cat([embeds, feats], dim=-1).float())  # [n, hidden]
        qkv = self.qkv(x)
        n = x.shape[0]
        cos, sin = self.rope.tables(positions)
        q = Rope.apply(qkv[:, :self.q_size].reshape(n, c.num_heads, c.head_dim), cos, sin)
        k = Rope.apply(qkv[:, self.q_size:self.q_size + self.kv_size].reshape(n, c.num_kv_heads, c.head_dim),
                       cos, sin).reshape(n, self.kv_size)
        v = qkv[:, self.q_size + self.kv_size:]
        keys = torch.cat([past_k, k]).view(-1, c.num_kv_heads, c.head_dim)  # [P + n, kvh, d]
        vals = torch.cat([past_v, v]).view(-1, c.num_kv_heads, c.head_dim)
        rep = c.num_heads // c.num_kv_heads
        qh = q.view(n, c.num_kv_heads, rep, c.head_dim)  # query heads grouped by their kv head
        scores = torch.einsum("ngrd,pgd->ngrp", qh, keys) * self.scale
        scores = scores.masked_fill(~attend[:, None, None, :], float("-inf"))
        att = torch.einsum("ngrp,pgd->ngrd", scores.softmax(-1), vals).reshape(n, self.q_size)
        h = x + self.o(att)
        xm = F.rms_norm(h, self.mlp_norm.shape, self.mlp_norm, c.rms_norm_eps)
        gate, up = self.gate_up(xm).chunk(2, dim=-1)
        h = h + self.down((F.silu(gate) * up).contiguous())  # [n, hidden]
        return h, k, v, self.lm_head(h if logits_rows is None else h[logits_rows].contiguous())

    def step_at(self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                k_buf: torch.Tensor, v_buf: torch.Tensor, start: int, free: int, attend: torch.Tensor | None,
                logits_rows: list[int] | None = None):
        """`step`'s arithmetic over K/V rows kept in place: the n new rows' K/V are written to
        positions start..start+n-1 of k_buf [kv, cap] (K transposed: a position a column, so the
        native scores need no horizontal sums) and v_buf [cap, kv] (fp32, contiguous); row i attends
        to rows 0..free-1 (all of them: the committed context) and, of rows free..start+n-1, those
        attend[i] marks (attend [n, start + n - free] bool; None: causal over the new rows, all
        earlier ones). On a CPU with the native layers one C call (kernels/cpu_head.py) with no
        copy of the earlier rows, since a draft depth's cost there is per-op dispatch, not
        arithmetic; else `step` over copies of them. -> (f^ [n, hidden], draft logits [len(rows), V])."""
        if self.native is not None:
            return self.native(embeds, feats, positions, k_buf, v_buf, start, free, attend, logits_rows)
        n = embeds.shape[0]
        full = torch.ones(n, start + n, dtype=torch.bool)  # the committed rows all seen
        if attend is None:
            full[:, start:] = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            full[:, free:] = attend
        h, k, v, logits = self.step(embeds, feats, positions, k_buf[:, :start].T, v_buf[:start], full, logits_rows)
        k_buf[:, start:start + n], v_buf[start:start + n] = k.T, v
        return h, logits


def default_head_path(fingerprint: str):
    """Where a target's trained head is kept (and looked for): the cache folder's heads/."""
    from prescient.cache_dir import cache_dir

    return cache_dir("heads") / (fingerprint.replace(":", "_") + ".safetensors")
