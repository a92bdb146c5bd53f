"""Tests of latency_bench/gpu_check.py without a GPU.

- Its --cpu-smoke mode, run the way the GPU machine runs it (a plain checkout on PYTHONPATH, no
  installed prescient), and its import alias. `python -S` keeps site-packages' .pth files (the
  editable install's import hook among them) from loading, so `prescient.runtime` is not
  importable until the script's alias provides it; the interpreter still finds torch through the
  site-packages directories passed on PYTHONPATH.
- The driver, with small fake sections through the registry (`main(argv, sections=...)`): the
  JSON after every section, error / fail / skipped statuses, exit status, time limits, SIGTERM.
- The pieces of the real sections that CPU runs would not reach: pytest outcome counts with
  failing tests, pytest's process group killed whole at the deadline, the decode section's
  divergence measure, the SLO section's failure (not substitution) when the real model does not
  load and its ITL max column.
- What makes the check fit a lent machine: the default time limit and budgets.
- `--kv-dtype int8` refused on CUDA (prescient/build.py), with CUDA detection faked.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from prescient.latency_bench import gpu_check

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
    assert report["finished"] and report["exit_code"] == 0
    sections = report["sections"]
    tests = sections["kernel_tests"]
    assert tests["status"] == "ok", tests
    assert "7 passed" in tests["summary"]  # test_cpu_tensors_run_the_reference: one per op
    assert tests["counts"]["passed"] == 7 and tests["counts"]["failed"] == 0 and tests["collected"] == 7
    # the GPU op test files only, ops first; the CPU-only suites and the sm_90 cross-compile not
    kernel_dir = str(REPO / "tests" / "kernels")
    files = [Path(a).name for a in tests["command"] if a.startswith(kernel_dir)]
    assert files == ["test_kernels_ops.py", "test_kernels_reference.py", "test_kernels_dispatch.py"], files
    assert "tests/kernels/test_kernels_dispatch.py::test_every_kernel_compiles_for_sm90" in tests["command"]
    assert tests["measured_error"] == 0 and tests["tolerance"] == 0

    attention = sections["tree_attention"]
    assert attention["status"] == "ok" and attention["backend"] == "reference"
    assert {(r["tree_size"], r["context"]) for r in attention["rows"]} == {(1, 64), (8, 64), (1, 256), (8, 256)}
    # float32 on both sides: the reference and SDPA agree to rounding.
    assert max(r["max_abs_err"] for r in attention["rows"]) < 1e-4
    assert attention["measured_error"] == max(r["max_abs_err"] for r in attention["rows"])
    assert attention["tolerance"] == 1e-4

    decode = sections["decode"]
    assert decode["status"] == "ok", decode
    rows = {(r["sampling"], r["speculation"]): r for r in decode["rows"]}
    assert rows.keys() == {("greedy", "off"), ("greedy", "ngram"), ("t=0.8", "off"), ("t=0.8", "ngram")}
    for row in rows.values():
        # 24 tokens, the first from the prefill step: the decode rate counts the other 23
        assert row["status"] == "ok" and row["decoded_tokens"] == 23 and row["decode_tokens_per_s"] > 0
    assert decode["greedy_outputs_match"]["identical"]  # speculation never changes greedy output
    assert decode["measured_error"] == 0.0

    slo = sections["slo"]
    assert slo["status"] == "ok", slo
    # every run eagerly on the device step path (the CPU told to take it); graph rows need CUDA
    statuses = {(r["sampling"], r["speculation"], r["graphs"]): r["status"] for r in slo["rows"]}
    assert statuses == {**{(sp, mode, "eager"): "ok" for sp, mode in slo_runs()},
                        **{(sp, mode, "graphs"): "skipped: CUDA graphs need CUDA" for sp, mode in slo_runs()}}
    for row in slo["rows"]:
        if row["status"] != "ok":
            continue
        assert row["step_path"] == "device"
        itl = row["itl_emission_s"]
        assert itl["max"] is not None and itl["max"] >= itl["p99"]
    verdict = slo["slo_verdict"]
    assert verdict["budgets"] == {"ttft_s": 0.2, "itl_emission_p99_s": 0.025}
    assert verdict["rows_measured"] == 4 and verdict["rows_meeting"] + len(verdict["missed"]) == 4
    for record in sections.values():  # every section's budget is in the JSON
        assert record["budget_s"] and record["budget_s"] > 0, record
    assert "| ITL/emission p99 ms | ITL max ms |" in out


def slo_runs():
    from prescient.latency_bench import gpu_sections_slo as slo

    return slo.RUNS


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


# ---------------------------------------------------------------- the driver, with fake sections


def _strict_json(path: Path) -> dict:
    """The report as a strict JSON parser reads it (NaN / Infinity rejected)."""
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=reject)


def _section(name: str, run, **kw) -> gpu_check.Section:
    return gpu_check.Section(name=name, title=f"fake {name}", run=run, metric="fake error", **kw)


def _ok(ctx) -> dict:
    return {"measured_error": 0.0}


@pytest.fixture
def check(tmp_path, monkeypatch):
    """main() with fake sections; returns (exit status, the JSON it left)."""
    # main() unsets TRITON_INTERPRET outside --cpu-smoke: monkeypatch puts it back afterwards
    # for the kernel tests that share this process.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    out = tmp_path / "gpu_check.json"

    def run(sections, *args):
        code = gpu_check.main(["--out", str(out), *args], sections=sections)
        return code, _strict_json(out)

    run.path = out
    return run


def test_json_is_rewritten_after_every_section(check):
    seen = {}

    def second(ctx):
        # What a kill during this section would leave behind: the first section's result.
        seen.update({name: r["status"] for name, r in _strict_json(check.path)["sections"].items()})
        ctx.checkpoint({"rows": [1, 2]})
        seen["checkpoint"] = _strict_json(check.path)["sections"]["second"]
        return {"measured_error": 0.0}

    code, report = check([_section("first", _ok, tolerance=1.0), _section("second", second, tolerance=1.0),
                          _section("third", _ok, tolerance=1.0)])
    assert code == 0
    assert seen["first"] == "ok" and seen["second"] == "running" and seen["third"] == "pending"
    assert seen["checkpoint"]["status"] == "running" and seen["checkpoint"]["rows"] == [1, 2]
    assert report["finished"] and report["exit_code"] == 0
    assert [r["status"] for r in report["sections"].values()] == ["ok", "ok", "ok"]
    assert report["summary"]["ok"] == ["first", "second", "third"]
    # no temporary files left beside the report
    assert [p.name for p in check.path.parent.iterdir()] == [check.path.name]


def test_a_raising_section_is_an_error_and_the_next_still_runs(check, capsys):
    def broken(ctx):
        ctx.checkpoint({"rows": ["measured before the crash"]})
        raise ValueError("boom")

    code, report = check([_section("broken", broken, tolerance=1.0), _section("after", _ok, tolerance=1.0)])
    assert code == 1
    broken_rec, after = report["sections"]["broken"], report["sections"]["after"]
    assert broken_rec["status"] == "error" and broken_rec["error"] == "ValueError: boom"
    assert "Traceback" in broken_rec["traceback"]
    assert broken_rec["rows"] == ["measured before the crash"]  # the checkpoint survives the crash
    assert after["status"] == "ok"
    assert "**error**: ValueError: boom" in capsys.readouterr().out


def test_an_error_above_its_tolerance_fails(check, capsys):
    code, report = check([
        _section("within", lambda ctx: {"measured_error": 0.05}, tolerance=0.1),
        _section("above", lambda ctx: {"measured_error": 0.5}, tolerance=0.1),
        _section("nan", lambda ctx: {"measured_error": math.nan}, tolerance=0.1),
        _section("sub_error", lambda ctx: {"measured_error": 0.0, "errors": {"case 3": "RuntimeError: no"}},
                 tolerance=0.1),
    ])
    assert code == 1
    s = report["sections"]
    assert s["within"]["status"] == "ok"
    assert s["above"]["status"] == "fail"
    assert s["above"]["measured_error"] == 0.5 and s["above"]["tolerance"] == 0.1
    assert s["above"]["verdict"] == "fake error 5.00e-01 > tolerance 1.00e-01"
    assert s["nan"]["status"] == "fail" and s["nan"]["measured_error"] == "nan"  # strict JSON, still visible
    assert s["sub_error"]["status"] == "error" and "case 3: RuntimeError: no" in s["sub_error"]["error"]
    assert report["summary"]["fail"] == ["above", "nan"] and report["summary"]["error"] == ["sub_error"]
    assert "**FAIL**: fake error 5.00e-01 > tolerance 1.00e-01" in capsys.readouterr().out


def test_the_time_limit_skips_the_remaining_sections(check):
    def slow(ctx):
        time.sleep(0.5)
        return {"measured_error": 0.0}

    ran = []
    code, report = check([_section("slow", slow, tolerance=1.0),
                          _section("later", lambda ctx: ran.append("later") or {}),
                          _section("last", lambda ctx: ran.append("last") or {})], "--time-limit", "0.3")
    assert code == 0 and not ran
    s = report["sections"]
    assert s["slow"]["status"] == "ok"
    for name in ("later", "last"):
        assert s[name]["status"] == "skipped" and s[name]["reason"] == "time limit", s[name]
    assert report["time_limit_s"] == 0.3


def test_a_section_budget_stops_its_loop_and_the_next_section_runs(check):
    def loop(ctx):
        ticks = 0
        while not ctx.expired():
            ticks += 1
            ctx.checkpoint({"ticks": ticks})
            time.sleep(0.02)
        return {"measured_error": 0.0, "ticks": ticks, "truncated": "time limit"}

    t0 = time.monotonic()
    # the budget from the command line replaces the section's own
    code, report = check([_section("loop", loop, tolerance=1.0, budget_s=60.0), _section("next", _ok, tolerance=1.0)],
                         "--budget", "loop=0.2")
    assert time.monotonic() - t0 < 10
    assert code == 0
    loop_rec = report["sections"]["loop"]
    assert loop_rec["status"] == "ok" and loop_rec["ticks"] > 0 and loop_rec["budget_s"] == 0.2
    assert loop_rec["truncated"] == "time limit" and loop_rec["deadline"] == "budget"
    assert report["sections"]["next"]["status"] == "ok"


def test_a_section_leaves_the_later_sections_their_minimum(check):
    def greedy(ctx):  # would take all the time there is
        while not ctx.expired():
            time.sleep(0.01)
        return {"measured_error": 0.0, "truncated": "time limit"}

    code, report = check([_section("greedy", greedy, tolerance=1.0),
                          _section("modest", _ok, tolerance=1.0, min_s=0.5)], "--time-limit", "1.0")
    assert code == 0
    greedy_rec = report["sections"]["greedy"]
    assert greedy_rec["deadline"] == "the later sections' minimum" and greedy_rec["seconds"] < 0.9
    assert report["sections"]["modest"]["status"] == "ok"


def test_sections_without_cuda_are_skipped(check, monkeypatch):
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: False)
    t0 = time.monotonic()
    code, report = check(None)  # the real registry
    assert time.monotonic() - t0 < 30
    assert code == 0
    assert list(report["sections"]) == ["kernel_tests", "tree_attention", "decode", "slo", "tensor_parallel"]
    for record in report["sections"].values():
        assert record["status"] == "skipped" and record["reason"] == "no CUDA device", record
    tolerances = {name: r["tolerance"] for name, r in report["sections"].items()}
    assert tolerances == {"kernel_tests": 0, "tree_attention": 2e-2, "decode": 0.1, "slo": None,
                          "tensor_parallel": 5e-2}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the whole GPU check")
def test_module_entry_point_without_cuda(tmp_path):
    out = tmp_path / "x.json"
    result = subprocess.run([sys.executable, "-m", "prescient.latency_bench.gpu_check", "--out", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "No CUDA device (torch.cuda.is_available() is False)" in result.stdout
    report = _strict_json(out)
    assert report["finished"] and {r["status"] for r in report["sections"].values()} == {"skipped"}


def test_sigterm_records_the_running_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    code = textwrap.dedent(f"""
        import sys, time
        from prescient.latency_bench import gpu_check

        def hang(ctx):
            ctx.checkpoint({{"rows": ["kept"]}})
            print("HANGING", flush=True)
            time.sleep(60)

        sections = [gpu_check.Section("quick", "quick", lambda ctx: {{}}),
                    gpu_check.Section("hang", "hang", hang),
                    gpu_check.Section("never", "never", lambda ctx: {{}})]
        sys.exit(gpu_check.main(["--cpu-smoke", "--out", {str(out)!r}], sections=sections))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # the Markdown up to the hanging section, printed as it went
            lines.append(line)
            if line.startswith("HANGING"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
    assert "## 2. hang" in "".join(lines)
    report = _strict_json(out)
    s = report["sections"]
    assert s["quick"]["status"] == "ok"
    assert s["hang"]["status"] == "error" and "SIGTERM" in s["hang"]["error"] and s["hang"]["rows"] == ["kept"]
    assert s["never"]["status"] == "skipped"
    assert report["finished"] and report["exit_code"] == 128 + signal.SIGTERM


# ---------------------------------------------------------------- pieces of the real sections


class _Ctx:
    """A SectionContext stand-in: no deadline, checkpoints collected."""

    def __init__(self, seconds: float = math.inf):
        self.deadline = time.monotonic() + seconds
        self.checkpoints = []

    def time_left(self):
        return self.deadline - time.monotonic()

    def expired(self):
        return self.time_left() <= 0

    def checkpoint(self, partial):
        self.checkpoints.append(partial)


def test_kernel_tests_count_every_outcome_without_stopping_at_a_failure(tmp_path):
    from prescient.latency_bench import gpu_sections_kernels

    (tmp_path / "test_zz_fake.py").write_text(textwrap.dedent("""
        import pytest

        def test_zz_fails():
            assert 1 == 2

        def test_zz_passes():
            pass

        @pytest.fixture
        def zz_broken():
            raise RuntimeError("fixture")

        def test_zz_errors(zz_broken):
            pass

        @pytest.mark.skip(reason="fake")
        def test_zz_skipped():
            pass

        def test_zz_passes_after_the_failures():
            pass
    """))
    # -k zz_: only the fake tests out of everything collected under tests/kernels
    result = gpu_sections_kernels.run(_Ctx(), REPO, None, [str(tmp_path / "test_zz_fake.py"), "-k", "zz_"])
    c = result["counts"]
    assert (c["passed"], c["failed"], c["error"], c["skipped"]) == (2, 1, 1, 1), result["output_tail"]
    assert result["measured_error"] == 2 and result["collected"] == 5 and result["returncode"] == 1
    assert {f["nodeid"].split("::")[-1] for f in result["failures"]} == {"test_zz_fails", "test_zz_errors"}
    assert not result["errors"]  # failing tests make a fail (measured error), not an error


def test_decode_divergence_gap(tmp_path):
    from prescient.latency_bench import gpu_sections_decode as decode
    from prescient.runtime.model import LlamaModel
    from prescient.runtime.sampling_params import SamplingParams

    device, config = torch.device("cpu"), decode.tiny_config()
    model = LlamaModel(config, decode.random_weights(config, device, torch.float32), dtype=torch.float32,
                       device=device, fast_linear=False)
    prompt, kv = list(range(5, 29)), 8 << 20
    engine = decode._new_engine(model, kv)
    plain = decode._generate(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                             device)["tokens"]
    d = 3
    top = decode._generate(engine, prompt + plain[:d], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20,
                                                                      ignore_eos=True), device)["logprobs"][0]["top"]
    (first, first_lp), (second, second_lp) = top[0], top[1]
    assert first == plain[d]

    same = decode.divergence_gap(model, prompt, plain, list(plain), kv, device)
    assert same == {"identical": True, "first_divergence": None, "logit_gap": 0.0}

    # The runner-up at position d: a gap of the top-2 logit difference, the probe's argmax the
    # plain token (so the probe looks at the position the outputs part at, not one off).
    spec = plain[:d] + [second] + plain[d + 1:]
    gap = decode.divergence_gap(model, prompt, plain, spec, kv, device)
    assert gap["first_divergence"] == d and gap["probe_argmax"] == plain[d] and gap["speculative_token"] == second
    assert gap["logit_gap"] == pytest.approx(first_lp - second_lp, abs=1e-4) and gap["logit_gap"] > 0

    # A token outside the top 20, and outputs of different lengths: infinite gaps, always a fail.
    outside = next(t for t in range(config.vocab_size) if t not in dict(top))
    assert decode.divergence_gap(model, prompt, plain, plain[:d] + [outside] + plain[d + 1:], kv,
                                 device)["logit_gap"] == math.inf
    assert decode.divergence_gap(model, prompt, plain, plain[:-1], kv, device)["logit_gap"] == math.inf


