"""The native decoder layers (kernels/cpu_layer.c via cpu_layer.FusedLayers) against the torch
layer loop of LlamaModel.forward, on tiny random models.

Each case runs one forward of the prepared model (runtime/model.CpuForward) twice on identical
KV caches, PRESCIENT_FUSED_LAYERS=0 (the torch loop) and on (the native layers), and compares the logits and every layer's KV cache (each
layer's roped k and v: its intermediate state), for float and GGUF-block weights, decode and
verify trees, every ISA tier; greedy generation through Engine.generate must not change.  Both
paths call the same GEMV and attention kernels, so they differ only in the glue between them.

Tolerances.  The glue mirrors torch op by op: each op's output rounded to the model dtype where
torch rounds it, the RMSNorm's fp32 sum of squares in torch's own summation order (cpu_layer.c
torch_row_sum), RoPE's addcmul as torch's fused multiply-add.  bfloat16: bit for bit equal
(asserted), since bf16 x bf16 products are exact in fp32 and the one fp32 function left, SiLU's
exp (torch's vectorised one, good to about an ulp; a correctly rounded one here), moves SiLU's
fp32 result by about an ulp at most, which its bf16 rounding absorbs (1M random inputs: no
difference).  float32: that exp is the only difference, an ulp now and then in the SiLU
outputs, so layer 0's K/V cache (written before its first SiLU) is asserted bit for bit equal,
everything after it within 1e-5 of the tensor's largest magnitude (measured: under 6e-7).
"""

from __future__ import annotations

import pytest
import torch

from prescient.kernels import cpu_layer, cpu_linear
from prescient.kernels.cpu_linear import ISA_TIERS
from prescient.runtime.batch import SeqRows, pack_forward_batch
from prescient.runtime.env import FUSED_LAYERS
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.speculative.tree import DraftTree
from tests.conftest import make_tiny_checkpoint

DTYPES = [torch.float32, torch.bfloat16]
BLOCK = 16


@pytest.fixture(autouse=True)
def _needs_native(monkeypatch):
    if not cpu_layer.available():
        pytest.skip(f"native layers unavailable: {cpu_layer.why_not()}")
    for var in ("PRESCIENT_KERNELS", "PRESCIENT_CPU_ATTENTION", FUSED_LAYERS):
        monkeypatch.delenv(var, raising=False)
    yield
    cpu_linear._set_isa_cap(99)


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    """GQA group 3 as the default model (6 q heads over 2 kv heads, head_dim 32), a
    Qwen2 (q/k/v biases) with head_dim 64, and the conftest tiny Llama (head_dim 16)."""
    root = tmp_path_factory.mktemp("cpu_layer")
    return {
        "llama": make_tiny_checkpoint(
            root / "llama", hidden_size=192, intermediate_size=320, num_attention_heads=6,
            num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=2048, seed=1),
        "qwen2": make_tiny_checkpoint(
            root / "qwen2", "qwen2", hidden_size=256, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=2, seed=2),
        "tiny": make_tiny_checkpoint(root / "tiny", seed=3),
    }


@pytest.fixture(scope="module")
def ckpts(ckpt_dirs):
    return {name: load_checkpoint(str(path)) for name, path in ckpt_dirs.items()}


