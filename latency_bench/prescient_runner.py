"""Batch-1 runs on an in-process prescient `Engine`: plain decoding or with a speculator, with or
without the workload's output grammar.

The request is stepped to completion on the calling thread; times are the engine's own stamps
(arrival at `add_request`, one `token_times` stamp per committed step). The prefix cache is
reset before each run so every mode pays for a cold prefill, as transformers does.
"""

from __future__ import annotations

from dataclasses import asdict

from prescient.grammar import spec_from_response_format
from prescient.latency_bench.modes import ModeSpec, RunResult, Unavailable, decode_steps, register_runner
from prescient.latency_bench.efficiency import kv_bytes_per_token, prescient_model_bytes
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.slo import RequestTrace


class PrescientRunner:
    def __init__(self, spec: ModeSpec, ctx):
        self.spec = spec
        self.engine = ctx.engine(spec.dtype, spec.speculate)
        if spec.speculate != "off" and self.engine.speculator is None:
            raise Unavailable(f"speculation {spec.speculate!r} did not attach to the engine "
                              "(the builder made no speculator)")
        self.weight_bytes = prescient_model_bytes(self.engine.model)
        self.kv_bytes_per_token = kv_bytes_per_token(ctx.model_config, self.engine.model.dtype)

    def prepare(self, constraints: list[dict]) -> None:
        """Compile the grammars before timing (the compiler caches them; a server that has seen a
        schema once answers from the cache too)."""
        if self.spec.grammar:
            for schema in constraints:
                self._submit(schema).result()

    def _submit(self, schema: dict):
        spec = spec_from_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
        return self.engine.grammar_compiler().submit(spec)

    def run(self, prompt_ids: list[int], max_tokens: int, request_id: str,
            constraint: dict | None = None) -> RunResult:
        self.engine.block_manager.reset_prefix_cache()
        # each request gets its own matcher over the (cached) compiled grammar
        grammar = self._submit(constraint) if self.spec.grammar and constraint is not None else None
        request = self.engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                                          request_id=request_id, grammar=grammar)
        while request.finish_reason is None:
            self.engine.step()
        trace = RequestTrace.from_request(request)
        return RunResult(trace, list(request.output_token_ids), decode_steps(trace, len(prompt_ids)))

    def stats(self) -> dict:
        spec = self.engine.speculator
        if spec is None or not hasattr(spec, "stats"):
            return {}
        s = spec.stats
        out = {k: v for k, v in asdict(s).items()} if hasattr(s, "__dataclass_fields__") else {}
        for key in ("acceptance_rate", "mean_accepted_length"):
            if hasattr(s, key):
                out[key] = getattr(s, key)
        return out


@register_runner("prescient")
def make_prescient_runner(spec: ModeSpec, ctx) -> PrescientRunner:
    return PrescientRunner(spec, ctx)
