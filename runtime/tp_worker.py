"""Tensor-parallel processes: rank 0's face of the sharded model, the workers' loop, and the
step messages between them (runtime/tensor_parallel.py holds the sharding itself).

Rank 0 (the process that serves) keeps the scheduler, proposer, grammar, sampling and
verification; it hands the engine a `TensorParallelModel` that looks like a LlamaModel. Each
forward sends one step message to the workers, then every rank runs its shard of the same
forward (all-reduces after O and down, logits gathered to rank 0):

    message = [commands queued since the last step: alloc/free a KV cache, KV copies] + forward
    frame   = flat int64 [op, num_args, args..., op, ...]   (encode_* / decode_frame)
    channel = BroadcastChannel: one broadcast of a fixed buffer per step (a second one only
              for a frame that outgrows it: a long prefill chunk)

The framing is the transport-free part: a prefill/decode split could move the same frames with
torch.distributed p2p (`dist.send`/`recv` of the buffer to one rank) instead of a broadcast.
KV copies after verification go through the cache's `copy_slots` (speculative/speculator.py
calls it when the cache has one): rank 0 copies its own layers and queues the slots for the
workers; they travel with the next forward, the first thing that reads them.

Process groups: the messages group (gloo) carries the step messages, with a timeout that is each
process's own: a worker waits for the next message without limit (an idle server), rank 0's
sends are bounded; the default group only startup's gathers; the compute group (gloo on CPU, NCCL on CUDA) carries the all-reduces and the
gather. Both are bounded on rank 0 by `step_timeout_s` (10 s, PRESCIENT_TP_STEP_TIMEOUT_S via
runtime/env.py, or launch's argument; handed to each worker with its arguments): a
rank that dies or hangs makes the step raise `TensorParallelError` naming it (a watchdog also
sees a death between steps), and rank 0's failure handler ends the server. A worker dies with
rank 0 (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import ctypes
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from prescient.kernels import ops
from prescient.runtime.batch import ForwardBatch
from prescient.runtime.env import TP_STEP_TIMEOUT_S, runtime_env
from prescient.runtime.kv_layer import KVLayer
from prescient.runtime.tensor_parallel import TensorParallelError, TensorParallelRefusal, default_threads, describe_plan, plan_shards, shard_model

OP_ALLOC, OP_FREE, OP_KV_COPY, OP_FORWARD, OP_STOP = 1, 2, 3, 4, 5
FRAME_CAPACITY = 4096  # int64 slots broadcast every step: a verify step of a few sequences fits
STEP_TIMEOUT_S = TP_STEP_TIMEOUT_S  # the default (runtime/env.py)
IDLE_TIMEOUT = timedelta(days=365)  # a worker waits for the next step as long as rank 0 is alive


# ---------------------------------------------------------------- frames

def _cmd(op: int, args: list[int] | torch.Tensor) -> torch.Tensor:
    args = torch.as_tensor(args, dtype=torch.int64).reshape(-1)
    return torch.cat([torch.tensor([op, args.numel()], dtype=torch.int64), args])


def encode_forward(cache_id: int, num_layers: int, batch: ForwardBatch) -> torch.Tensor:
    """One forward: [cache_id, num_layers, T, B, max_blocks, W (-1: causal), L] + the batch's tensors."""
    b = batch
    mask = b.mask_bits
    head = torch.tensor([cache_id, num_layers, b.num_tokens, b.num_seqs, b.block_tables.shape[1],
                         -1 if mask is None else mask.shape[1], b.logits_indices.shape[0]], dtype=torch.int64)
    parts = [head, b.input_ids, b.positions, b.slot_mapping, b.block_tables.reshape(-1), b.context_lens,
             b.cu_seqlens_q, b.logits_indices] + ([] if mask is None else [mask.reshape(-1)])
    return _cmd(OP_FORWARD, torch.cat([p.to("cpu", torch.int64) for p in parts]))


def decode_forward(args: torch.Tensor, device: torch.device) -> tuple[int, int, ForwardBatch]:
    cache_id, num_layers, t, b, mb, w, n = (int(x) for x in args[:7])
    sizes = [t, t, t, b * mb, b, b + 1, n, 0 if w < 0 else t * w]
    fields, at = [], 7
    for s in sizes:
        fields.append(args[at:at + s])
        at += s
    ids, pos, slots, tables, ctx, cu, logits, mask = fields
    i32 = lambda x: x.to(device=device, dtype=torch.int32)  # noqa: E731
    i64 = lambda x: x.to(device=device)  # noqa: E731
    batch = ForwardBatch(input_ids=i64(ids), positions=i64(pos), slot_mapping=i64(slots),
                         block_tables=i32(tables.reshape(b, mb)), context_lens=i32(ctx), cu_seqlens_q=i32(cu),
                         mask_bits=None if w < 0 else i32(mask.reshape(t, w)), logits_indices=i64(logits))
    return cache_id, num_layers, batch


