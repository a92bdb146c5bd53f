"""The kernel pool's default size: the usable physical cores (kernels/cpu_threads.py).

A fake sysfs topology and cgroup tree stand for the machines users have: SMT siblings count once,
a container's CPU quota bounds the count, a missing topology counts every CPU. The loaded library
gets that size unless PRESCIENT_GEMV_THREADS says otherwise.
"""

import os
import subprocess
import sys

import pytest

from prescient.kernels import cpu_linear, cpu_threads


def _topology(root, cores):
    """cores: {cpu id: (package, core)} written as sysfs topology files under root."""
    for cpu, (package, core) in cores.items():
        t = root / f"cpu{cpu}" / "topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{package}\n")
        (t / "core_id").write_text(f"{core}\n")
    return root


def test_smt_siblings_count_once(tmp_path):
    # 4 cores x 2 threads, Linux numbering: cpu n and n + 4 are siblings
    sysfs = _topology(tmp_path, {c: (0, c % 4) for c in range(8)})
    assert cpu_threads.physical_cores(range(8), sysfs) == 4
    # an affinity mask holding both siblings of core 0 and one thread of core 1
    assert cpu_threads.physical_cores([0, 4, 1], sysfs) == 2


def test_cores_of_two_packages_are_distinct(tmp_path):
    sysfs = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)})
    assert cpu_threads.physical_cores(range(4), sysfs) == 4


def test_without_a_topology_every_cpu_counts(tmp_path):
    sysfs = _topology(tmp_path, {0: (0, 0)})
    assert cpu_threads.physical_cores([0, 1, 2], sysfs) == 3


@pytest.mark.parametrize("text, cpus", [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5)])
def test_cgroup_v2_quota(tmp_path, text, cpus):
    (tmp_path / "cpu.max").write_text(text + "\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path) == cpus


@pytest.mark.parametrize("quota, cpus", [("-1", None), ("300000", 3.0)])
def test_cgroup_v1_quota(tmp_path, quota, cpus):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path) == cpus


def test_a_container_quota_bounds_the_cores(tmp_path):
    sysfs = _topology(tmp_path / "sys", {c: (0, c) for c in range(16)})
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "cpu.max").write_text("250000 100000\n")  # --cpus 2.5 on a 16-core host
    assert cpu_threads.usable_cores(range(16), sysfs, cgroup) == 2
    (cgroup / "cpu.max").write_text("50000 100000\n")  # half a CPU still runs one thread
    assert cpu_threads.usable_cores(range(16), sysfs, cgroup) == 1
    (cgroup / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.usable_cores(range(16), sysfs, cgroup) == 16


def test_default_threads_is_capped_at_the_pools_limit():
    assert 1 <= cpu_threads.default_threads() <= cpu_threads.MAX_THREADS
    assert cpu_threads.default_threads() == min(cpu_threads.usable_cores(), cpu_threads.MAX_THREADS)


@pytest.mark.skipif(not cpu_linear.available(), reason="no C kernel library")
@pytest.mark.parametrize("env, expect", [(None, "default"), ("1", 1)])
def test_the_loaded_pool_takes_the_default_unless_the_variable_says(env, expect):
    # a fresh process: the pool size is set when the library loads
    environ = {k: v for k, v in os.environ.items() if k != "PRESCIENT_GEMV_THREADS"}
    if env is not None:
        environ["PRESCIENT_GEMV_THREADS"] = env
    code = ("from prescient.kernels import cpu_linear, cpu_threads; "
            "print(cpu_linear.kernel_info()['threads'], cpu_threads.default_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    threads, default = map(int, out.stdout.split())
    assert threads == (default if expect == "default" else expect)
