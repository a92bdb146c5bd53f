"""The batch-1 phase: every mode on the same prompts, one request at a time, interleaved.

The machine is shared and noisy, so modes are never run one after another in blocks: for each
prompt every mode runs once, in an order rotated per prompt and repetition, so slow periods hit
all modes alike and ratios between modes stay meaningful. Each mode first runs one short
warm-up request (excluded) so one-time costs (thread pools, first-call allocations) do not land
on the first measured prompt; grammar modes compile their grammars before timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from prescient.latency_bench.modes import RunResult
from prescient.latency_bench.workloads import Workload


@dataclass
class Batch1Record:
    mode: str
    workload: Workload
    rep: int
    num_prompt_tokens: int
    result: RunResult


def chat_prompt_ids(tokenizer, workload: Workload) -> list[int]:
    return tokenizer.apply_chat_template(list(workload.messages))


def run_batch1(runners: dict, workloads: list[Workload], tokenizer, reps: int, progress=None,
               warmup_tokens: int = 8) -> list[Batch1Record]:
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
                result = runners[name].run(ids, w.max_tokens, f"{name}-{w.name}-r{rep}", w.constraint)
                records.append(Batch1Record(name, w, rep, len(ids), result))
                if progress is not None:
                    progress.update(1)
    return records
