"""The clone's top-level kernels/ folder against the `kernels` distribution on PyPI.

The required layout puts prescient's kernels in a folder named `kernels/` at the repository's
root (imported as `prescient.kernels` through package-dir). From a clone's root the current
directory is on sys.path (`python -m pytest`, `python -m prescient.latency_bench...`), so a bare
`import kernels` found that folder; transformers >= 5.25 imports the Hugging Face `kernels`
distribution when it loads and failed on ours ("cannot import name 'CUDAProperties' from
'kernels'"). A finder first on sys.meta_path resolves the top-level name `kernels` on sys.path
without the clone's root, lazily (that distribution takes ~1.4 s to import). Installed from a
wheel there is no clone root and nothing is changed.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _KernelsPastTheClone:
    """Finds the top-level `kernels` anywhere on sys.path but the clone's root; None (the usual
    search, which finds the folder) when no other is installed."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "kernels":
            return None
        others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
        return importlib.machinery.PathFinder.find_spec(name, others)


def install() -> None:
    in_clone = os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) and os.path.isdir(os.path.join(_ROOT, "kernels"))
    if in_clone and not any(isinstance(f, _KernelsPastTheClone) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelsPastTheClone())
