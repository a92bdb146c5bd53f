"""Batch-1 runs with Hugging Face transformers `generate()`: the peer on this machine.

Greedy, the same token ids and stop tokens as prescient; optionally prompt lookup decoding
(`prompt_lookup_num_tokens`), transformers' own n-gram speculation. A streamer stamps each
`put()` with perf_counter: generate calls it once per forward with every token that forward
produced, so a prompt-lookup step that accepts several tokens is one multi-token emission, as
with prescient's speculation. The arrival stamp is taken just before `generate()`, so TTFT
includes its set-up as a user of transformers would see it. It runs with torch's thread count
as it was before any prescient forward (prescient's model changes it for its own decode steps).
"""

from __future__ import annotations

import time

import torch

from prescient.latency_bench.context import torch_threads
from prescient.latency_bench.efficiency import hf_model_bytes, kv_bytes_per_token
from prescient.latency_bench.modes import ModeSpec, RunResult, decode_steps, register_runner
from prescient.runtime.slo import RequestTrace


class _TimingStreamer:
    """transformers' streamer protocol (`put`, `end`); the first `put` is the prompt."""

    def __init__(self, trace: RequestTrace):
        self.trace = trace
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.trace.add_emission(now, int(value.numel()))

    def end(self) -> None:
        self.trace.finished_time = time.perf_counter()


class HFRunner:
    def __init__(self, spec: ModeSpec, ctx):
        self.spec = spec
        self.model = ctx.hf_model(spec.dtype)
        self.threads = ctx.default_threads  # transformers' GEMMs/GEMVs use torch's threads
        self.eos = list(ctx.eos_token_ids or ctx.tokenizer.eos_token_ids)
        self.weight_bytes = hf_model_bytes(self.model)
        self.kv_bytes_per_token = kv_bytes_per_token(ctx.model_config, next(self.model.parameters()).dtype)
        self._num_runs = 0

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], max_tokens: int, request_id: str,
            constraint: dict | None = None) -> RunResult:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        trace = RequestTrace(request_id, time.perf_counter(), num_prompt_tokens=len(prompt_ids))
        kwargs = {"prompt_lookup_num_tokens": self.spec.prompt_lookup} if self.spec.prompt_lookup else {}
        with torch_threads(self.threads):
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, temperature=None, top_p=None, top_k=None,
                                      eos_token_id=self.eos, pad_token_id=self.eos[0],
                                      streamer=_TimingStreamer(trace), **kwargs)
        output_ids = out[0, len(prompt_ids):].tolist()
        self._num_runs += 1
        return RunResult(trace, output_ids, decode_steps(trace, len(prompt_ids)))

    def stats(self) -> dict:
        return {"num_runs": self._num_runs}


@register_runner("hf")
def make_hf_runner(spec: ModeSpec, ctx) -> HFRunner:
    return HFRunner(spec, ctx)
