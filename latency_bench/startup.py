"""Start-up time as a user meets it: process start to `/health` answering 200 (`prescient
serve`) and to the first printed token (`prescient generate`), median of N runs each.

    prescient bench startup [--runs 3] [--model PATH]   # = python -m prescient.latency_bench.startup

"first start" runs each process against an empty cache folder (PRESCIENT_CACHE_DIR in a fresh
temporary directory): the GGUF conversion and the one-time C kernel compile are paid then, as on
a machine's first start after install. "warm" reuses one cache that a first start filled.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from prescient.latency_bench.suites import suite_parser
from prescient.runtime.slo import percentile

EXE = os.path.join(os.path.dirname(sys.executable), "prescient")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_to_health(env: dict, model: list[str], timeout: float = 300.0) -> float:
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([EXE, "serve", "--port", str(port), "--quiet", *model], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"prescient serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.02)
        raise TimeoutError("no /health within the timeout")
    finally:
        proc.terminate()
        proc.wait(30)


def generate_to_first_token(env: dict, model: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([EXE, "generate", "Write a haiku about the sea", "--quiet", *model], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        first = proc.stdout.read(1)  # generate flushes each delta as it is committed
        elapsed = time.perf_counter() - t0
        if not first:
            raise RuntimeError("prescient generate printed nothing")
        proc.stdout.read()
        return elapsed
    finally:
        proc.wait(120)


def cli(argv: list[str] | None = None) -> int:
    p = suite_parser("startup", __doc__, model=True)
    p.add_argument("--runs", type=int, default=3, help="runs per figure (median reported)")
    args = p.parse_args(argv)
    model = ["--model", args.model] if args.model else []
    results: dict[str, list[float]] = {}
    for what, fn in (("serve_to_health_s", serve_to_health), ("generate_to_first_token_s", generate_to_first_token)):
        first, warm = [], []
        warm_dir = tempfile.mkdtemp(prefix="prescient-warm-")
        for i in range(args.runs):
            cold_dir = tempfile.mkdtemp(prefix="prescient-cold-")
            first.append(fn({**os.environ, "PRESCIENT_CACHE_DIR": cold_dir}, model))
            shutil.rmtree(cold_dir, ignore_errors=True)
            if i == 0:  # fill the warm cache once
                fn({**os.environ, "PRESCIENT_CACHE_DIR": warm_dir}, model)
            warm.append(fn({**os.environ, "PRESCIENT_CACHE_DIR": warm_dir}, model))
            print(f"{what}: first start {first[-1]:.2f} s, warm {warm[-1]:.2f} s", file=sys.stderr, flush=True)
        shutil.rmtree(warm_dir, ignore_errors=True)
        results[f"{what}_first_start"] = first
        results[f"{what}_warm"] = warm
    summary = {k: {"median": percentile(v, 50), "runs": v} for k, v in results.items()}
    from prescient.kernels.cpu_linear import kernel_info

    summary["isa"] = kernel_info().get("isa")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
