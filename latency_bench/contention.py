"""How much of the machine other processes took while a measurement ran ("foreign CPU").

On a shared 2-core machine a colleague's test run can halve a mode's speed for a minute, and
interleaving modes only spreads that over them; a burst still lands on whichever runs it
overlaps. So each batch-1 run is metered: from /proc/stat, CPU time all processes spent busy
during the run, minus this process's own CPU time (os.times: every thread, the C kernels' too),
over wall time x CPUs. 0.0 = the machine was ours; 0.5 on 2 cores = another process held a whole
core throughout. Runs above a threshold are retried and the least disturbed attempt is kept; the
report lists the foreign share of every run. Returns None where /proc/stat does not exist.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    # guest time is already included in user/nice: count the first eight fields only
    return (sum(fields[:8]) - idle) / _TICK


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class CpuMeter:
    """with CpuMeter() as m: ... ; then m.foreign_share (None when unknown)."""

    foreign_share: float | None = None
    own_share: float | None = None
    wall_s: float = 0.0

    def __enter__(self) -> "CpuMeter":
        self._t0, self._busy0, self._own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        busy1, own = _busy_seconds(), _own_seconds() - self._own0
        capacity = self.wall_s * (os.cpu_count() or 1)
        if self._busy0 is None or busy1 is None or capacity <= 0:
            return
        # clock ticks are coarse (10 ms): clamp the small negative differences they produce
        self.foreign_share = min(1.0, max(0.0, (busy1 - self._busy0 - own) / capacity))
        self.own_share = min(1.0, own / capacity)
