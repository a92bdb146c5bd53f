"""How many threads the native kernels' pool gets by default: the cores this process may use.

The pool (kernels/cpu_runtime.c) runs every GEMV, the attention kernel and, since prefill runs
on the decode kernels, every prefill chunk. Its size once was a flat 2 (every machine measured
here had 2 cores), which on a user's 8- or 16-core machine left decode's memory bandwidth and
prefill's compute on two cores while llama.cpp, the peer, uses them all. The default now is

    usable_cores = min(physical cores in the affinity mask, the cgroup CPU quota)

SMT siblings count once: two hyperthreads share one core's integer-dot and FMA units, and a
worker spinning beside the caller on the same core only slows prefill (a lone core's two
threads are the exception: 2, the old default every 2-vCPU machine here ran). A container's CPU quota
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
    """Distinct physical cores among `cpus` (logical CPU ids): a core is its set of SMT siblings
    (topology/thread_siblings_list), or its (package, core id) where that list is missing; the
    number of CPUs when the topology cannot be read for one of them (count every CPU a core)."""
    cpus = list(cpus)
    seen = set()
    for c in cpus:
        topo = sysfs / f"cpu{c}" / "topology"
        siblings = _read(topo / "thread_siblings_list")
        if siblings:
            seen.add(siblings)
            continue
        package, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        if package is None or core is None:
            return len(cpus)
        seen.add((package, core))
    return len(seen)


def _quota(text: str | None, period: str | None = None) -> float | None:
    """CPUs of time of one cgroup level: v2 "quota period" / "max period", or v1's quota (-1:
    none) with its period."""
    if not text:
        return None
    quota, _, p = text.partition(" ")
    p = period if period is not None else p
    try:
        q, per = int(quota), int(p or "100000")
    except ValueError:  # "max", or unreadable
        return None
    return q / per if q > 0 and per > 0 else None


def cgroup_cpu_limit(cgroup: Path = _CGROUP, proc_cgroup: str | None = None) -> float | None:
    """CPUs of time the cgroup quotas allow this process, None without a quota: the smallest
    quota from its own cgroup (/proc/self/cgroup: v2 "0::/path", v1 "n:cpu,...:/path") up to the
    hierarchy's root, as mounted under `cgroup` (a container sees its own cgroup at the root)."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    levels = []  # (directory, v1) from the process's cgroup up to the root
    for line in proc_cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v1 = "cpu" in controllers.split(",")
        if controllers and not v1:
            continue
        mount = cgroup if not v1 else next((cgroup / d for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                                            if (cgroup / d).is_dir()), cgroup / "cpu")
        parts = [q for q in path.strip("/").split("/") if q]
        levels += [(mount.joinpath(*parts[:i]), v1) for i in range(len(parts), -1, -1)]
    if not levels:  # no /proc: the root as a container sees it
        levels = [(cgroup, False), (cgroup / "cpu", True)]
    limits = []
    for directory, v1 in levels:
        if v1:
            limit = _quota(_read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us"))
        else:
            limit = _quota(_read(directory / "cpu.max"))
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def usable_cores(cpus: Iterable[int] | None = None, sysfs: Path = _SYSFS_CPU, cgroup: Path = _CGROUP,
                 proc_cgroup: str | None = None) -> int:
    """Physical cores of the affinity mask (`cpus`; default this process's), bounded by the
    cgroup quota (rounded down: 1.5 CPUs of time keep one thread busy, not two); at least 1.
    One core with two SMT threads (a common 2-vCPU cloud VM) still gets 2: the pool's default on
    every 2-vCPU machine measured here (whether any of them was an SMT pair is not known), which
    this keeps rather than halving decode's weight streaming on an unmeasured guess."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = list(cpus)
    n = physical_cores(cpus, sysfs)
    if n < 2 <= len(cpus):
        n = 2
    limit = cgroup_cpu_limit(cgroup, proc_cgroup)
    if limit is not None:
        n = min(n, math.floor(limit))
    return max(1, n)


def default_threads() -> int:
    """The pool size when PRESCIENT_GEMV_THREADS is unset: usable_cores(), at most MAX_THREADS."""
    return min(usable_cores(), MAX_THREADS)


__all__ = ["MAX_THREADS", "physical_cores", "cgroup_cpu_limit", "usable_cores", "default_threads"]
