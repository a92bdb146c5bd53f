"""A tiny model the benchmark can run end to end in seconds: random Llama weights plus a small
byte-level BPE tokenizer (trained here on the workloads' own text) with SmolLM2's chat template,
saved together as one Hugging Face folder, so prescient and transformers both load it."""

from __future__ import annotations

import pathlib

import pytest

from tests.conftest import make_tiny_checkpoint

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_tokenizer(path: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from prescient.latency_bench.workloads import load_workloads

    workloads, _ = load_workloads()
    corpus = [m["content"] for w in workloads for m in w.messages]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny_chat_model")
    tok = make_tiny_tokenizer(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    make_tiny_checkpoint(path, vocab_size=len(tok), max_position_embeddings=4096, eos_token_id=eos,
                         bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"))
    return path
