"""From a clone's root, `import kernels` is the Hugging Face distribution transformers needs, and
`prescient.kernels` is still this repository's kernels/ folder (prescient/import_shadow.py)."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_transformers_loads_from_the_clone_root_beside_our_kernels_folder():
    probe = ("import prescient, transformers.activations, prescient.kernels as ours\n"
             "import kernels\n"
             "print(ours.__file__); print(kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ours, theirs = (pathlib.Path(line).resolve() for line in out.stdout.split())
    assert ours == ROOT / "kernels" / "__init__.py"
    try:  # is the distribution installed? (asked of its metadata, which our folder has none of)
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    assert theirs != ours and ROOT / "kernels" not in theirs.parents
