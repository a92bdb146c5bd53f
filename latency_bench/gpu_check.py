"""One-shot GPU check for a lent CUDA machine: GPU op tests, tree attention vs SDPA, decode, SLOs.

    PYTHONPATH=. python latency_bench/gpu_check.py                    # on the GPU machine (300 s)
    PYTHONPATH=. python latency_bench/gpu_check.py --cpu-smoke        # anywhere, tiny shapes, no GPU
    python -m prescient.latency_bench.gpu_check --out /tmp/x.json     # no CUDA: all sections skipped

Sections, in order (`default_sections`; each one's code in latency_bench/gpu_sections_*.py):
1. kernel_tests (gpu_sections_kernels): the GPU op tests (tests/kernels/test_kernels_ops.py,
   test_kernels_reference.py, test_kernels_dispatch.py: the Triton kernels against the
   reference), no -x, in a subprocess of its own process group with TRITON_INTERPRET unset so the
   kernels compile for the GPU; outcome counts in the JSON. The CPU-only suites (C kernels, CPU
   benchmarks) are left to CI. Tolerance: 0 failed or erroring tests.
2. tree_attention (gpu_sections_attention): `ops.tree_attention` against SDPA over KV gathered
   from the paged cache, SmolLM2-135M attention shapes, bf16, CUDA-event timings.
   Tolerance: max |tree_attention - SDPA| <= 2e-2 in bf16 (1e-4 in float32, --cpu-smoke).
3. decode (gpu_sections_decode): greedy decode tokens/s of a random-init SmolLM2-135M, plain and
   with n-gram speculation, plus sampled decoding. Tolerance: at the first token where speculative
   greedy output leaves the plain one, its logit gap to the plain argmax <= 0.1 in bf16 (1e-3 in
   float32); 0 when the outputs are identical.
Later: slo (gpu_sections_slo): 32 concurrent multi-turn agents on the real 135M model (the
   section errors, naming why, when it cannot load: random weights are never passed off as it)
   and an 8B-shaped random Llama, greedy and sampled, n-gram speculation off and on, each eager
   and with CUDA graphs (EngineConfig.cuda_graphs, which only this section turns on), on the
   device step path (one forward and one sync a step; --cpu-smoke runs that path on the CPU,
   graph rows skipped); TTFT p50/p99, per-emission ITL p99 and the largest gap (ITL max) against
   the seed SLO (200 ms / 25 ms), reported in the section's `slo_verdict` (every row's budgets, the
   rows that missed, graphs / eager ITL p99), no tolerance. tensor_parallel (gpu_sections_tp): TP=2
   over two GPUs (NCCL) against TP=1, logits and decode ms/token; skipped with a line saying so
   below two GPUs. Tolerance: relative logit error <= 5e-2 in bf16.

Nothing measured is lost: the JSON ($OUT/gpu_check.json, or --out) is rewritten atomically (temp
file + os.replace) when the check starts, after every section and at checkpoints inside the long
ones; the Markdown report goes to stdout section by section, flushed. Each section ends as
`ok`, `fail` (its error above its tolerance: measured error and tolerance recorded), `error` (it
raised; the exception is recorded and the next section runs) or `skipped` (with the reason: no
CUDA device, --skip-tests, time limit). The exit status is 1 when a section failed or errored.
Time: --time-limit (default 300 s: with the machine's start-up, a rerun still fits in 15 minutes
of device time) bounds the whole check and each section has a budget (--budget NAME=SECONDS; the
defaults, `DEFAULT_BUDGETS_S`, add up to the default limit); the long sections stop their loops
at their deadline, a section's deadline leaves the sections after it the minimum they need to
start, and a section is skipped ("time limit") when less than half its minimum is left. On
SIGTERM the running section is recorded as an error, the JSON written, and the exit status is
143.

The GPU machine has no installed prescient, only the copied tree: setuptools' package-dir maps
`prescient.runtime` -> runtime/ etc., which a plain PYTHONPATH cannot express, so
`ensure_prescient_importable` builds that mapping as a directory of symlinks (see there). This
file imports nothing of prescient at module level for that reason: the sections are imported by
`default_sections`, after the alias exists.
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
import contextlib  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Callable  # noqa: E402

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

# Seconds per section (their sum is the default --time-limit). The kernel tests are the GPU op
# tests only; the long sections stop their loops at their deadline and keep what they measured.
# The SLO section has the most: two models x four runs x eager and CUDA graphs.
DEFAULT_BUDGETS_S = {"kernel_tests": 80.0, "tree_attention": 30.0, "decode": 50.0, "slo": 110.0,
                     "tensor_parallel": 30.0}
# At most 300 s, so that a failed first run can be rerun within 15 minutes of device time,
# machine start-up included.
DEFAULT_TIME_LIMIT_S = 300.0

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


def cuda_available() -> bool:
    """torch.cuda.is_available(), a function of its own so that tests can pretend either way."""
    import torch

    return torch.cuda.is_available()


def _fmt_err(x) -> str:
    # The same as gpu_sections_common.fmt_err, which this file cannot import before the alias.
    if x is None:
        return "–"
    if isinstance(x, int) or (isinstance(x, float) and math.isfinite(x) and x == int(x) and (x >= 1 or x == 0)):
        return str(int(x))
    return f"{x:.2e}" if isinstance(x, float) and math.isfinite(x) else str(x)


def _jsonable(obj):
    """`obj` with non-finite floats as strings ("nan", "inf"): json.dumps would write NaN and
    Infinity, which strict JSON parsers reject, and a NaN error is exactly what must show."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write to a temporary file beside `path`, then rename it over `path`: a reader (or a kill
    mid-write) sees the previous complete file or the new one, never a truncated one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_jsonable(obj), f, indent=2, default=str)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would differ from what a plain write gives
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------- sections and their driver

