"""The suite registry (latency_bench/suites.py): `prescient bench SUITE` dispatches by the first
argument, every registered suite imports and parses its options, the legacy spellings land on
the same suite, an unknown name is exit 2 naming the suites. Nothing here runs a benchmark: the
entries are called with --help, or replaced by a recorder."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib
import subprocess
import sys

import pytest

from prescient.latency_bench import suites
from prescient.latency_bench.suites import ALIASES, SUITES, UnknownSuite, dispatch, resolve, suite_parser

PACKAGE = pathlib.Path(suites.__file__).resolve().parent


@pytest.fixture
def recorded(monkeypatch):
    """dispatch's entries replaced by one that records (suite, argv) and returns 0."""
    calls = []

    def entry(name):
        return lambda argv: calls.append((name, list(argv))) or 0

    monkeypatch.setattr(suites, "entry", entry)
    return calls


@pytest.mark.parametrize("name", list(SUITES))
def test_every_suite_imports_and_its_entry_parses_its_options(name, capsys):
    suite = SUITES[name]
    module = importlib.import_module(f"prescient.latency_bench.{suite.module}")
    fn = getattr(module, suite.entry)
    assert callable(fn) and suites.entry(name) is fn
    assert list(inspect.signature(fn).parameters)[0] == "argv"
    with pytest.raises(SystemExit) as e:
        fn(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--help" in out
    if suite.entry == "cli":  # gpu_check keeps its own parser (a plain script on the GPU machine)
        assert out.startswith(f"usage: prescient bench {name}")


@pytest.mark.parametrize("name", list(SUITES))
def test_python_dash_m_runs_the_registered_entry(name):
    """`python -m prescient.latency_bench.MODULE` (the old spelling) calls the same entry."""
    suite = SUITES[name]
    tree = ast.parse((PACKAGE / f"{suite.module}.py").read_text())
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    if suite.module == "run":  # the default suite: `python -m prescient.latency_bench` (__main__.py)
        tree = ast.parse((PACKAGE / "__main__.py").read_text())
        guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert "dispatch()" in ast.unparse(guards[0])
        return
    assert any(f"{suite.entry}()" in ast.unparse(g) for g in guards), suite.module


def test_bench_help_lists_every_suite(capsys):
    from prescient.cli import main

    for argv in (["bench", "--help"], ["bench", "-h"], ["bench", "list"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        for name, suite in SUITES.items():
            assert f"  {name} " in out, name
            assert suite.help in out
        for flag in ALIASES:
            assert flag in out  # the legacy spellings are stated where the suites are


def test_the_first_argument_picks_the_suite_and_no_name_is_the_latency_suite(recorded):
    from prescient.cli import main

    assert main(["bench", "--quick", "--out", "d"]) == 0
    assert main(["bench"]) == 0
    assert main(["bench", "latency", "--quick"]) == 0
    assert main(["bench", "pd", "--server"]) == 0
    assert recorded == [("latency", ["--quick", "--out", "d"]), ("latency", []), ("latency", ["--quick"]),
                        ("pd", ["--server"])]


@pytest.mark.parametrize("legacy, name, rest", [
    (["--agents", "--quick", "--out", "d"], "agents", ["--quick", "--out", "d"]),
    (["--agents"], "agents", []),
    (["--load", "--quick"], "load", ["--quick"]),
    (["--tp", "--reps", "1"], "tp", ["--reps", "1"]),
    (["--pd-split", "--server"], "pd", ["--server"]),
])
def test_the_old_spellings_route_to_the_same_suite(recorded, legacy, name, rest):
    from prescient.cli import main

    assert resolve(legacy) == (name, rest) == resolve([name, *rest])
    assert main(["bench", *legacy]) == 0 and main(["bench", name, *rest]) == 0
    assert recorded == [(name, rest), (name, rest)]


def test_agents_with_a_count_stays_the_latency_suites_option(recorded):
    assert dispatch(["--agents", "4", "--quick"]) == 0
    assert dispatch(["--quick", "--agents", "4"]) == 0
    assert recorded == [("latency", ["--agents", "4", "--quick"]), ("latency", ["--quick", "--agents", "4"])]
    # the latency suite's parser reads it as its agent count
    from prescient.latency_bench.run import _parser, config_from_args

    assert config_from_args(_parser().parse_args(["--quick", "--agents", "4"])).num_agents == 4


@pytest.mark.parametrize("argv", [["--quick", "--load"], ["--quick", "--agents"], ["--out", "d", "--tp"]])
def test_a_suite_flag_out_of_the_suite_names_place_is_refused(recorded, argv, capsys):
    with pytest.raises(UnknownSuite, match="put it first"):
        resolve(argv)
    assert dispatch(argv) == 2 and not recorded
    err = capsys.readouterr().err
    assert err.startswith("prescient bench: error: ") and "put it first" in err


def test_an_unknown_suite_is_exit_2_naming_the_suites(recorded, capsys):
    from prescient.cli import main

    assert main(["bench", "latenc", "--quick"]) == 2 and not recorded
    err = capsys.readouterr().err
    assert "unknown suite 'latenc'" in err and all(name in err for name in SUITES)


def test_the_console_script_exits_2_on_an_unknown_suite():
    exe = os.path.join(os.path.dirname(sys.executable), "prescient")
    res = subprocess.run([exe, "bench", "nope"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (f"prescient bench: error: unknown suite 'nope'; the suites: {', '.join(SUITES)} "
                                  "(`prescient bench list`)")


def test_the_old_module_path_of_the_latency_parser_still_answers():
    from prescient.latency_bench.__main__ import _parser
    from prescient.latency_bench.run import _parser as moved

    assert _parser is moved


def test_the_shared_flags_take_a_suites_own_default_and_refuse_unknown_names():
    p = suite_parser("demo", "One line.\n\nMore.", out={"default": "bench_demo"}, model=True, reps={"default": 7})
    args = p.parse_args([])
    assert (args.out, args.model, args.reps) == ("bench_demo", None, 7)
    assert p.prog == "prescient bench demo" and p.description == "One line."
    assert "(default: bench_demo)" in p.format_help()
    with pytest.raises(TypeError, match="no shared flag"):
        suite_parser("demo", "x", modle=True)


def test_entries_and_parsers_are_the_registrys():
    """No suite grows its own main() or ArgumentParser again: the parsers come from suite_parser,
    except gpu_check's (it runs as a plain script before prescient is importable)."""
    mains, parsers = [], []
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        mains += [path.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        parsers += [path.name for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and ast.unparse(n.func).endswith("ArgumentParser")]
    assert mains == ["gpu_check.py"]
    assert sorted(parsers) == ["gpu_check.py", "suites.py"]
    registered = {s.module for s in SUITES.values()}
    with_entry = {path.stem for path in PACKAGE.glob("*.py")
                  if any(isinstance(n, ast.FunctionDef) and n.name == "cli" for n in ast.parse(path.read_text()).body)}
    assert with_entry <= registered  # every entry is reachable from `prescient bench`
