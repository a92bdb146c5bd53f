"""prescient: a low-latency LLM runtime for interactive agents.

The import package maps onto the top-level folders (runtime/, speculative/, kernels/, grammar/,
server/, latency_bench/) through setuptools' package-dir; code imports `prescient.*` only.
"""

__version__ = "0.1.0"
