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
                   layouts, kernels/cpu_linear.py's bf16 copies).
    zeros(nbytes)  a zero-filled uint8 tensor on a mapping of its own (a KV cache: freed with
                   it), zero pages handed out lazily as calloc does, 2 MiB at a first touch.
    adopt(t)       t's values in the arena (a float weight the kernels read as stored), or t
                   itself where it is small, already adopted, or off the CPU.

Either falls back to ordinary memory (torch.empty; numpy's lazy calloc for zeros) where the
platform has no MADV_HUGEPAGE, where PRESCIENT_HUGEPAGES=0, or for requests under MIN_BYTES. A
mapping is released when the last tensor made from it is (each tensor holds it), so loading and
dropping models leaks nothing; an arena's untouched tail costs no memory.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import torch

HUGE = 2 << 20           # the huge page size of x86-64 and of arm64's 4 KiB granule
ARENA_BYTES = 64 << 20   # one mapping per this many bytes of weight copies
MIN_BYTES = 256 << 10    # smaller requests: ordinary memory (an arena's 2 MiB pages are for streams)
ALIGN = 64               # a cache line: no kernel's vector load straddles two

_lock = threading.Lock()
_arena: "_Mapping | None" = None


def enabled() -> bool:
    """Whether large requests come from advised mappings: the platform has MADV_HUGEPAGE and
    PRESCIENT_HUGEPAGES is not 0. (Whether the kernel then grants huge pages is its setting:
    /sys/kernel/mm/transparent_hugepage/enabled, `never` turns them off.)"""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("PRESCIENT_HUGEPAGES", "1") != "0"


class _Mapping:
    """One advised anonymous mapping, handed out front to back from its first 2 MiB boundary
    (the kernel backs only whole, aligned 2 MiB ranges with a huge page)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base, self.end = whole.data_ptr(), whole.numel()
        self.pos = -self.base % HUGE
        del whole

    def take(self, nbytes: int) -> "torch.Tensor | None":
        start = self.pos + (-(self.base + self.pos) % ALIGN)
        if start + nbytes > self.end:
            return None
        self.pos = start + nbytes
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=start)


def _mapping(nbytes: int) -> "_Mapping | None":
    try:
        return _Mapping(-(-nbytes // HUGE) * HUGE)
    except (OSError, ValueError):  # no such mapping here (a sandbox, an exhausted map count)
        return None


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes, 64-byte aligned, from the shared arena (a request
    larger than an arena: a mapping of its own, the arena left as it was)."""
    global _arena
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes > ARENA_BYTES:
        own = _mapping(nbytes)
        return own.take(nbytes) if own is not None else torch.empty(nbytes, dtype=torch.uint8)
    with _lock:
        out = _arena.take(nbytes) if _arena is not None else None
        if out is None:
            fresh = _mapping(ARENA_BYTES)
            if fresh is None:
                return torch.empty(nbytes, dtype=torch.uint8)
            _arena, out = fresh, fresh.take(nbytes)
    return out


def zeros(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of nbytes, 64-byte aligned, on a mapping of its own; no page is
    written (or backed) until touched."""
    if nbytes >= MIN_BYTES and enabled():
        own = _mapping(nbytes)
        if own is not None:
            return own.take(nbytes)
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)  # calloc: lazily zeroed pages too
    offset = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[offset:offset + nbytes])



def adopt(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with t's values, in the arena where t is large enough (a copy: t's
    own memory goes when its last holder lets go). Adopting an adopted tensor returns it, so a
    weight shared by two layers (a tied embedding and LM head) keeps one copy."""
    if t.device.type != "cpu" or getattr(t, "_huge_pages", False):
        return t
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES or not enabled():
        return t.contiguous()
    out = empty(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    out._huge_pages = True  # type: ignore[attr-defined]
    return out
