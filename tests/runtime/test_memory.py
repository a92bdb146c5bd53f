"""runtime/memory.py: a lazily zeroed buffer becomes resident without its contents changing."""

from __future__ import annotations

import os
import platform
import sys

import pytest
import torch

from prescient.runtime.memory import populate
from prescient.runtime.model import _zeros


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of t's whole pages that are resident (mincore)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(b & 1 for b in vec) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populate_backs_the_pages_and_keeps_the_contents():
    # 48 MiB: past glibc's largest mmap threshold (32 MiB), so fresh zero pages whatever the heap holds
    t = _zeros((8192, 16, 3, 64), torch.bfloat16, torch.device("cpu"))
    t[5, 3] = 1.5  # a row the engine already wrote
    done = populate([t])
    if done == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    # every whole page inside the tensor is backed now (whether or not the allocator had handed
    # out pages already resident: some environments do, so no "before" is asserted)
    page = os.sysconf("SC_PAGE_SIZE")
    assert done >= t.numel() * t.element_size() - 2 * page and _resident_bytes(t) >= done
    assert t[5, 3].eq(1.5).all() and t.float().abs().sum() == 1.5 * 3 * 64


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_tune_allocator_applies_on_glibc():
    import subprocess

    # in a child: the settings are process-wide
    code = "from prescient.runtime.memory import tune_allocator; print(tune_allocator())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_freeze_startup_objects_keeps_them_out_of_later_collections():
    import subprocess

    # in a child: gc.freeze is process-wide. The objects alive at the call are frozen (a full
    # collection no longer looks at them: a cycle among them that becomes garbage later
    # survives it), objects made after it are collected as ever (a later cycle is freed).
    code = """
import gc, weakref
from prescient.runtime.memory import freeze_startup_objects
class Node: pass
def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a
held = cycle()  # alive at start-up, garbage later
n = freeze_startup_objects()
assert n == gc.get_freeze_count() > 1000, n
old = weakref.ref(held)
del held
gc.collect()
assert old() is not None, "a frozen cycle was collected"
new = weakref.ref(cycle())
gc.collect()
assert new() is None, "a cycle made after the freeze was not collected"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