OK, FAIL, ERROR, SKIPPED = "ok", "fail", "error", "skipped"


class Section:
    """One step of the check. `run(ctx)` returns a dict of what it measured; the driver turns it
    into the section's status: `measured_error` above `tolerance` (NaN included) is a fail, a
    non-empty `errors` an error, {"status": "skipped", "reason": ...} a skip.

    A plain class, not a dataclass: dataclasses look their module up in sys.modules, which a
    file loaded by path (spec_from_file_location, as the alias test does) is not in."""

    def __init__(self, name: str, title: str, run: Callable[["SectionContext"], dict], *, metric: str = "",
                 tolerance: float | None = None, budget_s: float | None = None, min_s: float = 0.0,
                 needs_cuda: bool = False, skip_reason: str | None = None,
                 render: Callable[[dict], list[str]] | None = None):
        self.name = name  # key in the JSON's "sections"
        self.title = title  # Markdown heading
        self.run = run
        self.metric = metric  # what measured_error is
        self.tolerance = tolerance  # None: no error measure (the section fails only by raising)
        self.budget_s = budget_s  # the section's deadline is its start + this (within --time-limit)
        self.min_s = min_s  # the least time worth starting with: reserved by the sections before
        self.needs_cuda = needs_cuda  # skipped without a CUDA device
        self.skip_reason = skip_reason  # skipped by the command line (--skip-tests, ...)
        self.render = render  # Markdown lines for the section's record

    def __repr__(self) -> str:
        return f"Section({self.name!r})"


class SectionContext:
    """What a running section sees of the driver: its deadline and a way to save partial results."""

    def __init__(self, deadline: float, on_checkpoint: Callable[[dict], None]):
        self.deadline = deadline  # time.monotonic() value; math.inf without any limit
        self._on_checkpoint = on_checkpoint

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.time_left() <= 0

    def checkpoint(self, partial: dict) -> None:
        """Record what the section has so far (status "running") and rewrite the JSON: a kill
        before the section ends still leaves these numbers."""
        self._on_checkpoint(partial)


