"""A long-running server's memory: the KV cache made resident ahead of need, malloc settings
that keep the heap from fragmenting, and the start-up heap kept out of the cyclic collector.

The KV cache is allocated as untouched zero pages (runtime/model.py `_zeros`), so a start costs
nothing for it; left so, the process's memory then grows page by page for as long as the
server runs (first the cache fills, then the prefix cache keeps it full), which reads like a leak
and makes some decode steps pay page faults. `prefault_in_background` asks the kernel to back
every page now, on a thread: MADV_POPULATE_WRITE (Linux 5.14+) maps the pages writable without
changing their contents, so it is safe while the engine already writes KV rows. Where the call is
missing (older kernels, other systems) nothing happens and the pages stay lazy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23


def _madvise():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate(tensors: list[torch.Tensor]) -> int:
    """Back the whole pages inside each CPU tensor's bytes; returns the bytes populated (0 where
    the kernel lacks MADV_POPULATE_WRITE)."""
    if not hasattr(os, "sysconf"):
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        madvise = _madvise()
    except (OSError, AttributeError):
        return 0
    done = 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end <= start:
            continue
        if madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
            log.debug("madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(ctypes.get_errno()))
            return done
        done += end - start
    return done


def prefault_in_background(tensors: list[torch.Tensor]) -> threading.Thread:
    """`populate(tensors)` on a daemon thread (the syscall releases the GIL); the thread holds the
    tensors until it is done."""
    thread = threading.Thread(target=populate, args=(list(tensors),), name="kv-prefault", daemon=True)
    thread.start()
    return thread


_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8


def tune_allocator(mmap_threshold: int = 32 << 20, arena_max: int = 2) -> bool:
    """glibc malloc settings for a long-running server: a fixed mmap threshold, so every buffer of
    32 MiB or more is mapped and handed back to the system when freed (glibc's default raises the
    threshold after such a free, and later big buffers then come from the heap, which fragments
    and seldom shrinks); and few arenas, so each thread that ever allocated (event loop, engine,
    tokenizer pool) does not keep a heap of its own. The threshold is glibc's own ceiling for its
    moving one, not lower: every mapped buffer is fresh pages, faulted in on first touch, and at
    1 MiB a prefill's activations were mapped and unmapped every layer (a 1500-token prompt alone
    through the server took 3.0 s against 2.5 s at 32 MiB, the same RSS; 2-core AVX-512 machine).
    False when the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_ARENA_MAX, arena_max))


def freeze_startup_objects() -> int:
    """Move every object alive now (the model, torch's and the libraries' modules) to the
    collector's permanent generation (gc.freeze), after one full collection; returns how many.

    CPython's oldest-generation collection walks every tracked object, and a loaded server holds
    hundreds of thousands that never become garbage: measured in `prescient serve` on the default
    model, each such collection took 100-120 ms (2 in ~8 s of batch-1 streaming), holding the GIL,
    so the engine thread could not start its next step -- a stall of that size in every stream's
    inter-token gap. Frozen, the same collections take ~1.6 ms. Objects made later are collected
    as before; a frozen object freed by its reference count is freed as ever (only cycles among
    start-up objects are no longer found)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
