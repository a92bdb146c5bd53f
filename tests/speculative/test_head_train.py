"""Training an EAGLE head (speculative/head_train.py), phase by phase on a tiny random model:
the target's greedy and seeded sampled outputs, the features of a plain forward over each
sequence (the target's own; packing and chunking change nothing), the draft vocab (the most
frequent output tokens, the stop tokens always in), a head initialised from the target's last
layer, a short training run that lowers the loss, the head file and the data file round trips,
and the whole command on a tiny chat model (chat template included)."""

from __future__ import annotations

import json

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint, quantize_linears
from prescient.runtime.model import LlamaModel
from prescient.speculative import head_train as ht
from prescient.speculative.eagle import fingerprint, lm_head_rows
from prescient.speculative.eagle_head import load_head
from prescient.train_head import main as train_head_main

EOS = 2
PROMPTS = [[1, 5, 9, 33], [1, 40, 41], [1, 7, 7, 7, 12, 60], [1, 88], [1, 3, 14, 15, 92, 65], [1, 27, 18]]
NEW = 12


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float32)


def make_engine(model) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    return Engine(model, None, config, eos_token_ids=(EOS,))


@pytest.fixture(scope="module")
def samples(tiny):
    return ht.generate_outputs(make_engine(tiny), PROMPTS, max_new_tokens=NEW, seed=5, progress=False)


@pytest.fixture(scope="module")
def seqs(tiny, samples):
    return ht.collect_features(tiny, samples, dtype=torch.float32, progress=False)


def test_each_prompt_gets_a_greedy_and_a_sampled_output_that_reruns_the_same(tiny, samples):
    assert [(s.prompt_index, s.kind) for s in samples] == [(i, k) for i in range(len(PROMPTS))
                                                             for k in ("greedy", "sampled")]
    for s in samples:
        assert s.prompt_ids == PROMPTS[s.prompt_index]
        assert 1 <= len(s.output_ids) <= NEW
        assert EOS not in s.output_ids[:-1]  # an output ends at its stop token
    again = ht.generate_outputs(make_engine(tiny), PROMPTS, max_new_tokens=NEW, seed=5, progress=False)
    assert [s.output_ids for s in again] == [s.output_ids for s in samples]
    # the sampled outputs are draws, not the greedy ones again
    assert any(a.output_ids != b.output_ids for a, b in zip(samples[::2], samples[1::2]))


