"""Batch-invariant forwards: which scheduled sequences share a target forward.

A decode or verify row must get the same bits whatever else the step holds (greedy output with
speculation equal to plain decoding; a request alone equal to the same request in a batch). With
the kernels loaded every linear runs the GEMV kernels at any row count, MAX_M rows a call
(runtime/linear.py), and the fused native layers (kernels/cpu_layer.c) and the torch loop compute
a row alike: decode rows and prefill chunks get the same bits in any
forward, whatever shares it and however the prompt was cut. The fallback GEMM path (F.linear /
the tiled quantized path: no kernel library, a block format without a native kernel,
float64) computes a row alike only for the same row count, since the GEMM library picks its
kernel by shape (on a 2-core AVX-512 machine with AMX, twelve prompts' chunks in one GEMM gave
other bits than each alone). For that path the plan decides the forwards per *sequence*, never
by the step's total, and gives each prefill chunk a forward of its own:

    small = [s for s in seqs if rows(s) <= BATCH_INVARIANT_M]   # decode, verify trees, short chunks
    large = the rest                                            # prefill chunks
    forwards = [each large chunk alone (> BATCH_INVARIANT_M rows)] +
               [small, packed in order into forwards of <= BATCH_INVARIANT_M rows]

and the logits come back in the sequences' order (a sequence whose logits row came with it, a
P/D handoff, takes no forward: its row goes in its place). The scheduler cuts a prompt into the
same chunks alone and under load, so on the fallback path a chunk's GEMM has the same rows either
way. A prefill chunk the scheduler split by layers (its `layers` set) runs alone through
`model.forward_layers`, its hidden states kept on the request until its last layer has run (the
same ops as one forward: the same bits). Split chunks run after the step's other forwards, a
few layers a call, and past the step's `cutoff` (a perf_counter time: where the step, its
sampling and commit priced at the last step's, would pass the scheduler's `itl_cutoff` x its ITL
bound) no more of their layers start:

    run every other forward
    for a split chunk: its first layer alone, then groups of layers, each as many as the time
        a layer took so far says end by the cutoff; stop where none does (the step's first
        split chunk always runs its first layer, a later one past the cutoff runs none) and
        mark the chunk as run to there (seq.layers, seq.completes), for later steps to go on from

so a step slower than its prediction is cut short, not every stream's bound broken. A chunk whose
logits row the step had already counted on (it samples, and a grammar bitmask was built for the
step's rows: `rows_fixed`) runs its planned layers. A step of only decodes (the common case) is one
forward; a prefill chunk beside decodes costs one extra forward's dispatch, and more than
BATCH_INVARIANT_M decode/verify rows cost one weight pass per forward (no more than one forward
would: the kernels take MAX_M = BATCH_INVARIANT_M rows a call).

That plan is the CPU's (runtime/step_path.CpuStepPath). On a GPU a forward's launch and sync
overhead, not its weight pass, is what a split costs, and its GEMMs are not batch invariant
anyway; the device path (DeviceStepPath) takes `plan_one`: every sequence that needs a forward
in one forward, whatever its rows. Batch invariance is then not promised there (as in vLLM and
SGLang without their deterministic modes): greedy speculation and a request alone vs in a batch
may differ where two logits are within a rounding of each other.
"""

from __future__ import annotations

import math
import time

import torch

from prescient.runtime.batch import ForwardBatch, build_forward_batch
from prescient.runtime.linear import BATCH_INVARIANT_M
from prescient.runtime.scheduler import ScheduledSeq


def split(seq) -> bool:
    """A chunk run by layers over several steps (ScheduledSeq.layers): a forward of its own."""
    return getattr(seq, "layers", None) is not None


def precomputed(seq) -> bool:
    """A sequence whose logits came with it (a P/D handoff, ScheduledSeq.logits): no forward."""
    return getattr(seq, "logits", None) is not None


def seq_rows(seq, tree) -> int:
    """Rows a scheduled sequence adds to a forward: its draft tree's nodes, or its new tokens."""
    return len(tree.tokens) if tree is not None else seq.num_new_tokens


def seq_logits(seq, tree) -> int:
    """Logits rows it gets back (build_forward_batch): every tree node, or its last new token
    when the step samples."""
    return len(tree.tokens) if tree is not None else int(seq.samples)


