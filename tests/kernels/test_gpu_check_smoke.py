"""Smoke test of latency_bench/gpu_check.py without a GPU: its --cpu-smoke mode, run the way the
GPU machine runs it (a plain checkout on PYTHONPATH, no installed prescient), and its import alias.

`python -S` keeps site-packages' .pth files (the editable install's import hook among them) from
loading, so `prescient.runtime` is not importable until the script's alias provides it; the
interpreter still finds torch through the site-packages directories passed on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "latency_bench" / "gpu_check.py"


def _plain_checkout_env() -> dict[str, str]:
    # The repo first (as `PYTHONPATH=.` on the GPU machine), then this interpreter's own path
    # entries minus the repo, so torch/numpy/pytest import without site processing.
    paths = [str(REPO)] + [p for p in sys.path if p and Path(p).resolve() != REPO]
    env = {k: v for k, v in os.environ.items() if k != "PRESCIENT_KERNELS"}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def test_cpu_smoke_runs_from_a_plain_checkout(tmp_path):
    env = _plain_checkout_env()
    env["OUT"] = str(tmp_path)
    # Section 1 on one small test selection: the pytest plumbing (addopts override, the alias
    # imported ahead of pytest's own sys.path insertion) without the whole suite's runtime.
    cmd = [sys.executable, "-S", str(SCRIPT), "--cpu-smoke", "--run-tests",
           "--pytest-args", "-k test_cpu_tensors_run_the_reference"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    out = result.stdout
    assert "| tree | context | tree_attention µs |" in out
    assert "| speculation | status |" in out

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke"
    assert "alias" in report["import_mode"], report["import_mode"]
    sections = report["sections"]
    assert sections["kernel_tests"]["status"] == "passed", sections["kernel_tests"]
    assert "6 passed" in sections["kernel_tests"]["summary"]

    attention = sections["tree_attention"]
    assert attention["status"] == "ok" and attention["backend"] == "reference"
    assert {(r["tree_size"], r["context"]) for r in attention["rows"]} == {(1, 64), (8, 64), (1, 256), (8, 256)}
    # float32 on both sides: the reference and SDPA agree to rounding.
    assert max(r["max_abs_err"] for r in attention["rows"]) < 1e-4

    decode = sections["decode"]
    assert decode["status"] == "ok", decode
    rows = {(r["sampling"], r["speculation"]): r for r in decode["rows"]}
    assert rows.keys() == {("greedy", "off"), ("greedy", "ngram"), ("t=0.8", "off"), ("t=0.8", "ngram")}
    for row in rows.values():
        # 24 tokens, the first from the prefill step: the decode rate counts the other 23
        assert row["status"] == "ok" and row["decoded_tokens"] == 23 and row["decode_tokens_per_s"] > 0
    assert decode["greedy_outputs_match"]["identical"]  # speculation never changes greedy output


def test_alias_reaches_child_processes(tmp_path):
    """ensure_prescient_importable maps prescient.<part> onto the checkout's folders, for the
    process and (through PYTHONPATH) for the subprocesses it starts; its directory goes at exit."""
    code = textwrap.dedent(f"""
        import importlib.util, os, subprocess, sys
        spec = importlib.util.spec_from_file_location("gpu_check", {str(SCRIPT)!r})
        gpu_check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpu_check)
        alias = gpu_check.ensure_prescient_importable()
        assert alias is not None, "prescient.runtime should not import before the alias"
        import prescient.runtime.config
        # resolved here: the alias (and so its symlinks) is gone once this process exits
        print("parent", os.path.realpath(prescient.runtime.config.__file__))
        child = subprocess.run(
            [sys.executable, "-S", "-c",
             "import os, prescient.kernels.ops, prescient.runtime.engine, prescient.speculative.speculator; "
             "print('child', os.path.realpath(prescient.kernels.ops.__file__))"],
            cwd=alias, env=os.environ, capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr
        print(child.stdout.strip())
        print("alias", alias)
    """)
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=_plain_checkout_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert Path(lines["parent"]) == REPO / "runtime" / "config.py"
    assert Path(lines["child"]) == REPO / "kernels" / "ops.py"
    assert not Path(lines["alias"]).exists()  # removed at exit, symlinks and all
    assert (REPO / "runtime" / "config.py").exists()  # ... without touching the checkout
