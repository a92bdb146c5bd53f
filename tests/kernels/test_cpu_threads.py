"""The kernel pool's default size: the usable physical cores (kernels/cpu_threads.py).

Fake sysfs topologies and cgroup trees stand for the machines users have: SMT siblings count
once, a container's (or a parent cgroup's) CPU quota bounds the count, a missing topology counts
every CPU. The loaded library gets that size unless PRESCIENT_GEMV_THREADS says otherwise.
"""

import os
import subprocess
import sys

import pytest

from prescient.kernels import cpu_linear, cpu_threads


def _topology(root, cores, siblings=True):
    """cores: {cpu id: (package, core)} as sysfs topology files under root; with `siblings`
    each CPU's thread_siblings_list too (the CPUs of the same (package, core))."""
    for cpu, (package, core) in cores.items():
        t = root / f"cpu{cpu}" / "topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{package}\n")
        (t / "core_id").write_text(f"{core}\n")
        if siblings:
            same = sorted(c for c, pc in cores.items() if pc == (package, core))
            (t / "thread_siblings_list").write_text(",".join(map(str, same)) + "\n")
    return root


@pytest.mark.parametrize("siblings", [True, False], ids=["siblings_list", "core_id"])
def test_smt_siblings_count_once(tmp_path, siblings):
    # 4 cores x 2 threads, Linux numbering: cpu n and n + 4 are siblings
    sysfs = _topology(tmp_path, {c: (0, c % 4) for c in range(8)}, siblings)
    assert cpu_threads.physical_cores(range(8), sysfs) == 4
    # an affinity mask holding both siblings of core 0 and one thread of core 1
    assert cpu_threads.physical_cores([0, 4, 1], sysfs) == 2


def test_cores_of_two_packages_are_distinct(tmp_path):
    sysfs = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}, siblings=False)
    assert cpu_threads.physical_cores(range(4), sysfs) == 4


def test_without_a_topology_every_cpu_counts(tmp_path):
    sysfs = _topology(tmp_path, {0: (0, 0)})
    assert cpu_threads.physical_cores([0, 1, 2], sysfs) == 3


def test_a_lone_core_keeps_its_two_threads(tmp_path):
    # a 2-vCPU VM that is one core's two hyperthreads keeps the pool's old default of 2
    sysfs = _topology(tmp_path / "sys", {0: (0, 0), 1: (0, 0)})
    assert cpu_threads.physical_cores([0, 1], sysfs) == 1
    assert cpu_threads.usable_cores([0, 1], sysfs, tmp_path / "cg", proc_cgroup="0::/") == 2
    assert cpu_threads.usable_cores([0], sysfs, tmp_path / "cg", proc_cgroup="0::/") == 1