def plan(seqs: list, trees: list) -> list[list[int]]:
    """The sequences' indices grouped into forwards (module docstring): the large ones first,
    together, then the small ones in order, at most BATCH_INVARIANT_M rows a forward."""
    large = [i for i, (s, t) in enumerate(zip(seqs, trees))
             if seq_rows(s, t) > BATCH_INVARIANT_M and not split(s) and not precomputed(s)]
    groups = [[i] for i, s in enumerate(seqs) if split(s)] + [[i] for i in large]
    cur: list[int] = []
    rows = 0
    for i, (s, t) in enumerate(zip(seqs, trees)):
        n = seq_rows(s, t)
        if n > BATCH_INVARIANT_M or split(s) or precomputed(s):
            continue
        if cur and rows + n > BATCH_INVARIANT_M:
            groups.append(cur)
            cur, rows = [], 0
        cur.append(i)
        rows += n
    if cur:
        groups.append(cur)
    return groups


def plan_one(seqs: list, trees: list) -> list[list[int]]:
    """The device plan: every sequence that needs a forward in one (a chunk split by layers,
    which the device path's scheduler never makes, would still run alone)."""
    groups = [[i] for i, s in enumerate(seqs) if split(s)]
    rest = [i for i, s in enumerate(seqs) if not split(s) and not precomputed(s)]
    return groups + [rest] if rest else groups


def run_forward(model, kv_caches, seqs: list, trees: list, block_size: int, path=None,
                hidden: list | None = None, cutoff: float | None = None, rows_fixed: bool = False) -> torch.Tensor:
    """One step's target logits [num_logits, vocab], sequences in order (as one
    build_forward_batch forward would return them), computed in the planned forwards.
    path: the engine's runtime/step_path object (its plan and its packing); None = the CPU's.
    hidden: a list to receive, per sequence, its rows' hidden states [rows, hidden] before the
    final norm (a tree's in node order, a chunk's in token order), None where no forward ran
    its last layer (a handoff, a chunk's middle layers); the forwards run with
    `model.keep_hidden` set (and only they: another engine may share the model).
    cutoff: when split chunks stop starting layers (module docstring; None: never), which may
    change their `layers` and `completes` in place; rows_fixed: the step's logits rows are
    fixed (a grammar bitmask covers them), so a chunk that samples is never cut."""
    groups = path.plan(seqs, trees) if path is not None else plan(seqs, trees)
    # split chunks last: what they may run is what the step's other forwards leave of its time
    groups = [g for g in groups if not split(seqs[g[0]])] + [g for g in groups if split(seqs[g[0]])]
    pack = path.pack if path is not None else None
    if hidden is not None:
        hidden[:] = [None] * len(seqs)
        model.keep_hidden, model.last_hidden = True, None
        try:
            return _run_groups(model, kv_caches, seqs, trees, block_size, groups, pack, hidden, cutoff, rows_fixed)
        finally:
            model.keep_hidden, model.last_hidden = False, None
    return _run_groups(model, kv_caches, seqs, trees, block_size, groups, pack, None, cutoff, rows_fixed)


def _run_groups(model, kv_caches, seqs: list, trees: list, block_size: int, groups, pack,
                hidden: list | None, cutoff: float | None = None, rows_fixed: bool = False) -> torch.Tensor:
    if len(groups) == 1 and len(groups[0]) == len(seqs) and not split(seqs[groups[0][0]]):
        batch = build_forward_batch(seqs, trees, block_size, model.device, pack=pack)
        logits = model.forward(batch, kv_caches)
        if hidden is not None:
            _take_hidden(model, seqs, trees, range(len(seqs)), hidden)
        return logits
    # per sequence: its logits rows (a handed-off prompt's came with it)
    parts: list[torch.Tensor | None] = [s.logits if precomputed(s) else None for s in seqs]
    first_split = True
    for group in groups:
        if split(seqs[group[0]]):
            # past the cutoff only the step's first split chunk still runs a layer
            logits = _forward_split(model, kv_caches, seqs[group[0]], block_size, pack, cutoff, rows_fixed,
                                    must_progress=first_split)
            first_split = False
            if logits is not None:
                parts[group[0]] = logits
            if hidden is not None and seqs[group[0]].completes:
                _take_hidden(model, seqs, trees, group, hidden)
            continue
        batch: ForwardBatch = build_forward_batch([seqs[i] for i in group], [trees[i] for i in group],
                                                  block_size, model.device, pack=pack)
        logits = model.forward(batch, kv_caches)  # [group's logits rows, vocab]
        if hidden is not None:
            _take_hidden(model, seqs, trees, group, hidden)
        row = 0
        for i in group:
            n = seq_logits(seqs[i], trees[i])
            parts[i] = logits[row:row + n]
            row += n
    kept = [p for p in parts if p is not None]
    if not kept:  # only a chunk's middle layers ran: no logits this step
        return torch.empty(0, model.config.vocab_size, dtype=torch.float32, device=model.device)
    return torch.cat(kept)


