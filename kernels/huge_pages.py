"""Memory the kernels stream every step (weight copies, the KV cache), on transparent huge pages.

A decode step reads every weight once, ~92 MiB for the default model, as one long sequential
stream a thread. On 4 KiB pages that stream takes a TLB miss every 4 KiB and the hardware
prefetchers stop at every page boundary; on 2 MiB pages neither happens. Measured on the 2-core
Zen 4 EPYC (docs/CPU_PERFORMANCE.md, twenty-second session): two threads reading 256 MiB in
order, 36-39 GB/s on 4 KiB pages, 47-51 GB/s on 2 MiB pages.

Linux backs an anonymous mapping with huge pages where it is advised to (`MADV_HUGEPAGE`;
`transparent_hugepage/enabled` is `madvise` on most distributions, and `always` needs no advice),
so:

    empty(nbytes)  an uninitialised uint8 tensor, 64-byte aligned, carved from the current arena
                   (an advised mapping of ARENA_BYTES; a larger request gets one of its own),
                   in the order asked: the order a model's layers are built and read, so one
                   layer's weights follow the previous layer's and the stream runs on across
                   matrices. For the copies the kernels read (kernels/quant_linear.py's SIMD
                   layouts, kernels/cpu_linear.py's bf16 row-pair and AMX copies).
    zeros(nbytes)  a zero-filled uint8 tensor on a mapping of its own from ZEROS_MIN_BYTES (a KV
                   cache: freed with it), zero pages handed out lazily as calloc does, 2 MiB at a
                   first touch (so smaller caches stay on calloc's pages).
    adopt(t)       t's values in the arena (a float weight the kernels read as stored), or
                   t.contiguous() where t is small, a view into a larger tensor (the other holder
                   keeps the memory: a tensor-parallel rank's LM head rows of its embedding), off
                   the CPU, already adopted, or where no arena can be had.
    fresh_arena()  the next copy starts a new arena: each model's build calls it first, so a
                   draft or probe model built later never shares, so never pins, the target's.

Everything falls back to ordinary memory (torch.empty; numpy's lazy calloc for zeros) where the
platform has no MADV_HUGEPAGE, where PRESCIENT_HUGEPAGES=0, where a mapping is refused (a
sandbox, the map count; remembered, so not asked again), or for small requests. A mapping goes
when the last tensor made from it does: each tensor holds the mmap (torch.frombuffer's storage),
and the current arena only weakly once carved from, so no arena outlives its tensors. Within one
arena, space is never reused: a tensor freed early (a copy dropped by `regroup(False)`) keeps its
pages until the arena's others go. Nothing here ever closes or resizes a mapping: that would
unmap memory under live tensors.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np
import torch

HUGE = 2 << 20            # the huge page size of x86-64 and of arm64's 4 KiB granule
ARENA_BYTES = 64 << 20    # one mapping per this many bytes of weight copies
MIN_BYTES = 256 << 10     # smaller copies: ordinary memory (an arena's 2 MiB pages are for streams)
ZEROS_MIN_BYTES = HUGE    # smaller caches: calloc's pages (a mapping of their own would round up)
ALIGN = 64                # a cache line: no kernel's vector load straddles two

_lock = threading.Lock()
_arena: "_Mapping | None" = None
_refused = False          # a mapping was refused once: ordinary memory from then on


def enabled() -> bool:
    """Whether large requests come from advised mappings: the platform has MADV_HUGEPAGE,
    PRESCIENT_HUGEPAGES is not 0 and no mapping has been refused. (Whether the kernel then grants
    huge pages is its setting: /sys/kernel/mm/transparent_hugepage/enabled, `never` turns them
    off.)"""
    return (hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("PRESCIENT_HUGEPAGES", "1") != "0"
            and not _refused)


class _Mapping:
    """One advised anonymous mapping, handed out front to back from its first 2 MiB boundary
    (the kernel backs only whole, aligned 2 MiB ranges with a huge page). Held strongly until the
    first carve, then weakly: the carved tensors keep it."""

    def __init__(self, nbytes: int):
        m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(m, dtype=torch.uint8)
        self.base, self.end = whole.data_ptr(), whole.numel()
        self.pos = -self.base % HUGE
        del whole
        self._strong: "mmap.mmap | None" = m
        self._weak = weakref.ref(m)

    def take(self, nbytes: int) -> "torch.Tensor | None":
        m = self._strong or self._weak()
        start = self.pos + (-(self.base + self.pos) % ALIGN)
        if m is None or start + nbytes > self.end:
            return None
        self.pos = start + nbytes
        out = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start)
        self._strong = None
        return out


def _mapping(nbytes: int) -> "_Mapping | None":
    global _refused
    try:
        return _Mapping(-(-nbytes // HUGE) * HUGE)
    except (OSError, ValueError):  # no such mapping here (a sandbox, an exhausted map count)
        _refused = True
        return None


def _carve(nbytes: int) -> "torch.Tensor | None":
    """nbytes from the arena (or a mapping of its own past ARENA_BYTES); None: ordinary memory."""
    global _arena
    if nbytes < MIN_BYTES or not enabled():
        return None
    if nbytes > ARENA_BYTES:
        own = _mapping(nbytes)
        return own.take(nbytes) if own is not None else None
    with _lock:
        out = _arena.take(nbytes) if _arena is not None else None
        if out is None:
            fresh = _mapping(ARENA_BYTES)
            if fresh is None:
                return None
            _arena, out = fresh, fresh.take(nbytes)
    return out


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes, 64-byte aligned, from the arena where it can be."""
    out = _carve(nbytes)
    return out if out is not None else torch.empty(nbytes, dtype=torch.uint8)


def zeros(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of nbytes, 64-byte aligned, on a mapping of its own from
    ZEROS_MIN_BYTES; no page is written (or backed) until touched."""
    if nbytes >= ZEROS_MIN_BYTES and enabled():
        own = _mapping(nbytes)
        if own is not None:
            return own.take(nbytes)
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)  # calloc: lazily zeroed pages too
    offset = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[offset:offset + nbytes])


def adopt(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with t's values, in the arena where t is a large CPU tensor of its own
    (a copy: t's memory goes when its last holder lets go). Adopting an adopted tensor returns it,
    so a weight shared by two layers (a tied embedding and LM head) keeps one copy."""
    if t.device.type != "cpu" or getattr(t, "_huge_pages", False):
        return t.contiguous()
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() > nbytes:  # a view into a larger tensor: its holder keeps the memory
        return t.contiguous()
    out = _carve(nbytes)
    if out is None:
        return t.contiguous()
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    out._huge_pages = True  # type: ignore[attr-defined]
    return out


def describe(thp_setting: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """What the startup memory line says of this module: "on huge pages" where the advice is
    taken, else why not (switched off, no THP on this platform or kernel, `never`, a refusal)."""
    if os.environ.get("PRESCIENT_HUGEPAGES", "1") == "0":
        return "huge pages off (PRESCIENT_HUGEPAGES=0)"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no huge pages on this platform"
    if _refused:
        return "huge pages refused (a mapping failed)"
    try:
        with open(thp_setting) as f:
            mode = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "no transparent huge pages in this kernel"
    if mode == "never":
        return "transparent huge pages set to never"
    return "on huge pages"


def fresh_arena() -> None:
    """The next copy starts a new arena (a model's build calls it first: a draft or probe model
    built after the target never carves from, so never pins, the target's arena pages)."""
    global _arena
    with _lock:
        _arena = None
