"""Counting the host syncs an engine step makes, on any device (the CPU included).

On CUDA a step's latency is set as much by how often the host waits for the GPU as by the
kernels: every read of a device value (`.item()`, `.tolist()`, `int(t)`, `.cpu()`), every
blocking host-to-device copy (`torch.tensor(..., device=d)`, `.to(d)` without non_blocking) and
every op whose output size depends on the data (`nonzero`, boolean-mask indexing,
`repeat_interleave` by a tensor) drains the stream. On a CPU none of these costs a thing, so a
test could never see them by timing; `count_syncs` wraps those entry points instead and records
each call made from the engine's step code (runtime/ and speculative/), whatever the device.

Not counted, by design: calls from kernels/ (on CPU they stand in for device kernels that take
no decision on the host: the C kernels, the reference ops), from grammar/ and runtime/constrain.py
(grammar matching is host work: the bitmask is built on the host and copied), and from torch's
own Python code, and from runtime/staging.py (it writes host memory; its one copy a step is
non-blocking). Other non-blocking copies are recorded apart (`uploads`): they do not stall the host.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
_COUNTED = tuple(str(_ROOT / d) + "/" for d in ("runtime", "speculative"))
# constrain.py: grammar host work; staging.py: writes host memory and issues the one non-blocking
# copy (counted by StagingBuffer.num_uploads); this file itself
_EXCLUDED = (str(_ROOT / "runtime" / "constrain.py"), str(_ROOT / "runtime" / "staging.py"),
             str(Path(__file__).resolve()))


@dataclass
class SyncLog:
    syncs: list[tuple[str, str]] = field(default_factory=list)  # (what, "file:line")
    uploads: list[str] = field(default_factory=list)  # non-blocking host-to-device copies

    def __len__(self) -> int:
        return len(self.syncs)

    def clear(self) -> None:
        self.syncs.clear()
        self.uploads.clear()


@functools.lru_cache(maxsize=4096)
def _resolved(name: str) -> str:
    # resolved: imported through gpu_check's alias (symlinks), a module's file names the alias
    return str(Path(name).resolve()) if name and not name.startswith("<") else name


def _caller(depth: int = 2) -> str | None:
    """"file:line" of the code that made the call, when it is engine step code."""
    frame = sys._getframe(depth)
    name = _resolved(frame.f_code.co_filename)
    if not name.startswith(_COUNTED) or name in _EXCLUDED:
        return None
    return f"{Path(name).relative_to(_ROOT)}:{frame.f_lineno}"


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _device_arg(args, kwargs) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (str, torch.device)) for a in args)


@contextlib.contextmanager
def count_syncs():
    """Within the block, every host sync made from runtime/ or speculative/ step code is
    appended to the yielded SyncLog (see the module docstring for what counts)."""
    log = SyncLog()
    T = torch.Tensor
    saved_methods = {name: getattr(T, name) for name in
                     ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__",
                      "nonzero", "to", "__getitem__", "__setitem__")}
    saved_funcs = {name: getattr(torch, name) for name in ("tensor", "as_tensor", "nonzero", "repeat_interleave")}

    def reads(name):
        original = saved_methods[name]

        def wrapper(self, *args, **kwargs):
            where = _caller()
            if where is not None:
                log.syncs.append((name, where))
            return original(self, *args, **kwargs)
        return wrapper

    def to(self, *args, **kwargs):
        where = _caller()
        if where is not None and _device_arg(args, kwargs):
            if kwargs.get("non_blocking") or (len(args) > 1 and args[1] is True):
                log.uploads.append(where)
            else:
                log.syncs.append(("to(device)", where))
        return saved_methods["to"](self, *args, **kwargs)

    def getitem(self, index):
        if _is_bool_index(index):
            where = _caller()
            if where is not None:
                log.syncs.append(("bool index", where))
        return saved_methods["__getitem__"](self, index)

    def setitem(self, index, value):
        if _is_bool_index(index):
            where = _caller()
            if where is not None:
                log.syncs.append(("bool index", where))
        return saved_methods["__setitem__"](self, index, value)

    def creates(name):
        original = saved_funcs[name]

        def wrapper(*args, **kwargs):
            where = _caller()
            if where is not None and kwargs.get("device") is not None:
                log.syncs.append((f"torch.{name}(device=)", where))
            return original(*args, **kwargs)
        return wrapper

    def nonzero(*args, **kwargs):
        where = _caller()
        if where is not None:
            log.syncs.append(("torch.nonzero", where))
        return saved_funcs["nonzero"](*args, **kwargs)

    def repeat_interleave(*args, **kwargs):
        where = _caller()
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if where is not None and isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            log.syncs.append(("torch.repeat_interleave", where))
        return saved_funcs["repeat_interleave"](*args, **kwargs)

    patches = {name: reads(name) for name in
               ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "nonzero")}
    patches.update({"to": to, "__getitem__": getitem, "__setitem__": setitem})
    try:
        for name, fn in patches.items():
            setattr(T, name, fn)
        torch.tensor = creates("tensor")
        torch.as_tensor = creates("as_tensor")
        torch.nonzero = nonzero
        torch.repeat_interleave = repeat_interleave
        yield log
    finally:
        for name, fn in saved_methods.items():
            setattr(T, name, fn)
        for name, fn in saved_funcs.items():
            setattr(torch, name, fn)
