"""Benchmark modes: what is compared, by name, and the runner protocol each engine implements.

A mode is one (engine, dtype, decoding method) pair, e.g. `prescient-bf16-ngram` or
`hf-bf16-pld10`. Every mode runs the same token ids through `Runner.run` at batch 1 and hands back
a `RequestTrace` on the perf_counter clock, so all modes are measured by the same arithmetic
(runtime/slo.py). Runners are built by `RUNNERS[spec.engine]`; a runner that cannot be built here
(llama-cpp-python not installed, speculation not wired in) is reported as unavailable with the
reason instead of failing the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from prescient.runtime.slo import RequestTrace

DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class ModeSpec:
    engine: str  # "prescient" | "hf" | "llamacpp"
    dtype: str  # "float32" | "bfloat16"
    speculate: str = "off"  # prescient: "off" | "ngram" | "draft"
    prompt_lookup: int | None = None  # hf: prompt_lookup_num_tokens
    grammar: bool = False  # prescient: constrain each workload's output (workloads.CONSTRAINTS)

    @property
    def name(self) -> str:
        name = f"{self.engine}-{DTYPE_SHORT.get(self.dtype, self.dtype)}"
        if self.speculate != "off":
            name += f"-{self.speculate}"
        if self.prompt_lookup:
            name += f"-pld{self.prompt_lookup}"
        if self.grammar:
            name += "-grammar"
        return name

    @property
    def plain_name(self) -> str:
        """The same engine and dtype decoding plainly: the baseline for speedups."""
        return ModeSpec(self.engine, self.dtype).name

    @property
    def unconstrained_name(self) -> str:
        """The same mode without the grammar: the baseline for the grammar's effect."""
        return ModeSpec(self.engine, self.dtype, self.speculate, self.prompt_lookup).name

    @property
    def speculative(self) -> bool:
        return self.speculate != "off" or bool(self.prompt_lookup)

    def to_dict(self) -> dict:
        return {"name": self.name, "engine": self.engine, "dtype": self.dtype, "speculate": self.speculate,
                "prompt_lookup_num_tokens": self.prompt_lookup, "grammar": self.grammar}


@dataclass
class RunResult:
    trace: RequestTrace
    output_ids: list[int]
    # decode steps as (context length, tokens emitted), for bandwidth/MFU accounting
    steps: list[tuple[int, int]]


class Runner(Protocol):
    spec: ModeSpec
    weight_bytes: int  # bytes one forward reads from weights
    kv_bytes_per_token: int

    def run(self, prompt_ids: list[int], max_tokens: int, request_id: str,
            constraint: dict | None = None) -> RunResult:
        """Greedy, batch 1. `constraint` (a JSON Schema) applies only to grammar modes."""
        ...

    def stats(self) -> dict:
        """Mode-specific counters for the report (speculation stats, ...)."""
        ...


def decode_steps(trace: RequestTrace, num_prompt_tokens: int) -> list[tuple[int, int]]:
    """(context length at the step, tokens it emitted) for every emission after the first."""
    steps, ctx = [], num_prompt_tokens + (trace.emission_tokens[0] if trace.emission_tokens else 0)
    for n in trace.emission_tokens[1:]:
        steps.append((ctx, n))
        ctx += n
    return steps


class Unavailable(Exception):
    """A mode that cannot run on this machine; the message says why."""


RunnerFactory = Callable[[ModeSpec, "object"], Runner]
RUNNERS: dict[str, RunnerFactory] = {}


def register_runner(engine: str):
    def register(factory: RunnerFactory) -> RunnerFactory:
        RUNNERS[engine] = factory
        return factory

    return register


def default_modes(dtypes: tuple[str, ...], spec_dtype: str, peers: bool = True) -> list[ModeSpec]:
    """Plain prescient and transformers in every dtype (issue 2), speculation in `spec_dtype`
    (issue 3): n-gram, draft, transformers prompt lookup; the output grammar with n-gram speculation
and alone (issue 5);
    llama.cpp when installed. Without `peers`, prescient's modes alone."""
    modes = []
    for dtype in dtypes:
        modes += [ModeSpec("prescient", dtype), ModeSpec("hf", dtype)]
    modes += [ModeSpec("prescient", spec_dtype, "ngram"), ModeSpec("prescient", spec_dtype, "draft"),
              ModeSpec("hf", spec_dtype, prompt_lookup=10), ModeSpec("prescient", spec_dtype, "ngram", grammar=True),
              ModeSpec("prescient", spec_dtype, grammar=True), ModeSpec("llamacpp", spec_dtype)]
    if spec_dtype not in dtypes:
        modes += [ModeSpec("prescient", spec_dtype), ModeSpec("hf", spec_dtype)]
    return modes if peers else [m for m in modes if m.engine == "prescient"]