class Terminated(BaseException):
    """Raised by the SIGTERM handler: a BaseException, so that the sections' `except Exception`
    blocks let it through to the driver, which records it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _raise_terminated(signum, frame):
    raise Terminated(signum)


class Reporter:
    """The report dict, its JSON file and the Markdown stream."""

    def __init__(self, report: dict, json_path: str | None):
        self.report = report
        self.json_path = json_path
        self._warned = False

    def save(self) -> None:
        if not self.json_path:
            return
        try:
            write_json_atomic(self.json_path, self.report)
        except (OSError, TypeError, ValueError) as e:
            # A full disk must not stop the measurements (stdout still carries them).
            if not self._warned:
                print(f"gpu_check: cannot write {self.json_path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._warned = True

    def print(self, *lines: str) -> None:
        print("\n".join(lines), flush=True)  # flushed: a killed run keeps what was printed


def _judge(section: Section, result: dict) -> dict:
    """The section's record: its result plus status, measured error vs tolerance, verdict."""
    record = dict(result)
    if result.get("status") == SKIPPED:
        record.setdefault("reason", "skipped by the section")
        return record
    measured, tol = result.get("measured_error"), section.tolerance
    record["measured_error"] = measured
    errors = result.get("errors")
    if tol is not None and measured is not None and not measured <= tol:  # `not <=`: NaN fails
        record["status"] = FAIL
        record["verdict"] = f"{section.metric or 'error'} {_fmt_err(measured)} > tolerance {_fmt_err(tol)}"
    elif errors:
        record["status"] = ERROR
        parts = [f"{k}: {v['error'] if isinstance(v, dict) else v}" for k, v in errors.items()] \
            if isinstance(errors, dict) else [str(e) for e in errors]
        record["error"] = "; ".join(parts)[:2000]
    elif tol is not None and measured is None:
        if result.get("truncated"):
            record["status"], record["reason"] = SKIPPED, "time limit before anything to hold against the tolerance"
        else:
            record["status"], record["error"] = ERROR, "the section measured nothing to hold against its tolerance"
    else:
        record["status"] = OK
        if tol is not None:
            record["verdict"] = f"{section.metric or 'error'} {_fmt_err(measured)} <= tolerance {_fmt_err(tol)}"
    return record


def _deadline(section: Section, start: float, deadline_all: float, reserve: float) -> tuple[float, str]:
    """When `section` must stop, and what sets that time: its budget, the time the later sections
    need at least (`reserve`, so the first sections cannot eat the whole --time-limit), or the
    limit itself. Never less than the section's own minimum."""
    candidates = [(deadline_all, "--time-limit"), (deadline_all - reserve, "the later sections' minimum")]
    if section.budget_s is not None:
        candidates.append((start + section.budget_s, "budget"))
    deadline, why = min(candidates, key=lambda c: c[0])
    return max(deadline, min(deadline_all, start + section.min_s)), why


def _run_one(section: Section, base: dict, reporter: Reporter, deadline: float,
             why: str) -> tuple[dict, Terminated | KeyboardInterrupt | None]:
    records = reporter.report["sections"]
    start = time.monotonic()

    def checkpoint(partial: dict) -> None:
        records[section.name] = {**base, **partial, "status": "running", "seconds": round(time.monotonic() - start, 1)}
        reporter.save()

    checkpoint({})
    stop = None
    try:
        record = _judge(section, dict(section.run(SectionContext(deadline, checkpoint)) or {}))
    except (Terminated, KeyboardInterrupt) as e:
        stop = e
        name = e.args[0] if isinstance(e, Terminated) else "SIGINT"
        # What the last checkpoint saved stays in the record.
        record = {**records[section.name], "status": ERROR,
                  "error": f"gpu_check was terminated ({name}) {time.monotonic() - start:.1f} s into this section"}
    except Exception as e:
        record = {**records[section.name], "status": ERROR, "error": f"{type(e).__name__}: {e}"[:2000],
                  "traceback": traceback.format_exc()[-4000:]}
    record = {**base, **record, "seconds": round(time.monotonic() - start, 1)}
    if record.get("truncated"):
        record["deadline"] = why
    return record, stop


def _status_line(record: dict) -> list[str]:
    status = record["status"]
    timing = f" ({record['seconds']} s" + (f" of a {record['budget_s']} s budget)" if record.get("budget_s") else ")") \
        if "seconds" in record else ""
    truncated = "; stopped early at its time limit" if record.get("truncated") else ""
    if status == SKIPPED:
        return [f"skipped: {record.get('reason')}" + (f" ({record['detail']})." if record.get("detail") else ".")]
    if status == OK:
        return [f"**ok**{': ' + record['verdict'] if record.get('verdict') else ''}{timing}{truncated}."]
    if status == FAIL:
        return [f"**FAIL**: {record['verdict']}{timing}{truncated}."]
    lines = [f"**error**: {record.get('error')}{timing}."]
    if record.get("traceback"):
        lines += ["", "```", record["traceback"][-1500:], "```"]
    return lines


