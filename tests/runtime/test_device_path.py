"""The device path (runtime/step_path.DeviceStepPath) run on the CPU: what a GPU step does, checked
without one.

- the plan: one forward per step on the device plan, whatever mixes in it; the CPU plan as it was;
- the staging buffer: a ForwardBatch packed through one upload equals pack_forward_batch's;
- the counter RNG: uniforms strictly inside (0, 1), a function of (seed, position) alone;
- device-side sampling: greedy equals the CPU path's tokens, seeded sampling reproduces, and
  speculation with no drafts emits what plain decoding does;
- the sync count: a greedy, a sampled and a verify step each read the device at most once.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from prescient.runtime import forward_plan
from prescient.runtime.batch import SeqRows, pack_forward_batch
from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.counter_rng import NOISE, counter_exponential, counter_uniform, row_key
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.linear import BATCH_INVARIANT_M
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.staging import StagingBuffer, pack_staged
from prescient.runtime.step_path import CpuStepPath, DeviceStepPath, step_path_for
from prescient.runtime.sync_count import count_syncs
from prescient.speculative.tree import DraftTree

VOCAB = 97


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


def make_engine(model, path: str, speculator=None, budget: int = 64) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget), step_path=path)
    return Engine(model, None, config, eos_token_ids=(2,), speculator=speculator)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def _seq(rows: int, samples: bool = True):
    return SimpleNamespace(num_new_tokens=rows, samples=samples)


def test_the_path_is_chosen_by_device_and_can_be_forced():
    assert isinstance(step_path_for("cpu"), CpuStepPath)
    assert isinstance(step_path_for("cuda"), DeviceStepPath)  # (built without touching a GPU)
    assert isinstance(step_path_for("cpu", "device"), DeviceStepPath)
    with pytest.raises(ValueError):
        step_path_for("cpu", "fast")
    with pytest.raises(ValueError):
        EngineConfig(step_path="gpu")


def test_a_cuda_plan_is_one_forward_per_step_and_the_cpu_plan_is_unchanged():
    tree17 = DraftTree(list(range(17)), [-1] + list(range(16)))
    seqs = [_seq(1), _seq(1), _seq(300, False), _seq(1), _seq(BATCH_INVARIANT_M), _seq(30), _seq(65)]
    trees = [None, tree17, None, None, None, None, None]
    cuda = step_path_for("cuda")
    assert cuda.plan(seqs, trees) == [list(range(len(seqs)))]  # prefill chunks and decodes together
    assert cuda.plan([_seq(1)] * 32, [None] * 32) == [list(range(32))]  # 32 agents, one forward
    # the CPU keeps its batch-invariant plan: each prefill chunk alone, small ones packed
    assert step_path_for("cpu").plan(seqs, trees) == [[2], [6], [0, 1, 3], [4], [5]]
    assert cuda.layer_split is False  # a chunk split by layers would be a second forward


def _forwards_per_step(model, path: str, monkeypatch) -> list[int]:
    """Forwards each step of an engine runs while long prompts arrive beside running decodes."""
    calls = []
    original = model.forward
    monkeypatch.setattr(model, "forward", lambda batch, kv: calls.append(batch.num_seqs) or original(batch, kv))
    engine = make_engine(model, path, budget=256)
    rng = random.Random(6)
    long_prompts = [[rng.randrange(3, VOCAB) for _ in range(100)] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p in prompts(6, 3):
        engine.add_request(p, params)
    per_step, arrivals = [], list(long_prompts)
    while engine.has_unfinished_requests():
        before = len(calls)
        engine.step()
        per_step.append(len(calls) - before)
        if arrivals:  # a prompt of 100 tokens (a prefill chunk above BATCH_INVARIANT_M) each step
            engine.add_request(arrivals.pop(), params)
    monkeypatch.undo()
    return per_step


def test_a_device_engine_runs_one_forward_per_step(tiny, monkeypatch):
    device = _forwards_per_step(tiny, "device", monkeypatch)
    assert max(device) == 1
    # the same steps on the CPU path: each prefill chunk in a forward of its own
    assert max(_forwards_per_step(tiny, "cpu", monkeypatch)) > 1


def test_staged_batch_equals_pack_forward_batch():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 0, 1])
    rows = [SeqRows([3, 4, 5], range(10, 13), 10, [4, 2], None, [2]),
            SeqRows(tree.tokens, [20 + d for d in tree.depth], 20, [1, 7, 9], tree.mask_bits(), range(4)),
            SeqRows([9], [0], 0, [3], None, [0])]
    staging = StagingBuffer("cpu", slots=2, min_elems=8)  # small: a buffer has to grow
    for _ in range(3):  # the ring of buffers gives the same batch each time
        want, got = pack_forward_batch(rows, 8, torch.device("cpu")), pack_staged(rows, 8, staging)
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "cu_seqlens_q",
                     "mask_bits", "logits_indices"):
            a, b = getattr(want, name), getattr(got, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert staging.num_uploads == 3  # one copy per forward


def test_staged_views_survive_the_next_upload():
    staging = StagingBuffer("cpu", slots=1)
    (first,) = staging.upload([[1, 2, 3]])
    staging.upload([[7, 7, 7]])
    assert first.tolist() == [1, 2, 3]  # a CPU "device" copy is a clone, never the host buffer


def test_counter_rng_is_a_function_of_seed_and_position():
    keys = torch.tensor([row_key(s, o, NOISE) for s, o in [(1, 0), (1, 1), (2, 0), (1, 0)]])
    u = counter_uniform(keys, 50_000)  # [4, 50000]
    assert (u > 0).all() and (u < 1).all()
    assert torch.equal(u[0], u[3])  # same coordinates, same draws
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # histogram of one row: no bin far from its share
    counts = torch.histc(u[1], bins=20, min=0, max=1)
    assert (counts - 2500).abs().max() < 250
    e = counter_exponential(keys, 50_000)
    assert (e > 0).all() and abs(e.mean().item() - 1) < 0.02
    assert row_key(-1, 5, NOISE) == row_key((1 << 64) - 1, 5, NOISE)  # signed seeds map one to one


def test_device_path_greedy_equals_cpu_path(tiny):
    ps = prompts(0, 6)
    params = SamplingParams(temperature=0, max_tokens=12)
    assert make_engine(tiny, "device").generate(ps, params) == make_engine(tiny, "cpu").generate(ps, params)


def test_device_sampling_reproduces_per_seed_and_alone_equals_batched(tiny):
    ps = prompts(1, 5)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10)
    a = make_engine(tiny, "device").generate(ps, seeded)
    b = make_engine(tiny, "device").generate(ps, seeded)
    assert a == b
    alone = make_engine(tiny, "device").generate([ps[2]], seeded)[0]
    assert alone == a[2]  # noise keyed by (seed, position): the batch does not change a request's draws
    other = make_engine(tiny, "device").generate(ps, SamplingParams(temperature=0.9, top_p=0.95, seed=12,
                                                                    max_tokens=10))
    assert other != a


def test_device_sampling_follows_the_target_distribution():
    path = DeviceStepPath("cpu")
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits / 0.7, -1)[0]
    params = SamplingParams(temperature=0.7, seed=0)
    counts = torch.zeros(4)
    for seed in range(4000):
        request = SimpleNamespace(params=params, rng_seed=seed, output_token_ids=[])
        counts[path.sample([request], logits.clone())[0]] += 1
    assert (counts / 4000 - p).abs().sum() / 2 < 0.03  # TVD


def test_speculation_without_drafts_emits_what_plain_decoding_does(tiny):
    from prescient.speculative.adaptive import AdaptiveConfig
    from prescient.speculative.speculator import make_speculator

    ps = prompts(2, 4)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10)
    plain = make_engine(tiny, "device").generate(ps, params)
    spec = make_speculator(tiny, 8, "ngram", adaptive_config=AdaptiveConfig(), calibrate="off")
    spec.proposer.propose = lambda contexts: [None] * len(contexts)  # every tree a 1-node tree
    assert make_engine(tiny, "device", spec).generate(ps, params) == plain


def test_device_penalties_equal_the_host_ones():
    from prescient.runtime.penalties import penalize_rows

    path = DeviceStepPath("cpu")
    tree = DraftTree([4, 9, 9, 5, 4], [-1, 0, 0, 1, 3])
    params = SamplingParams(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={3: 2.5, 9: -1.0})
    request = SimpleNamespace(params=params, output_token_ids=[4, 4, 7, 9])
    for t in (None, tree):
        logits = torch.randn(1 if t is None else t.num_nodes, VOCAB, generator=torch.Generator().manual_seed(1))
        host, device = logits.clone(), logits.clone()
        penalize_rows(host, request, t)
        penalize_rows(device, request, t, path.upload)
        assert not torch.equal(host, logits) and torch.equal(device, host)


def _syncs_per_step(engine) -> list[list]:
    seen = []
    while engine.has_unfinished_requests():
        with count_syncs() as log:
            engine.step()
        seen.append(list(log.syncs))
    return seen


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_sync_count_of_a_device_step_is_at_most_one(tiny, sampling):
    engine = make_engine(tiny, "device")
    if sampling == "greedy":
        params = [SamplingParams(temperature=0.0, max_tokens=8)] * 8
    else:  # greedy and sampled rows in one batch, three distinct sampling params, seeded or not
        params = [SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(temperature=0.8, seed=3, max_tokens=8),
                  SamplingParams(temperature=1.1, top_k=20, max_tokens=8),
                  SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, max_tokens=8, frequency_penalty=0.5,
                                 presence_penalty=0.3, logit_bias={5: 1.5})] * 2
    for p, sp in zip(prompts(3, 8), params):
        engine.add_request(p, sp)
    steps = _syncs_per_step(engine)
    assert len(steps) >= 8
    assert all(len(s) <= 1 for s in steps), [s for s in steps if len(s) > 1]
    assert sum(len(s) == 1 for s in steps) >= 8  # each sampling step reads its tokens: the one sync


def _oracle_engine(model, truth):
    from tests.speculative.test_engine_speculation import OracleProposer
    from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
    from prescient.speculative.speculator import Speculator

    # prior 1.0 and a flat cost: a tree every step (a wrong branch, then the truth with a wrong tail)
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, prior_acceptance=1.0,
                                                  verify_cost={1: 1.0, 64: 1.0}))
    return make_engine(model, "device", Speculator(OracleProposer(truth), 8, adaptive))


def test_device_verification_is_lossless_in_greedy_decoding(tiny):
    ps = prompts(4, 4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = make_engine(tiny, "device").generate(ps, params)
    engine = _oracle_engine(tiny, {tuple(p): o for p, o in zip(ps, plain)})
    assert engine.generate(ps, params) == plain
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_sync_count_of_a_verify_step_is_at_most_one(tiny):
    ps = prompts(5, 4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = make_engine(tiny, "device").generate(ps, greedy)
    engine = _oracle_engine(tiny, {tuple(p): o for p, o in zip(ps, plain)})
    for i, p in enumerate(ps):  # greedy and sampled requests verified in the same steps
        engine.add_request(p, greedy if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=12,
                                                                   ignore_eos=True))
    steps = _syncs_per_step(engine)
    assert engine.speculator.stats.num_draft_tokens > 0  # the steps verified real trees
    assert all(len(s) <= 1 for s in steps), [s for s in steps if len(s) > 1]


def test_the_cpu_path_would_fail_the_sync_count(tiny):
    """The counter sees what the issue counted: the CPU path's per-forward copies (its batch's
    fields, two blocking copies) and per-row reads (a sampled row's draws)."""
    engine = make_engine(tiny, "cpu")
    for i, p in enumerate(prompts(3, 4)):
        engine.add_request(p, SamplingParams(temperature=0.8, seed=i, max_tokens=3))
    steps = _syncs_per_step(engine)
    assert max(len(s) for s in steps) > 4
    assert all(sum(where.startswith("runtime/batch.py") for _, where in s) == 2 for s in steps)


def test_bucketed_padding_leaves_the_real_rows_and_the_kv_as_they_are(tiny):
    """What a CUDA graph replays (runtime/cuda_graphs.py), run eagerly on the CPU: a decode and a
    verify step padded to their buckets give the unpadded logits, and the padding writes no KV."""
    from prescient.runtime.cuda_graphs import Bucket, batch_from_flat, bucket_for, flat_size, pack_bucketed

    block, max_blocks = 8, 16
    g = torch.Generator().manual_seed(0)

    def kv():
        caches = tiny.allocate_kv_cache(64, block)
        for k, v in caches:
            k.copy_(torch.randn(k.shape, generator=g, dtype=torch.float64))
            v.copy_(torch.randn(v.shape, generator=g, dtype=torch.float64))
        return caches

    tree = DraftTree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3])
    decode = [SeqRows([11], [20], 20, [1, 2, 3], None, [0]), SeqRows([12], [9], 9, [4, 5], None, [0]),
              SeqRows([13], [3], 3, [6], None, [0])]
    verify = [decode[0], SeqRows(tree.tokens, [30 + d for d in tree.depth], 30, [7, 8, 9, 10, 11], tree.mask_bits(),
                                 range(5))]
    assert bucket_for(3, 3, 0) == Bucket(4, 4, 0)
    assert bucket_for(2, 6, 1) == Bucket(4, 16, 2)  # one sequence more: the dummy holding the pad
    for rows, b in ((decode, bucket_for(3, 3, 0)), (verify, bucket_for(2, 6, 1))):
        base = kv()
        padded_kv = [type(layer)(layer[0].clone(), layer[1].clone()) for layer in base]
        want = LlamaModel.forward(tiny, pack_forward_batch(rows, block, torch.device("cpu")), base)
        parts, num_logits = pack_bucketed(rows, block, b, max_blocks)
        flat = torch.zeros(flat_size(b, max_blocks), dtype=torch.int64)
        StagingBuffer("cpu").upload_into(parts, flat)
        got = LlamaModel.forward(tiny, batch_from_flat(flat, b, max_blocks), padded_kv)
        assert num_logits == want.shape[0] and got.shape[0] == b.tokens
        # (float64: a GEMM of more rows may round a row differently, by far less than this)
        torch.testing.assert_close(got[:num_logits], want, rtol=0, atol=1e-9)
        for a, c in zip(base, padded_kv):  # the same KV written, nothing else (pad slots are -1)
            torch.testing.assert_close(c[0], a[0], rtol=0, atol=1e-9)
            torch.testing.assert_close(c[1], a[1], rtol=0, atol=1e-9)


def test_cuda_graphs_refuse_a_cpu_engine(tiny):
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=64), step_path="device", cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA"):
        Engine(tiny, None, config, eos_token_ids=(2,))


def test_stacked_kv_moves_every_layer_in_one_copy_as_kv_copy_does(tiny):
    from prescient.kernels import reference

    stacked = tiny.allocate_kv_cache(8, 4, stacked=True)
    assert [layer[0].data_ptr() for layer in stacked] == [stacked.stack[i, 0].data_ptr() for i in range(len(stacked))]
    stacked.stack.copy_(torch.randn(stacked.stack.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    per_layer = [(k.clone(), v.clone()) for k, v in stacked]
    src, dst = torch.tensor([5, 9, 12]), torch.tensor([4, 5, 6])  # overlapping: slot 5 is read and written
    stacked.copy_slots(src, dst)
    for (k, v), (k_ref, v_ref) in zip(stacked, per_layer):
        reference.kv_copy(k_ref, v_ref, src, dst)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
