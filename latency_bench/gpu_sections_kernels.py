"""gpu_check section 1: the GPU op tests (the Triton kernels' tests) on CUDA, kernels compiled.

Only the test files that run the ops on the GPU (`GPU_TEST_FILES`, the op tests first): the
CPU-only suites of tests/kernels (`CPU_ONLY_TEST_FILES`: the C kernels, the CPU benchmarks) and
the CI-only tests (`CI_ONLY_TESTS`: subprocesses that never touch the GPU, such as the sm_90
cross-compile) are CI's, and would only spend the lent machine's minutes.
tests/kernels/test_kernels_dispatch.py checks that every test file there is in one list or the
other.

pytest runs in a subprocess with TRITON_INTERPRET unset and without `-x`, so one failing op does
not hide the others. The subprocess leads its own process group (its own session): at the
deadline, or when gpu_check is interrupted, the whole group is killed (os.killpg), so a test's
own children (a `python -c` helper, a compile worker) cannot outlive the run on the GPU; on
Linux it is also sent SIGKILL should gpu_check die without cleaning up (PR_SET_PDEATHSIG).
`OutcomeRecorder`, a pytest plugin loaded into that subprocess, appends each test's outcome to a
JSON-lines file as it happens; the parent re-reads it while waiting, so the pass/fail counts
reach the report even when the run is stopped at its time budget (or gpu_check itself is
killed: the counts are checkpointed into the JSON every few seconds).

This module is also imported inside the pytest subprocess (for the plugin): keep its top-level
imports to the standard library.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from prescient.latency_bench.gpu_sections_common import table

_PROBE = "gpu_check-probe:"
# Outcome names as pytest's own summary line spells them.
_OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_POLL_S = 3.0

# tests/kernels files whose tests run the ops on the GPU (the `device` / `backend` fixtures of
# tests/kernels/conftest.py), in the order they run: the Triton op tests first.
GPU_TEST_FILES = ("test_kernels_ops.py", "test_kernels_reference.py", "test_kernels_dispatch.py")
# CPU-only: the C kernels, int8 KV (a CPU-only cache format), the CPU reference benchmarks, and
# gpu_check's own smoke test (it would only run gpu_check again). CI runs them.
CPU_ONLY_TEST_FILES = ("test_attention_invariance.py", "test_cl_rows_bits.py", "test_cpu_argmax.py", "test_cpu_bitmask.py", "test_cpu_attention.py",
                       "test_cpu_layer.py",
                       "test_cpu_linear.py", "test_cpu_threads.py", "test_gpu_check_smoke.py", "test_kernels_bench.py", "test_kv_int8.py",
                       "test_format_table.py", "test_huge_pages.py", "test_qgemv_k.py", "test_qgemv_k_bits.py", "test_quant_linear.py")
# Tests inside GPU_TEST_FILES that only CI needs, each a subprocess that never touches the GPU:
# lowering every kernel to an sm_90 cubin without one (tens of seconds; the compiled runs here
# prove more), the specialization keys of the kernels' launches (the same on any machine), and
# the CPU path of an interpreter without triton.
CI_ONLY_TESTS = tuple(f"tests/kernels/test_kernels_dispatch.py::{name}" for name in (
    "test_every_kernel_compiles_for_sm90", "test_shape_integers_do_not_split_compiled_variants",
    "test_ops_import_and_run_without_triton"))

# The pytest subprocess starts with these lines: on Linux, the kernel sends it SIGKILL when its
# parent (gpu_check) dies, so even a SIGKILLed gpu_check leaves no pytest holding the GPU. The
# parent's pid, passed in, catches a parent that died before prctl ran.
_DIE_WITH_PARENT = (
    "import os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "    if os.getppid() != int(sys.argv.pop(1)):\n"
    "        os._exit(1)\n"
    "else:\n"
    "    sys.argv.pop(1)\n"
)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s whole process group (it leads one: start_new_session), then reap it.
    No-op for a group already gone: a pid is not reused while a group of that id has members."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class OutcomeRecorder:
    """pytest plugin (inside the subprocess): one JSON line per test outcome, flushed at once."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # line-buffered: each outcome lands on disk

    def _write(self, **record) -> None:
        self._file.write(json.dumps(record) + "\n")

    def pytest_runtest_logreport(self, report) -> None:
        # setup/teardown reports only count when they did not pass (a skip marker, a broken
        # fixture); the call report carries the test's own outcome. pytest counts the same way.
        if report.when != "call" and report.passed:
            return
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.failed and report.when != "call":
            outcome = "error"
        else:
            outcome = report.outcome
        record = {"nodeid": report.nodeid, "when": report.when, "outcome": outcome,
                  "seconds": round(getattr(report, "duration", 0.0), 3)}
        if report.failed:
            record["message"] = (report.longreprtext or "")[-1500:]
        self._write(**record)

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # an import error in a test module: pytest reports it as an error
            self._write(nodeid=report.nodeid, when="collect", outcome="error",
                        message=(report.longreprtext or "")[-1500:])

    def pytest_collection_finish(self, session) -> None:
        self._write(collected=len(session.items))

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self._write(exitstatus=int(exitstatus))
        self._file.close()


