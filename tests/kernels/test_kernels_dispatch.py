"""The dispatch point (prescient.kernels.ops), the GPU compile check of every Triton kernel, that
shape integers do not split a kernel's compiled variants, and which kernel test files gpu_check
runs on a GPU."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from prescient.kernels import ops, reference
from tests.kernels.conftest import HAS_TRITON

OPS = ["store_kv", "tree_attention", "kv_copy", "greedy_verify", "rejection_sample", "apply_token_bitmask",
       "rms_norm"]
TRITON_MODULE = {
    "store_kv": "triton_kv",
    "kv_copy": "triton_kv",
    "tree_attention": "triton_tree_attention",
    "greedy_verify": "triton_verify",
    "rejection_sample": "triton_verify",
    "apply_token_bitmask": "triton_bitmask",
    "rms_norm": "triton_rmsnorm",
}


def _args(op: str, device: torch.device = torch.device("cpu")) -> tuple:
    """Tiny valid arguments for each op, on `device`."""
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in _cpu_args(op))


def _forced_triton_device() -> torch.device:
    """Where the forced-Triton test puts its tensors: CUDA when there is one (CPU tensors with
    PRESCIENT_KERNELS=triton need the interpreter, which the conftest sets only without CUDA),
    else the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cpu_args(op: str) -> tuple:
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
        "rms_norm": (torch.ones(1, 16, dtype=torch.bfloat16), torch.ones(16, dtype=torch.bfloat16), 1e-5),
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
    getattr(ops, op)(*_args(op, _forced_triton_device()))
    assert calls == [op]


def test_forced_triton_test_uses_cuda_tensors_on_a_cuda_machine(monkeypatch):
    # What test_forced_triton_runs_the_kernel meets on a GPU machine: CUDA present, the
    # interpreter unset. Its tensors must then be CUDA ones, which need no interpreter.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PRESCIENT_KERNELS", "triton")
    device = _forced_triton_device()
    assert device.type == "cuda"
    assert ops.use_triton(device)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):  # what CPU tensors got there
        ops.use_triton(torch.device("cpu"))


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