class _UntilFile(_Ctx):
    """A deadline that comes once `path` exists (the fake test has started its child), or after
    `cap` seconds, so a broken run cannot hang the test."""

    def __init__(self, path: Path, cap: float = 120.0):
        super().__init__(cap)
        self.path = path

    def time_left(self):
        return 0.0 if self.path.exists() else super().time_left()


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_kernel_tests_kill_pytest_and_its_children_at_the_deadline(tmp_path, monkeypatch):
    from prescient.latency_bench import gpu_sections_kernels

    pids_file = tmp_path / "pids"
    monkeypatch.setenv("ZZ_PIDS", str(pids_file))
    (tmp_path / "test_zz_hang.py").write_text(textwrap.dedent("""
        import os, subprocess, sys, time

        def test_zz_hangs_with_a_child():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            path = os.environ["ZZ_PIDS"]
            with open(path + ".tmp", "w") as f:
                f.write(f"{os.getpid()} {child.pid} {os.getpgrp()}")
            os.replace(path + ".tmp", path)
            time.sleep(300)
    """))
    t0 = time.monotonic()
    result = gpu_sections_kernels.run(_UntilFile(pids_file), REPO, None,
                                      [str(tmp_path / "test_zz_hang.py"), "-k", "zz_"])
    pytest_pid, child_pid, group = map(int, pids_file.read_text().split())
    try:
        assert time.monotonic() - t0 < 100
        assert "timeout" in result["errors"], result
        # pytest led a process group of its own, not gpu_check's ...
        assert group == pytest_pid and group != os.getpgrp()
        # ... and the whole group went: pytest and the child its test started
        deadline = time.monotonic() + 10
        while (_alive(pytest_pid) or _alive(child_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pytest_pid)
        assert not _alive(child_pid), "the test's child outlived pytest"
    finally:
        if _alive(child_pid):  # the old behaviour: clean up what the fake test started
            os.kill(child_pid, signal.SIGKILL)


def test_default_time_limit_leaves_room_for_a_rerun():
    args = gpu_check._parse_args([])
    # 15 minutes of device time, with start-up, must hold a first run and a rerun
    assert args.time_limit <= 300
    sections = gpu_check.default_sections(args, cuda=True, alias=None)
    budgets = {s.name: s.budget_s for s in sections}
    assert budgets == gpu_check.DEFAULT_BUDGETS_S | {"kernel_tests": args.pytest_timeout}
    assert sum(budgets.values()) <= args.time_limit
    assert sum(s.min_s for s in sections) < args.time_limit / 2


def test_slo_fails_when_the_real_model_does_not_load(check, monkeypatch, capsys):
    from prescient import build
    from prescient.latency_bench import gpu_sections_decode as decode
    from prescient.latency_bench import gpu_sections_slo as slo

    def no_model(spec):
        raise FileNotFoundError("no GGUF on this machine")

    def substituted(*args, **kwargs):
        raise AssertionError("random weights substituted for the real model")

    monkeypatch.setattr(build, "load_model", no_model)
    monkeypatch.setattr(decode, "random_weights", substituted)
    cpu = torch.device("cpu")
    name, smollm = slo.default_models(cpu, torch.float32, smoke=False)[0]
    assert name == "SmolLM2-135M"
    with pytest.raises(slo.ModelLoadError, match="no GGUF on this machine"):
        smollm()

    section = gpu_check.Section("slo", "SLO", lambda ctx: slo.run(ctx, cpu, torch.float32, [(name, smollm)], agents=2,
                                                               turns=1, prefix_len=8, user_len=4, turn_tokens=4,
                                                               tool_tokens=4, kv_cache_bytes=1 << 20),
                                render=slo.render)
    code, report = check([section])
    assert code == 1
    record = report["sections"]["slo"]
    assert record["status"] == "error"
    assert "no GGUF on this machine" in record["error"] and "no random weights" in record["error"]
    assert [(r["sampling"], r["speculation"], r["graphs"], r["status"]) for r in record["rows"]] == [
        (sampling, mode, graphs, "failed") for graphs in slo.GRAPH_MODES for sampling, mode in slo.RUNS]
    assert report["summary"]["error"] == ["slo"]
    out = capsys.readouterr().out
    assert "**error**: SmolLM2-135M: ModelLoadError: the real SmolLM2-135M did not load" in out
    assert "slo did not pass" in out


def test_slo_table_shows_the_max_gap_beside_p99_and_an_ngram_row():
    from prescient.latency_bench import gpu_sections_slo as slo

    assert ("greedy", "ngram") in slo.RUNS and ("greedy", "off") in slo.RUNS and ("t=0.8", "ngram") in slo.RUNS
    row = {"model": "m", "sampling": "greedy", "speculation": "ngram", "graphs": "eager", "status": "ok", "requests": 3,
           "ttft_s": {"p50": 0.010, "p99": 0.020}, "itl_emission_s": {"p99": 0.020, "max": 0.500},
           "mean_accepted_length": 1.5, "slo_attainment": 1.0, "meets_seed_slo": True}
    lines = "\n".join(slo.render({"agents": 2, "turns": 1, "turn_tokens": 4, "dtype": "float32", "rows": [row]}))
    assert ("| model | sampling | speculation | graphs | requests | TTFT p50 ms | TTFT p99 ms | ITL/emission p99 ms | "
            "ITL max ms |") in lines
    assert "| m | greedy | ngram | eager | 3 | 10.0 | 20.0 | 20.0 | 500.0 | 1.50 | 1.00 | yes |" in lines


def test_kv_int8_is_refused_on_cuda(monkeypatch):
    import types

    from prescient import build
    from prescient.runtime.config import CacheConfig
    from prescient.runtime.engine import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, as far as the spec sees
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="--kv-dtype int8 is not supported on CUDA"):
            build.EngineSpec(device=device, kv_dtype="int8")
    build.EngineSpec(device="cuda")  # the compute dtype's KV is fine there
    build.EngineSpec(device="cpu", kv_dtype="int8")  # and int8 on the CPU, which has its kernels
    # an EngineConfig handed to build_engine directly (as the gpu_check sections do)
    model = types.SimpleNamespace(dtype=torch.float32, weights_mode=None, device=torch.device("cuda"), config=None)
    config = EngineConfig(dtype="float32", cache=CacheConfig(kv_dtype="int8"))
    with pytest.raises(ValueError, match="--kv-dtype int8 is not supported on CUDA"):
        build.build_engine(build.EngineSpec(dtype="float32", speculate="off"),
                           build.LoadedModel(model, None, (), None), config=config)