def _tree(n: int) -> DraftTree:
    """A branching draft tree of n nodes: node i hangs off i - 2, or off i // 2 every third."""
    return DraftTree(list(range(3, 3 + n)), [-1] + [max(0, i - 2) if i % 3 else i // 2 for i in range(1, n)])


def _case(model: LlamaModel, T: int, ctx: int, seed: int, tree: bool):
    """A random KV cache (two copies), and a forward of T new tokens after ctx cached ones."""
    g = torch.Generator().manual_seed(seed)
    nb = (ctx + T) // BLOCK + 3
    kv = model.allocate_kv_cache(nb, BLOCK)
    for k, v in kv:
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    ids = torch.randint(3, model.config.vocab_size, (T,), generator=g).tolist()
    blocks = torch.randperm(nb, generator=g).tolist()  # scattered blocks, as after reuse
    mask, positions = None, list(range(ctx, ctx + T))
    if tree:  # tree nodes take prefix length + depth as their RoPE position
        t = _tree(T)
        mask, positions = t.mask_bits(), [ctx + d for d in t.depth]
    batch = pack_forward_batch([SeqRows(ids, positions, ctx, blocks, mask, list(range(T)))], BLOCK,
                               torch.device("cpu"))
    return kv, [(k.clone(), v.clone()) for k, v in kv], batch


def _run_both(model, kv_torch, kv_fused, batch, monkeypatch):
    monkeypatch.setenv(FUSED_LAYERS, "0")
    ref = model.forward(batch, kv_torch)
    monkeypatch.setenv(FUSED_LAYERS, "1")
    calls = _record_native_calls(monkeypatch)
    out = model.forward(batch, kv_fused)
    assert calls, "the fused path did not run"
    return ref, out


def _record_native_calls(monkeypatch) -> list[int]:
    """The token counts of the native forwards run from now on: FusedLayers.forward (the layers
    alone) or FusedLayers.logits (pl_forward: ids to logits, where it takes the model)."""
    calls: list[int] = []
    fwd, logits = cpu_layer.FusedLayers.forward, cpu_layer.FusedLayers.logits

    def counted_logits(self, model, batch):
        out = logits(self, model, batch)
        if out is not None:
            calls.append(batch.input_ids.shape[0])
        return out

    monkeypatch.setattr(cpu_layer.FusedLayers, "forward", lambda self, h, *a: calls.append(h.shape[0]) or fwd(self, h, *a))
    monkeypatch.setattr(cpu_layer.FusedLayers, "logits", counted_logits)
    return calls


def _assert_match(ref: torch.Tensor, out: torch.Tensor, what: str, exact: bool):
    assert ref.shape == out.shape and ref.dtype == out.dtype, what
    if exact:
        bad = (ref != out).sum().item()
        assert bad == 0, f"{what}: {bad} of {ref.numel()} elements differ (max {(ref - out).abs().max().item():.3g})"
    else:
        scale = ref.abs().max().item() or 1.0
        diff = (ref - out).abs().max().item()
        assert diff <= 1e-5 * scale, f"{what}: max diff {diff:.3g} (scale {scale:.3g})"


def _compare(model, T, ctx, seed, tree, monkeypatch):
    kv_torch, kv_fused, batch = _case(model, T, ctx, seed, tree)
    ref, out = _run_both(model, kv_torch, kv_fused, batch, monkeypatch)
    bf16 = model.dtype == torch.bfloat16
    _assert_match(ref, out, f"logits T={T} ctx={ctx}", bf16)
    for i, ((k1, v1), (k2, v2)) in enumerate(zip(kv_torch, kv_fused)):
        _assert_match(k1, k2, f"layer {i} k cache T={T} ctx={ctx}", bf16 or i == 0)
        _assert_match(v1, v2, f"layer {i} v cache T={T} ctx={ctx}", bf16 or i == 0)


# (T, context before the step, tree mask): decode at several lengths (a split context at 300
# and 1000), verify trees of 8 and 40 nodes, and prefill chunks of 64 and 150 tokens (the
# linears 64 rows a call, then a shorter last call).
CASES = [(1, 0, False), (1, 40, False), (1, 300, False), (1, 1000, False),
         (8, 0, True), (8, 37, True), (8, 300, True), (16, 100, False), (40, 120, True),
         (64, 10, False), (150, 30, False)]


@pytest.mark.parametrize("isa", ISA_TIERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_matches_torch_loop_every_tier(ckpts, isa, dtype, monkeypatch):
    if isa not in cpu_linear.machine_tiers():
        pytest.skip(f"this CPU cannot run {isa}")
    assert cpu_linear._set_isa_cap(isa) == isa
    model = LlamaModel(ckpts["llama"].config, ckpts["llama"].weights, dtype=dtype)
    for i, (T, ctx, tree) in enumerate(CASES):
        _compare(model, T, ctx, 10 * i + len(isa), tree, monkeypatch)


def test_silu_same_bits_every_tier():
    """The SiLU of the native layer (and of the torch loop, which calls it) gives the same bits at
    every ISA tier: the AVX2 and AVX-512 paths fuse the multiply-adds of their double-precision
    exp as gcc contracts the scalar loop (each checked over all 2^32 floats when written), and a
    length that is not a whole number of their 32-float steps goes through the same arithmetic.  Random values
    over exp's whole range and its edges (clamps, overflow, zeros, infinities)."""
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(3 * 1000, generator=g) * 30,
                   torch.tensor([0.0, -0.0, 88.7, 89.5, -88.0, -103.9, -104.5, 1e-30, -1e-30,
                                 float("inf"), -float("inf"), 3.4e38, -3.4e38, 10.0, -10.0])])
    gu = torch.stack([torch.cat([x[i::3], torch.ones_like(x[i::3])]) for i in range(3)])  # [3, 2 I]
    assert gu.shape[1] // 2 % 32 != 0
    outs = {}
    for isa in cpu_linear.machine_tiers():
        assert cpu_linear._set_isa_cap(isa) == isa
        for dt in (torch.float32, torch.bfloat16):
            outs[isa, dt] = cpu_layer.silu_mul(gu.to(dt))
    for (isa, dt), out in outs.items():
        first = outs["portable", dt]
        assert torch.equal(out.view(torch.int32 if dt == torch.float32 else torch.int16),
                           first.view(torch.int32 if dt == torch.float32 else torch.int16)), (isa, dt)
    # and it is SiLU: within an fp32 ulp or two of torch's (whose exp is good to about an ulp)
    ref = torch.nn.functional.silu(gu[:, : gu.shape[1] // 2])
    torch.testing.assert_close(outs["portable", torch.float32], ref, rtol=3e-7, atol=1e-30, equal_nan=True)


def test_bf16_silu_is_the_fp32_silu_rounded_for_every_gate_value():
    """A bf16 gate's SiLU comes from a table of all 65536 bf16 values, built once at whatever tier
    ran first: it must be exactly the fp32 SiLU of the widened gate rounded to bf16, times up,
    rounded again (what the layer computed before, and what the fp32 path gives) at every tier, for
    every bit pattern (zeros, subnormals, infinities, NaNs included), whatever the up value."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every pattern
    g = torch.Generator().manual_seed(9)
    ups = [torch.ones(65536), torch.randn(65536, generator=g) * 3, torch.full((65536,), -0.5)]
    try:
        for isa in cpu_linear.machine_tiers():
            assert cpu_linear._set_isa_cap(isa) == isa
            silu32 = cpu_layer.silu_mul(torch.cat([gate.float(), torch.ones(65536)])[None])[0]  # this tier's
            for up in ups:
                up = up.to(torch.bfloat16)
                got = cpu_layer.silu_mul(torch.cat([gate, up])[None])[0]
                want = (silu32.to(torch.bfloat16).float() * up.float()).to(torch.bfloat16)
                nan = want.isnan()
                assert torch.equal(got.isnan(), nan), isa
                assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), isa
    finally:
        cpu_linear._set_isa_cap(99)


def test_silu_same_bits_in_the_generic_build(generic_so):
    """The build without -march=native (the fallback) compiles the scalar SiLU without fused
    multiply-adds, the AVX2 one with them: still the same bits as the native build, every tier
    (the double-precision exp leaves the fp32 result the same either way)."""
    import ctypes

    lib = ctypes.CDLL(str(generic_so))
    lib.pl_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.pg_set_isa_cap.argtypes = [ctypes.c_int]
    g = torch.Generator().manual_seed(8)
    gu = torch.randn(4, 2 * 999, generator=g) * 20  # [4, 2 I], I not a multiple of 32
    native = cpu_layer.silu_mul(gu)
    for isa in cpu_linear.machine_tiers():
        assert lib.pg_set_isa_cap(ISA_TIERS.index(isa)) == ISA_TIERS.index(isa)
        act = torch.empty(4, 999)
        assert lib.pl_silu_mul(gu.data_ptr(), act.data_ptr(), 4, 999, 0) == 0
        assert torch.equal(act.view(torch.int32), native.view(torch.int32)), isa


@pytest.mark.parametrize("name", ["qwen2", "tiny"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_other_shapes_and_qkv_bias(ckpts, name, dtype, monkeypatch):
    model = LlamaModel(ckpts[name].config, ckpts[name].weights, dtype=dtype)
    if name == "qwen2":
        assert model.layers[0].qkv.bias is not None  # the bias path is exercised
    # 40 rows: past PL_PAR_T (16), the elementwise ops and the bias add split over the pool
    for i, (T, ctx, tree) in enumerate([(1, 50, False), (8, 200, True), (3, 0, False), (40, 30, False)]):
        _compare(model, T, ctx, i, tree, monkeypatch)


@pytest.mark.parametrize("quantize", ["int4", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_format_weights(ckpts, quantize, dtype, monkeypatch):
    """Linears in GGUF blocks (Q4_1, Q8_0: QuantizedLinear, run by pg_linear_w through its
    descriptor): the same kernels in both paths, so the same results."""
    from prescient.runtime.loader import quantize_linears

    ck = ckpts["llama"]
    model = LlamaModel(ck.config, quantize_linears(ck.weights, quantize), dtype=getattr(torch, dtype))
    assert type(model.layers[0].qkv).__name__ == "QuantizedLinear"
    for i, (T, ctx, tree) in enumerate([(1, 100, False), (8, 300, True)]):
        _compare(model, T, ctx, i, tree, monkeypatch)


def _three_sequences(num_blocks: int):
    """A batch of two decoding sequences around a 4-node verify tree, on a cache of num_blocks."""
    rows = [SeqRows([5], [20], 20, [0, 1], None, [0]),
            SeqRows([6, 7, 8, 9], [33, 34, 34, 35], 33, [2, 3, 4], _tree(4).mask_bits(), [0, 1, 2, 3]),
            SeqRows([10], [3], 3, [num_blocks - 1], None, [0])]
    return pack_forward_batch(rows, BLOCK, torch.device("cpu"))


def test_two_sequences_and_skipped_slots(ckpts, monkeypatch):
    """A batch of two decoding sequences and a verify tree, and a slot of -1 (not stored)."""
    model = LlamaModel(ckpts["llama"].config, ckpts["llama"].weights, dtype=torch.bfloat16)
    kv_torch, kv_fused, _ = _case(model, 1, 100, 5, False)  # 9 blocks
    batch = _three_sequences(kv_torch[0][0].shape[0])
    batch.slot_mapping[1] = -1
    ref, out = _run_both(model, kv_torch, kv_fused, batch, monkeypatch)
    _assert_match(ref, out, "logits", True)
    for (k1, v1), (k2, v2) in zip(kv_torch, kv_fused):
        _assert_match(k1, k2, "k cache", True)
        _assert_match(v1, v2, "v cache", True)


def test_per_layer_calls_equal_the_all_layers_call(ckpts):
    model = LlamaModel(ckpts["llama"].config, ckpts["llama"].weights, dtype=torch.bfloat16)
    kv1, kv2, batch = _case(model, 8, 100, 7, True)
    h0 = model.embed_tokens(batch.input_ids)
    cos, sin = model.rope.tables(batch.positions)
    a = cpu_layer.FusedLayers(model, kv1, per_layer=True).forward(h0.clone(), batch, cos, sin)
    b = cpu_layer.FusedLayers(model, kv2, per_layer=False).forward(h0.clone(), batch, cos, sin)
    assert torch.equal(a, b)
    assert all(torch.equal(x1, x2) for p1, p2 in zip(kv1, kv2) for x1, x2 in zip(p1, p2))


def test_hook_conditions(ckpts, monkeypatch):
    """The model takes the fused path only where it applies, and finds it again per KV cache.
    (PRESCIENT_FUSED_LAYERS is the runtime's switch, read by the prepared forward:
    tests/runtime/test_model_reference.py.)"""
    ck = ckpts["llama"]
    model = LlamaModel(ck.config, ck.weights, dtype=torch.float32)
    kv = model.allocate_kv_cache(4, BLOCK)
    fl = cpu_layer.fused_layers(model, kv)
    assert fl is not None and cpu_layer.fused_layers(model, kv) is fl
    other = model.allocate_kv_cache(4, BLOCK)
    assert cpu_layer.fused_layers(model, other) not in (None, fl)
    assert cpu_layer.fused_layers(model, kv) is fl  # both stay cached
    assert cpu_layer.fused_layers(model.early_exit(1), kv) not in (None, fl)  # its own layers
    for var, value in (("PRESCIENT_KERNELS", "reference"), ("PRESCIENT_CPU_ATTENTION", "0")):
        monkeypatch.setenv(var, value)
        assert cpu_layer.fused_layers(model, kv) is None
        monkeypatch.delenv(var)
    unpacked = LlamaModel(ck.config, ck.weights, dtype=torch.float32, fast_linear=False)
    assert cpu_layer.fused_layers(unpacked, unpacked.allocate_kv_cache(4, BLOCK)) is None
    f64 = LlamaModel(ck.config, ck.weights, dtype=torch.float64)
    assert cpu_layer.fused_layers(f64, f64.allocate_kv_cache(4, BLOCK)) is None
    # more than MAX_T tokens (a larger prefill chunk than the scheduler makes): the torch loop;
    # MAX_T lowered here, the real bound (2048) being past this model's positions
    monkeypatch.setattr(cpu_layer, "MAX_T", 40)
    n = cpu_layer.MAX_T + 1
    big_kv = model.allocate_kv_cache(-(-n // BLOCK), BLOCK)
    rows = [SeqRows([3 + i % 20 for i in range(n)], range(n), 0, list(range(-(-n // BLOCK))), None, [n - 1])]
    batch = pack_forward_batch(rows, BLOCK, torch.device("cpu"))
    monkeypatch.setattr(cpu_layer.FusedLayers, "forward", lambda *a: pytest.fail(f"fused path on {n} tokens"))
    monkeypatch.setattr(cpu_layer.FusedLayers, "logits", lambda *a: pytest.fail(f"pl_forward on {n} tokens"))
    model.forward(batch, big_kv)


def _composed(model, fl, batch) -> torch.Tensor:
    """CpuForward's forward as separate calls: the embedding lookup, the RoPE rows, the layers'
    native call, the final norm, the LM head."""
    h = model.embed_tokens(batch.input_ids)
    cos, sin = model.rope.tables(batch.positions)
    h = fl.forward(h, batch, cos, sin)
    return model._logits(fl.final_norm(h, batch.logits_indices, model.norm))


@pytest.fixture(scope="module")
def gguf_model_weights(ckpts, tmp_path_factory):
    """The llama checkpoint as a GGUF of Q4_1 linears and a tied Q8_0 embedding (the default
    model's formats), loaded with its blocks."""
    from tests.runtime.test_native_weights import write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "llama.Q4_1.gguf", ckpts["llama"], tied=True)
    return load_checkpoint(str(path), native=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gguf"])
def test_one_call_forward_is_the_composed_forward(ckpts, gguf_model_weights, name, dtype):
    """pl_forward (FusedLayers.logits: ids to logits in one call) gives the composed calls' bits,
    logits and KV cache: decode, a tree, two sequences at once, a prefill chunk whose logits are
    its last row and one that wants none; float tables and a block-format (Q8_0) embedding
    shared with the LM head; a model that cannot go there says why."""
    ck = gguf_model_weights if name == "gguf" else ckpts[name]
    model = LlamaModel(ck.config, ck.weights, dtype=dtype)
    assert (model._embed_q is not None) == (name == "gguf")
    for i, (T, ctx, tree) in enumerate([(1, 300, False), (8, 37, True), (40, 20, False)]):
        kv1, kv2, batch = _case(model, T, ctx, 20 + i, tree)
        a = cpu_layer.FusedLayers(model, kv1)
        b = cpu_layer.FusedLayers(model, kv2)
        want = _composed(model, b, batch)
        got = a.logits(model, batch)
        assert got is not None, a.ends_why_not
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), (T, ctx)
        assert all(torch.equal(x, y) for p, q in zip(kv1, kv2) for x, y in zip(p, q))
        if T == 40:  # the chunk's last row only, then no row (a chunk before the last)
            for rows in ([T - 1], []):
                batch.logits_indices = torch.tensor(rows, dtype=torch.int64)
                got = a.logits(model, batch)
                assert got.shape == (len(rows), model.config.vocab_size)
                assert torch.equal(got, _composed(model, b, batch))
    kv1, kv2, _ = _case(model, 1, 100, 5, False)
    batch = _three_sequences(kv1[0][0].shape[0])
    assert torch.equal(cpu_layer.FusedLayers(model, kv1).logits(model, batch),
                       _composed(model, cpu_layer.FusedLayers(model, kv2), batch))
    per_layer = cpu_layer.FusedLayers(model, kv1, per_layer=True)
    assert per_layer.logits(model, batch) is None and "per layer" in per_layer.ends_why_not


def test_one_call_forward_only_where_the_model_allows_it(ckpts, monkeypatch):
    """The forward composes its calls around the layers where pl_forward cannot stand for them:
    an LM head whose bias torch adds, an embedding table in another dtype, a tensor-parallel
    shard, and a forward whose caller keeps the hidden states (an EAGLE head's features)."""
    ck = ckpts["llama"]

    def refused(edit) -> str:
        model = LlamaModel(ck.config, ck.weights, dtype=torch.bfloat16)
        edit(model)
        kv, _, batch = _case(model, 1, 10, 0, False)
        fl = cpu_layer.FusedLayers(model, kv)
        assert fl.logits(model, batch) is None
        return fl.ends_why_not

    vocab = ck.config.vocab_size
    assert "bias" in refused(lambda m: setattr(m.lm_head, "bias", torch.ones(vocab, dtype=torch.bfloat16)))
    assert "embedding" in refused(lambda m: setattr(m, "embed", m.embed.float()))
    assert "tensor-parallel" in refused(lambda m: setattr(m, "is_sharded", True))
    model = LlamaModel(ck.config, ck.weights, dtype=torch.bfloat16)
    kv, _, batch = _case(model, 1, 10, 0, False)
    calls = []
    real = cpu_layer.FusedLayers.logits
    monkeypatch.setattr(cpu_layer.FusedLayers, "logits", lambda self, m, b: calls.append(1) or real(self, m, b))
    want = model.forward(batch, kv)
    assert calls == [1]
    model.keep_hidden = True
    try:
        assert torch.equal(model.forward(batch, kv), want) and model.last_hidden is not None
    finally:
        model.keep_hidden, model.last_hidden = False, None
    assert calls == [1]  # the second forward composed its calls (it kept h)


def test_one_call_forward_refuses_ids_outside_its_tables(ckpts):
    """A token id past the vocabulary or a position past the RoPE tables: IndexError, as the
    composed calls raise, and the object keeps working."""
    model = LlamaModel(ckpts["llama"].config, ckpts["llama"].weights, dtype=torch.bfloat16)
    kv, _, batch = _case(model, 1, 10, 0, False)
    fl = cpu_layer.FusedLayers(model, kv)
    good = fl.logits(model, batch)
    for field, bad in (("input_ids", model.config.vocab_size), ("input_ids", -1),
                       ("positions", model.rope.cos.shape[0])):
        value = getattr(batch, field)[0].item()
        getattr(batch, field)[0] = bad
        with pytest.raises(IndexError, match="outside its table"):
            fl.logits(model, batch)
        getattr(batch, field)[0] = value
    assert torch.equal(fl.logits(model, batch), good)
    batch.logits_indices = torch.tensor([1])  # T = 1: row 1 does not exist
    with pytest.raises(ValueError, match="logits row"):
        fl.logits(model, batch)


def test_bad_arguments_raise(ckpts):
    model = LlamaModel(ckpts["llama"].config, ckpts["llama"].weights, dtype=torch.float32)
    kv, _, batch = _case(model, 1, 10, 0, False)
    fl = cpu_layer.FusedLayers(model, kv)
    h = model.embed_tokens(batch.input_ids)
    cos, sin = model.rope.tables(batch.positions)
    with pytest.raises(ValueError, match="h must be"):
        fl.forward(h.to(torch.bfloat16), batch, cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        fl.forward(h, batch, cos[:, :, :8], sin)
    for start, stop in ((1, 1), (-1, 1), (0, fl.num_layers + 1)):
        with pytest.raises(ValueError, match="not within"):
            fl.forward(h, batch, cos, sin, start, stop)
    out = fl.forward(h, batch, cos, sin)
    with pytest.raises(ValueError, match="rows must lie"):
        fl.final_norm(out, torch.tensor([1]), model.norm)  # T = 1: row 1 does not exist
    with pytest.raises(ValueError, match="last forward"):
        fl.final_norm(out.clone(), torch.tensor([0]), model.norm)
    batch.slot_mapping[0] = kv[0][0].shape[0] * BLOCK  # one past the end
    with pytest.raises(RuntimeError, match="past the end"):
        fl.forward(h, batch, cos, sin)
    batch.slot_mapping[0] = 0
    batch.context_lens[0] = 10_000  # more than the block table holds
    with pytest.raises(RuntimeError, match="context_lens"):
        fl.forward(h, batch, cos, sin)
    with pytest.raises(ValueError, match="KV cache"):
        cpu_layer.FusedLayers(model, [(k.to(torch.bfloat16), v) for k, v in kv])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("speculate", ["off", "draft"])
def test_greedy_generation_identical(ckpts, dtype, speculate, monkeypatch):
    """Engine.generate with and without the fused path: the same tokens.  "draft" (the
    early-exit draft of the target) also runs the draft's own steps and T > 1 verify steps."""
    from prescient.build import EngineSpec, LoadedModel, build_engine
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import EngineConfig
    from prescient.runtime.sampling_params import SamplingParams

    ck = ckpts["llama"]
    model = LlamaModel(ck.config, ck.weights, dtype=getattr(torch, dtype))
    sizes = _record_native_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    # repetitive prompts, so that drafts get accepted and the verify steps are long
    prompts = [(torch.randint(3, 97, (n,), generator=g).tolist() * 3)[:40] for n in (7, 11, 5)]
    outs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(FUSED_LAYERS, mode)
        config = EngineConfig(dtype=dtype, cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
        spec = EngineSpec(dtype=dtype, speculate=speculate, calibrate="off", progress=False)
        engine = build_engine(spec, LoadedModel(model, None, (2,), None), config)
        outs[mode] = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
        if mode == "0":
            assert not sizes
    assert outs["0"] == outs["1"]
    assert sum(len(o) for o in outs["1"]) > 30
    assert 1 in sizes
    if speculate == "draft":
        assert max(sizes) > 1, "no verify step ran through the fused path"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_int8_kv_cache(ckpts, dtype, monkeypatch):
    """--kv-dtype int8: the native layer quantizes the new K/V rows and attends over the int8
    cache with the same kernels as the torch loop (ops.store_kv, ops.tree_attention)."""
    model = LlamaModel(ckpts["llama"].config, ckpts["llama"].weights, dtype=dtype)
    for i, (T, ctx, tree) in enumerate([(1, 300, False), (8, 100, True), (40, 20, True)]):
        g = torch.Generator().manual_seed(i)
        nb = (ctx + T) // BLOCK + 3
        kv_torch = model.allocate_kv_cache(nb, BLOCK, torch.int8)
        for layer in kv_torch:
            for c in layer:
                c.copy_(torch.randint(-127, 128, c.shape, generator=g).to(c.dtype) if c.dtype == torch.int8
                        else torch.rand(c.shape, generator=g) * 0.05)
        kv_fused = model.allocate_kv_cache(nb, BLOCK, torch.int8)
        for a, b in zip(kv_fused, kv_torch):
            for x, y in zip(a.tensors(), b.tensors()):
                x.copy_(y)
        _, _, batch = _case(model, T, ctx, i, tree)
        ref, out = _run_both(model, kv_torch, kv_fused, batch, monkeypatch)
        if dtype == torch.bfloat16:
            _assert_match(ref, out, f"int8 KV logits T={T}", True)
        else:  # SiLU's fp32 ulp (module docstring) can move a later layer's row by one int8 step
            assert (ref - out).abs().max() <= 1e-2 * ref.abs().max(), f"int8 KV logits T={T}"
        for j, (a, b) in enumerate(zip(kv_torch, kv_fused)):
            for x, y in zip(a.tensors(), b.tensors()):
                # layer 0's stored rows precede any SiLU, so they agree bit for bit in fp32 too
                if dtype == torch.bfloat16 or j == 0:
                    _assert_match(x.float(), y.float(), f"int8 KV layer {j}", True)
                elif x.dtype == torch.int8:
                    assert (x.int() - y.int()).abs().max() <= 1, f"int8 KV layer {j}: more than one step apart"
                else:
                    _assert_match(x, y, f"int8 KV scales layer {j}", False)