# Launches of one kernel with the same constexprs must share one compiled variant whatever the
# step's sizes: Triton specializes integer arguments on == 1 and on divisibility by 16, so a
# batch size, token count, tree size or block-table width not marked do_not_specialize compiles
# new variants while gpu_check times a run. Run with TRITON_INTERPRET unset (real JITFunctions);
# the binder computes the specialization a launch would compile for sm_90, no GPU needed.
_SPECIALIZATION_SCRIPT = textwrap.dedent("""
    import collections, math, sys
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from prescient.kernels import triton_bitmask, triton_kv, triton_tree_attention, triton_verify
    from prescient.kernels.reference import pack_bits

    backend = make_backend(GPUTarget("cuda", 90, 32))
    launches = collections.defaultdict(list)  # kernel name -> (its constexprs' values, specialization)

    class Recorder:
        def __init__(self, fn):
            self.fn = fn
            self.bind = create_function_from_signature(fn.signature, fn.params, backend)
            # the declared constexprs (an int argument equal to 1 also binds as a constexpr)
            self.constexprs = [p.num for p in fn.params if p.is_constexpr]

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                spec = tuple(map(tuple, self.bind(*args, **kwargs)[1]))
                launches[self.fn.__name__].append((tuple(spec[i] for i in self.constexprs), spec))
            return launch

    for module in (triton_kv, triton_tree_attention, triton_verify, triton_bitmask):
        for name in dir(module):
            if isinstance(getattr(module, name), triton.runtime.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, Recorder(getattr(module, name)))

    k_cache = torch.zeros(64, 16, 2, 64, dtype=torch.bfloat16)
    for n in (1, 2, 3, 16, 17, 32):  # decode steps of n sequences, one token each
        q = torch.zeros(n, 6, 64, dtype=torch.bfloat16)
        width = n + 2  # the block table is as wide as the batch's longest context
        tables = torch.zeros(n, width, dtype=torch.int32)
        lens = torch.full((n,), 16 * width - 3, dtype=torch.int32)
        cu = torch.arange(n + 1, dtype=torch.int32)
        for splits in (1, 3):
            triton_tree_attention.tree_attention(q, k_cache, k_cache, tables, lens, cu, None, 0.125, splits)
        kv = torch.zeros(n, 2, 64, dtype=torch.bfloat16)
        triton_kv.store_kv(k_cache, k_cache.clone(), kv, kv, torch.arange(n))
        triton_kv.kv_copy(k_cache, k_cache.clone(), torch.arange(n), torch.arange(n) + 1)
    for nodes in (9, 16, 33, 48):  # one draft tree: mask rows of 1 or 2 words
        q = torch.zeros(nodes, 6, 64, dtype=torch.bfloat16)
        tables = torch.zeros(1, 8, dtype=torch.int32)
        mask = pack_bits(torch.ones(nodes, nodes, dtype=torch.bool).tril())
        cu = torch.tensor([0, nodes], dtype=torch.int32)
        triton_tree_attention.tree_attention(q, k_cache, k_cache, tables, torch.tensor([100], dtype=torch.int32),
                                             cu, mask, 0.125, 1)
    for seqs, nodes in ((1, 9), (3, 12), (16, 16), (2, 1), (4, 1)):  # verify: BLOCK_NODES 16, then 1
        tokens = torch.zeros(seqs, nodes, dtype=torch.int64)
        counts = torch.full((seqs,), nodes)
        triton_verify.greedy_verify(tokens, tokens, counts, tokens)
        triton_verify.rejection_sample(tokens, tokens, counts, torch.full((seqs, nodes, 40), 0.025), None,
                                       torch.zeros(seqs, nodes), torch.ones(seqs, 40))

    split = 0
    for kernel, specs in sorted(launches.items()):
        groups = collections.defaultdict(set)
        for constexprs, spec in specs:
            groups[constexprs].add(spec)
        for constexprs, variants in groups.items():
            if len(variants) > 1:
                split += 1
                print(f"{kernel}: {len(variants)} variants for one set of constexprs {constexprs}")
        print(kernel, len(specs), "launches,", len(groups), "constexpr sets")
    sys.exit(1 if split else 0)
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_shape_integers_do_not_split_compiled_variants():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SPECIALIZATION_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # every kernel whose integers vary per call was exercised
    for kernel in ("_tree_attention_kernel", "_merge_splits_kernel", "_kv_copy_kernel", "_greedy_verify_kernel",
                   "_rejection_sample_kernel"):
        assert f"{kernel} " in result.stdout, result.stdout


def test_gpu_check_runs_the_gpu_op_tests_and_leaves_the_cpu_suites_to_ci():
    """Every tests/kernels test file is either one of gpu_check's GPU op tests or a CPU-only
    suite, so a new file is classified instead of silently run on (or dropped from) the GPU."""
    from prescient.latency_bench import gpu_sections_kernels as section

    here = pathlib.Path(__file__).parent
    files = {p.name for p in here.glob("test_*.py")}
    gpu, cpu = set(section.GPU_TEST_FILES), set(section.CPU_ONLY_TEST_FILES)
    assert not gpu & cpu
    assert files == gpu | cpu, f"unclassified: {sorted(files - gpu - cpu)}, missing: {sorted((gpu | cpu) - files)}"
    assert section.GPU_TEST_FILES[0] == "test_kernels_ops.py"  # the op tests first
    # the GPU files are the ones that run the ops on the conftest's device
    for name in gpu - {"test_kernels_dispatch.py"}:
        assert "device" in (here / name).read_text(), name
    for nodeid in section.CI_ONLY_TESTS:
        path, _, test = nodeid.partition("::")
        assert pathlib.Path(path).name in gpu and f"def {test}(" in (here / pathlib.Path(path).name).read_text()
