"""The device path's host-to-device traffic: one host buffer (pinned on CUDA), one copy per upload.

`pack_forward_batch` builds the ForwardBatch fields as views of two tensors on the device (three
with a mask): as many blocking copies from pageable memory per forward, each of which waits for
the GPU. Here every
field of a forward's metadata is written into one int64 host buffer and moved with one
non-blocking copy; the fields are then views (int32 ones converted on the device, a kernel, not a
sync). Pinned memory is what lets the copy run asynchronously: from pageable memory CUDA stages
through a driver buffer and the call returns only once the copy is done.

A ring of host buffers (8: a step makes a few uploads before its one read: the forward's, the
sampling keys', one per penalised request, the KV moves') keeps a write from racing a copy still
in flight; each records a CUDA event after its copy, and a buffer whose copy has not completed
is replaced by a fresh one rather than waited for (that wait would be a host sync).
On a CPU device the "copy" is a clone: the views must not alias a buffer the next upload
rewrites (a chunk split by layers keeps its batch across steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from prescient.runtime.batch import ForwardBatch, SeqRows, _mask_bits, slot_of


class StagingBuffer:
    """Uploads of int64 parts through a ring of host buffers, one copy per `upload` call."""

    def __init__(self, device: torch.device | str, slots: int = 8, min_elems: int = 1 << 12):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list = [None] * slots
        self._next = 0
        self._min = min_elems
        self.num_uploads = 0  # copies issued (each one non-blocking on CUDA)

    def _host(self, total: int) -> tuple[int, torch.Tensor]:
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        event = self._events[i]
        if event is not None and not event.query():
            # the copy from this buffer (a ring ago) is still queued behind the GPU's work:
            # waiting would be a host sync; a fresh buffer instead (torch's pinned allocator
            # keeps the old block until its copy is done)
            self._bufs[i] = None
        buf = self._bufs[i]
        if buf is None or buf.numel() < total:
            size = max(total, self._min, 2 * (buf.numel() if buf is not None else 0))
            buf = torch.empty(size, dtype=torch.int64, pin_memory=self.pinned)
            self._bufs[i] = buf
        return i, buf

    def _fill(self, parts: Sequence) -> tuple[int, torch.Tensor, list[int], int]:
        """The parts written one after another into a host buffer: (its ring index, the buffer,
        each part's size, their total)."""
        sizes = [p.numel() if isinstance(p, torch.Tensor) else len(p) for p in parts]
        total = sum(sizes)
        i, host = self._host(total)
        flat = host.numpy()
        offset = 0
        for part, n in zip(parts, sizes):
            if n:
                if isinstance(part, torch.Tensor):
                    host[offset:offset + n] = part.reshape(-1)
                else:
                    flat[offset:offset + n] = part
            offset += n
        return i, host, sizes, total

    def upload(self, parts: Sequence[Sequence[int] | np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
        """Each part (Python ints, a numpy array, or a host integer tensor) as a 1-D int64 tensor
        on the device, all moved by one copy; the results are views of one device tensor (its
        own memory: the ring comes back to the host buffer)."""
        sizes = [p.numel() if isinstance(p, torch.Tensor) else len(p) for p in parts]
        dev = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        self.upload_into(parts, dev)
        return list(dev.split(sizes))

    def upload_into(self, parts: Sequence, dst: torch.Tensor) -> None:
        """`upload`, written into `dst` (a 1-D int64 device tensor at least as long: a CUDA
        graph's static input) by the one copy instead of into a new tensor."""
        i, host, sizes, total = self._fill(parts)
        dst[:total].copy_(host[:total], non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[i] = event
        self.num_uploads += 1


def pack_staged(rows: list[SeqRows], block_size: int, staging: StagingBuffer) -> ForwardBatch:
    """`pack_forward_batch` through one upload: the same fields, dtypes and values."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    context_lens: list[int] = []
    cu = [0]
    logits_indices: list[int] = []
    max_blocks = max(len(s.block_ids) for s in rows)
    table = np.zeros((len(rows), max_blocks), dtype=np.int64)
    for i, s in enumerate(rows):
        num_rows = len(s.input_ids)
        row = cu[-1]
        table[i, :len(s.block_ids)] = s.block_ids
        input_ids.extend(s.input_ids)
        positions.extend(s.positions)
        slots.extend(slot_of(s.block_ids, p, block_size) for p in range(s.start, s.start + num_rows))
        context_lens.append(s.start + num_rows)
        cu.append(row + num_rows)
        logits_indices.extend(row + r for r in s.logits_rows)
    mask = _mask_bits(rows, cu) if any(s.mask_bits is not None for s in rows) else None  # [T, W] int32
    parts = [input_ids, positions, slots, logits_indices, context_lens, cu, table.reshape(-1)]
    if mask is not None:
        parts.append(mask)  # int32 words widened to int64 (exact), narrowed back on the device
    dev = staging.upload(parts)
    ids, pos, slot, logit_rows, ctx, cu_t, table_t = dev[:7]
    return ForwardBatch(
        input_ids=ids, positions=pos, slot_mapping=slot,
        block_tables=table_t.view(len(rows), max_blocks).to(torch.int32),
        context_lens=ctx.to(torch.int32), cu_seqlens_q=cu_t.to(torch.int32),
        mask_bits=None if mask is None else dev[7].view(mask.shape).to(torch.int32),
        logits_indices=logit_rows,
    )