def test_features_are_the_targets_own_and_chunking_changes_nothing(tiny, samples, seqs):
    for s, q in zip(samples, seqs):
        ids = s.prompt_ids + s.output_ids
        assert q.tokens.tolist() == ids and q.prompt_len == len(s.prompt_ids)
        assert q.features.shape == (len(ids), tiny.config.hidden_size)
        # the LM head over a feature gives the target's argmax there
        assert torch.equal(tiny.lm_head(q.features).argmax(-1), q.argmax)
    assert len({len(q.tokens) for q in seqs}) > 1  # (lengths differ: packing is exercised)
    greedy = [(s, q) for s, q in zip(samples, seqs) if s.kind == "greedy"]
    for s, q in greedy:  # a greedy output is the argmax at each position before it
        p = q.prompt_len
        assert q.argmax[p - 1:len(q.tokens) - 1].tolist() == s.output_ids
    # one sequence alone, several packed into one forward, or split over forwards: the same
    lists = [q.tokens.tolist() for q in seqs[:5]]
    alone = ht.sequence_features(tiny, lists[4:])[0]
    for chunk in (3, 1024):
        packed = ht.sequence_features(tiny, lists, chunk=chunk)
        assert [f.shape[0] for f, _ in packed] == [len(ids) for ids in lists]
        torch.testing.assert_close(packed[4][0], alone[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(packed[4][1], alone[1])
    assert tiny.keep_hidden is False and tiny.last_hidden is None  # the model is left as it was


def test_draft_vocab_is_the_most_frequent_outputs_sorted_with_the_stop_tokens():
    outputs = [[5, 5, 5, 9, 9, 30], [9, 30, 5, 44], [61, 62]]  # counts: 5:4, 9:3, 30:2, then 44, 61, 62
    ids = ht.draft_vocab(outputs, 4, vocab_size=97, eos_ids=(2,))
    assert ids.tolist() == [2, 5, 9, 30]  # the stop token displaces the least frequent
    ids = ht.draft_vocab(outputs, 6, vocab_size=97, eos_ids=(2, 96))
    assert ids.tolist() == [2, 5, 9, 30, 44, 96]  # ties (44, 61, 62 once each) go to the lower id
    capped = ht.draft_vocab(outputs, 8192, vocab_size=97, eos_ids=(2,))
    assert capped.tolist() == list(range(97))  # capped at the vocab (unseen ids fill in id order)


def test_draft_vocab_of_generated_outputs(tiny, samples):
    ids = ht.draft_vocab((s.output_ids for s in samples), 40, tiny.config.vocab_size, (EOS,))
    assert len(ids) == 40 and ids.dtype == torch.int64
    assert torch.equal(ids, ids.sort().values) and len(set(ids.tolist())) == 40
    assert EOS in ids.tolist()
    counts = torch.bincount(torch.tensor([t for s in samples for t in s.output_ids]), minlength=97)
    assert int(counts.argmax()) in ids.tolist()


def test_the_head_starts_as_the_targets_last_layer_passing_the_feature_through(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    weights = quantize_linears(ckpt.weights, "int8")  # blocks: QuantizedLinear, ColumnGroups for o/down
    model = LlamaModel(ckpt.config, weights, dtype=torch.float32)
    head = ht.init_head(model, torch.arange(10), "fp")
    last = ckpt.config.num_layers - 1
    deq = {n: weights[f"layers.{last}.{n}"].dequantize(torch.float32)
           for n in ("q", "k", "v", "o", "gate", "up", "down")}
    norm = ckpt.weights[f"layers.{last}.attn_norm"].float()
    for n in ("q", "k", "v"):  # the layer's input norm folded into the columns it scaled
        torch.testing.assert_close(getattr(head, n).weight, deq[n] * norm[None, :])
    for n in ("o", "gate", "up", "down"):
        torch.testing.assert_close(getattr(head, n).weight, deq[n])
    torch.testing.assert_close(head.mlp_norm.data, ckpt.weights[f"layers.{last}.mlp_norm"].float())
    h = ckpt.config.hidden_size
    assert torch.equal(head.fc.weight[:, h:], torch.eye(h))  # x_t = f_t (+ a small embedding term)
    assert head.fc.weight[:, :h].abs().max() < 0.2


def test_draft_lm_head_rows_are_the_targets(tiny, tiny_llama_dir):
    ids = torch.tensor([2, 7, 50])
    torch.testing.assert_close(lm_head_rows(tiny, ids), tiny.lm_head.weight[ids].float())
    # a tied LM head held in blocks (the default model's): the embedding's rows, dequantized
    from prescient.kernels.quant_reference import quantize
    from prescient.runtime.linear import QuantizedLinear, QuantWeight

    ckpt = load_checkpoint(str(tiny_llama_dir))
    embed = ckpt.weights["embed"].float().contiguous()
    blocks = torch.as_tensor(quantize(embed, "q8_0")).reshape(embed.shape[0], -1).contiguous()
    weights = {k: v for k, v in ckpt.weights.items() if k != "lm_head"}
    weights["embed"] = q = QuantWeight(blocks, "q8_0", tuple(embed.shape))
    model = LlamaModel(ckpt.config, weights, dtype=torch.float32)
    assert isinstance(model.lm_head, QuantizedLinear)
    torch.testing.assert_close(lm_head_rows(model, ids), q.dequantize(torch.float32)[ids])


def test_a_short_training_run_lowers_the_loss_and_the_head_file_round_trips(tiny, seqs, tmp_path):
    train, held = ht.split_holdout(seqs, 0.2, seed=0)
    assert held and train and not {s.prompt_index for s in held} & {s.prompt_index for s in train}
    ids = ht.draft_vocab((s.tokens[s.prompt_len:].tolist() for s in seqs), 48, tiny.config.vocab_size, (EOS,))
    embed, w_d = ht.embedder(tiny), lm_head_rows(tiny, ids)
    head = ht.init_head(tiny, ids, fingerprint(tiny))
    before = ht.evaluate(head, w_d, train, embed)
    history = ht.train_head(head, w_d, train, held, embed, epochs=6, lr=3e-3, batch_tokens=64, progress=False)
    after = ht.evaluate(head, w_d, train, embed)
    assert len(history) == 6 and history[-1]["steps"] > 6
    assert after["loss"] < 0.8 * before["loss"]
    assert 0 <= history[-1]["held_acc1"] <= history[-1]["held_in_vocab"] <= 1
    assert before["positions"] == sum(len(s.tokens) - s.prompt_len for s in train)  # the output rows

    path = tmp_path / "head.safetensors"
    head.save(str(path), {"held_acc1": history[-1]["held_acc1"]})
    loaded, meta = load_head(str(path), tiny.config)
    assert meta == {"held_acc1": history[-1]["held_acc1"]}
    assert torch.equal(loaded.draft_ids, ids) and loaded.cfg == head.cfg
    batch = ht.make_batch(held, embed)
    with torch.no_grad():
        want = head.forward_train(batch.embeds, batch.feats, batch.positions)
        got = loaded.forward_train(batch.embeds, batch.feats, batch.positions)
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.05)


def test_a_time_limit_stops_training_after_the_epoch_it_falls_in(tiny, seqs):
    ids = torch.arange(tiny.config.vocab_size)
    head = ht.init_head(tiny, ids, "fp")
    history = ht.train_head(head, lm_head_rows(tiny, ids), seqs, [], ht.embedder(tiny), epochs=50,
                            minutes=0.0, progress=False)
    assert len(history) == 1 and history[0]["steps"] == 0


def test_the_data_file_round_trips_and_knows_its_target(seqs, tmp_path):
    path = tmp_path / "data.pt"
    ht.save_data(path, seqs, "llama:97x64x2:abc", {"max_new_tokens": NEW})
    back, meta = ht.load_data(path, "llama:97x64x2:abc")
    assert meta == {"max_new_tokens": NEW}
    for a, b in zip(seqs, back):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)
        assert torch.equal(a.argmax, b.argmax)
        assert (a.prompt_len, a.prompt_index, a.kind) == (b.prompt_len, b.prompt_index, b.kind)
    with pytest.raises(ValueError, match="another target|this target"):
        ht.load_data(path, "llama:97x64x2:other")


def test_the_bundled_prompt_set_is_varied_chat():
    chats = ht.load_prompts()
    assert 350 <= len(chats) <= 500
    assert ht.PROMPTS.stat().st_size < 120_000
    assert all(c and c[-1]["role"] == "user" and c[-1]["content"].strip() for c in chats)
    assert all(m["role"] in ("system", "user", "assistant") for c in chats for m in c)
    assert sum(c[0]["role"] == "system" for c in chats) >= 20
    assert sum(any(m["role"] == "assistant" for m in c) for c in chats) >= 10  # follow-ups
    assert len({c[-1]["content"] for c in chats}) == len(chats)  # no repeats
    assert ht.load_prompts(limit=20) == chats[:20]
    json.dumps(chats)


def test_fitting_the_branch_scale_never_starts_worse_than_the_copied_layer(tiny, seqs):
    ids = torch.arange(tiny.config.vocab_size)
    embed, w_d = ht.embedder(tiny), lm_head_rows(tiny, ids)
    head = ht.init_head(tiny, ids, "fp")
    copied = ht.evaluate(head, w_d, seqs, embed)["loss"]
    o = head.o.weight.clone()
    scale = ht.fit_branch_scale(head, w_d, seqs, embed)
    assert scale in ht.BRANCH_SCALES
    torch.testing.assert_close(head.o.weight, o * scale)
    assert ht.evaluate(head, w_d, seqs, embed)["loss"] <= copied


def test_the_command_end_to_end_on_a_tiny_chat_model(tmp_path):
    """Prompts through the chat template, generation, features, training, the head file; then a
    rerun from the saved data, its head where the runtime looks for this target's, measured
    beside n-gram into the verdict `--speculate auto` reads."""
    from tests.conftest import make_tiny_checkpoint
    from tests.latency_bench.conftest import make_tiny_tokenizer

    from prescient.speculative.eagle_head import default_head_path
    from prescient.speculative.head_verdict import PAYS_RATIO, file_sha256, read_verdict, verdict_path

    path = tmp_path / "model"
    tok = make_tiny_tokenizer(path)
    make_tiny_checkpoint(path, vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"))
    config = load_checkpoint(str(path)).config
    out, data = tmp_path / "head.safetensors", tmp_path / "data.pt"
    common = ["--model", str(path), "--dtype", "float32", "--draft-vocab", "64", "--batch-tokens", "256"]
    assert train_head_main(common + ["--limit", "4", "--samples", "1", "--max-new-tokens", "6", "--epochs", "1", "--out", str(out),
                             "--save-data", str(data)]) == 0
    head, meta = load_head(str(out), config)
    assert head.cfg.draft_vocab == 64 and head.cfg.hidden_size == config.hidden_size
    assert (meta["prompts"], meta["sequences"], meta["epochs"]) == (4, 8, 1)
    assert meta["data"]["max_new_tokens"] == 6 and meta["command"].startswith("prescient train-head")
    assert 0 <= meta["held_acc1"] <= 1 and meta["date"]

    assert not verdict_path(str(out)).exists()  # --out elsewhere: not measured (auto would not look there)

    assert train_head_main(common + ["--load-data", str(data), "--epochs", "2", "--verdict-workloads", "2"]) == 0
    target = head.cfg.target
    again, meta = load_head(str(default_head_path(target)), config)
    assert again.cfg.target == target and (meta["sequences"], meta["epochs"]) == (8, 2)
    assert meta["data"]["max_new_tokens"] == 6  # what the data was made with, not this run's default
    # then measured beside n-gram where the runtime looks: both lossless, so the outputs agree
    verdict = read_verdict(str(default_head_path(target)))
    assert verdict["workloads"] == 2 and verdict["identical_outputs"] == 2
    assert verdict["head_sha256"] == file_sha256(str(default_head_path(target)))
    assert verdict["pays"] == (verdict["eagle_over_ngram"] >= PAYS_RATIO) and verdict["ngram_tok_s"] > 0


def test_the_learning_rate_warms_up_then_decays_to_zero_when_the_run_ends():
    assert [ht.cosine_lr(s, 0.0, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert ht.cosine_lr(10, 0.0, 4) == 1.0
    assert ht.cosine_lr(10, 0.5, 4) == pytest.approx(0.5)
    assert ht.cosine_lr(10, 1.0, 4) == pytest.approx(0.0) and ht.cosine_lr(10, 3.0, 4) == pytest.approx(0.0)
