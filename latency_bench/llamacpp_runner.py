"""Batch-1 runs with llama.cpp through llama-cpp-python: the second peer, when it is installed.

llama-cpp-python builds llama.cpp from source (about ten minutes here), so it stays optional and
out of CI: without it this mode is reported as unavailable. It runs the GGUF file as stored (the
default model's file is Q4_1, not the dense fp32/bf16 weights the other modes use; pass an F32 or
BF16 GGUF with --llamacpp-model for a like-for-like comparison), with flash attention on (its
faster setting on these CPUs). Greedy (`temp=0`), the same token ids and stop tokens; the
context is reset before each request so prefill is cold, as for the other modes. `generate`
yields one token per decode step, stamped on arrival.
"""

from __future__ import annotations

import os
import time

from prescient.latency_bench.efficiency import kv_bytes_per_token
from prescient.latency_bench.modes import ModeSpec, RunResult, Unavailable, decode_steps, register_runner
from prescient.runtime.slo import RequestTrace
from prescient.kernels.cpu_threads import default_threads


class LlamaCppRunner:
    def __init__(self, spec: ModeSpec, ctx, model_path: str | None = None, n_ctx: int = 4096):
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise Unavailable("llama-cpp-python is not installed (optional: pip install llama-cpp-python, "
                              "builds llama.cpp from source)") from e
        path = model_path or ctx.model_path
        if not path.endswith(".gguf"):
            raise Unavailable(f"llama.cpp needs a .gguf file, got {path}")
        self.spec = spec
        self.path = path
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=default_threads(), flash_attn=True, verbose=False)
        self.eos = set(ctx.eos_token_ids) | {self.llm.token_eos()}
        self.weight_bytes = os.path.getsize(path)  # the file is the weights as llama.cpp streams them
        self.kv_bytes_per_token = kv_bytes_per_token(ctx.model_config, ctx.model(spec.dtype).dtype)

    def run(self, prompt_ids: list[int], max_tokens: int, request_id: str,
            constraint: dict | None = None) -> RunResult:
        self.llm.reset()
        trace = RequestTrace(request_id, time.perf_counter(), num_prompt_tokens=len(prompt_ids))
        output: list[int] = []
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                       repeat_penalty=1.0, reset=True):
            trace.add_emission(time.perf_counter(), 1)
            output.append(int(token))
            if token in self.eos or len(output) >= max_tokens:
                break
        trace.finished_time = time.perf_counter()
        return RunResult(trace, output, decode_steps(trace, len(prompt_ids)))

    def stats(self) -> dict:
        return {"model_file": self.path}


@register_runner("llamacpp")
def make_llamacpp_runner(spec: ModeSpec, ctx) -> LlamaCppRunner:
    return LlamaCppRunner(spec, ctx, getattr(ctx, "llamacpp_model", None))
