"""Kernel-test setup: the Triton interpreter on CPU, and the backends every op test runs over.

TRITON_INTERPRET must be set before any Triton kernel is decorated (the decorator reads it), so
it is set here, at conftest import, ahead of every kernels test module.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# One expectation, every backend (the xgrammar pattern): "reference" is the pure-torch path,
# "triton" the kernels (interpreted on CPU, compiled on CUDA).
BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")),
]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    """Route prescient.kernels.ops through one backend for the test."""
    monkeypatch.setenv("PRESCIENT_KERNELS", request.param)
    return request.param


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(scope="session")
def generic_so(tmp_path_factory):
    """The kernels' .so built without -march=native (per-function targets, run-time ISA
    choice), compiled once for the tests that check that build is complete (~40 s a build on
    2 cores)."""
    from prescient.kernels import cpu_linear

    cc = cpu_linear._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path_factory.mktemp("generic") / "generic.so"
    plain = next(f for f in cpu_linear._flag_sets() if not any("march" in x or "PQ_AVXVNNI" in x for x in f))
    cpu_linear._compile(cc, plain, so)
    return so


@pytest.fixture(scope="session")
def aarch64_kernels(tmp_path_factory):
    """(aarch64 compiler, qemu-aarch64, the kernel library cross-built once for the session), or a
    skip where the cross tools are missing (tests/kernels/kernel_oracles.py)."""
    from tests.kernels.kernel_oracles import aarch64_cross_tools, build_aarch64_library

    cc, qemu, why = aarch64_cross_tools()
    if why:
        pytest.skip(why)
    so = tmp_path_factory.mktemp("aarch64") / "libprescient_kernels.so"
    build_aarch64_library(cc, so)
    return cc, qemu, so
