"""Linear layers for the model: one place that picks the matrix-vector path.

At batch 1 on these CPUs the decode step is a stream of GEMVs and `F.linear` reaches well under
the memory-bandwidth floor (docs/CPU_PERFORMANCE.md); `prescient.kernels.cpu_linear` packs each
weight once at load time into a layout its bandwidth-bound kernel streams. Anything that kernel
does not cover (GPU tensors, float64, large M) goes to `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, fast_path: bool = True):
        self.weight = weight.contiguous()  # [out_features, in_features]
        self.bias = bias
        self.packed = None
        if fast_path and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16):
            try:
                from prescient.kernels import cpu_linear
            except ImportError:
                cpu_linear = None
            if cpu_linear is not None and cpu_linear.available():
                self.packed = cpu_linear.pack_weight(self.weight)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        y = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias
