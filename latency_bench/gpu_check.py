"""One-shot GPU check for a lent CUDA machine: kernel tests, tree attention vs SDPA, decode tokens/s.

    PYTHONPATH=. python latency_bench/gpu_check.py            # on the GPU machine
    PYTHONPATH=. python latency_bench/gpu_check.py --cpu-smoke   # anywhere, tiny shapes, no GPU

Sections (each runs on its own; a failure is reported and the next section still runs):
1. `pytest tests/kernels -q -x` in a subprocess with TRITON_INTERPRET unset, so the Triton
   kernels compile for the GPU (skipped in --cpu-smoke and when pytest is missing).
2. `prescient.kernels.ops.tree_attention` (Triton on CUDA) against PyTorch SDPA over KV gathered
   from the paged cache into contiguous tensors, SmolLM2-135M attention shapes, bf16, timed with
   CUDA events (median of N per-call latencies).
3. End-to-end greedy decode tokens/s of a random-init model with the default model's config
   (SmolLM2-135M), plain and with n-gram speculation, plus a short sampled-decoding probe.

The GPU machine has no installed prescient, only the copied tree: setuptools' package-dir maps
`prescient.runtime` -> runtime/ etc., which a plain PYTHONPATH cannot express, so
`ensure_prescient_importable` builds that mapping as a directory of symlinks (see there).
Output: a Markdown report on stdout; JSON to $OUT/gpu_check.json when OUT is set (or --json).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run as a script, Python puts latency_bench/ first on sys.path, where config.py, markdown.py,
# schema.py, run.py ... would shadow top-level modules of those names for everything imported
# after this point (torch and triton included). Nothing here needs that entry.
if __name__ == "__main__" and sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse  # noqa: E402
import atexit  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

# Fallback for when pyproject.toml cannot be read (no tomllib before Python 3.11).
_DEFAULT_PACKAGE_DIRS = {
    "prescient": "prescient",
    "prescient.runtime": "runtime",
    "prescient.speculative": "speculative",
    "prescient.kernels": "kernels",
    "prescient.grammar": "grammar",
    "prescient.server": "server",
    "prescient.latency_bench": "latency_bench",
}

# Packages the check may meet or miss on the GPU machine (reported, never required up front).
_OPTIONAL_PACKAGES = ("numpy", "triton", "pytest", "pytest_benchmark", "pytest_timeout",
                      "hypothesis", "transformers", "tokenizers", "gguf", "xgrammar", "safetensors")


# ---------------------------------------------------------------- importing prescient from a checkout


def _package_dirs(repo: Path) -> dict[str, str]:
    try:
        import tomllib

        cfg = tomllib.loads((repo / "pyproject.toml").read_text())
        dirs = cfg["tool"]["setuptools"]["package-dir"]
        return dict(dirs) if dirs else dict(_DEFAULT_PACKAGE_DIRS)
    except Exception:  # no tomllib (Python < 3.11), no pyproject: the layout as of writing
        return dict(_DEFAULT_PACKAGE_DIRS)


def _prescient_from(repo: Path) -> bool:
    """Whether `prescient.runtime` imports, and from this checkout (not some other install)."""
    try:
        spec = importlib.util.find_spec("prescient.runtime")
    except ImportError:  # ModuleNotFoundError for the parent or the child
        return False
    if spec is None or not spec.origin:
        return False
    return Path(spec.origin).resolve().is_relative_to(repo.resolve())


def _forget_prescient() -> None:
    # find_spec above imported the checkout's bare prescient/ package (no subpackages); drop it
    # so the next import resolves through the alias.
    for name in [n for n in sys.modules if n == "prescient" or n.startswith("prescient.")]:
        del sys.modules[name]


def ensure_prescient_importable(repo: Path = REPO) -> str | None:
    """Make `import prescient.<part>` load <repo>/<part> without an install. Returns the alias
    directory (also put first on sys.path and on PYTHONPATH, so subprocesses such as the pytest
    run and the tests' own helpers inherit it), or None when prescient already imports from repo.

    The alias is a temporary `prescient/` package made of symlinks that follow setuptools'
    package-dir: prescient/__init__.py -> <repo>/prescient/__init__.py, prescient/runtime ->
    <repo>/runtime, ... Plain import machinery then does the rest, and sources stay the repo's.
    """
    if _prescient_from(repo):
        return None
    _forget_prescient()
    root = Path(tempfile.mkdtemp(prefix="prescient-alias-"))
    pkg = root / "prescient"
    pkg.mkdir()
    created: list[Path] = []
    for name, rel in _package_dirs(repo).items():
        src = (repo / rel).resolve()
        if name == "prescient":
            for entry in src.iterdir():  # __init__.py, cli.py, ...
                if entry.name != "__pycache__":
                    (pkg / entry.name).symlink_to(entry)
                    created.append(pkg / entry.name)
        elif name.count(".") == 1 and name.startswith("prescient."):
            (pkg / name.split(".", 1)[1]).symlink_to(src, target_is_directory=True)
            created.append(pkg / name.split(".", 1)[1])

    def cleanup() -> None:
        # Unlink the symlinks first so nothing below can reach into the checkout, then drop the
        # temporary directory with what runs inside it left there (pytest-benchmark's
        # .benchmarks/, __pycache__).
        for path in created:
            path.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)

    atexit.register(cleanup)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    # Absolute entries: the pytest run starts in another directory, where PYTHONPATH=. would
    # no longer mean the checkout.
    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(root), str(repo.resolve()), *inherited]))
    if not _prescient_from(repo):
        raise ImportError(f"the prescient alias in {root} does not resolve prescient.runtime")
    return str(root)


# ---------------------------------------------------------------- small helpers


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:
        return None


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(x, digits=1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _failure(e: BaseException) -> dict:
    return {"status": "failed", "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-4000:]}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- 1. kernel tests on CUDA


_PROBE = "gpu_check-probe:"


def run_kernel_tests(timeout_s: float, alias: str | None, extra_args: list[str] | None = None) -> dict:
    """`pytest tests/kernels -q -x` in a subprocess, TRITON_INTERPRET unset (compiled kernels)."""
    if not _has("pytest"):
        return {"status": "skipped", "reason": "pytest is not installed"}
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PRESCIENT_KERNELS")}
    # Without an install, the checkout's bare prescient/ must not be found first. pytest puts the
    # repo at sys.path[0] before the test modules import prescient, and `python -c` children of
    # the tests put their cwd there; so the run starts in the alias directory and imports the
    # alias's prescient before pytest starts (a package, once imported, keeps its __path__).
    cwd = alias or str(REPO)
    boot = "import sys; import prescient; " if alias else "import sys; "
    # pyproject's addopts carries --benchmark-disable, an unknown option (a usage error before
    # any test runs) where pytest-benchmark is missing; override addopts, drop the bench file.
    has_bench = _has("pytest_benchmark")
    addopts = "-p no:cacheprovider" + (" --benchmark-disable" if has_bench else "")
    pytest_args = [str(REPO / "tests" / "kernels"), "--rootdir", str(REPO), "-q", "-x", "-o", f"addopts={addopts}",
                   # this script's own CPU smoke test: it would only run this script again
                   "--ignore", str(REPO / "tests" / "kernels" / "test_gpu_check_smoke.py")]
    notes = []
    if not has_bench:
        pytest_args += ["--ignore", str(REPO / "tests" / "kernels" / "test_kernels_bench.py")]
        notes.append("pytest-benchmark missing: test_kernels_bench.py ignored")
    pytest_args += extra_args or []
    # The conftests set TRITON_INTERPRET=1 only without CUDA; the run reports what the test
    # process ended up with, since an interpreted run would "pass" without ever compiling a
    # kernel for the GPU.
    probe = ("import os, torch; print('\\n%s interpret=%s cuda=%s' % "
             f"({_PROBE!r}, os.environ.get('TRITON_INTERPRET'), torch.cuda.is_available())); ")
    cmd = [sys.executable, "-c", boot + "import pytest; rc = pytest.main(sys.argv[1:]); " + probe + "sys.exit(rc)",
           *pytest_args]
    t0 = time.perf_counter()
    base = {"command": cmd, "cwd": cwd, "notes": notes}
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1), **base,
                "output_tail": out[-3000:]}
    out = proc.stdout + proc.stderr
    probe_line = next((line for line in out.splitlines() if line.startswith(_PROBE)), "")
    # Only meaningful with a GPU: without one, the interpreter is the intended CPU path.
    forced = ("interpret=1" in probe_line) if "cuda=True" in probe_line else None
    base.update(conftest_forces_interpreter=forced, probe=probe_line[len(_PROBE):].strip())
    summary = next((line.strip("= ") for line in reversed(out.splitlines())
                    if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", line)), "")
    return {
        "status": "passed" if proc.returncode == 0 else "failed",
        "returncode": proc.returncode,
        "summary": summary,
        "seconds": round(time.perf_counter() - t0, 1),
        **base,
        "output_tail": out[-3000:],
    }


# ---------------------------------------------------------------- 2. tree attention vs SDPA


def _random_tree_parents(size: int, rng: random.Random) -> list[int]:
    # A bushy chain, the shape n-gram and draft-model trees have: each node hangs below one of
    # the 3 nodes before it.
    return [-1] + [rng.randint(max(0, i - 3), i - 1) for i in range(1, size)]


def _ancestor_mask(parents: list[int]):
    import torch

    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def _time_calls(fn, num_layers: int, iters: int, warmup: int, device) -> dict:
    """Median per-call latency (µs) and the mean over back-to-back calls, cycling over the
    per-layer caches as a decode step does (so a long context is not served from L2)."""
    import torch

    for i in range(warmup):
        fn(i % num_layers)
    _sync(device)
    per_call = []
    if device.type == "cuda":
        # An event pair around each call: the latency a decode step pays, launch overhead
        # included (the CPU issues each call, the GPU waits for it).
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(i % num_layers)
            end.record()
        torch.cuda.synchronize(device)
        per_call = [start.elapsed_time(end) * 1e3 for start, end in events]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i % num_layers)
        end.record()
        torch.cuda.synchronize(device)
        back_to_back = start.elapsed_time(end) * 1e3 / iters
    else:
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i % num_layers)
            per_call.append((time.perf_counter() - t0) * 1e6)
        back_to_back = statistics.fmean(per_call)
    return {"median_us": statistics.median(per_call), "back_to_back_us": back_to_back}


def bench_tree_attention(device, dtype, tree_sizes, contexts, num_heads, num_kv_heads, head_dim,
                         block_size, num_layers, iters, warmup, seed=0) -> dict:
    import torch
    import torch.nn.functional as F

    from prescient.kernels import ops
    from prescient.kernels.reference import pack_bits

    backend = "triton" if ops.use_triton(device) else "reference"
    scale = head_dim ** -0.5
    group = num_heads // num_kv_heads
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = []
    for ctx in contexts:
        max_len = ctx + max(tree_sizes)
        blocks_needed = -(-max_len // block_size)
        num_blocks = blocks_needed + 1  # a spare block: the table is a strict subset, as in a server
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # One cache pair per layer, as the model has; filled with noise so softmax is not flat.
        caches = [(torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype))
                  for _ in range(num_layers)]
        # Shuffled blocks: a paged cache after some churn (Triton reads them in place, the
        # SDPA path has to gather them).
        order = list(range(num_blocks))
        rng.shuffle(order)
        block_table = torch.tensor([order[:blocks_needed]], dtype=torch.int32, device=device)
        for size in tree_sizes:
            context_len = ctx + size
            q = torch.randn(size, num_heads, head_dim, device=device).to(dtype)
            context_lens = torch.tensor([context_len], dtype=torch.int32, device=device)
            cu = torch.tensor([0, size], dtype=torch.int32, device=device)
            if size == 1:
                mask_bits, sdpa_mask = None, None  # plain decode: the engine passes no mask
            else:
                tree = _ancestor_mask(_random_tree_parents(size, rng))
                mask_bits = pack_bits(tree).to(device)
                sdpa_mask = torch.ones(size, context_len, dtype=torch.bool)
                sdpa_mask[:, ctx:] = tree
                sdpa_mask = sdpa_mask.to(device)
            used_blocks = block_table[0, : -(-context_len // block_size)].long()

            def gather(layer: int):
                k_cache, v_cache = caches[layer]
                k = k_cache.index_select(0, used_blocks).flatten(0, 1)[:context_len]
                v = v_cache.index_select(0, used_blocks).flatten(0, 1)[:context_len]
                # [1, num_kv_heads, context_len, head_dim], contiguous for SDPA's fused kernels
                return k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous()

            q4 = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, size, head_dim]

            def sdpa(k, v):
                return F.scaled_dot_product_attention(q4, k, v, attn_mask=sdpa_mask, scale=scale,
                                                      enable_gqa=group > 1)

            def run_tree(layer: int):
                k_cache, v_cache = caches[layer]
                return ops.tree_attention(q, k_cache, v_cache, block_table, context_lens, cu, mask_bits, scale)

            def run_gather_sdpa(layer: int):
                return sdpa(*gather(layer))

            gathered = [gather(layer) for layer in range(num_layers)]
            # The same KV with each kv head repeated for its query heads: SDPA without GQA, which
            # every fused backend accepts (with enable_gqa torch may fall back to its math path).
            expanded = [(k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
                        for k, v in gathered]

            def run_sdpa_only(layer: int):
                return sdpa(*gathered[layer])

            def run_sdpa_expanded(layer: int):
                k, v = expanded[layer]
                return F.scaled_dot_product_attention(q4, k, v, attn_mask=sdpa_mask, scale=scale)

            # Each variant on its own: one that fails (a backend rejecting a shape) leaves the
            # others' numbers standing.
            row = {"tree_size": size, "context": ctx, "backend": backend, "errors": {}}
            variants = {"tree_attention": run_tree, "gather_sdpa": run_gather_sdpa, "sdpa_only": run_sdpa_only,
                        "sdpa_expanded": run_sdpa_expanded}
            for name, fn in variants.items():
                try:
                    timing = _time_calls(fn, num_layers, iters, warmup, device)
                except Exception as e:
                    timing = {"median_us": None, "back_to_back_us": None}
                    row["errors"][name] = f"{type(e).__name__}: {e}"[:500]
                row[f"{name}_us"], row[f"{name}_b2b_us"] = timing["median_us"], timing["back_to_back_us"]
            try:
                want = run_sdpa_only(0)[0].transpose(0, 1).float()
                row["max_abs_err"] = (run_tree(0).float() - want).abs().max().item()
            except Exception as e:
                row["max_abs_err"] = None
                row["errors"].setdefault("compare", f"{type(e).__name__}: {e}"[:500])
            ok = row["tree_attention_us"] and row["gather_sdpa_us"]
            row["speedup_vs_gather_sdpa"] = row["gather_sdpa_us"] / row["tree_attention_us"] if ok else None
            rows.append(row)
            del gathered, expanded
        del caches
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = any(r["errors"] for r in rows)
    return {"status": "failed" if failed else "ok", "backend": backend, "dtype": str(dtype).replace("torch.", ""),
            "shapes": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                       "block_size": block_size, "layers_cycled": num_layers},
            "iters": iters, "rows": rows}


# ---------------------------------------------------------------- 3. end-to-end decode


def smollm2_135m_config(name: str = "SmolLM2-135M (random init)"):
    """The default model's architecture (SmolLM2-135M-Instruct's config.json)."""
    from prescient.runtime.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                       name=name)


def tiny_config():
    from prescient.runtime.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                       name="tiny (random init)")


def random_weights(config, device, dtype, seed: int = 0) -> dict:
    """Random weights under the canonical names runtime/loader.py produces, made on the device
    (135M float32 parameters would take seconds on the host and a copy)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim

    def normal(*shape):
        # std 0.02: SmolLM2's initializer_range, so activations have a trained model's scale
        # (what matters here is the work per step, not what the model says).
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)

    weights = {"embed": normal(config.vocab_size, h), "norm": torch.ones(h, device=device, dtype=dtype)}
    if not config.tie_word_embeddings:
        weights["lm_head"] = normal(config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        weights.update({
            p + "q": normal(config.num_heads * d, h), p + "k": normal(config.num_kv_heads * d, h),
            p + "v": normal(config.num_kv_heads * d, h), p + "o": normal(h, config.num_heads * d),
            p + "gate": normal(i, h), p + "up": normal(i, h), p + "down": normal(h, i),
            p + "attn_norm": torch.ones(h, device=device, dtype=dtype),
            p + "mlp_norm": torch.ones(h, device=device, dtype=dtype),
        })
    return weights


def _generate(engine, prompt: list[int], params, device) -> dict:
    """One request to completion; decode rate counted from the first generated token on."""
    t0 = time.perf_counter()
    steps0 = engine.num_steps
    engine.add_request(prompt, params)
    tokens: list[int] = []
    t_first = n_first = steps_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
            tokens.extend(out.new_token_ids)
        if t_first is None and tokens:
            _sync(device)
            t_first, n_first, steps_first = time.perf_counter(), len(tokens), engine.num_steps
    _sync(device)
    t_end = time.perf_counter()
    decoded = len(tokens) - (n_first or 0)
    return {
        "tokens": tokens,
        "prefill_ms": (t_first - t0) * 1e3 if t_first else None,
        "decode_tokens_per_s": decoded / (t_end - t_first) if t_first and t_end > t_first and decoded else None,
        "decode_steps": engine.num_steps - (steps_first or steps0),
        "decoded_tokens": decoded,
    }


def bench_decode(device, dtype, config, prompt_len: int, new_tokens: int, kv_cache_bytes: int,
                 seed: int = 0, fast_linear: bool = True) -> dict:
    import torch

    from prescient.runtime.config import CacheConfig
    from prescient.runtime.engine import Engine, EngineConfig
    from prescient.runtime.model import LlamaModel
    from prescient.runtime.sampling_params import SamplingParams
    from prescient.speculative.speculator import SpecStats, make_speculator

    t0 = time.perf_counter()
    weights = random_weights(config, device, dtype, seed)
    model = LlamaModel(config, weights, dtype=dtype, device=device, fast_linear=fast_linear)
    del weights
    _sync(device)
    build_s = time.perf_counter() - t0
    # A repeated phrase: the n-gram proposer finds matches from the first decode step on.
    rng = random.Random(seed)
    phrase = [rng.randrange(config.vocab_size) for _ in range(32)]
    prompt = (phrase * (prompt_len // len(phrase) + 1))[:prompt_len]
    runs = {
        "greedy": SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
        # Sampling takes other code paths (plain: Engine._sample's noise; speculative: rejection
        # sampling), and on a random model's near-flat distributions n-grams rarely hit: the
        # speculative row then shows what speculation costs when it does not pay.
        "t=0.8": SamplingParams(max_tokens=new_tokens, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True),
    }
    rows, errors, outputs = [], {}, {}
    for sampling, params in runs.items():
        for mode in ("off", "ngram"):
            key = f"{sampling}/{mode}"
            engine = None
            try:
                engine = Engine(model, None, EngineConfig(cache=CacheConfig(block_size=16, kv_cache_bytes=kv_cache_bytes)),
                                eos_token_ids=())
                if mode != "off":
                    # Calibrates the verify cost table on this model, as the CLI does at start-up.
                    engine.speculator = make_speculator(engine, mode)
                # A full-length warm-up run first: tree sizes and context lengths vary step to
                # step, and each new Triton specialization compiles on first use (seconds).
                _generate(engine, prompt, params, device)
                if engine.speculator is not None:
                    engine.speculator.stats = SpecStats()  # count the measured run only
                result = _generate(engine, prompt, params, device)
                outputs[key] = result.pop("tokens")
                stats = engine.speculator.stats if engine.speculator is not None else None
                rows.append({
                    "sampling": sampling, "speculation": mode, "status": "ok", "prompt_tokens": prompt_len, **result,
                    "ms_per_token": 1e3 / result["decode_tokens_per_s"] if result["decode_tokens_per_s"] else None,
                    "acceptance_rate": stats.acceptance_rate if stats else None,
                    "mean_accepted_length": stats.mean_accepted_length if stats else None,
                    "distinct_output_tokens": len(set(outputs[key])),
                })
            except Exception as e:
                errors[key] = _failure(e)
                rows.append({"sampling": sampling, "speculation": mode, "status": "failed",
                             "error": errors[key]["error"]})
            finally:
                engine = None  # frees this engine's KV cache before the next one
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    same = None
    if "greedy/off" in outputs and "greedy/ngram" in outputs:
        a, b = outputs["greedy/off"], outputs["greedy/ngram"]
        diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        same = {"identical": a == b, "first_divergence": diverge}
    failed = [r for r in rows if r["status"] != "ok"]
    return {"status": "failed" if failed else "ok", "model": config.name, "dtype": str(dtype).replace("torch.", ""),
            "model_build_s": build_s, "rows": rows, "greedy_outputs_match": same, "errors": errors}


# ---------------------------------------------------------------- report


def render(report: dict) -> str:
    out = [f"# prescient GPU check ({report['mode']})", ""]
    env = report["environment"]
    out.append(f"Device: {env.get('device_name')}; torch {env.get('torch')}, triton {env.get('triton')}, "
               f"Python {env.get('python')}; prescient imported {report['import_mode']}. "
               f"Missing: {', '.join(m for m, ok in env['packages'].items() if not ok) or 'nothing'}.")
    out.append("")
    s = report["sections"]

    t = s.get("kernel_tests", {})
    out += ["## 1. Kernel tests (`pytest tests/kernels -q -x`, TRITON_INTERPRET unset)", ""]
    if t.get("status") == "skipped":
        out.append(f"Skipped: {t.get('reason')}.")
    else:
        out.append(f"**{t.get('status')}** in {t.get('seconds')} s: {t.get('summary') or '(no summary line)'}. "
                   f"conftest forces the interpreter: {t.get('conftest_forces_interpreter')} ({t.get('probe')}).")
        for note in t.get("notes", []):
            out.append(f"Note: {note}.")
        if t.get("status") != "passed":
            out += ["", "```", (t.get("output_tail") or t.get("error") or "")[-1500:], "```"]
    out.append("")

    a = s.get("tree_attention", {})
    out += ["## 2. Tree attention vs SDPA over gathered KV", ""]
    if a.get("rows"):
        sh = a["shapes"]
        out.append(f"`ops.tree_attention` ({a['backend']}) vs `F.scaled_dot_product_attention` (enable_gqa, tree "
                   f"mask) on KV gathered from shuffled paged blocks; {a['dtype']}, {sh['num_heads']} q heads, "
                   f"{sh['num_kv_heads']} kv heads, head_dim {sh['head_dim']}, block {sh['block_size']}, cycling "
                   f"{sh['layers_cycled']} per-layer caches. Median of {a['iters']} per-call latencies in µs "
                   "(launch overhead included); the SDPA-only columns have the KV pre-gathered (KV contiguous: "
                   "enable_gqa, as the torch reference path runs it; heads expanded: kv heads repeated, no GQA); "
                   "b2b: mean over back-to-back calls, closer to pure GPU time.")
        out.append("")
        out.append(_table(
            ["tree", "context", "tree_attention µs", "gather+SDPA µs", "SDPA µs (KV contiguous)",
             "SDPA µs (heads expanded)", "speedup vs gather+SDPA", "b2b µs tree / gather+SDPA", "max abs err"],
            [[r["tree_size"], r["context"], _fmt(r["tree_attention_us"]), _fmt(r["gather_sdpa_us"]),
              _fmt(r["sdpa_only_us"]), _fmt(r["sdpa_expanded_us"]), _fmt(r["speedup_vs_gather_sdpa"], 2) + "x" if r["speedup_vs_gather_sdpa"] else "–",
              f"{_fmt(r['tree_attention_b2b_us'])} / {_fmt(r['gather_sdpa_b2b_us'])}",
              "–" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e}"]
             for r in a["rows"]]))
        for r in a["rows"]:
            for name, err in r["errors"].items():
                out.append(f"Failed: tree {r['tree_size']}, context {r['context']}, {name}: {err}")
    else:
        out.append(f"**{a.get('status')}**: {a.get('error') or a.get('reason')}")
        if a.get("traceback"):
            out += ["", "```", a["traceback"][-1500:], "```"]
    out.append("")

    d = s.get("decode", {})
    out += ["## 3. End-to-end decode (random-init weights, batch 1)", ""]
    if d.get("rows"):
        out.append(f"{d['model']}, {d['dtype']}; decode rate from the first generated token on, after a "
                   "full-length warm-up run, repetitive prompt. A random model's greedy output tends to repeat "
                   "itself, which n-grams predict well: read the greedy speculative row as an upper bound and the "
                   "sampled one (near-flat distributions, few n-gram hits) as the cost of speculating in vain; "
                   "see acceptance and distinct tokens.")
        out.append("")
        out.append(_table(
            ["sampling", "speculation", "status", "prompt", "decoded", "decode tok/s", "ms/token", "steps",
             "acceptance", "mean accepted len", "distinct tokens", "prefill ms"],
            [[r["sampling"], r["speculation"], r["status"], r.get("prompt_tokens", "–"), r.get("decoded_tokens", "–"),
              _fmt(r.get("decode_tokens_per_s")), _fmt(r.get("ms_per_token"), 2), r.get("decode_steps", "–"),
              _fmt(r.get("acceptance_rate"), 2), _fmt(r.get("mean_accepted_length"), 2),
              r.get("distinct_output_tokens", "–"), _fmt(r.get("prefill_ms"))] for r in d["rows"]]))
        m = d.get("greedy_outputs_match")
        if m is not None:
            out += ["", f"Greedy tokens identical with and without speculation: {m['identical']}"
                    + ("" if m["identical"] else f" (first divergence at token {m['first_divergence']}; bf16 "
                       "rounding differs between a 1-token and a tree forward, so near-ties can flip)")]
        for key, err in d.get("errors", {}).items():
            out += ["", f"Decode {key} failed:", "```", err["traceback"][-1500:], "```"]
    else:
        out.append(f"**{d.get('status')}**: {d.get('error') or d.get('reason')}")
        if d.get("traceback"):
            out += ["", "```", d["traceback"][-1500:], "```"]
    out += ["", f"Total: {report['total_seconds']:.1f} s."]
    return "\n".join(out)


# ---------------------------------------------------------------- main


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no kernel tests (CI)")
    p.add_argument("--skip-tests", action="store_true", help="skip section 1 (pytest)")
    p.add_argument("--run-tests", action="store_true", help="run section 1 under --cpu-smoke too")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments for section 1, e.g. '-k dispatch'")
    p.add_argument("--pytest-timeout", type=float, default=150.0, help="seconds for section 1")
    p.add_argument("--iters", type=int, default=None, help="timed calls per attention case")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per decode run (default 256; 24 with --cpu-smoke)")
    p.add_argument("--json", default=None, help="JSON path (default: $OUT/gpu_check.json when OUT is set)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    t_start = time.perf_counter()
    if not args.cpu_smoke:
        # The Triton kernels read TRITON_INTERPRET when first imported: unset, they compile for
        # the GPU, which is what this check is for.
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        alias = ensure_prescient_importable()
    except Exception as e:
        print(f"cannot import prescient from {REPO}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    if not args.cpu_smoke and not cuda:
        print("no CUDA device: run with --cpu-smoke for the CPU smoke test", file=sys.stderr)
        return 2
    device = torch.device("cuda" if not args.cpu_smoke else "cpu")
    report = {
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "import_mode": f"through the alias {alias}" if alias else "as installed",
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
            "cuda": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(0) if cuda and device.type == "cuda" else platform.processor() or "cpu",
            "packages": {m: _has(m) for m in _OPTIONAL_PACKAGES},
            "env": {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "PRESCIENT_KERNELS")},
        },
        "sections": {},
    }
    sections = report["sections"]

    if args.skip_tests:
        sections["kernel_tests"] = {"status": "skipped", "reason": "--skip-tests"}
    elif args.cpu_smoke and not args.run_tests:
        sections["kernel_tests"] = {"status": "skipped", "reason": "--cpu-smoke (the CPU suite runs in CI itself)"}
    else:
        try:
            sections["kernel_tests"] = run_kernel_tests(args.pytest_timeout, alias, shlex.split(args.pytest_args))
        except Exception as e:
            sections["kernel_tests"] = _failure(e)

    try:
        t0 = time.perf_counter()
        if args.cpu_smoke:
            sections["tree_attention"] = bench_tree_attention(
                device, torch.float32, tree_sizes=(1, 8), contexts=(64, 256), num_heads=9, num_kv_heads=3,
                head_dim=64, block_size=16, num_layers=2, iters=args.iters or 5, warmup=2)
        else:
            sections["tree_attention"] = bench_tree_attention(
                device, torch.bfloat16, tree_sizes=(1, 8, 32, 64), contexts=(512, 4096, 16384), num_heads=9,
                num_kv_heads=3, head_dim=64, block_size=16, num_layers=30, iters=args.iters or 100, warmup=10)
        sections["tree_attention"]["seconds"] = round(time.perf_counter() - t0, 1)
    except Exception as e:
        sections["tree_attention"] = _failure(e)

    try:
        t0 = time.perf_counter()
        if args.cpu_smoke:
            sections["decode"] = bench_decode(device, torch.float32, tiny_config(), prompt_len=48,
                                              new_tokens=args.new_tokens or 24, kv_cache_bytes=8 << 20,
                                              fast_linear=False)
        else:
            sections["decode"] = bench_decode(device, torch.bfloat16, smollm2_135m_config(), prompt_len=256,
                                              new_tokens=args.new_tokens or 256, kv_cache_bytes=1 << 30)
        sections["decode"]["seconds"] = round(time.perf_counter() - t0, 1)
    except Exception as e:
        sections["decode"] = _failure(e)

    report["total_seconds"] = time.perf_counter() - t_start
    print(render(report))
    json_path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2, default=str))
    failed = [name for name, sec in sections.items() if sec.get("status") not in ("ok", "passed", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
