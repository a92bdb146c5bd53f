"""The dispatch point (prescient.kernels.ops) and the GPU compile check of every Triton kernel."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from prescient.kernels import ops, reference
from tests.kernels.conftest import HAS_TRITON

OPS = ["store_kv", "tree_attention", "kv_copy", "greedy_verify", "rejection_sample", "apply_token_bitmask"]
TRITON_MODULE = {
    "store_kv": "triton_kv",
    "kv_copy": "triton_kv",
    "tree_attention": "triton_tree_attention",
    "greedy_verify": "triton_verify",
    "rejection_sample": "triton_verify",
    "apply_token_bitmask": "triton_bitmask",
}


def _args(op: str) -> tuple:
    """Tiny valid arguments for each op (CPU)."""
    cache = torch.zeros(2, 16, 1, 16)
    tokens = torch.zeros(1, 2, dtype=torch.int64)
    i32 = torch.int32
    return {
        "store_kv": (cache, cache.clone(), torch.ones(1, 1, 16), torch.ones(1, 1, 16), torch.tensor([3])),
        "kv_copy": (cache, cache.clone(), torch.tensor([1]), torch.tensor([0])),
        "tree_attention": (torch.ones(1, 1, 16), cache, cache.clone(), torch.zeros(1, 1, dtype=i32),
                           torch.tensor([1], dtype=i32), torch.tensor([0, 1], dtype=i32), None, 0.25),
        "greedy_verify": (tokens, tokens - 1, torch.tensor([1]), tokens),
        "rejection_sample": (tokens, tokens - 1, torch.tensor([1]), torch.full((1, 2, 4), 0.25), None,
                             torch.zeros(1, 2), torch.ones(1, 4)),
        "apply_token_bitmask": (torch.zeros(1, 40), torch.zeros(1, 2, dtype=i32)),
    }[op]


@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_run_the_reference(op, monkeypatch):
    monkeypatch.delenv("PRESCIENT_KERNELS", raising=False)
    # CPU tree_attention runs the C kernel when it builds (its routing is tested in
    # test_cpu_attention.py); with it switched off, the reference.
    monkeypatch.setenv("PRESCIENT_CPU_ATTENTION", "0")
    calls = []
    monkeypatch.setattr(reference, op, lambda *a: calls.append(op))
    getattr(ops, op)(*_args(op))
    assert calls == [op]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("op", OPS)
def test_forced_triton_runs_the_kernel(op, monkeypatch):
    import importlib

    module = importlib.import_module(f"prescient.kernels.{TRITON_MODULE[op]}")
    monkeypatch.setenv("PRESCIENT_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(module, op, lambda *a: calls.append(op))
    getattr(ops, op)(*_args(op))
    assert calls == [op]


def test_bad_backend_name_is_rejected(monkeypatch):
    monkeypatch.setenv("PRESCIENT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PRESCIENT_KERNELS"):
        ops.store_kv(*_args("store_kv"))


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("PRESCIENT_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.use_triton(torch.device("cpu"))


def test_reference_can_be_forced(monkeypatch):
    monkeypatch.setenv("PRESCIENT_KERNELS", "reference")
    assert not ops.use_triton(torch.device("cuda"))


def test_cuda_without_triton_falls_back_to_the_reference(monkeypatch):
    monkeypatch.delenv("PRESCIENT_KERNELS", raising=False)
    monkeypatch.setattr(ops, "_triton_missing_warned", False)
    monkeypatch.setattr(ops.importlib.util, "find_spec", lambda name: None)
    with pytest.warns(UserWarning, match="triton is not installed"):
        assert not ops.use_triton(torch.device("cuda"))


def test_ops_import_and_run_without_triton():
    # A fresh interpreter where `import triton` fails: the package and the CPU path still work.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from prescient.kernels import ops\n"
        "logits = torch.zeros(1, 40)\n"
        "ops.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32))\n"
        "assert torch.isinf(logits[:, :32]).all()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PRESCIENT_KERNELS"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_every_kernel_compiles_for_sm90():
    """The interpreter is lenient; lower every kernel launch to an sm_90 cubin as well."""
    script = pathlib.Path(__file__).with_name("sm90_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default-change warning
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "compiled" in result.stdout
