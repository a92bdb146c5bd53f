"""Batch invariance: a decode or verify row gets the same bits whatever shares its forward.

Speculation is lossless in greedy decoding only if a k-token verify forward computes each row
exactly as a one-token decode step would, and a request gives the same text alone as in a
batch only if its rows do not depend on the other rows. Checked here bit for bit, on every ISA
tier this CPU runs:
- the linears (float weights and GGUF blocks): rows of an M-row call equal one-row calls, for M
  up to BATCH_INVARIANT_M (runtime/linear.py runs them through the GEMV kernels, MAX_M rows a call);
- the forward plan (runtime/forward_plan.py): decode/verify-sized sequences never share a forward
  with a prefill chunk, and their logits come back in order;
- a tiny model: a chain draft tree's rows equal the decode steps they stand for, and a decode row
  equals itself beside other decodes or a verify tree, in fp32 and bf16, float and block weights;
- a prompt's rows (logits and KV) whole in one prefill-sized forward, as a prefix then a short
  tail on the native layers (a prefix-cache hit), or decoded token by token: the same bits, in
  fp32 and bf16, float and Q4_1 weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from prescient.kernels import cpu_layer, cpu_linear
from prescient.kernels.cpu_linear import ISA_TIERS
from prescient.runtime import forward_plan
from prescient.runtime.batch import SeqRows, pack_forward_batch
from prescient.runtime.config import SchedulerConfig
from prescient.runtime.linear import BATCH_INVARIANT_M, QuantWeight, make_linear
from prescient.runtime.loader import load_checkpoint, quantize_linears
from prescient.runtime.model import LlamaModel
from prescient.speculative.tree import DraftTree
from tests.conftest import make_tiny_checkpoint

BLOCK = 16
CPU = torch.device("cpu")


@pytest.fixture
def tier(request):
    isa = request.param
    if isa not in cpu_linear.machine_tiers():
        pytest.skip(f"this CPU cannot run {isa}")
    assert cpu_linear._set_isa_cap(isa) == isa
    yield isa
    cpu_linear._set_isa_cap(99)


def test_bounds_agree():
    """The fused layers take a default prefill chunk whole (512 tokens and a joined tail of up to
    64), so no chunk falls back to the torch loop."""
    assert cpu_layer.MAX_T >= SchedulerConfig().prefill_chunk + BATCH_INVARIANT_M


def _weights(kind: str, n: int, k: int, g: torch.Generator):
    w = torch.randn(n, k, generator=g)
    if kind in ("f32", "bf16"):
        return w.to(torch.float32 if kind == "f32" else torch.bfloat16)
    from prescient.kernels.quant_reference import quantize
    from prescient.kernels.quant_reference_k import quantize_k

    blocks = (quantize_k if kind.endswith("_k") else quantize)(w, kind)
    return QuantWeight(torch.as_tensor(blocks).reshape(n, -1), kind, (n, k))


@pytest.mark.parametrize("tier", ISA_TIERS, indirect=True)
@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0", "q4_1", "q4_k", "q6_k"])
# K in 32-element blocks: 8 (one full group of the AVX2 int8 kernel, half an AVX-512 one), 13
# (AVX2: a full group and a padded one of 5), 19 (AVX-512: a full group of 16, then pairs)
@pytest.mark.parametrize("k", [256, 416, 608])
def test_linear_rows_do_not_depend_on_the_batch(tier, kind, k):
    if kind.endswith("_k"):
        k = {256: 256, 416: 512, 608: 768}[k]  # k-quants: whole 256-element super-blocks
    g = torch.Generator().manual_seed(len(kind) + len(tier) + k)
    lin = make_linear(_weights(kind, 200, k, g))
    for xdt in (torch.float32, torch.bfloat16):
        x = torch.randn(150, k, generator=g).to(xdt)  # [M, K]
        alone = torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])
        # past BATCH_INVARIANT_M (prefill chunks): MAX_M rows a call, and a shorter last call
        for m in (2, 7, 16, 17, 40, BATCH_INVARIANT_M, BATCH_INVARIANT_M + 1, 129, 150):
            got = lin(x[:m])
            assert torch.equal(got, alone[:m]), f"{kind} {xdt} M={m}: {(got != alone[:m]).sum()} elements differ"
        # a row's place in the call does not matter either
        assert torch.equal(lin(x[5:30]), alone[5:30])


@pytest.mark.parametrize("tier", ISA_TIERS, indirect=True)
@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0", "q4_1", "q4_k"])
def test_output_rows_do_not_depend_on_their_tile(tier, kind):
    """An output feature gets the same bits in a full 4-row tile as among the leftover rows of
    an N that is no multiple of 4 (the kernels' one-row tail path), so no thread split or shard
    boundary moves a result."""
    g = torch.Generator().manual_seed(len(kind))
    w = _weights("f32", 203, 256, g)  # [N, K], N % 4 == 3
    rolled = torch.roll(w, 3, dims=0)  # the last 3 rows (the tail) now lead, inside a full tile
    if kind != "f32":
        w, rolled = w.to(torch.bfloat16), rolled.to(torch.bfloat16)
    if kind not in ("f32", "bf16"):
        from prescient.kernels.quant_reference import quantize
        from prescient.kernels.quant_reference_k import quantize_k

        q = quantize_k if kind.endswith("_k") else quantize
        w, rolled = (QuantWeight(torch.as_tensor(q(t.float(), kind)).reshape(203, -1), kind, (203, 256))
                     for t in (w, rolled))
    x = torch.randn(5, 256, generator=g)  # [M, K]
    a, b = make_linear(w)(x), make_linear(rolled)(x)
    assert torch.equal(torch.roll(a, 3, dims=1), b), f"{kind}: {(torch.roll(a, 3, dims=1) != b).sum()} differ"


def _seq(rows: int, samples: bool = True):
    return SimpleNamespace(num_new_tokens=rows, samples=samples)


def test_plan_keeps_decode_and_verify_rows_off_the_prefill_forward():
    tree17 = DraftTree(list(range(17)), [-1] + list(range(16)))
    seqs = [_seq(1), _seq(1), _seq(300, False), _seq(1), _seq(BATCH_INVARIANT_M), _seq(30), _seq(65)]
    trees = [None, tree17, None, None, None, None, None]
    groups = forward_plan.plan(seqs, trees)
    assert groups[:2] == [[2], [6]]  # each prefill chunk alone: its GEMM's rows its own length
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))
    for g in groups[2:]:
        assert g == sorted(g)
        assert sum(forward_plan.seq_rows(seqs[i], trees[i]) for i in g) <= BATCH_INVARIANT_M
    assert groups[2:] == [[0, 1, 3], [4], [5]]
    # the common step (decodes only) stays one forward
    assert forward_plan.plan([_seq(1)] * 8, [None] * 8) == [list(range(8))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """GQA group 3 as the default model (6 q heads over 2 kv heads)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("inv") / "llama", hidden_size=192,
                                intermediate_size=320, num_attention_heads=6, num_key_value_heads=2,
                                num_hidden_layers=2, max_position_embeddings=4096, seed=7)
    return load_checkpoint(str(path))


