"""How many threads the native kernels' pool gets by default: the cores this process may use.

The pool (kernels/cpu_runtime.c) runs every GEMV, the attention kernel and, since prefill runs
on the decode kernels, every prefill chunk. Its size once was a flat 2 (every machine measured
here had 2 cores), which on a user's 8- or 16-core machine left decode's memory bandwidth and
prefill's compute on two cores while llama.cpp, the peer, uses them all. The default now is

    usable_cores = min(physical cores in the affinity mask, the cgroup CPU quota)

SMT siblings count once: two hyperthreads share one core's integer-dot and FMA units, and a
worker spinning beside the caller on the same core only slows it. A container's CPU quota
(`docker --cpus 2` on a 64-core host: 64 CPUs in the mask, 2 CPUs of time) bounds it, or the
pool's spinning workers would be descheduled mid-chunk. `PRESCIENT_GEMV_THREADS` overrides it
(kernels/cpu_linear.py); the pool's own cap is PG_MAX_THREADS (16). Ranks of one machine (tensor
parallel, the prefill worker) share `usable_cores()` out (runtime/tensor_parallel.default_threads).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

MAX_THREADS = 16  # PG_MAX_THREADS in kernels/cpu_runtime.c
_SYSFS_CPU = Path("/sys/devices/system/cpu")
_CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def physical_cores(cpus: Iterable[int], sysfs: Path = _SYSFS_CPU) -> int:
    """Distinct (package, core) pairs among `cpus` (logical CPU ids); the number of CPUs when
    the topology cannot be read for one of them (no sysfs: count every CPU as a core)."""
    cpus = list(cpus)
    seen = set()
    for c in cpus:
        topo = sysfs / f"cpu{c}" / "topology"
        package, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        if package is None or core is None:
            return len(cpus)
        seen.add((package, core))
    return len(seen)


def cgroup_cpu_limit(cgroup: Path = _CGROUP) -> float | None:
    """CPUs of time the cgroup quota allows (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / period),
    None without a quota. Read at the hierarchy's root as a container sees it (its own cgroup
    is mounted there)."""
    v2 = _read(cgroup / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max":
            try:
                return int(quota) / int(period or "100000")
            except ValueError:
                return None
        return None
    quota, period = _read(cgroup / "cpu" / "cpu.cfs_quota_us"), _read(cgroup / "cpu" / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cores(cpus: Iterable[int] | None = None, sysfs: Path = _SYSFS_CPU, cgroup: Path = _CGROUP) -> int:
    """Physical cores of the affinity mask (`cpus`; default this process's), bounded by the
    cgroup quota (rounded down: 1.5 CPUs of time keep one thread busy, not two); at least 1."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    n = physical_cores(cpus, sysfs)
    limit = cgroup_cpu_limit(cgroup)
    if limit is not None:
        n = min(n, math.floor(limit))
    return max(1, n)


def default_threads() -> int:
    """The pool size when PRESCIENT_GEMV_THREADS is unset: usable_cores(), at most MAX_THREADS."""
    return min(usable_cores(), MAX_THREADS)


__all__ = ["MAX_THREADS", "physical_cores", "cgroup_cpu_limit", "usable_cores", "default_threads"]
