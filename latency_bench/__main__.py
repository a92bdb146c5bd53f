"""`python -m prescient.latency_bench` = `prescient bench`: the suites' dispatcher (suites.py).

    prescient bench --quick --out DIR           # the latency suite (run.py), the default
    prescient bench agents --quick --out DIR    # another suite (`prescient bench list`)
"""

from __future__ import annotations

import sys

from prescient.latency_bench.suites import dispatch


def __getattr__(name: str):
    # the latency suite's parser and flag mapping, where callers found them before they moved to
    # run.py (tests/server/test_cli.py reads `_parser` here); imported on use: run.py loads torch
    if name in ("_parser", "config_from_args"):
        from prescient.latency_bench import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(dispatch())
