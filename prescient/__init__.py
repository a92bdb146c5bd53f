"""prescient: a low-latency LLM runtime for interactive agents.

The import package maps onto the top-level folders (runtime/, speculative/, kernels/, grammar/,
server/, latency_bench/) through setuptools' package-dir; code imports `prescient.*` only.
"""

__version__ = "0.1.0"

from prescient import import_shadow as _import_shadow

_import_shadow.install()  # before anything imports transformers: see import_shadow.py
