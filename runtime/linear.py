"""Linear layers for the model: one place that picks the matrix-vector path.

At batch 1 on these CPUs the decode step is a stream of GEMVs and `F.linear` reaches well under
the memory-bandwidth floor (docs/CPU_PERFORMANCE.md); `prescient.kernels.cpu_linear` packs each
float weight once at load time into a layout its bandwidth-bound kernel streams. Anything that
kernel does not cover (GPU tensors, float64) goes to `F.linear`.

Every row count runs the same kernel, MAX_M rows a call: decode steps, verify trees and prefill
chunks alike, so a row's bits do not depend on what shares its forward, how its prompt was cut
or whether its prefix came from the cache (docs/ARCHITECTURE.md, batch invariance); and on the
CPU measured the kernel is the faster path for prefill too (the int8 small-M kernel against a
tile-wise dequantize + GEMM: a prompt's TTFT 1.5-1.6x shorter, 2-core Zen 3, avx2).

A weight kept in a checkpoint's quantized blocks (`QuantWeight`: a GGUF's Q4_1, Q8_0, ...) runs
through `prescient.kernels.quant_linear.QuantLinear`, which reads the blocks as they are (a
quarter to a half of the bf16 bytes per decode step). `fused_linear` builds the fused q/k/v and
gate/up layers: parts of one format become one matrix; parts of different formats stay separate
layers whose outputs are concatenated (converting one part to another format would be lossy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prescient.kernels import cpu_linear as _cpu_linear, huge_pages


@dataclass
class QuantWeight:
    """A [N, K] weight in its quantized blocks: row n is `blocks[n]`, K / block_elems blocks of
    the format's block_bytes each (kernels/quant_reference.QTYPES). Rows are whole blocks, so row
    permutations and row concatenations act on `blocks` directly."""

    blocks: torch.Tensor  # uint8 [N, row_bytes]
    qtype: str  # a quant_reference.QTYPES name: q8_0, q4_0, q4_1, q4_k, q5_k, q6_k
    shape: tuple[int, int]  # the logical (N, K)

    def __post_init__(self) -> None:
        from prescient.kernels.quant_reference import QTYPES

        if self.qtype not in QTYPES:
            raise ValueError(f"no kernel for quantized format {self.qtype!r} (supported: {', '.join(QTYPES)})")
        n, k = self.shape = (int(self.shape[0]), int(self.shape[1]))
        _, block_elems, block_bytes = QTYPES[self.qtype]
        if k % block_elems or tuple(self.blocks.shape) != (n, k // block_elems * block_bytes):
            raise ValueError(f"{self.qtype} blocks of shape {tuple(self.blocks.shape)} do not hold a {n}x{k} matrix")
        if self.blocks.dtype != torch.uint8:
            raise ValueError(f"quantized blocks must be uint8, got {self.blocks.dtype}")

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [N, K] in `dtype` (the reference dequantizer: exact for every format)."""
        from prescient.kernels.quant_reference import dequantize

        return torch.as_tensor(dequantize(self.blocks, self.qtype, *self.shape)).to(dtype)


def format_name(w: torch.Tensor | QuantWeight) -> str:
    """How a weight is stored, as the model reports it: q4_1, bf16, f32, ..."""
    if isinstance(w, QuantWeight):
        return w.qtype
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
            torch.float64: "f64"}.get(w.dtype, str(w.dtype).replace("torch.", ""))


