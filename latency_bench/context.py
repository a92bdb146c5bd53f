"""What the benchmark loads once and shares between modes: checkpoint, tokenizer, models, engines.

Loading a GGUF (dequantizing every tensor) is the slowest part of setting up, so the checkpoint
is read once and each dtype's `LlamaModel` is built once; every prescient mode of that dtype is an
`Engine` of its own (own KV cache, scheduler and speculator) over the shared, read-only model.
Engines are configured the way `prescient.cli.build_engine` configures them, and speculators are
attached through the same hook the CLI uses, so a mode measures what `prescient serve` runs.
The transformers peer loads the same GGUF with `from_pretrained(dir, gguf_file=...)`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
from dataclasses import dataclass

import torch

from prescient.latency_bench.modes import Unavailable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineKnobs:
    """The serving knobs of `prescient serve` that matter to the benchmark."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_gb: float = 0.5
    draft_model: str | None = None


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch intra-op threads = n inside the block (restored after), so a measurement runs on the
    thread count it is meant to, whatever the last prescient forward left set."""
    if not n:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class BenchContext:
    def __init__(self, model_path: str | None, knobs: EngineKnobs = EngineKnobs()):
        from prescient.runtime.loader import resolve_model_path

        self.model_path = resolve_model_path(model_path)
        self.knobs = knobs
        # torch's thread count before any prescient forward: LlamaModel.forward switches torch to
        # one thread for decode-sized batches (its GEMV kernel has its own pool) and leaves it so,
        # which must not leak into the transformers runs or the bandwidth probe
        self.default_threads = torch.get_num_threads()
        self._ckpt = None
        self._tokenizer = None
        self._models: dict[str, object] = {}
        self._hf: dict[str, object] = {}

    # ---------------------------------------------------------------- prescient

    @property
    def checkpoint(self):
        if self._ckpt is None:
            from prescient.runtime.loader import load_checkpoint

            self._ckpt = load_checkpoint(self.model_path)
        return self._ckpt

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from prescient.runtime.tokenizer import Tokenizer

            ck = self.checkpoint
            self._tokenizer = Tokenizer.load(ck.tokenizer_dir, ck.gguf_file, ck.eos_token_ids)
        return self._tokenizer

    @property
    def model_config(self):
        return self.checkpoint.config

    def model(self, dtype: str):
        if dtype not in self._models:
            from prescient.runtime.model import LlamaModel

            self._models[dtype] = LlamaModel(self.checkpoint.config, self.checkpoint.weights, dtype=DTYPES[dtype])
        return self._models[dtype]

    def engine(self, dtype: str, speculate: str = "off", prefix_caching: bool = True):
        """A fresh engine over the shared model; `speculator` stays None when speculation is off
        or could not be attached (the caller checks)."""
        from prescient.cli import _attach_speculator
        from prescient.runtime.config import CacheConfig, SchedulerConfig
        from prescient.runtime.engine import Engine, EngineConfig

        k = self.knobs
        config = EngineConfig(
            dtype=dtype,
            cache=CacheConfig(kv_cache_bytes=int(k.kv_cache_gb * (1 << 30)), enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=k.max_num_seqs, max_num_batched_tokens=k.max_num_batched_tokens),
        )
        engine = Engine(self.model(dtype), self.tokenizer, config, eos_token_ids=self.checkpoint.eos_token_ids)
        args = argparse.Namespace(speculate=speculate, draft_model=k.draft_model)
        try:
            _attach_speculator(engine, args)
        except Exception as e:  # speculation is optional per mode: report why, run the others
            raise Unavailable(f"speculation {speculate!r} failed to attach: {type(e).__name__}: {e}") from e
        return engine

    # ---------------------------------------------------------------- transformers

    def hf_model(self, dtype: str):
        """The transformers model in `dtype`. The first dtype asked for is loaded from the model
        file; another dtype is that model cast (the same dense weights, as loading the file again
        in that dtype would give, without dequantizing the GGUF twice)."""
        if dtype not in self._hf:
            if self._hf:
                first = next(iter(self._hf.values()))
                self._hf[dtype] = copy.deepcopy(first).to(DTYPES[dtype])
            else:
                self._hf[dtype] = self._load_hf(dtype)
        return self._hf[dtype]

    def _load_hf(self, dtype: str):
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        kwargs = {}
        if self.model_path.endswith(".gguf"):
            directory, name = os.path.split(self.model_path)
            kwargs["gguf_file"] = name
        else:
            directory = self.model_path
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], **kwargs)
        model.eval()
        return model
