"""Paths of the data the package ships: the benchmark workloads and the JSONSchemaBench sample.

Both are package data (pyproject.toml), so they sit next to this file in a checkout, an editable
install and a plain `pip install` alike; nothing is looked up outside the package. Benchmarks
take `--workloads` / `--data` for other (e.g. the full) files.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

WORKLOADS = _HERE / "workloads.jsonl"
# A sample of JSONSchemaBench, one {"id", "schema"} object per line; see its README.md.
JSONSCHEMABENCH = _HERE / "jsonschemabench-sample"


def jsonschemabench_file(name: str) -> Path:
    """One bundled sample file, e.g. "Glaiveai2K.jsonl"; FileNotFoundError names what is there."""
    path = JSONSCHEMABENCH / name
    if not path.is_file():
        have = sorted(p.name for p in JSONSCHEMABENCH.glob("*.jsonl"))
        raise FileNotFoundError(f"{name} is not in the bundled sample {JSONSCHEMABENCH} (has {have})")
    return path