def decode_frame(frame: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """A frame -> its (op, args) commands in order."""
    out, at = [], 0
    while at < frame.numel():
        op, n = int(frame[at]), int(frame[at + 1])
        out.append((op, frame[at + 2:at + 2 + n]))
        at += 2 + n
    return out


class BroadcastChannel:
    """Frames from rank 0 to every rank over `group`: slot 0 of a fixed buffer holds the length."""

    def __init__(self, group=None, capacity: int = FRAME_CAPACITY):
        self.group, self.buf = group, torch.zeros(capacity, dtype=torch.int64)

    def send(self, frame: torch.Tensor) -> None:
        n, room = frame.numel(), self.buf.numel() - 1
        self.buf[0] = n
        self.buf[1:1 + min(n, room)] = frame[:room]
        dist.broadcast(self.buf, src=0, group=self.group)
        if n > room:
            dist.broadcast(frame[room:].contiguous(), src=0, group=self.group)

    def recv(self) -> torch.Tensor:
        dist.broadcast(self.buf, src=0, group=self.group)
        n, room = int(self.buf[0]), self.buf.numel() - 1
        frame = self.buf[1:1 + min(n, room)].clone()
        if n > room:
            rest = torch.empty(n - room, dtype=torch.int64)
            dist.broadcast(rest, src=0, group=self.group)
            frame = torch.cat([frame, rest])
        return frame


# ---------------------------------------------------------------- where a model comes from

@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint each rank loads itself (the converted-weights cache: a memory map after rank 0's
    first conversion). Picklable, so it crosses the spawn."""

    path: str | None
    dtype: str
    use_cache: bool = True
    weights: str | None = None
    quantize: str | None = None

    def __call__(self):
        from prescient.runtime.weights_cache import load_model_files

        files = load_model_files(self.path, self.dtype, self.use_cache, False, weights=self.weights,
                                 quantize=self.quantize)
        return files.config, files.weights


@dataclass(frozen=True)
class GivenWeights:
    """Weights held in memory (tests, random models): handed to the workers through the spawn."""

    config: object
    weights: dict

    def __call__(self):
        return self.config, self.weights

    def __reduce__(self):
        # as bytes: torch's own pickler would move each tensor's storage into shared memory in
        # place, freeing memory a packed kernel of rank 0's model still points at
        import io

        buf = io.BytesIO()
        torch.save(self.weights, buf)
        return _given_from_bytes, (self.config, buf.getvalue())


def _given_from_bytes(config, data: bytes) -> GivenWeights:
    import io

    return GivenWeights(config, torch.load(io.BytesIO(data), weights_only=False))


# ---------------------------------------------------------------- the worker

def _die_with_parent() -> None:
    try:  # Linux: a worker must not outlive rank 0, even one killed with SIGKILL
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _set_threads(n: int) -> tuple[int, int | None]:
    """torch's and the native kernels' threads for this rank -> the previous (torch, kernels)."""
    old_torch, old_kernels = torch.get_num_threads(), None
    torch.set_num_threads(n)
    try:
        from prescient.kernels import cpu_linear

        if cpu_linear.available():
            old_kernels = cpu_linear.kernel_info().get("threads")
            cpu_linear.set_num_threads(n)
    except ImportError:
        pass
    return old_torch, old_kernels


def _init_groups(rank: int, world: int, store, device: str, startup_timeout_s: float, step_timeout_s: float):
    """-> (compute group, messages group). The default group (startup's gathers) waits as long as
    startup may take; a gloo timeout is each process's own, so on the messages group the workers
    wait for the next step without limit while rank 0's sends are bounded like the steps."""
    startup, step = timedelta(seconds=startup_timeout_s), timedelta(seconds=step_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=startup)
    dist.barrier()  # every rank here: the groups below meet at once, well within their bound
    backend = "nccl" if device.startswith("cuda") else "gloo"
    compute = dist.new_group(backend=backend, timeout=step)
    return compute, dist.new_group(backend="gloo", timeout=step if rank == 0 else IDLE_TIMEOUT)


def _step_timeout() -> float:
    """The environment's bound (PRESCIENT_TP_STEP_TIMEOUT_S, runtime/env.py), default 10 s."""
    return runtime_env().tp_step_timeout_s


def _device_of(device: str, rank: int) -> str:
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return f"cuda:{rank}"
    return device


def _worker_main(rank: int, world: int, port: int, source, model_kwargs: dict, device: str, threads: int,
                 step_timeout_s: float, setup) -> None:
    _die_with_parent()
    if setup is not None:
        setup()
    _set_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120))
    device = _device_of(device, rank)
    compute, messages = _init_groups(rank, world, store, device, 300.0, step_timeout_s)
    local, error = None, None
    try:
        config, weights = source()
        plan = plan_shards(config, weights, world)[rank]
        local = shard_model(config, weights, plan, compute, **{**model_kwargs, "device": device})
        del weights
    except Exception as e:  # reported to rank 0, which names it in its error
        error = f"rank {rank}: {type(e).__name__}: {e}"
    statuses = [None] * world
    dist.all_gather_object(statuses, error)
    if any(statuses):
        return
    try:
        serve_steps(local, BroadcastChannel(messages), torch.device(device))
    except Exception:
        # rank 0 gone or the group broken: say why on stderr and leave (rank 0 reports its side)
        print(f"prescient: tensor-parallel rank {rank} stopped:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group may already be broken
            pass


def _draft_of(models: dict, local, num_layers: int):
    """The shard's model of `num_layers` layers (itself, or its early-exit draft), made once."""
    model = models.get(num_layers)
    if model is None:
        model = models[num_layers] = local.early_exit(num_layers)
    return model


def serve_steps(local, channel: BroadcastChannel, device: torch.device) -> None:
    """A worker's loop: apply each step message's commands until OP_STOP."""
    caches: dict[int, list[KVLayer]] = {}
    models = {local.num_layers: local}  # early-exit drafts share the shard's layers
    while True:
        for op, args in decode_frame(channel.recv()):
            if op == OP_STOP:
                return
            if op == OP_ALLOC:
                cache_id, num_blocks, block_size, int8, num_layers = (int(x) for x in args)
                model = _draft_of(models, local, num_layers)
                caches[cache_id] = model.allocate_kv_cache(num_blocks, block_size, torch.int8 if int8 else None)
            elif op == OP_FREE:
                caches.pop(int(args[0]), None)
            elif op == OP_KV_COPY:
                cache_id, n = int(args[0]), (args.numel() - 1) // 2
                src, dst = args[1:1 + n].to(device), args[1 + n:].to(device)
                for kv in caches[cache_id]:
                    ops.kv_copy(kv[0], kv[1], src, dst, **kv.scales)
            elif op == OP_FORWARD:
                cache_id, num_layers, batch = decode_forward(args, device)
                model = _draft_of(models, local, num_layers)
                model.forward(batch, caches[cache_id])
            else:
                raise TensorParallelError(f"unknown step command {op}")


# ---------------------------------------------------------------- rank 0

class TPKVCache(list):
    """The engine's KV cache under TP: rank 0's KVLayers (its shard), which the shard's forward
    takes; the workers hold theirs under `cache_id`."""

    cache_id: int
    on_copy = None  # (src, dst) -> None: queues the copy for the workers

    @property
    def local(self) -> list:
        return self

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV slots src -> dst [n] int64 in every layer, on every rank (after verification)."""
        for kv in self:
            ops.kv_copy(kv[0], kv[1], src, dst, **kv.scales)
        self.on_copy(src, dst)


class TPGroup:
    """Rank 0's side of the processes: the groups, the channel, the workers, the queued commands
    and the failure state (one owner for all of it)."""

    def __init__(self, world: int, procs: list, compute, messages, threads_before: tuple, device: str,
                 step_timeout_s: float):
        self.world, self.procs, self.compute, self.device = world, procs, compute, device
        self.channel = BroadcastChannel(messages)
        self.step_timeout_s = step_timeout_s
        self._threads_before = threads_before
        self._pending: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._ids = 0
        self.failure: str | None = None
        self._on_failure = None
        self._closed = False
        self._watch = threading.Thread(target=self._watchdog, name="prescient-tp-watchdog", daemon=True)
        self._watch.start()
        atexit.register(self.close)

    # commands queued for the next step
    def queue(self, frame: torch.Tensor) -> None:
        with self._lock:
            self._pending.append(frame)

    def new_cache(self, num_blocks: int, block_size: int, int8: bool, num_layers: int) -> int:
        with self._lock:
            self._ids += 1
            cache_id = self._ids
        self.queue(_cmd(OP_ALLOC, [cache_id, num_blocks, block_size, int(int8), num_layers]))
        return cache_id

    def step(self, forward: torch.Tensor) -> None:
        """Send the queued commands and this forward as one message."""
        self.check()
        with self._lock:
            frame = torch.cat(self._pending + [forward])
            self._pending = []
        self.run(lambda: self.channel.send(frame))

    def run(self, fn):
        """fn() (a collective, or a forward full of them); a failure becomes TensorParallelError."""
        try:
            return fn()
        except Exception as e:  # gloo/NCCL: a closed connection, a timeout
            raise self.fail(f"a tensor-parallel step failed ({self._ranks_state()}): {e}") from e

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def set_failure_handler(self, handler) -> None:
        """handler(message) runs once, on the thread that saw the failure (the server stops)."""
        self._on_failure = handler
        if self.failure is not None:
            handler(self.failure)

    def fail(self, message: str) -> TensorParallelError:
        first = self.failure is None
        if first:
            self.failure = message
            print(f"prescient: error: {message}", file=sys.stderr, flush=True)
            for p in self.procs:  # a hung rank would never leave on its own
                if p.is_alive():
                    p.kill()
            if self._on_failure is not None:
                self._on_failure(message)
        return TensorParallelError(self.failure)

    def _ranks_state(self) -> str:
        states = []
        for rank, p in enumerate(self.procs, start=1):
            code = p.exitcode
            states.append(f"rank {rank} (pid {p.pid}) " + ("alive: no answer within the "
                          f"{self.step_timeout_s:g} s bound or a broken connection" if code is None
                          else f"exited with code {code}"))
        return "; ".join(states)

    def _watchdog(self) -> None:
        # a rank that dies while the server is idle ends it too, not only at the next step
        while not self._closed and self.failure is None:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self._closed:
                    self.fail(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
                    return
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the workers and leave the groups (atexit does it too)."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:
                self.channel.send(_cmd(OP_STOP, []))
            except Exception:  # noqa: BLE001 - a worker already gone: killed below
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        old_torch, old_kernels = self._threads_before
        torch.set_num_threads(old_torch)
        if old_kernels:
            from prescient.kernels import cpu_linear

            cpu_linear.set_num_threads(old_kernels)


class TensorParallelModel:
    """What the engine holds under `--tp N`: a LlamaModel's interface over rank 0's shard (`local`)
    that runs every forward on all ranks. `config` is the whole model's; KV sizes are per rank
    (rank 0 holds the most heads), so `--kv-cache-gb` bounds each rank's cache."""

    is_sharded = True  # runtime/model.ModelRunner

    def __init__(self, tp: TPGroup, local, config, plans):
        self.tp, self.local, self.config, self.plans = tp, local, config, plans
        self.dtype, self.device = local.dtype, local.device
        self.num_layers = local.num_layers
        self.weights_mode = local.weights_mode
        self.world = tp.world

    def early_exit(self, num_layers: int) -> "TensorParallelModel":
        """The self-speculative draft, sharded like the target: it is the target's first layers,
        and rank 0 holds only its shard of them (a separate --draft-model runs on rank 0 whole): the
        same group over the shard's own early-exit draft (LlamaModel.early_exit)."""
        return TensorParallelModel(self.tp, self.local.early_exit(num_layers), self.config, self.plans)

    def forward(self, batch: ForwardBatch, kv_caches: TPKVCache) -> torch.Tensor:
        """-> logits [num_logits, vocab] (gathered from every rank's vocab slice)."""
        self.tp.step(encode_forward(kv_caches.cache_id, self.num_layers, batch))
        return self.tp.run(lambda: self.local.forward(batch, kv_caches.local))

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None) -> TPKVCache:
        local = self.local.allocate_kv_cache(num_blocks, block_size, kv_dtype)
        cache_id = self.tp.new_cache(num_blocks, block_size, kv_dtype == torch.int8, self.num_layers)
        tp = self.tp

        def on_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
            tp.queue(_cmd(OP_KV_COPY, torch.cat([torch.tensor([cache_id]), src.cpu(), dst.cpu()])))

        cache = TPKVCache(local)
        cache.cache_id, cache.on_copy = cache_id, on_copy
        weakref.finalize(cache, tp.queue, _cmd(OP_FREE, [cache_id]))  # the workers' copy goes with it
        return cache

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        return self.local.kv_bytes_per_token(kv_dtype)

    def weight_bytes(self) -> int:
        """Rank 0's bytes; a tied LM head's vocab rows are a view of the embedding, counted once."""
        local = self.local
        embed = local._embed_q.weight if local._embed_q is not None else local.embed
        head = local.lm_head.inner.weight
        shared = head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
        return local.weight_bytes() - (head.nbytes if shared else 0)

    def weight_formats(self) -> tuple[str, ...]:
        return self.local.weight_formats()

    def weights_description(self) -> str:
        return f"{self.local.weights_description()}, --tp {self.world}: rank 0's shard"

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.local.embed_tokens(ids)

    def set_failure_handler(self, handler) -> None:
        self.tp.set_failure_handler(handler)

    @property
    def failure(self) -> str | None:
        return self.tp.failure

    def close(self) -> None:
        self.tp.close()