def _take_hidden(model, seqs: list, trees: list, group, hidden: list) -> None:
    """The last forward's hidden states (model.last_hidden, its sequences' rows in order) cut
    into `hidden`'s entries for the sequences of `group`."""
    h, row = model.last_hidden, 0
    model.last_hidden = None
    if h is None:
        return
    for i in group:
        n = seq_rows(seqs[i], trees[i])
        hidden[i] = h[row:row + n]
        row += n


def _forward_split(model, kv_caches, seq, block_size: int, pack=None, cutoff: float | None = None,
                   rows_fixed: bool = False, must_progress: bool = True) -> torch.Tensor | None:
    """Layers [start, stop) of a chunk split by layers, or fewer past `cutoff` (run_forward;
    none at all unless `must_progress`); its logits [1, vocab] when this step runs its last
    layer and it samples, else None. The chunk's batch (built once, with the logits row it will
    need) and hidden states wait on the request between steps."""
    request = seq.request
    start, stop = seq.layers
    if start == 0:
        whole = ScheduledSeq(request, seq.num_new_tokens, 0)  # as the chunk's last step will see it
        batch, h = build_forward_batch([whole], [None], block_size, model.device, pack=pack), None
    else:
        batch, h = request.chunk_state
    if cutoff is None or (rows_fixed and seq.samples):
        h = model.forward_layers(batch, kv_caches, h, start, stop)  # [chunk_tokens, hidden]
    else:
        h, reached = _layers_until(model, batch, kv_caches, h, start, stop, cutoff, must_progress)
        if reached < stop:  # the rest in later steps (the engine tells the scheduler: layers_run)
            seq.layers, seq.completes = (start, reached), False
    if not seq.completes:
        request.chunk_state = (batch, h) if seq.layers[1] > 0 else None  # (none run: not started)
        return None
    request.chunk_state = None
    if model.keep_hidden:
        model.last_hidden = h  # forward_head keeps it too, when the chunk samples
    return model.forward_head(batch, h) if seq.samples else None


# A split chunk's layers run in a few calls a step (its first layer alone, then at most this
# many groups): the cutoff is looked at before each, and a call's fixed cost (~tens of
# microseconds) stays small beside its layers.
_CUT_GROUPS = 4

_now = time.perf_counter  # (tests put a clock of their own here)


def _layers_until(model, batch, kv_caches, h, start: int, stop: int, cutoff: float,
                  must_progress: bool = True) -> tuple[torch.Tensor, int]:
    """Layers from `start` towards `stop` while they end by `cutoff`: (h after them, the first
    layer not run). The first layer runs alone (its time is the estimate: nothing unmeasured
    runs past the cutoff), always when `must_progress` (the step's prefill always progresses),
    else only before the cutoff; then groups, each as many layers as the estimate says end by
    the cutoff (the slower of the last call's time a layer and the average: a host that just
    got busier is believed)."""
    group = max(1, math.ceil((stop - start - 1) / _CUT_GROUPS))
    i, t0 = start, _now()
    per_layer = 0.0
    while i < stop:
        now = _now()
        if i == start:
            if now >= cutoff and not must_progress:
                break
            n = 1
        else:
            if now >= cutoff:
                break
            per_layer = max(per_layer, (now - t0) / (i - start))
            n = min(group, stop - i, int((cutoff - now) / per_layer) if per_layer > 0 else group)
            if n <= 0:
                break
        t = _now()
        h = model.forward_layers(batch, kv_caches, h, i, i + n)  # h after layer i + n - 1: the same bits as one call
        per_layer = (_now() - t) / n  # the last call's, for the max above
        i += n
    return h, i