def _render_section(section: Section, record: dict) -> list[str]:
    lines = _status_line(record)
    if section.render is not None:  # a skipped section may still carry partial results
        try:
            body = section.render(record)
        except Exception as e:  # a report bug must not end the check
            body = [f"(rendering this section failed: {type(e).__name__}: {e})"]
        if body:
            lines += [""] + body
    return lines


def run_sections(sections: list[Section], reporter: Reporter, *, cuda: bool, time_limit: float | None,
                 t_start: float) -> int:
    """Run the sections in order, saving and printing after each; returns the exit status."""
    report = reporter.report
    records = report.setdefault("sections", {})
    bases = {s.name: {"title": s.title, "metric": s.metric, "tolerance": s.tolerance, "budget_s": s.budget_s}
             for s in sections}
    for s in sections:
        records[s.name] = {**bases[s.name], "status": "pending"}
    reporter.save()  # a valid JSON from the start
    deadline_all = math.inf if time_limit is None else t_start + time_limit
    stop: Terminated | KeyboardInterrupt | None = None
    for number, s in enumerate(sections, 1):
        base = bases[s.name]
        reporter.print("", f"## {number}. {s.title}", "")
        left = deadline_all - time.monotonic()
        if stop is not None:
            record = {**base, "status": SKIPPED, "reason": "gpu_check was terminated before this section"}
        elif s.skip_reason:
            record = {**base, "status": SKIPPED, "reason": s.skip_reason}
        elif s.needs_cuda and not cuda:
            record = {**base, "status": SKIPPED, "reason": "no CUDA device"}
        elif left <= 0 or left < s.min_s / 2:
            # Half, not all, of its minimum: the section before may overrun the deadline that
            # reserved this minimum by its last step, and half still buys a first result.
            record = {**base, "status": SKIPPED, "reason": "time limit",
                      "detail": f"{max(left, 0):.1f} s left of --time-limit {time_limit} s; the section needs "
                                f"about {s.min_s} s to start"}
        else:
            # Sections after this one that will run, each needing its min_s.
            reserve = sum(t.min_s for t in sections[number:]
                          if not t.skip_reason and not (t.needs_cuda and not cuda))
            deadline, why = _deadline(s, time.monotonic(), deadline_all, reserve)
            record, stop = _run_one(s, base, reporter, deadline, why)
        records[s.name] = record
        reporter.save()
        reporter.print(*_render_section(s, record))

    bad = [name for name, r in records.items() if r["status"] in (FAIL, ERROR)]
    if isinstance(stop, Terminated):
        code = 128 + stop.signum
    elif isinstance(stop, KeyboardInterrupt):
        code = 130
    else:
        code = 1 if bad else 0
    report["summary"] = {status: [n for n, r in records.items() if r["status"] == status]
                         for status in (OK, FAIL, ERROR, SKIPPED)}
    report["exit_code"] = code
    report["total_seconds"] = round(time.monotonic() - t_start, 1)
    report["finished"] = True
    reporter.save()
    rows = [[n, r["status"] + (f" ({r['reason']})" if r["status"] == SKIPPED else ""),
             _fmt_err(r.get("measured_error")), _fmt_err(r.get("tolerance")), r.get("seconds", "–")]
            for n, r in records.items()]
    reporter.print("", "## Summary", "",
                   "| section | status | measured error | tolerance | seconds |", "|---|---|---|---|---|",
                   *["| " + " | ".join(str(c) for c in row) + " |" for row in rows], "",
                   f"Exit status {code}" + (f": {', '.join(bad)} did not pass" if bad else "")
                   + f". Total: {report['total_seconds']:.1f} s.")
    return code


# ---------------------------------------------------------------- the registry