def launch(source, world: int, model_kwargs: dict, device: str = "cpu", rank0_weights=None,
           threads: int | None = None, step_timeout_s: float | None = None, progress: bool = False,
           startup_timeout_s: float = 300.0, setup=None) -> TensorParallelModel:
    """Start `world - 1` worker processes (torch.multiprocessing, spawn) and return rank 0's model.
    source: a picklable () -> (config, weights) every worker calls (CheckpointSource, GivenWeights);
    rank0_weights: rank 0's (config, weights) when already loaded; setup: a picklable () -> None
    each worker runs first (a kernel mode a test also set on rank 0). A TP size the model cannot be
    split into is refused here, before any process starts."""
    import torch.multiprocessing as mp

    if dist.is_initialized():
        raise TensorParallelError("a tensor-parallel group is already running in this process")
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        raise TensorParallelRefusal(f"--tp {world} on CUDA needs {world} GPUs (one per rank); torch sees "
                                  f"{torch.cuda.device_count()}")
    config, weights = rank0_weights or source()
    plans = plan_shards(config, weights, world)
    if progress:
        print(f"prescient: tensor parallel --tp {world}: {describe_plan(config, plans)}", file=sys.stderr, flush=True)
    step_timeout_s = step_timeout_s or _step_timeout()
    threads = threads or default_threads(world)
    threads_before = _set_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=startup_timeout_s),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, name=f"prescient-tp-rank{r}", daemon=True,
                         args=(r, world, store.port, source, model_kwargs, device, threads, step_timeout_s, setup))
             for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        dev = _device_of(device, 0)
        compute, messages = _join(lambda: _init_groups(0, world, store, dev, startup_timeout_s, step_timeout_s), procs,
                                  startup_timeout_s)
        local, error = None, None
        try:
            local = shard_model(config, weights, plans[0], compute, **{**model_kwargs, "device": dev})
        except Exception as e:  # noqa: BLE001 - every rank reports before anyone leaves
            error = f"rank 0: {type(e).__name__}: {e}"
        del weights
        statuses = [None] * world
        _join(lambda: dist.all_gather_object(statuses, error), procs, startup_timeout_s)
        if any(statuses):
            raise TensorParallelError("tensor-parallel startup failed: " + "; ".join(s for s in statuses if s))
    except BaseException:
        for p in procs:
            p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads_before[0])
        raise
    return TensorParallelModel(TPGroup(world, procs, compute, messages, threads_before, device, step_timeout_s),
                               local, config, plans)


def _join(fn, procs: list, timeout_s: float, name=lambda rank: f"tensor-parallel rank {rank}",
          error=TensorParallelError):
    """fn() on a helper thread while the workers are watched: a worker that exits during startup
    is an error at once, not a wait for the rendezvous timeout. `name(rank)` names a worker (ranks
    from 1) and `error` is what is raised."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive():
        t.join(0.1)
        for rank, p in enumerate(procs, start=1):
            if p.exitcode is not None and t.is_alive():
                raise error(f"{name(rank)} exited with code {p.exitcode} during startup (its error is above)")
        if time.monotonic() > deadline:
            raise error(f"startup: {', '.join(name(r) for r in range(1, len(procs) + 1))} did not meet this "
                        f"process within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
