"""Presence/frequency penalty arithmetic (OpenAI's formula over generated tokens), per draft-tree
node, and parameter validation."""

from __future__ import annotations

import pytest
import torch

from prescient.runtime.penalties import apply_penalties
from prescient.runtime.request import Request
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.scheduler import ScheduledSeq
from prescient.speculative.tree import DraftTree


def seq_with(output_ids, **penalties):
    request = Request("r", [9, 9, 9], SamplingParams(**penalties), (), 0.0)
    request.output_token_ids = list(output_ids)
    request.num_computed_tokens = request.num_tokens - 1  # decoding: the last token is new
    seq = ScheduledSeq(request, 1, 0)
    assert seq.samples
    return seq


def test_plain_row_follows_openai_formula():
    logits = torch.zeros(1, 8)
    apply_penalties(logits, [seq_with([1, 1, 3], presence_penalty=0.5, frequency_penalty=0.25)], [None])
    # token 1 twice: 0.5 + 2 * 0.25; token 3 once: 0.5 + 0.25; the prompt's 9s do not count
    assert logits[0].tolist() == [0, -1.0, 0, -0.75, 0, 0, 0, 0]


def test_tree_rows_count_their_own_path():
    # root 5 -> a: 2 -> b: 2 ; root -> c: 4
    tree = DraftTree([5, 2, 2, 4], [-1, 0, 1, 0])
    logits = torch.zeros(4, 6)
    apply_penalties(logits, [seq_with([4], frequency_penalty=1.0)], [tree])
    expected = torch.zeros(4, 6)
    expected[:, 4] -= 1  # the output's 4, seen by every node
    expected[1, 2] -= 1  # node a: its own 2
    expected[2, 2] -= 2  # node b: a's 2 and its own
    expected[3, 4] -= 1  # node c: its own 4 on top of the output's
    assert torch.equal(logits, expected)


def test_requests_without_penalties_are_untouched_and_rows_stay_aligned():
    logits = torch.zeros(3, 4)
    tree = DraftTree([0, 1], [-1, 0])
    apply_penalties(logits, [seq_with([1]), seq_with([2], presence_penalty=1.0)], [tree, None])
    assert logits[:2].abs().sum() == 0
    assert logits[2].tolist() == [0, 0, -1.0, 0]


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("presence_penalty", "1")])
def test_out_of_range_penalty_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_is_added_to_every_row_of_a_tree():
    logits = torch.zeros(3, 8, dtype=torch.float64)
    tree = DraftTree([1, 4, 5], [-1, 0, 1])
    apply_penalties(logits, [seq_with([], logit_bias={3: -100.0, 6: 2.5})], [tree])
    assert (logits[:, 3] == -100).all() and (logits[:, 6] == 2.5).all()
    assert logits[:, [0, 1, 2, 4, 5, 7]].eq(0).all()


@pytest.mark.parametrize("bad,match", [({99999999: 1.0}, "outside the vocabulary"), ({-5: 1.0}, "token ids >= 0"),
                                       ({3: 1e9}, r"\[-100, 100\]"), ({3: float("nan")}, r"\[-100, 100\]")])
def test_bad_logit_bias_is_refused_by_name(tiny_llama_dir, bad, match):
    from prescient.runtime.engine import Engine
    from prescient.runtime.loader import load_checkpoint
    from prescient.runtime.model import LlamaModel

    ckpt = load_checkpoint(str(tiny_llama_dir))
    engine = Engine(LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64), None, eos_token_ids=(2,))
    with pytest.raises(ValueError, match=match):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, logit_bias=bad))
    assert not engine.requests


def test_a_banned_token_never_appears_and_speculation_stays_exact(tiny_llama_dir):
    """Greedy decoding with the token it would pick most banned (-100): it never appears, and
    n-gram speculation (drafts verified against the biased rows) gives plain decoding's output."""
    from prescient.runtime.config import SchedulerConfig
    from prescient.runtime.engine import Engine, EngineConfig
    from prescient.runtime.loader import load_checkpoint
    from prescient.runtime.model import LlamaModel
    from prescient.speculative.speculator import make_speculator

    ckpt = load_checkpoint(str(tiny_llama_dir))
    model = LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]

    def run(bias, speculate: bool):
        spec = make_speculator(model, 16, "ngram", calibrate="off") if speculate else None
        engine = Engine(model, None, EngineConfig(scheduler=SchedulerConfig()), eos_token_ids=(2,), speculator=spec)
        return engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                        logit_bias=bias))[0]

    plain = run({}, False)
    top = max(set(plain), key=plain.count)
    banned = run({top: -100.0}, False)
    assert top not in banned
    assert run({top: -100.0}, True) == banned