def _kv(model, num_blocks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = model.allocate_kv_cache(num_blocks, BLOCK)
    for k, v in kv:
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    return kv


def _forward(model, kv, rows: list[SeqRows]) -> torch.Tensor:
    return model.forward(pack_forward_batch(rows, BLOCK, CPU), kv)


@pytest.mark.parametrize("tier", ISA_TIERS, indirect=True)
@pytest.mark.parametrize("weights", ["float", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_verify_rows_equal_decode_steps_and_batches(tiny, tier, weights, dtype):
    w = tiny.weights if weights == "float" else quantize_linears(tiny.weights, "int4")
    model = LlamaModel(tiny.config, w, dtype=dtype)
    for ctx in (20, 700):  # a context the attention splits, and one it does not
        blocks_a = list(range(ctx // BLOCK + 2))  # sequence A
        base = len(blocks_a)
        tokens = [11, 12, 13, 14, 15, 16]
        # plain decoding: one token a forward, each after the last one's KV
        kv = _kv(model, base + 40, ctx)
        steps = [_forward(model, kv, [SeqRows([t], [ctx + j], ctx + j, blocks_a, None, [0])])[0]
                 for j, t in enumerate(tokens)]
        # the same tokens as a chain draft tree, verified in one forward
        kv = _kv(model, base + 40, ctx)
        chain = DraftTree(tokens, [-1] + list(range(len(tokens) - 1)))
        tree_logits = _forward(model, kv, [SeqRows(tokens, [ctx + d for d in chain.depth], ctx, blocks_a,
                                                   chain.mask_bits(), range(len(tokens)))])
        for j in range(len(tokens)):
            assert torch.equal(tree_logits[j], steps[j]), f"{tier} {weights} {dtype} ctx={ctx}: node {j}"
        # A's first decode beside two other decodes and a 17-node verify tree of other sequences
        kv = _kv(model, base + 40, ctx)
        t17 = DraftTree(list(range(20, 37)), [-1] + [max(0, i - 2) for i in range(1, 17)])
        others = [SeqRows([7], [5], 5, [base], None, [0]),
                  SeqRows(t17.tokens, [30 + d for d in t17.depth], 30, [base + 1, base + 2, base + 3],
                          t17.mask_bits(), range(17)),
                  SeqRows([8], [50], 50, [base + 4, base + 5, base + 6, base + 7], None, [0])]
        batched = _forward(model, kv, others[:2] + [SeqRows([tokens[0]], [ctx], ctx, blocks_a, None, [0])]
                           + others[2:])
        assert torch.equal(batched[18], steps[0]), f"{tier} {weights} {dtype} ctx={ctx}: decode in a batch"


@pytest.mark.parametrize("tier", ISA_TIERS, indirect=True)
@pytest.mark.parametrize("weights", ["float", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_prompt_gets_the_same_bits_whole_in_pieces_or_decoded(tiny, tier, weights, dtype):
    """A prompt's rows do not depend on how it was computed: one prefill-sized forward, a prefix
    then a short tail (a prefix-cache hit), token by token (a session's KV, written by decode
    steps), or split by layers (as the scheduler runs a chunk over several steps). Same logits,
    same KV."""
    w = tiny.weights if weights == "float" else quantize_linears(tiny.weights, "int4")
    model = LlamaModel(tiny.config, w, dtype=dtype)
    n = BATCH_INVARIANT_M + 36
    ids = torch.randint(3, tiny.config.vocab_size, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks = list(range(n // BLOCK + 1))

    def run(cuts: list[int]):
        kv = model.allocate_kv_cache(len(blocks), BLOCK)
        logits = [_forward(model, kv, [SeqRows(ids[a:b], range(a, b), a, blocks, None, range(b - a))])
                  for a, b in zip(cuts, cuts[1:])]
        return torch.cat(logits), kv

    whole, kv_whole = run([0, n])
    for cuts in ([0, n - 20, n], [0, 30, n], list(range(n + 1))):
        got, kv = run(cuts)
        where = f"{tier} {weights} {dtype} cuts {cuts[:4]}"
        assert torch.equal(got, whole), f"{where}: {(got != whole).any(dim=1).sum()} rows differ"
        for (k, v), (k0, v0) in zip(kv, kv_whole):
            assert torch.equal(k, k0) and torch.equal(v, v0), f"{where}: KV differs"
    kv = model.allocate_kv_cache(len(blocks), BLOCK)
    batch = pack_forward_batch([SeqRows(ids, range(n), 0, blocks, None, range(n))], BLOCK, CPU)
    h = model.forward_layers(batch, kv, None, 0, 1)
    h = model.forward_layers(batch, kv, h, 1, model.num_layers)
    split = model.forward_head(batch, h)
    assert torch.equal(split, whole), f"{tier} {weights} {dtype} by layers: {(split != whole).any(dim=1).sum()} rows differ"
