"""The batch-1 phase: every mode on the same prompts, one request at a time, interleaved.

The machine is shared and noisy, so modes are never run one after another in blocks: for each
prompt every mode runs once, in an order rotated per prompt and repetition, so slow periods hit
all modes alike and ratios between modes stay meaningful. Each mode first runs one short
warm-up request (excluded) so one-time costs (thread pools, first-call allocations) do not land
on the first measured prompt; grammar modes compile their grammars before timing. A run during
which other processes took more than `max_foreign` of the CPUs (contention.py) is retried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prescient.latency_bench.contention import CpuMeter
from prescient.latency_bench.modes import RunResult
from prescient.latency_bench.workloads import Workload


@dataclass
class Batch1Record:
    mode: str
    workload: Workload
    rep: int
    num_prompt_tokens: int
    result: RunResult
    foreign_cpu: float | None  # share of the machine other processes used during the kept attempt
    attempts: int


def _measured_run(runner, ids: list[int], w: Workload, request_id: str, max_foreign: float, retries: int):
    """Run once; while other processes took more than `max_foreign` of the machine, run again
    (at most `retries` times) and keep the least disturbed attempt."""
    best = None
    for attempt in range(retries + 1):
        with CpuMeter() as meter:
            result = runner.run(ids, w.max_tokens, f"{request_id}-a{attempt}", w.constraint)
        share = meter.foreign_share
        if best is None or (share is not None and (best[1] is None or share < best[1])):
            best = (result, share)
        if share is None or share <= max_foreign:
            break
        time.sleep(1.0)  # let a burst of someone else's work pass before trying again
    return best[0], best[1], attempt + 1


def chat_prompt_ids(tokenizer, workload: Workload) -> list[int]:
    return tokenizer.apply_chat_template(list(workload.messages))


def run_batch1(runners: dict, workloads: list[Workload], tokenizer, reps: int, progress=None,
               warmup_tokens: int = 8, max_foreign: float = 0.2, retries: int = 2) -> list[Batch1Record]:
    prompts = [(w, chat_prompt_ids(tokenizer, w)) for w in workloads]
    names = list(runners)
    warm_ids = prompts[0][1]
    constraints = list({str(w.constraint): w.constraint for w in workloads if w.constraint}.values())
    for name in names:
        if hasattr(runners[name], "prepare"):
            runners[name].prepare(constraints)
        runners[name].run(warm_ids, warmup_tokens, f"warmup-{name}")
        if progress is not None:
            progress.set_postfix_str(f"warm-up {name}")
    records = []
    for rep in range(reps):
        for i, (w, ids) in enumerate(prompts):
            shift = (i + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                if progress is not None:
                    progress.set_postfix_str(f"{name} {w.name}")
                result, foreign, attempts = _measured_run(runners[name], ids, w, f"{name}-{w.name}-r{rep}",
                                                          max_foreign, retries)
                records.append(Batch1Record(name, w, rep, len(ids), result, foreign, attempts))
                if progress is not None:
                    progress.update(1)
    return records