def read_outcomes(path: Path) -> dict:
    """Counts, failing tests and pytest's exit status from the recorder's file (so far)."""
    counts: Counter = Counter()
    failures, exitstatus, collected = [], None, None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the line being written as we read
            continue
        if "exitstatus" in record:
            exitstatus = record["exitstatus"]
            continue
        if "collected" in record:
            collected = record["collected"]
            continue
        counts[record["outcome"]] += 1
        if record["outcome"] in ("failed", "error"):
            failures.append(record)
    return {"counts": {k: counts.get(k, 0) for k in _OUTCOMES}, "failures": failures[:30],
            "num_failures": len(failures), "collected": collected, "exitstatus": exitstatus}


def run(ctx, repo: Path, alias: str | None, extra_args: list[str] | None = None) -> dict:
    """`pytest tests/kernels -q` (no -x) in a subprocess until it ends or ctx's deadline."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": "pytest is not installed"}
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PRESCIENT_KERNELS")}
    # Without an install, the checkout's bare prescient/ must not be found first. pytest puts the
    # repo at sys.path[0] before the test modules import prescient, and `python -c` children of
    # the tests put their cwd there; so the run starts in the alias directory and imports the
    # alias's prescient before pytest starts (a package, once imported, keeps its __path__).
    cwd = alias or str(repo)
    # pyproject's addopts carries --benchmark-disable, an unknown option (a usage error before
    # any test runs) where pytest-benchmark is missing; override addopts.
    has_bench = importlib.util.find_spec("pytest_benchmark") is not None
    addopts = "-p no:cacheprovider" + (" --benchmark-disable" if has_bench else "")
    kernels = repo / "tests" / "kernels"
    pytest_args = [*(str(kernels / name) for name in GPU_TEST_FILES), "--rootdir", str(repo), "-q",
                   "-o", f"addopts={addopts}", *(a for nodeid in CI_ONLY_TESTS for a in ("--deselect", nodeid))]
    notes = [f"CPU-only suites left to CI: {', '.join(CPU_ONLY_TEST_FILES)}; deselected: {', '.join(CI_ONLY_TESTS)}"]
    pytest_args += extra_args or []
    # The conftests set TRITON_INTERPRET=1 only without CUDA; the run reports what the test
    # process ended up with, since an interpreted run would "pass" without ever compiling a
    # kernel for the GPU.
    probe = ("import os, torch; print('\\n%s interpret=%s cuda=%s' % "
             f"({_PROBE!r}, os.environ.get('TRITON_INTERPRET'), torch.cuda.is_available())); ")
    boot = (_DIE_WITH_PARENT + ("import prescient; " if alias else "")
            + "import pytest; from prescient.latency_bench.gpu_sections_kernels import OutcomeRecorder; "
            + "rc = pytest.main(sys.argv[2:], plugins=[OutcomeRecorder(sys.argv[1])]); " + probe + "sys.exit(rc)")

    with tempfile.TemporaryDirectory(prefix="gpu_check-pytest-") as tmp:
        outcomes_path, log_path = Path(tmp) / "outcomes.jsonl", Path(tmp) / "output.txt"
        cmd = [sys.executable, "-c", boot, str(os.getpid()), str(outcomes_path), *pytest_args]
        base = {"command": cmd, "cwd": cwd, "notes": notes, "time_allowed_s": _round(ctx.time_left())}
        t0 = time.monotonic()
        timed_out = False
        with open(log_path, "w") as log:
            # Its own session and process group, killed whole below: killing pytest alone would
            # leave its children (subprocesses some tests start) running on the GPU.
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                while True:
                    try:
                        proc.wait(timeout=max(0.05, min(_POLL_S, ctx.time_left())))
                        break
                    except subprocess.TimeoutExpired:
                        if ctx.expired():
                            timed_out = True
                            break
                        ctx.checkpoint({**base, **read_outcomes(outcomes_path),
                                        "seconds": round(time.monotonic() - t0, 1)})
            finally:
                # The deadline, or gpu_check itself interrupted (SIGTERM): pytest's whole group
                # goes; after a normal exit, whatever its tests left running in the group.
                kill_group(proc)
        out = log_path.read_text(errors="replace")
        result = {**base, **read_outcomes(outcomes_path)}
    seconds = round(time.monotonic() - t0, 1)
    probe_line = next((line for line in out.splitlines() if line.startswith(_PROBE)), "")
    # Only meaningful with a GPU: without one, the interpreter is the intended CPU path.
    forced = ("interpret=1" in probe_line) if "cuda=True" in probe_line else None
    summary = next((line.strip("= ") for line in reversed(out.splitlines())
                    if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", line)), "")
    counts = result["counts"]
    errors = {}
    if timed_out:
        errors["timeout"] = (f"pytest stopped at its time limit, {base['time_allowed_s']} s, after "
                             f"{sum(counts.values())} test outcomes ({result['collected']} tests collected); "
                             "the rest did not run")
    elif proc.returncode not in (0, 1) or (proc.returncode == 1 and not result["num_failures"]):
        # 2 interrupted, 3 internal error, 4 usage error, 5 no tests collected
        errors["pytest"] = f"pytest exited with status {proc.returncode}"
    if forced:
        errors["interpreter"] = "TRITON_INTERPRET=1 on a CUDA machine: the kernels ran interpreted, not compiled"
    result.update({
        "returncode": None if timed_out else proc.returncode,
        "summary": summary,
        "seconds": seconds,
        "conftest_forces_interpreter": forced,
        "probe": probe_line[len(_PROBE):].strip(),
        # The section's error measure: tests that failed or errored (tolerance 0).
        "measured_error": counts["failed"] + counts["error"],
        "errors": errors,
        "output_tail": out[-3000:],
    })
    return result


def _round(x: float) -> float | None:
    return None if x == float("inf") else round(x, 1)


def render(r: dict) -> list[str]:
    if "counts" not in r:
        return []
    c = r["counts"]
    out = [f"{', '.join(f'{c[k]} {k}' for k in _OUTCOMES if c.get(k)) or 'no outcomes'} of "
           f"{r.get('collected')} collected in {r.get('seconds')} s "
           f"(pytest: {r.get('summary') or 'no summary line'}); conftest forces the interpreter: "
           f"{r.get('conftest_forces_interpreter')} ({r.get('probe') or 'no probe line'})."]
    out += [f"Note: {note}." for note in r.get("notes", [])]
    if r.get("failures"):
        out += ["", table(["test", "phase", "outcome"],
                          [[f"`{f['nodeid']}`", f["when"], f["outcome"]] for f in r["failures"]])]
        if r.get("num_failures", 0) > len(r["failures"]):
            out.append(f"... and {r['num_failures'] - len(r['failures'])} more.")
    if r.get("status") not in ("ok", "running"):
        out += ["", "```", (r.get("output_tail") or "")[-1500:], "```"]
    return out
