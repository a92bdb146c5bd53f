"""The block formats' int8 rows on the column-lane copy give one set of bits on every ISA that has
them: x86's VNNI and AVX2 rows (kernels/cpu_qgemv_cl.c) and aarch64's SDOT rows
(kernels/cpu_qgemv_neon.c) each equal, bit for bit, the scalar model in
tests/kernels/qgemv_cl_driver.c (Q8_0, Q4_0, Q4_1; M from 1 to 100 -- prefill's chunks past 64 --,
fp32 and bf16 x, bias, 1 and 2 threads). The aarch64 half builds the library as
kernels/cpu_linear.py does (so it also shows that the .so links there) and runs under
qemu-aarch64 where the cross tools are installed."""

from __future__ import annotations

import os
import platform
import subprocess

import pytest

from prescient.kernels import cpu_linear
from tests.kernels.kernel_oracles import native_driver_tools, run_c_driver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KDIR = os.path.join(REPO, "kernels")
DRIVER = os.path.join(REPO, "tests", "kernels", "qgemv_cl_driver.c")


def test_x86_cl_rows_equal_the_scalar_model(tmp_path):
    """The loaded library's VNNI / AVX2 column-lane rows, at every such tier this CPU runs."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 rows")
    tiers = set(cpu_linear.machine_tiers())
    if not {"avx2", "avx512_vnni"} & tiers:
        pytest.skip("no tier here reads the column-lane copy")
    cc, so = native_driver_tools()
    which, cases, failed, out = run_c_driver(cc, DRIVER, so, tmp_path / "qgemv_cl_driver")
    assert failed == 0, out
    assert which == "x86"
    # 168 int8 cases a tier and thread count (every tier here that reads the copy, 1 and 2
    # threads), and 6 of the fp32 rows at the portable tier a thread count
    assert cases == 168 * 2 * len({"avx2", "avx512_vnni", "avx512_bf16"} & tiers) + 6 * 2


def test_aarch64_library_links_and_its_sdot_rows_equal_the_scalar_model(tmp_path, aarch64_kernels):
    """The whole .so cross-built with cpu_linear's own flags (but -march=native) and sources
    (conftest's aarch64_kernels), the driver linked against it (ld refuses a library with
    undefined symbols) and run under qemu-aarch64 with every symbol bound at start: SDOT's rows
    give the model's bits."""
    cc, qemu, so = aarch64_kernels
    which, cases, failed, out = run_c_driver(cc, DRIVER, so, tmp_path / "qgemv_cl_driver", qemu)
    # and the SDOT file as an Arm machine's own -march=native build sees it (a target with the
    # extension: no target pragma there)
    native = subprocess.run([cc, "-O3", "-std=gnu11", "-mcpu=neoverse-n1", "-Wall", "-Werror", "-I", KDIR, "-c",
                             os.path.join(KDIR, "cpu_qgemv_neon.c"), "-o", str(tmp_path / "neon_n1.o")],
                            capture_output=True, text=True, timeout=300)
    assert native.returncode == 0, native.stderr[-3000:]
    assert failed == 0, out
    # 168 int8 cases a thread count, and 6 + 6 of the fp32 rows (no copy; SDOT switched off)
    assert which == "aarch64 sdot" and cases == 168 * 2 + 12 * 2