@pytest.mark.parametrize("text, cpus", [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5)])
def test_cgroup_v2_quota(tmp_path, text, cpus):
    (tmp_path / "cpu.max").write_text(text + "\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path, proc_cgroup="0::/\n") == cpus


def test_a_parent_cgroups_quota_counts(tmp_path):
    # systemd's CPUQuota= on a slice, the process in a cgroup below it, no namespace
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "cpu.max").write_text("150000 100000\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path, proc_cgroup="0::/a/b\n") == 1.5
    (tmp_path / "a" / "b" / "cpu.max").write_text("100000 100000\n")  # the smaller one wins
    assert cpu_threads.cgroup_cpu_limit(tmp_path, proc_cgroup="0::/a/b\n") == 1.0


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
@pytest.mark.parametrize("quota, cpus", [("-1", None), ("300000", 3.0)])
def test_cgroup_v1_quota(tmp_path, mount, quota, cpus):
    d = tmp_path / mount / "docker" / "x"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text(quota + "\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = "4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n0::/\n"
    assert cpu_threads.cgroup_cpu_limit(tmp_path, proc_cgroup=proc) == cpus


def test_a_zero_period_is_no_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("100000 0\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path, proc_cgroup="0::/") is None


def test_a_container_quota_bounds_the_cores(tmp_path):
    sysfs = _topology(tmp_path / "sys", {c: (0, c) for c in range(16)})
    cgroup = tmp_path / "cg"
    cgroup.mkdir()

    def usable():
        return cpu_threads.usable_cores(range(16), sysfs, cgroup, proc_cgroup="0::/")

    (cgroup / "cpu.max").write_text("250000 100000\n")  # --cpus 2.5 on a 16-core host
    assert usable() == 2
    (cgroup / "cpu.max").write_text("50000 100000\n")  # half a CPU still runs one thread
    assert usable() == 1
    (cgroup / "cpu.max").write_text("max 100000\n")
    assert usable() == 16


@pytest.mark.skipif(not cpu_linear.available(), reason="no C kernel library")
def test_the_python_cap_is_the_pools():
    before = cpu_linear.kernel_info()["threads"]
    try:
        assert cpu_linear.set_num_threads(cpu_threads.MAX_THREADS + 50) == cpu_threads.MAX_THREADS
    finally:
        cpu_linear.set_num_threads(before)


@pytest.mark.skipif(not cpu_linear.available(), reason="no C kernel library")
@pytest.mark.parametrize("env, expect", [(None, 3), ("1", 1)])
def test_the_loaded_pool_takes_the_default_unless_the_variable_says(env, expect):
    # a fresh process whose default is made 3 (no machine here has 3 cores) before the library
    # loads: the pool must take it, or the variable's value when set
    environ = {k: v for k, v in os.environ.items() if k != "PRESCIENT_GEMV_THREADS"}
    if env is not None:
        environ["PRESCIENT_GEMV_THREADS"] = env
    code = ("from prescient.kernels import cpu_linear, cpu_threads; cpu_threads.default_threads = lambda: 3; "
            "print(cpu_linear.kernel_info()['threads'])")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == expect


def test_the_startup_line_says_the_pool_size_and_where_it_came_from(monkeypatch):
    from prescient.build import kernels_line

    monkeypatch.delenv("PRESCIENT_GEMV_THREADS", raising=False)
    assert kernels_line({"isa": "avx2", "threads": 8}) == \
        "CPU kernels avx2, 8 threads (one per usable core; PRESCIENT_GEMV_THREADS=n to change)"
    assert kernels_line({"isa": "avx2", "threads": 4}, tp=2) == \
        "CPU kernels avx2, 4 threads (the usable cores shared by 2 ranks)"
    assert kernels_line({"isa": "avx2", "avx_vnni": True, "threads": 8}).startswith("CPU kernels avx2 + AVX-VNNI, 8")
    assert kernels_line({"isa": "portable", "neon_dot": True, "threads": 4}).startswith("CPU kernels portable + SDOT, 4")
    assert kernels_line({"isa": "avx2", "neon_dot": False, "threads": 4}).startswith("CPU kernels avx2, 4")
    assert kernels_line({"isa": "avx512_bf16", "bf16_dot": "fma", "threads": 2}).startswith(
        "CPU kernels avx512_bf16 (vdpbf16ps as FMAs), 2")
    assert kernels_line({"isa": "avx512_bf16", "bf16_dot": "dp", "threads": 2}).startswith("CPU kernels avx512_bf16, 2")
    assert kernels_line({"isa": "avx512_bf16", "bf16_dot": "fma", "bf16_amx": True, "threads": 2}).startswith(
        "CPU kernels avx512_bf16 (vdpbf16ps as FMAs; bf16 weights on AMX), 2")
    assert kernels_line({"isa": "avx512_bf16", "bf16_dot": "fma", "bf16_amx": True, "attn_amx": True,
                         "threads": 2}).startswith("CPU kernels avx512_bf16 (vdpbf16ps as FMAs; bf16 weights on AMX; q.K on AMX), 2")
    monkeypatch.setenv("PRESCIENT_GEMV_THREADS", "1")
    assert kernels_line({"isa": "portable", "threads": 1}) == "CPU kernels portable, 1 thread (PRESCIENT_GEMV_THREADS)"
