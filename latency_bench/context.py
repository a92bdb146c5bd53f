"""What the benchmark loads once and shares between modes: checkpoint, tokenizer, models, engines.

Each dtype's model is loaded once through `prescient.build.load_model` (the converted-weights
cache); every prescient mode of that dtype is an `Engine` of its own (own KV cache, scheduler and
speculator) built by `prescient.build.build_engine` over the shared, read-only model, so a mode
measures what `prescient serve` runs.
The transformers peer loads the same GGUF with `from_pretrained(dir, gguf_file=...)`.
"""

from __future__ import annotations

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
        self._loaded: dict[str, object] = {}  # dtype -> prescient.build.LoadedModel
        self._hf: dict[str, object] = {}

    # ---------------------------------------------------------------- prescient

    def loaded(self, dtype: str):
        """The model in `dtype`, loaded once through the builder (the converted-weights cache)."""
        if dtype not in self._loaded:
            from prescient.build import load_model

            self._loaded[dtype] = load_model(self._spec(dtype, "off"))
        return self._loaded[dtype]

    @property
    def _first(self):
        return next(iter(self._loaded.values())) if self._loaded else self.loaded("bfloat16")

    @property
    def tokenizer(self):
        return self._first.tokenizer

    @property
    def model_config(self):
        return self._first.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._first.eos_token_ids

    def model(self, dtype: str):
        return self.loaded(dtype).model

    def _spec(self, dtype: str, speculate: str, prefix_caching: bool = True):
        from prescient.build import EngineSpec

        k = self.knobs
        # calibrate now (or from the cache): a mode measures what `prescient serve` runs once
        # its idle-time calibration is done, not the default table
        return EngineSpec(model=self.model_path, dtype=dtype, speculate=speculate, draft_model=k.draft_model,
                          max_num_seqs=k.max_num_seqs, max_num_batched_tokens=k.max_num_batched_tokens,
                          kv_cache_gb=k.kv_cache_gb, enable_prefix_caching=prefix_caching, calibrate="now",
                          progress=False)

    def engine(self, dtype: str, speculate: str = "off", prefix_caching: bool = True):
        """A fresh engine (own KV cache, scheduler and speculator) over the shared model."""
        from prescient.build import build_engine

        try:
            return build_engine(self._spec(dtype, speculate, prefix_caching), self.loaded(dtype))
        except Exception as e:  # speculation is optional per mode: report why, run the others
            if speculate == "off":
                raise
            raise Unavailable(f"speculation {speculate!r} failed to build: {type(e).__name__}: {e}") from e

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