class Linear:
    """y = x @ weight.T (+ bias) for a float weight. The weight may be held in another float dtype
    than the activations (`--weights bfloat16 --dtype float32`): the result is in x's dtype."""

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
                # the kernels stream it every step: on huge pages (kernels/huge_pages.py)
                self.weight = huge_pages.adopt(self.weight)
                self.packed = cpu_linear.pack_weight(self.weight)
                self._max_m = cpu_linear.MAX_M  # rows per kernel call

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def weight_bytes(self) -> int:
        return self.weight.nbytes

    @property
    def formats(self) -> tuple[str, ...]:
        return (format_name(self.weight),)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features].

        Any number of tokens runs the packed GEMV kernel, its MAX_M rows a call (as
        QuantizedLinear does): a row gets the same bits in any batch and in any prefill chunk,
        where F.linear's GEMM rounds a row differently from the kernel."""
        if self.packed is not None:
            if x.dim() != 2:  # [..., in] as rows, so that every row takes the same path
                return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
            m, step = x.shape[0], self._max_m
            if m <= step:
                y = self.packed(x)
            else:
                y = x.new_empty(m, self.out_features)
                for i in range(0, m, step):
                    self.packed(x[i:i + step], out=y[i:i + step])
        elif x.dtype == self.weight.dtype:
            y = F.linear(x, self.weight)
        else:
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


# the most rows of one GEMV kernel call (PG_MAX_M in kernels/cpu_runtime.h, read from the kernels
# library): runtime/forward_plan.py packs decode/verify rows and short chunks into forwards of at
# most this many, each weight tile read once for all of them; a longer prefill chunk gets a
# forward of its own, its linears this many rows a call.
BATCH_INVARIANT_M = _cpu_linear.MAX_M


class QuantizedLinear:
    """y = x @ W.T (+ bias) with W in its quantized blocks (kernels/quant_linear.QuantLinear:
    its native kernel at every M, MAX_M rows a call; its tile-wise dequantize + matmul only for
    a format without a native kernel). `packed` is that kernel
    object, as `Linear.packed` is the float one; `weight` is the uint8 block matrix, so byte
    counts (`weight.nbytes`) read the same for both. Also an embedding: `lookup(ids)` dequantizes
    only the rows it is asked for, so a tied LM head and the embedding share one copy."""

    def __init__(self, w: QuantWeight, bias: torch.Tensor | None = None):
        from prescient.kernels.quant_linear import MAX_M, QuantLinear

        n, k = w.shape
        self._max_m = MAX_M
        self.qweight = w
        self.weight = w.blocks  # uint8 [N, row_bytes]
        self.bias = bias
        self.packed = QuantLinear(w.blocks, w.qtype, n, k,
                                  bias=None if bias is None else bias.to(torch.float32).contiguous())

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def weight_bytes(self) -> int:
        return self.qweight.nbytes

    @property
    def formats(self) -> tuple[str, ...]:
        return (self.qweight.qtype,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] fp32/bf16 (others are computed in fp32) -> [num_tokens, out_features].

        Any number of tokens (decode batches, verify trees, prefill chunks) runs the decode
        kernel, MAX_M rows a call, so every row gets the bits a lone decode step gets (the kernel
        may quantize activations to int8, ~0.5% off fp32). It is also the faster path at every
        M measured: a 17-row Q4_1 gate_up 0.4 ms against 1 ms through the tiled path (2-core Zen
        4); a prompt's TTFT 1.5-1.6x shorter than with the tiled fp32 path (2-core Zen 3, avx2).
        Only a format without a native kernel in the library (or no library) takes
        QuantLinear's tiled path, the whole x in one call."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            return self(x.to(torch.float32)).to(x.dtype)
        if x.dim() != 2:  # [..., in] as rows, so that every row takes the same path
            return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        if x.shape[0] <= self._max_m or not self.packed.native:
            return self.packed(x)
        return self.packed.rows(x)  # MAX_M rows a kernel call, in one library call

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids: [num_tokens] int -> rows [num_tokens, in_features] in `dtype`."""
        return self.packed.dequantize_rows(ids).to(dtype)


class _PartsLinear:
    """A linear made of other linears (`parts`, each in its own format): what they hold together."""

    parts: list
    packed = None  # no single descriptor

    @property
    def weight_bytes(self) -> int:
        return sum(p.weight_bytes for p in self.parts)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for p in self.parts for f in p.formats))


class ConcatLinear(_PartsLinear):
    """Layers side by side: y = cat([part(x) for part in parts], -1). A fused q/k/v or gate/up
    whose parts are stored in different formats (rare: a GGUF whose quantizer kept one of them at
    higher precision) keeps each part in its own format instead of converting one."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        return torch.cat([p(x) for p in self.parts], dim=-1)


