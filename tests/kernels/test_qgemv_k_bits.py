"""The K-quant formats' int8 kernels (Q4_K, Q5_K, Q6_K; kernels/cpu_qgemv_k.c) against the model in
tests/kernels/qgemv_k_driver.c on every ISA that has them: the activations quantized exactly as the
model says, y within fp32 rounding of the exact sum over them, each row of an M-row call (M up to
64) the bits of that row alone, on the calling thread and over the pool. x86's SIMD tiers run it
natively; aarch64's SDOT kernels under qemu-aarch64 where the cross tools are installed. Where the
int8 path must not run (x86's portable tier, SDOT switched off) the fp32 path must."""

from __future__ import annotations

import os
import platform
import subprocess

import pytest

from prescient.kernels import cpu_linear
from tests.kernels.kernel_oracles import native_driver_tools, run_c_driver

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qgemv_k_driver.c")
CASES = 102  # the driver's (format, shape, M) cases for one path


def test_x86_k_quant_kernels_match_the_model_at_every_tier_here(tmp_path):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 kernels")
    cc, so = native_driver_tools()
    which, cases, failed, out = run_c_driver(cc, DRIVER, so, tmp_path / "qgemv_k_driver")
    assert failed == 0, out
    # every tier this CPU runs: the int8 kernels at the SIMD ones, the fp32 path at the portable one
    assert which == "x86" and cases == CASES * len(cpu_linear.machine_tiers())


def test_aarch64_sdot_k_quant_kernels_match_the_model(tmp_path, aarch64_kernels):
    cc, qemu, so = aarch64_kernels
    which, cases, failed, out = run_c_driver(cc, DRIVER, so, tmp_path / "qgemv_k_driver", qemu)
    assert failed == 0, out
    # and the file as an Arm machine's own -march=native build sees it (the extension in the
    # target: no target pragma there)
    kdir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
    native = subprocess.run([cc, "-O3", "-std=gnu11", "-mcpu=neoverse-n1", "-Wall", "-Werror", "-I", kdir, "-c",
                             os.path.join(kdir, "cpu_qgemv_k.c"), "-o", str(tmp_path / "k_n1.o")],
                            capture_output=True, text=True, timeout=300)
    assert native.returncode == 0, native.stderr[-3000:]
    # the SDOT kernels, then the fp32 path with SDOT switched off
    assert which == "aarch64 sdot" and cases == 2 * CASES