def default_sections(args, cuda: bool, alias: str | None) -> list[Section]:
    """The check's sections, configured from the command line (GPU shapes, or --cpu-smoke's)."""
    import torch

    from prescient.latency_bench import gpu_sections_attention as attention
    from prescient.latency_bench import gpu_sections_decode as decode
    from prescient.latency_bench import gpu_sections_kernels as kernels
    from prescient.latency_bench import gpu_sections_slo as slo
    from prescient.latency_bench import gpu_sections_tp as tensor_parallel

    smoke = args.cpu_smoke
    device = torch.device("cuda" if cuda and not smoke else "cpu")
    dtype = torch.float32 if smoke else torch.bfloat16
    dtype_name = str(dtype).replace("torch.", "")
    if args.skip_tests:
        tests_skip = "--skip-tests"
    elif smoke and not args.run_tests:
        tests_skip = "--cpu-smoke: the CPU suite runs in CI itself (--run-tests runs it here)"
    else:
        tests_skip = None
    if smoke:
        attention_shapes = dict(tree_sizes=(1, 8), contexts=(64, 256), num_layers=2, iters=args.iters or 5, warmup=2)
        decode_setup = dict(config=decode.tiny_config(), prompt_len=48, new_tokens=args.new_tokens or 24,
                            kv_cache_bytes=8 << 20, fast_linear=False)
    else:
        attention_shapes = dict(tree_sizes=(1, 8, 32, 64), contexts=(512, 4096, 16384), num_layers=30,
                                iters=args.iters or 100, warmup=10)
        decode_setup = dict(config=decode.smollm2_135m_config(), prompt_len=256, new_tokens=args.new_tokens or 256,
                            kv_cache_bytes=1 << 30)
    extra_pytest_args = shlex.split(args.pytest_args)
    return [
        Section("kernel_tests", "GPU op tests (Triton kernels vs the reference; no -x, TRITON_INTERPRET unset)",
                run=lambda ctx: kernels.run(ctx, REPO, alias, extra_pytest_args),
                metric="failed + erroring tests", tolerance=0, budget_s=args.pytest_timeout, min_s=20.0,
                needs_cuda=not smoke, skip_reason=tests_skip, render=kernels.render),
        Section("tree_attention", "Tree attention vs SDPA over gathered KV",
                run=lambda ctx: attention.run(ctx, device, dtype, num_heads=9, num_kv_heads=3, head_dim=64,
                                              block_size=16, **attention_shapes),
                metric="max |tree_attention - SDPA|", tolerance=attention.TOLERANCE[dtype_name],
                budget_s=DEFAULT_BUDGETS_S["tree_attention"],
                min_s=10.0, needs_cuda=not smoke, render=attention.render),
        Section("decode", "End-to-end decode (random-init weights, batch 1)",
                run=lambda ctx: decode.run(ctx, device, dtype, **decode_setup),
                metric="logit gap at the first greedy divergence (speculative vs plain)",
                tolerance=decode.TOLERANCE[dtype_name], budget_s=DEFAULT_BUDGETS_S["decode"], min_s=20.0,
                needs_cuda=not smoke,
                render=decode.render),
        Section("slo", "Seed SLOs under 32 concurrent agents (TTFT <= 200 ms, ITL p99 <= 25 ms; ITL max shown)",
                run=lambda ctx: slo.run(ctx, device, dtype, slo.default_models(device, dtype, smoke),
                                        **(dict(agents=4, turns=2, prefix_len=32, user_len=8, turn_tokens=8,
                                                tool_tokens=8, kv_cache_bytes=8 << 20, step_path="device")
                                           if smoke else {})),
                budget_s=DEFAULT_BUDGETS_S["slo"], min_s=30.0, needs_cuda=not smoke, render=slo.render),
        Section("tensor_parallel", "Tensor parallel TP=2 vs TP=1 (two GPUs, NCCL)",
                run=lambda ctx: tensor_parallel.run(ctx, dtype, device.type,
                                                    **(dict(config=decode.tiny_config(), prompt_len=32,
                                                            new_tokens=8) if smoke else {})),
                metric="max |logits TP=2 - TP=1| / max |logits|", tolerance=tensor_parallel.TOLERANCE[dtype_name],
                budget_s=DEFAULT_BUDGETS_S["tensor_parallel"], min_s=30.0, needs_cuda=not smoke,
                render=tensor_parallel.render),
    ]


