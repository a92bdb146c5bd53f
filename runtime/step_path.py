"""How a step meets its device: the forward plan, the metadata upload, the random draws, the reads.

Chosen once, where the engine is built (`step_path_for`), never by `if cuda` in the step:

    CpuStepPath     the CPU's: forwards planned for batch invariance (runtime/forward_plan.plan),
                    one tensor per ForwardBatch field, a torch.Generator per request on the host,
                    each sampled token read as it is chosen. CPU outputs are this path's.
    DeviceStepPath  a GPU's: one forward per step (forward_plan.plan_one; batch invariance is not
                    promised, as in vLLM and SGLang outside their deterministic modes), metadata
                    through one staging buffer and one non-blocking copy (runtime/staging.py),
                    noise drawn on the device from (seed, position) (runtime/counter_rng.py), and
                    every token of the step read back at once: one device-to-host sync per step
                    in greedy and sampled decoding and in verification (`read`).

The CPU can be told to run the device path (EngineConfig(step_path="device")): that is how the
tests exercise the one-forward plan, the staging buffer, device-side sampling and the sync count
(runtime/sync_count.py) without a GPU. Its outputs are not the CPU path's bits (a batch is one
forward; the noise comes from another generator), only the same distributions.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from prescient.runtime import forward_plan
from prescient.runtime.batch import ForwardBatch, SeqRows, pack_forward_batch
from prescient.runtime.counter_rng import NOISE, counter_exponential, row_key
from prescient.runtime.sampler import make_generator, sample_from_probs, target_probs_from_logits
from prescient.runtime.staging import StagingBuffer, pack_staged

STEP_PATHS = ("auto", "cpu", "device")


class CpuStepPath:
    name = "cpu"
    device_side = False  # sampling and verification draw on the host, per request
    layer_split = True  # a long chunk may run its layers over several steps
    # small rows in forwards of at most BATCH_INVARIANT_M rows (forward_plan.plan): the step
    # cost model prices each as another pass over the weights
    packs_forwards = True
    # one KV tensor for all layers: a verify step that accepted a branch moves its KV rows in one
    # gather and one scatter (~40 us on a 2-core Zen 4) instead of an op pair a layer (~0.5 ms)
    stacked_kv = True

    def plan(self, seqs: list, trees: list) -> list[list[int]]:
        return forward_plan.plan(seqs, trees)

    def pack(self, rows: list[SeqRows], block_size: int, device: torch.device) -> ForwardBatch:
        return pack_forward_batch(rows, block_size, device)

    def init_request(self, request) -> None:
        params = request.params
        if not params.greedy or params.seed is not None:
            request.generator = make_generator(params.seed)


class DeviceStepPath:
    name = "device"
    device_side = True
    # one forward per step: a chunk is never split over steps by layers (that would be a second
    # forward); a chunk over the step's time budget runs whole as its first prefill work, or
    # waits for the next step (runtime/scheduler.py)
    layer_split = False
    packs_forwards = False  # forward_plan.plan_one: every row in one forward
    stacked_kv = True  # one KV tensor for all layers: a verify step's moves are one copy

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.staging = StagingBuffer(self.device)
        self.num_reads = 0  # device-to-host reads made through `read`

    def plan(self, seqs: list, trees: list) -> list[list[int]]:
        return forward_plan.plan_one(seqs, trees)

    def pack(self, rows: list[SeqRows], block_size: int, device: torch.device) -> ForwardBatch:
        return pack_staged(rows, block_size, self.staging)

    def init_request(self, request) -> None:
        """A request's draws are keyed by its seed (a fresh one when it gave none, drawn once
        here at admission, off the step)."""
        seed = request.params.seed
        request.rng_seed = seed if seed is not None else secrets.randbits(63)

    def upload(self, parts: Sequence) -> list[torch.Tensor]:
        """Host integers -> int64 device tensors, all in one non-blocking copy."""
        return self.staging.upload(parts)

    def read(self, t: torch.Tensor) -> list:
        """The step's one device-to-host sync: a tensor holding everything the host needs."""
        self.num_reads += 1
        return t.tolist()

    @staticmethod
    def keys(requests: list, stream: int) -> list[int]:
        """Flat [2 * len(requests)] counter-RNG key words: each request at its position."""
        out: list[int] = []
        for r in requests:
            out.extend(row_key(r.rng_seed, len(r.output_token_ids), stream))
        return out

    def sample(self, requests: list, logits: torch.Tensor) -> list[int]:
        """One token per request from logits [len(requests), vocab] (row i = requests[i]'s),
        read back in one sync. Greedy rows: the argmax; sampled rows: the exponential race over
        target_probs_from_logits (one call per distinct SamplingParams) with counter noise."""
        tokens = logits.argmax(-1)  # [rows]
        groups: dict = {}
        for i, r in enumerate(requests):
            if not r.params.greedy:
                groups.setdefault(r.params, []).append(i)
        if groups:
            order = [i for rows in groups.values() for i in rows]
            keys_flat = self.keys([requests[i] for i in order], NOISE)
            order_t, keys_t = self.upload([order, keys_flat])
            keys_t = keys_t.view(-1, 2)  # [sampled, 2]
            start = 0
            for params, rows in groups.items():
                idx = order_t[start:start + len(rows)]
                probs = target_probs_from_logits(logits[idx], params)  # [len(rows), vocab]
                noise = counter_exponential(keys_t[start:start + len(rows)], probs.shape[1])
                tokens[idx] = sample_from_probs(probs, noise)
                start += len(rows)
        return self.read(tokens)


def step_path_for(device: torch.device | str, name: str = "auto") -> CpuStepPath | DeviceStepPath:
    """The path for a model on `device`: "auto" = the device path on CUDA, the CPU path
    elsewhere; "cpu" / "device" force one (the tests run the device path on the CPU)."""
    if name not in STEP_PATHS:
        raise ValueError(f"step_path must be one of {STEP_PATHS}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        name = "device" if device.type == "cuda" else "cpu"
    return DeviceStepPath(device) if name == "device" else CpuStepPath()
