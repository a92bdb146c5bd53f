"""The runtime's environment overrides, parsed in one place into a frozen `RuntimeEnv`.

    env = RuntimeEnv.from_environ()        # os.environ (or any mapping) -> RuntimeEnv
    env = runtime_env()                    # the process environment's, parsed again only when it changed

Variables (runtime level):

    PRESCIENT_FUSED_LAYERS       1 (default): a CPU model's decode/verify-sized forwards run
                                 kernels/cpu_layer.c's native layers (runtime/model.prepare_for_cpu);
                                 0 / false / off: the torch layer loop; layer: one native call per
                                 layer instead of one per step
    PRESCIENT_TP_STEP_TIMEOUT_S  seconds a tensor-parallel step may take on rank 0 (default 10,
                                 runtime/tp_worker.py)

Code reads a `RuntimeEnv`, never these variables. A model prepared for the CPU without an
explicit env follows `runtime_env()`: the variables are looked up per forward (two dict reads)
and parsed again only when one changed, so a tool that flips PRESCIENT_FUSED_LAYERS between
forwards of one model (latency_bench/step_profile.py's A/B modes) is seen at the next forward.

The kernels' own variables stay in kernels/, below this layer: PRESCIENT_KERNELS and
PRESCIENT_CPU_ATTENTION (read per op by kernels/ops.py; kernels/cpu_layer.enabled honours them
too), PRESCIENT_CPU_GEMV, PRESCIENT_ISA, PRESCIENT_AVX_VNNI, PRESCIENT_BF16_DOT, PRESCIENT_ATTN_AMX,
PRESCIENT_ONE_STREAM, PRESCIENT_GEMV_THREADS, PRESCIENT_GEMV_SPIN_US and CC
(library load, kernels/cpu_linear.py), TRITON_INTERPRET.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

FUSED_LAYERS = "PRESCIENT_FUSED_LAYERS"
TP_STEP_TIMEOUT = "PRESCIENT_TP_STEP_TIMEOUT_S"
NAMES = (FUSED_LAYERS, TP_STEP_TIMEOUT)
TP_STEP_TIMEOUT_S = 10.0  # the default bound
_OFF = ("0", "false", "off")


@dataclass(frozen=True)
class RuntimeEnv:
    """The runtime's switches; the defaults are an empty environment's."""

    fused_layers: bool = True  # decode/verify-sized CPU forwards in the native layers
    fused_per_layer: bool = False  # one native call per layer (PRESCIENT_FUSED_LAYERS=layer)
    tp_step_timeout_s: float = TP_STEP_TIMEOUT_S

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RuntimeEnv":
        """Parse `environ` (default os.environ). A timeout that is not a number raises
        ValueError naming the variable; any PRESCIENT_FUSED_LAYERS value but 0/false/off and
        layer means on (as it always has)."""
        env = os.environ if environ is None else environ
        fused = env.get(FUSED_LAYERS, "1")
        raw_timeout = env.get(TP_STEP_TIMEOUT)
        timeout = TP_STEP_TIMEOUT_S
        if raw_timeout is not None:
            try:
                timeout = float(raw_timeout)
            except ValueError:
                raise ValueError(f"{TP_STEP_TIMEOUT}={raw_timeout!r}: expected a number of seconds") from None
        return cls(fused_layers=fused not in _OFF, fused_per_layer=fused == "layer", tp_step_timeout_s=timeout)


_last: tuple[tuple, RuntimeEnv] | None = None


def runtime_env() -> RuntimeEnv:
    """The process environment's RuntimeEnv, parsed again only when one of its variables changed."""
    global _last
    raw = tuple(os.environ.get(name) for name in NAMES)
    last = _last
    if last is None or last[0] != raw:
        last = _last = (raw, RuntimeEnv.from_environ({k: v for k, v in zip(NAMES, raw) if v is not None}))
    return last[1]


__all__ = ["FUSED_LAYERS", "TP_STEP_TIMEOUT", "RuntimeEnv", "runtime_env"]
