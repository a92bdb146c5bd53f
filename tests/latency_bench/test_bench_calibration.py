"""Every benchmark that runs `prescient serve` beside other systems measures its verify-cost table
fresh, at start-up: the default idle-time calibration would time its forwards while another
system is being measured (on two cores that table came out up to 2x wrong, and speculation then
ran below plain decoding), and a cached table may come from such a run."""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# module -> the callables that start a prescient server there
SERVER_STARTS = {
    "latency_bench/peer_decode.py": ("Server",),
    "latency_bench/load_bench.py": ("PrescientServer",),
    "latency_bench/agent_bench.py": ("PrescientServer",),
}


def _strings(node: ast.AST) -> list[str]:
    """The string constants of a call's argument expressions, in source order."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


@pytest.mark.parametrize("module", sorted(SERVER_STARTS))
def test_servers_beside_peers_calibrate_fresh_at_start(module):
    tree = ast.parse(open(os.path.join(REPO, module)).read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", getattr(n.func, "attr", None)) in SERVER_STARTS[module]]
    assert calls, f"{module} no longer starts a server through {SERVER_STARTS[module]}"
    for call in calls:
        words = [s for arg in call.args + [k.value for k in call.keywords] for s in _strings(arg)]
        assert "--calibrate" in words, f"{module}:{call.lineno} starts prescient serve without --calibrate"
        assert words[words.index("--calibrate") + 1] == "fresh", f"{module}:{call.lineno}"
