"""Every benchmark that runs `prescient serve` beside other systems measures its verify-cost table
fresh, at start-up: the default idle-time calibration would time its forwards while another
system is being measured (on two cores that table came out up to 2x wrong, and speculation then
ran below plain decoding), and a cached table may come from such a run. One place says so,
bench_servers.prescient_command; the benchmarks start prescient through it."""

from __future__ import annotations

import argparse
import ast
import os

import pytest

from prescient.latency_bench.bench_servers import prescient_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BESIDE_PEERS = ("latency_bench/peer_decode.py", "latency_bench/load_bench.py", "latency_bench/agent_bench.py")


def _calibrate(cmd: list[str]) -> str:
    """What `prescient serve` would parse for --calibrate (argparse: the last one wins)."""
    p = argparse.ArgumentParser()
    p.add_argument("--calibrate", default="idle")
    args, _ = p.parse_known_args(cmd[cmd.index("serve") + 1:])
    return args.calibrate


def test_the_server_command_calibrates_fresh_unless_told_otherwise():
    assert _calibrate(prescient_command("m.gguf", "ngram")) == "fresh"
    assert _calibrate(prescient_command(None, "off", ("--weights", "native"))) == "fresh"
    assert _calibrate(prescient_command(None, "ngram", ("--calibrate", "off"))) == "off"


@pytest.mark.parametrize("module", BESIDE_PEERS)
def test_benchmarks_beside_peers_start_prescient_through_it(module):
    tree = ast.parse(open(os.path.join(REPO, module)).read())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert "serve" not in strings and "--calibrate" not in strings, f"{module} launches or tunes prescient serve itself"
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "PrescientServer" in names, f"{module} no longer starts prescient through bench_servers.PrescientServer"
