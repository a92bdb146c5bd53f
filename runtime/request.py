"""One generation request's state as the engine sees it.

`all_token_ids` = prompt + output; `num_computed_tokens` of them have valid KV in the request's
blocks. The next forward feeds the tokens from `num_computed_tokens` on (a prefill chunk, or the
last sampled token when decoding), plus any draft-tree nodes. Times are engine monotonic times
(`time.perf_counter`) so the SLO tracker and the wire events share one clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from prescient.runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Where an emitted token came from (per-token provenance carried to clients).
SOURCE_TARGET = "target"  # sampled from the target's logits (bonus/recovered/plain)
SOURCE_DRAFT = "draft"  # a proposer's draft token accepted by verification
SOURCE_FORCED = "forced"  # a grammar-forced span token accepted by verification


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    session_id: str | None = None
    grammar: Any = None  # a grammar matcher, when the output is constrained
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the leading full blocks
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None  # the CPU path's draws (runtime/step_path.CpuStepPath)
    rng_seed: int | None = None  # the device path's counter-RNG seed (DeviceStepPath), set at admission
    num_preemptions: int = 0
    num_overtaken: int = 0  # later requests admitted past it while it did not fit (scheduler)
    # speculation: draft-token budget granted by the adaptive controller for the next step
    spec_budget: int = 0
    # the tokens the grammar forces next (the mask leaves no other text there): what the
    # scheduler still grants, up to spec_budget, while prompt work waits (runtime/scheduler.py)
    forced_budget: int = 0
    # timing (engine clock)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    token_sources: list[str] = field(default_factory=list)
    # speculation counters
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    # a prefill chunk split by layers over several steps (runtime/scheduler.py plans it and
    # writes these two; runtime/forward_plan.py keeps the chunk's batch and hidden states until
    # its last layer has run). chunk_layer 0: no chunk in flight.
    chunk_tokens: int = 0
    chunk_layer: int = 0
    chunk_state: Any = None  # (ForwardBatch, hidden [chunk_tokens, hidden]) between steps
    # latency bounds this request asked for that the server cannot meet even alone (the
    # scheduler's predictions), reported with its final output
    slo_notes: list[str] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1


@dataclass
class RequestOutput:
    """What one engine step produced for one request (the delta since the last output)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    token_times: list[float] = field(default_factory=list)
    token_sources: list[str] = field(default_factory=list)
    logprobs: list[dict] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # "overloaded": refused for load, worth retrying after retry_after_s; "invalid_request": the
    # request's own input cannot go on (RequestDeadEnd); None with an error: a server fault
    error_type: str | None = None
    retry_after_s: float | None = None
    # a prefill/decode split's first output: where the time to first token went (seconds:
    # queue_s, prefill_s, transfer_s, first_decode_s; runtime/kv_handoff.HandoffTiming)
    ttft_split: dict | None = None
    # on the final output: the request's latency bounds the server could not meet even alone
    slo_notes: list[str] | None = None


class RequestDeadEnd(ValueError):
    """The request cannot go on through no fault of the server (its grammar allows no token
    where its output stands): it ends with error_type "invalid_request", a 4xx to its client."""


class OverloadedError(RuntimeError):
    """The engine's queue is full or a request waited too long to start: come back later.
    Not a ValueError: nothing is wrong with the request itself."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s