class ColumnGroups(_PartsLinear):
    """A row-parallel linear (O, down) as fixed groups of input columns: y = (sum over groups, in
    order, of part_g(x[:, cols_g]) in fp32), rounded once to x's dtype. The groups are the cuts a
    TP=2 split makes (runtime/tensor_parallel.column_cuts), so TP=1 adds the very partials that
    TP=2's ranks all-reduce: two fp32 terms, the same sum in either order, and the same bits at
    either TP degree (a single accumulation over all columns would round differently). The parts
    hold the columns themselves (no second copy of the weight); the fused native layer takes them
    as two descriptors (kernels/cpu_layer.py)."""

    def __init__(self, parts: list, starts: list[int]):
        self.parts, self.starts = parts, starts  # starts[g]: group g's first input column
        self.bias = None  # (column_groups gives the native layer its parts' descriptors)

    @property
    def column_groups(self) -> list[tuple[int, object]]:
        return list(zip(self.starts, self.parts))

    @property
    def out_features(self) -> int:
        return self.parts[0].out_features

    @property
    def in_features(self) -> int:
        return sum(p.in_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]. A half-type x is widened
        (exactly) so each partial stays fp32, as RowParallel does on a rank."""
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        ends = self.starts[1:] + [self.in_features]
        y = None
        for a, b, part in zip(self.starts, ends, self.parts):
            yp = part(xf[:, a:b].contiguous())
            y = yp if y is None else y + yp
        return y.to(x.dtype)


def column_split(w: torch.Tensor | QuantWeight, starts: list[int], fast_path: bool = True,
                 dequantize_to: torch.dtype = torch.float32) -> ColumnGroups:
    """A ColumnGroups over w's input columns cut at `starts` (starts[0] == 0; block formats: at
    block boundaries, which runtime/tensor_parallel.column_cuts guarantees)."""
    from prescient.runtime.tensor_parallel import _cols

    ends = starts[1:] + [w.shape[1]]
    return ColumnGroups([make_linear(_cols(w, a, b), fast_path=fast_path, dequantize_to=dequantize_to)
                         for a, b in zip(starts, ends)], list(starts))


def make_linear(w: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None, fast_path: bool = True,
                dequantize_to: torch.dtype = torch.float32):
    """The layer for one weight: blocks run the quantized kernel, except with `fast_path=False`
    (the reference path: F.linear over the weight dequantized into `dequantize_to`)."""
    if isinstance(w, QuantWeight):
        if fast_path:
            return QuantizedLinear(w, bias)
        w = w.dequantize(dequantize_to).to(w.blocks.device)
    return Linear(w, bias, fast_path)


def fused_linear(parts: list[torch.Tensor | QuantWeight], bias: torch.Tensor | None = None,
                 fast_path: bool = True, dequantize_to: torch.dtype = torch.float32):
    """One layer computing the parts' outputs side by side (q/k/v, gate/up). Consecutive parts
    of one format are concatenated row-wise (float rows, or block rows of one qtype); a change
    of format starts a new sub-layer. bias: [sum of the parts' rows] or None."""
    groups: list[list] = []
    for p in parts:
        key = p.qtype if isinstance(p, QuantWeight) else p.dtype
        if groups and groups[-1][0] == key:
            groups[-1][1].append(p)
        else:
            groups.append([key, [p]])
    layers, row = [], 0
    for _, members in groups:
        if isinstance(members[0], QuantWeight):
            w = QuantWeight(torch.cat([m.blocks for m in members]), members[0].qtype,
                            (sum(m.shape[0] for m in members), members[0].shape[1]))
        else:
            w = torch.cat(members)
        n = w.shape[0]
        layers.append(make_linear(w, None if bias is None else bias[row:row + n], fast_path, dequantize_to))
        row += n
    return layers[0] if len(layers) == 1 else ConcatLinear(layers)