# ---------------------------------------------------------------- main


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no kernel tests (CI)")
    p.add_argument("--skip-tests", action="store_true", help="skip section 1 (pytest)")
    p.add_argument("--run-tests", action="store_true", help="run section 1 under --cpu-smoke too")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments for section 1, e.g. '-k dispatch'")
    p.add_argument("--pytest-timeout", type=float, default=DEFAULT_BUDGETS_S["kernel_tests"],
                   help=f"seconds for section 1 (its budget, default {DEFAULT_BUDGETS_S['kernel_tests']:g}; the same "
                   "as --budget kernel_tests=S)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per attention case")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per decode run (default 256; 24 with --cpu-smoke)")
    p.add_argument("--out", "--json", dest="out", default=None,
                   help="JSON path (default: $OUT/gpu_check.json when OUT is set)")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help=f"seconds for the whole check (default {DEFAULT_TIME_LIMIT_S:g}, so a rerun fits in 15 minutes "
                   "of device time with start-up): sections that would start later are skipped ('time limit')")
    p.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS",
                   help="a section's own time budget ("
                   + ", ".join(f"{name} {s:g}" for name, s in DEFAULT_BUDGETS_S.items()) + "); repeatable")
    args = p.parse_args(argv)
    budgets = {}
    for item in args.budget:
        name, sep, value = item.partition("=")
        try:
            budgets[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            p.error(f"--budget takes NAME=SECONDS, got {item!r}")
    args.budget = budgets
    return args


def _environment(torch, cuda: bool, on_gpu: bool) -> dict:
    return {
        "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
        "cuda": torch.version.cuda, "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu",
        "packages": {m: _has(m) for m in _OPTIONAL_PACKAGES},
        "env": {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "PRESCIENT_KERNELS")},
    }


def main(argv=None, sections: list[Section] | None = None) -> int:
    """The check; `sections` replaces the registry (tests pass small fake ones)."""
    t_start = time.monotonic()
    args = _parse_args(argv)
    json_path = args.out or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    report = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu",
              "argv": list(sys.argv[1:] if argv is None else argv), "time_limit_s": args.time_limit,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "finished": False, "sections": {}}
    reporter = Reporter(report, json_path)
    try:
        alias = ensure_prescient_importable()
        import torch

        cuda = cuda_available()
        if cuda and not args.cpu_smoke:
            # The Triton kernels read TRITON_INTERPRET when first imported: unset, they compile
            # for the GPU, which is what this check is for. Only with a GPU: on a CPU the
            # interpreter is the only way they run (and a test process keeps using them).
            os.environ.pop("TRITON_INTERPRET", None)
    except Exception as e:
        report.update(error=f"cannot import prescient or torch from {REPO}: {type(e).__name__}: {e}",
                      exit_code=2, finished=True)
        reporter.save()
        print(report["error"], file=sys.stderr, flush=True)
        return 2
    report["import_mode"] = f"through the alias {alias}" if alias else "as installed"
    report["environment"] = env = _environment(torch, cuda, cuda and not args.cpu_smoke)
    if sections is None:
        sections = default_sections(args, cuda, alias)
    unknown = set(args.budget) - {s.name for s in sections}
    if unknown:
        print(f"--budget: no section named {', '.join(sorted(unknown))} (sections: "
              f"{', '.join(s.name for s in sections)})", file=sys.stderr)
        return 2
    for s in sections:
        s.budget_s = args.budget.get(s.name, s.budget_s)

    reporter.print(f"# prescient GPU check ({report['mode']})", "",
                   f"Device: {env['device_name']}; torch {env['torch']}, triton {env['triton']}, "
                   f"Python {env['python']}; prescient imported {report['import_mode']}. "
                   f"Missing: {', '.join(m for m, ok in env['packages'].items() if not ok) or 'nothing'}. "
                   f"Time limit: {'none' if args.time_limit is None else f'{args.time_limit} s'}. "
                   f"JSON: {json_path or 'not written'}.")
    cuda_only = [s.name for s in sections if s.needs_cuda and not s.skip_reason]
    if not cuda and cuda_only:
        reporter.print("", f"No CUDA device (torch.cuda.is_available() is False): {', '.join(cuda_only)} "
                       "recorded as skipped; --cpu-smoke runs tiny shapes on the CPU.")
    try:
        previous, installed = signal.signal(signal.SIGTERM, _raise_terminated), True
    except ValueError:  # not the main thread: no handler, a SIGTERM then ends the run unrecorded
        previous, installed = None, False
    try:
        return run_sections(sections, reporter, cuda=cuda, time_limit=args.time_limit, t_start=t_start)
    except Terminated as e:  # between sections (while saving or printing): record and stop
        report.update(finished=True, exit_code=128 + e.signum, error=f"terminated ({e.args[0]})")
        reporter.save()
        return 128 + e.signum
    finally:
        if installed:  # `previous` is None for a handler not set from Python: back to the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
