"""Decoder layers in native calls for CPU forwards (decode steps, verify trees, prefill chunks):
the wrapper of cpu_layer.c.

A CPU decode step of the torch layer loop (runtime/model.py) makes ~30 torch ops per layer, and
at batch 1 their dispatch cost about as much as streaming the weights (for a prefill chunk the
torch ops' glue was ~15% of its time).  ``FusedLayers`` runs the
same layers with one C call per layer (``pl_layer``) or one for all of them (``pl_layers``),
through the very GEMV and attention kernels the torch path calls (cpu_gemv.c, cpu_attention.c,
the block formats of cpu_qgemv.c: anything with a ``pg_weight_t`` descriptor), and mirrors the
torch ops' roundings between them, so a bf16 model's results are the torch path's bit for bit
(an fp32 model's differ by an ulp here and there: SiLU's exp, see cpu_layer.c).

    fused = fused_layers(model, kv_caches)   # None: use the torch loop (see why_not())
    h = fused.forward(h, batch, cos, sin)    # h [T, hidden], T <= MAX_T, updated in place
    logits = fused.logits(model, batch)      # or ids to logits in one call (pl_forward); None:
                                             # the model's ends are not native (ends_why_not)

The KV cache is of the model dtype or int8 with per-(token, kv head) scales (``--kv-dtype int8``:
new rows quantized by the same pa_store_kv_i8 as ops.store_kv).

``fused_layers`` is the model's hook (runtime/model.CpuForward, the CPU transformation): it
builds a ``FusedLayers`` once per (model layers, KV cache) and hands it back on later steps.
Whether to take this path at all is the runtime's switch (PRESCIENT_FUSED_LAYERS, parsed by
runtime/env.py: off, or ``layer`` for one native call per layer instead of one per step, what
tensor parallelism would need: an all-reduce between layers); the kernels' own switches
PRESCIENT_KERNELS=reference|triton and PRESCIENT_CPU_ATTENTION=0 turn it off here, since they
ask for an attention the fused path does not run (read per call, as kernels/ops.py reads them).

Not reentrant: one forward at a time per FusedLayers (as for its KV cache itself): the step's
arguments and scratch are the object's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import weakref
from pathlib import Path
from typing import Optional

import torch

from prescient.kernels import cpu_attention, cpu_linear

log = logging.getLogger(__name__)

_OFF = ("0", "false", "off")
_C_VERSION = 6  # must match PL_VERSION in cpu_layer.c


def _max_tokens() -> int:
    """PL_MAX_T of cpu_layer.c, the one place the limit is written: pl_max_tokens() of the
    library.  Fallback, only when the library cannot be built (no C compiler): the same
    #define read from the C source the library would be built from."""
    lib = cpu_linear.library()
    if lib is not None:
        lib.pl_max_tokens.restype, lib.pl_max_tokens.argtypes = ctypes.c_int, []
        return int(lib.pl_max_tokens())
    src = Path(__file__).with_name("cpu_layer.c").read_text()
    return int(re.search(r"^#define PL_MAX_T (\d+)", src, re.M).group(1))


#: most tokens of one native forward (PL_MAX_T in cpu_layer.c): a prepared CPU model
#: (runtime/model.CpuForward) takes this path for every forward up to it, prefill chunks included
MAX_T = _max_tokens()
_DT = {torch.float32: 0, torch.bfloat16: 1}
_I64, _I32 = torch.int64, torch.int32
_torch_threads = torch.get_num_threads

_layer_fn = None  # pl_layer, once bound
_layers_fn = None  # pl_layers
_norm_fn = None  # pl_final_norm
_scratch_fn = None  # pl_scratch_bytes
_silu_fn = None  # pl_silu_mul
_forward_fn = None  # pl_forward
_tried = False
_why_not: Optional[str] = None

# C error codes of cpu_layer.c (positive); negative codes are pa_tree_attention's.
_ERRORS = {1: "bad shapes", 2: "a slot_mapping entry is past the end of the KV cache",
           3: "a linear rejected its arguments", 4: "out of memory",
           5: "a token id or position is outside its table"}


class _Step(ctypes.Structure):
    """Mirror of pl_step_t (cpu_layer.c): what one forward's layers share."""
    _fields_ = [(name, ctypes.c_int64) for name in (
        "T", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter", "dtype",
        "h", "cos", "sin", "slot_mapping",
        "block_tables", "context_lens", "cu_seqlens_q", "mask_bits",
        "num_seqs", "max_blocks", "num_words", "num_blocks", "block_size",
        "attn_flags", "sum_lanes", "scratch")] + [("eps", ctypes.c_double), ("scale", ctypes.c_double)]


class _LayerArgs(ctypes.Structure):
    """Mirror of pl_layer_args (cpu_layer.c): one layer's weights and KV cache, and its step."""
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "step", "qkv", "o", "gate_up", "down", "o_b", "down_b")] + [
        ("o_cut", ctypes.c_int64), ("down_cut", ctypes.c_int64)] + [(name, ctypes.c_void_p) for name in (
        "attn_norm", "mlp_norm", "qkv_bias", "k_cache", "v_cache", "k_scale", "v_scale")]


class _ForwardArgs(ctypes.Structure):
    """Mirror of pl_forward_args (cpu_layer.c): a whole forward, token ids to logits."""
    _fields_ = [("step", ctypes.c_void_p), ("layers", ctypes.c_void_p), ("num_layers", ctypes.c_int64),
                ("ids", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("embed_q", ctypes.c_void_p),
                ("embed", ctypes.c_void_p), ("vocab", ctypes.c_int64), ("cos_table", ctypes.c_void_p),
                ("sin_table", ctypes.c_void_p), ("max_pos", ctypes.c_int64), ("norm", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("num_rows", ctypes.c_int64), ("head", ctypes.c_void_p),
                ("logits", ctypes.c_void_p)]


def _bind() -> None:
    global _layer_fn, _layers_fn, _norm_fn, _scratch_fn, _forward_fn, _tried, _why_not
    _tried = True
    lib = cpu_linear.library()
    if lib is None:
        _why_not = cpu_linear._lib_error or "the C library did not load"
        return
    if not cpu_attention.available():
        _why_not = f"the C attention kernel is unavailable ({cpu_attention.why_not()})"
        return
    for fn in (lib.pl_version, lib.pl_pa_version, lib.pa_version, lib.pl_max_tokens):
        fn.restype, fn.argtypes = ctypes.c_int, []
    lib.pl_struct_bytes.argtypes = [ctypes.c_int]
    lib.pl_struct_bytes.restype = ctypes.c_int64
    lib.pl_forward_args_bytes.argtypes = []
    lib.pl_forward_args_bytes.restype = ctypes.c_int64
    # the build must be the one this wrapper was written against: (what it has, what is expected, why)
    for got, want, what in (
            (lib.pl_version(), _C_VERSION, "cpu_layer.c version"),
            (lib.pl_pa_version(), lib.pa_version(), "the pa_args_t version cpu_layer.c was built with (cpu_attention.h)"),
            ((lib.pl_struct_bytes(0), lib.pl_struct_bytes(1), lib.pl_forward_args_bytes()),
             (ctypes.sizeof(_Step), ctypes.sizeof(_LayerArgs), ctypes.sizeof(_ForwardArgs)),
             "the sizes of cpu_layer.c's structs (mirrored here)")):
        if got != want:
            _why_not = f"{what} is {got}, expected {want}"
            log.warning("prescient cpu_layer: %s", _why_not)
            return
    lib.pl_layer.argtypes = [ctypes.c_void_p]
    lib.pl_layer.restype = ctypes.c_int
    lib.pl_layers.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.pl_layers.restype = ctypes.c_int
    lib.pl_scratch_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.pl_scratch_bytes.restype = ctypes.c_int64
    lib.pl_mean_sq.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.pl_mean_sq.restype = ctypes.c_float
    lib.pl_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.pl_silu_mul.restype = ctypes.c_int
    global _silu_fn
    _silu_fn = lib.pl_silu_mul
    lib.pl_final_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.pl_final_norm.restype = ctypes.c_int
    lib.pl_profile.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.pl_profile.restype = None
    lib.pl_forward.argtypes = [ctypes.c_void_p]
    lib.pl_forward.restype = ctypes.c_int
    _forward_fn = lib.pl_forward
    _layer_fn, _layers_fn, _norm_fn, _scratch_fn = lib.pl_layer, lib.pl_layers, lib.pl_final_norm, lib.pl_scratch_bytes


_lanes: dict[int, int] = {}


def torch_sum_lanes(n: int) -> int:
    """The vector width torch's CPU row sum works in (SumKernel.cpp; 8 floats in the builds
    seen so far, whatever the CPU's AVX-512): the one with which cpu_layer.c's copy of that
    summation order reproduces torch's x.pow(2).mean(-1) bit for bit on random rows of n
    elements.  If none does (another torch), 8, and the bf16 results are near rather than equal."""
    if n not in _lanes:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(16, n, generator=g) * 3  # [rows, n]
        ref = x.pow(2).mean(-1).tolist()
        sq = torch.empty(n)
        fn = cpu_linear.library().pl_mean_sq
        found = [L for L in (8, 16, 4, 1) if all(
            fn(x[i].data_ptr(), n, L, sq.data_ptr()) == ref[i] for i in range(x.shape[0]))]
        if not found:
            log.info("prescient cpu_layer: torch's row-sum order not reproduced (n=%d); RMSNorm may "
                     "differ from the torch path by an fp32 rounding", n)
        _lanes[n] = found[0] if found else 8
    return _lanes[n]


def available() -> bool:
    """True when the native layer is loaded (builds the .so on first call)."""
    if not _tried:
        _bind()
    return _layer_fn is not None


def silu_mul(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """gate_up [T, 2 I] = [gate | up] (fp32/bf16, CPU) -> silu(gate) * up [T, I] computed as the
    fused layer computes it (cpu_layer.c's SiLU), or None when the native layer is unavailable
    or the tensor is not one it takes (the caller then uses torch's)."""
    # (the tensor's checks first: a CUDA model never touches the CPU library)
    if (not gate_up.is_cpu or gate_up.dtype not in _DT or gate_up.dim() != 2 or gate_up.shape[1] % 2
            or not available()):
        return None
    gu = gate_up.contiguous()
    T, I = gu.shape[0], gu.shape[1] // 2
    act = torch.empty(T, I, dtype=gu.dtype)
    if T and _silu_fn(gu.data_ptr(), act.data_ptr(), T, I, _DT[gu.dtype]):
        raise RuntimeError(f"cpu_layer: pl_silu_mul rejected a [{T}, {2 * I}] {gu.dtype} input")
    return act


def why_not() -> Optional[str]:
    """Why the native layer is unavailable, or None."""
    available()
    return _why_not


def profile(on: bool) -> dict[str, float]:
    """Turn the native layers' section timers on or off (latency_bench/step_profile.py); returns
    the seconds spent so far in their GEMVs, attention and glue, and resets them."""
    if not available():
        raise RuntimeError(f"native layers unavailable: {_why_not}")
    out = (ctypes.c_int64 * 3)()
    cpu_linear.library().pl_profile(int(on), out)
    return {"gemv": out[0] * 1e-9, "attention": out[1] * 1e-9, "glue": out[2] * 1e-9}


def enabled() -> bool:
    """Whether the kernels' switches let the fused path run: PRESCIENT_KERNELS unset/auto and
    PRESCIENT_CPU_ATTENTION not off (read per call, as ops.py does)."""
    env = os.environ
    return (env.get("PRESCIENT_KERNELS", "auto") in ("", "auto")
            and env.get("PRESCIENT_CPU_ATTENTION", "1") not in _OFF)


def _bias_after(lin, dptr: int, i: int) -> Optional[torch.Tensor]:
    """The bias the layer adds after its kernel's rounded output (runtime/linear.Linear adds it
    in torch, `y + bias`), or None when there is none or the kernel adds it itself (a bias in
    the descriptor, as QuantizedLinear's: fp32, before the rounding)."""
    bias = getattr(lin, "bias", None)
    if bias is None:
        return None
    in_desc = ctypes.c_void_p.from_address(dptr + ctypes.sizeof(ctypes.c_void_p)).value  # pg_weight_t.bias
    if type(lin).__name__ == "Linear" and not in_desc:
        return bias
    if in_desc and type(lin).__name__ != "Linear":
        return None
    raise ValueError(f"layer {i} qkv: {type(lin).__name__} with a bias the native layer cannot place")


def _error(rc: int) -> RuntimeError:
    if rc > 0:
        return RuntimeError(f"cpu_layer: {_ERRORS.get(rc, f'error {rc}')}")
    code, index = (-rc) % 8, (-rc) // 8
    return RuntimeError(f"cpu_layer: tree_attention: {cpu_attention._ERRORS.get(code, f'error {rc}')}"
                        + ("" if code in (1, 6, 7) else f" (sequence {index})"))


class FusedLayers:
    """A model's decoder layers bound to one KV cache, run natively.  Build with
    ``FusedLayers.build`` (None when the model cannot take this path, the reason in the log at
    debug level) or directly (raises ValueError)."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], per_layer: bool = False):
        if not available():
            raise ValueError(f"native layers unavailable: {_why_not}")
        cfg = model.config
        dtype = model.dtype
        if model.device.type != "cpu" or dtype not in _DT:
            raise ValueError(f"needs a float32/bfloat16 CPU model, got {dtype} on {model.device}")
        layers = model.layers
        n = min(len(layers), len(kv_caches))
        if n == 0:
            raise ValueError("no layers")
        D = cfg.head_dim
        if D % 2 or D > 512:
            raise ValueError(f"head_dim {D} must be even and <= 512")
        shape = tuple(kv_caches[0][0].shape)
        if len(shape) != 4 or shape[2:] != (cfg.num_kv_heads, D):
            raise ValueError(f"KV cache {shape} is not [num_blocks, block_size, {cfg.num_kv_heads}, {D}]")
        self.model_layers = layers  # identity checked by fused_layers()
        self.num_layers = n
        self.dtype = dtype
        self.per_layer = per_layer  # one pl_layer call per layer instead of one pl_layers call
        self._hidden = cfg.hidden_size
        self._head_dim = D

        step = _Step(T=0, hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                     head_dim=D, inter=cfg.intermediate_size, dtype=_DT[dtype], num_blocks=shape[0],
                     block_size=shape[1], sum_lanes=torch_sum_lanes(cfg.hidden_size),
                     eps=float(cfg.rms_norm_eps), scale=float(model.scale))
        self._scratch, self._capacity = None, 0  # scratch for up to _capacity tokens (_reserve)
        self._step = step
        self._step_ptr = ctypes.addressof(step)
        # pl_forward's arguments for one model's ends (logits()): bound on first use
        self._ends, self._ends_model, self._ends_keep, self._head_n, self._ends_ptr = None, None, None, 0, 0
        self.ends_why_not: Optional[str] = None

        def desc(lin, what: str, i: int) -> int:
            packed = getattr(lin, "packed", None)
            p = getattr(packed, "_dptr", None)
            if p is None:
                raise ValueError(f"layer {i} {what}: no native weight descriptor (Linear.packed._dptr)")
            if getattr(packed, "_native", True) is False:  # a block format without small-M kernels
                raise ValueError(f"layer {i} {what}: {packed!r} has no native kernel")
            return p

        def split_desc(lin, what: str, i: int) -> tuple[int, Optional[int], int]:
            """(first descriptor, second or None, the cut): a row-parallel linear held as two
            column groups (runtime/linear.ColumnGroups, TP-invariant sums) or as one."""
            groups = getattr(lin, "column_groups", None)
            if groups is None:
                return desc(lin, what, i), None, 0
            if len(groups) != 2:
                raise ValueError(f"layer {i} {what}: {len(groups)} column groups (the native layer takes 1 or 2)")
            (c0, p0), (c1, p1) = groups
            return desc(p0, what, i), desc(p1, what, i), c1

        def vec(t: Optional[torch.Tensor], what: str, i: int, size: int) -> Optional[int]:
            if t is None:
                return None
            if t.dtype is not dtype or not t.is_contiguous() or t.shape != (size,) or not t.is_cpu:
                raise ValueError(f"layer {i} {what}: want a contiguous [{size}] {dtype} CPU tensor")
            return t.data_ptr()

        nqkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * D
        args = (_LayerArgs * n)()
        self._kv_refs = []
        keep = []  # Python objects whose memory the structs point into
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            k, v = kv[0], kv[1]
            # an int8 cache (runtime/kv_layer.KVLayer) carries fp32 scales [blocks, block_size, kv heads]
            k_scale, v_scale = getattr(kv, "k_scale", None), getattr(kv, "v_scale", None)
            cdt = torch.int8 if k_scale is not None else dtype
            for c in (k, v):
                if c.dtype is not cdt or tuple(c.shape) != shape or not c.is_contiguous() or not c.is_cpu:
                    raise ValueError(f"layer {i} KV cache must be contiguous {cdt} {shape} on the CPU, "
                                     f"got {c.dtype} {tuple(c.shape)}")
            for c in (k_scale, v_scale) if k_scale is not None else ():
                if c.dtype is not torch.float32 or tuple(c.shape) != shape[:3] or not c.is_contiguous():
                    raise ValueError(f"layer {i} KV scales must be contiguous float32 {shape[:3]}")
            a = args[i]
            a.step = ctypes.addressof(step)
            a.qkv, a.gate_up = desc(layer.qkv, "qkv", i), desc(layer.gate_up, "gate_up", i)
            a.o, a.o_b, a.o_cut = split_desc(layer.o, "o", i)
            a.down, a.down_b, a.down_cut = split_desc(layer.down, "down", i)
            a.attn_norm = vec(layer.attn_norm, "attn_norm", i, cfg.hidden_size)
            a.mlp_norm = vec(layer.mlp_norm, "mlp_norm", i, cfg.hidden_size)
            a.qkv_bias = vec(_bias_after(layer.qkv, a.qkv, i), "qkv bias", i, nqkv)
            a.k_cache, a.v_cache = k.data_ptr(), v.data_ptr()
            if k_scale is not None:
                a.k_scale, a.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
            keep.append((layer.qkv, layer.o, layer.gate_up, layer.down))
            # weak: a FusedLayers cached on the model must not keep a dropped KV cache alive
            self._kv_refs.append((weakref.ref(k), weakref.ref(v)))
        self._keep = keep
        self._args = args
        self._args_ptr = ctypes.addressof(args)
        self._layer_ptrs = [ctypes.addressof(args[i]) for i in range(n)]

    def _reserve(self, T: int) -> None:
        """Scratch for a T-token forward: grown on demand (to a multiple of 64 tokens), so decode
        steps keep a small one and a prefill chunk's (~14 MB at 576 tokens for SmolLM2-135M)
        is only made where prefill runs."""
        if T <= self._capacity:
            return
        cap = min(MAX_T, -(-T // 64) * 64)
        nbytes = _scratch_fn(ctypes.byref(self._step), cap)
        raw = torch.empty(nbytes + 64, dtype=torch.uint8)
        self._step.scratch = raw.data_ptr() + (-raw.data_ptr() % 64)
        self._scratch, self._capacity = raw, cap

    @classmethod
    def build(cls, model, kv_caches, per_layer: bool = False) -> Optional["FusedLayers"]:
        try:
            return cls(model, kv_caches, per_layer)
        except ValueError as e:
            log.debug("prescient cpu_layer: torch layer loop (%s)", e)
            return None

    def bound_to(self, kv_caches) -> bool:
        """Whether kv_caches are the very tensors this object was built on (and still alive)."""
        if len(kv_caches) < self.num_layers:
            return False
        for (k, v), (rk, rv) in zip(kv_caches, self._kv_refs):
            if k is not rk() or v is not rv():
                return False
        return True

    def forward(self, h: torch.Tensor, batch, cos: torch.Tensor, sin: torch.Tensor, start: int = 0,
                stop: int | None = None) -> torch.Tensor:
        """Layers [start, stop) (default: every layer) on h -> h after them, in place: the
        embeddings for layer 0, else what an earlier call returned (a chunk split by layers).
        h: [T, hidden] contiguous, the model dtype, T <= MAX_T; batch: the ForwardBatch (its
        slot_mapping, block_tables, context_lens, cu_seqlens_q, mask_bits); cos, sin:
        [T, 1, head_dim] or [T, head_dim] contiguous (Rope.tables of batch.positions).
        The KV cache must be the one this object was built on and still alive (bound_to)."""
        dtype = self.dtype
        T = h.shape[0]
        if (h.dtype is not dtype or h.dim() != 2 or h.shape[1] != self._hidden or not 1 <= T <= MAX_T
                or not h.is_contiguous() or not h.is_cpu):
            raise ValueError(f"h must be a contiguous [1..{MAX_T}, {self._hidden}] {dtype} CPU tensor, "
                             f"got {h.dtype} {tuple(h.shape)}")
        stop = self.num_layers if stop is None else stop
        if not 0 <= start < stop <= self.num_layers:
            raise ValueError(f"layers [{start}, {stop}) are not within the {self.num_layers} layers")
        D = self._head_dim
        for t in (cos, sin):
            if t.dtype is not dtype or t.numel() != T * D or t.shape[-1] != D or not t.is_contiguous():
                raise ValueError(f"cos/sin must be contiguous [{T}, 1, {D}] {dtype}, got {t.dtype} {tuple(t.shape)}")
        s = self._set_batch(T, batch)
        s.h = h.data_ptr()
        s.cos = cos.data_ptr()
        s.sin = sin.data_ptr()
        if self.per_layer:
            fn = _layer_fn
            for p in self._layer_ptrs[start:stop]:
                rc = fn(p)
                if rc:
                    raise _error(rc)
        else:
            rc = _layers_fn(self._layer_ptrs[start], stop - start)
            if rc:
                raise _error(rc)
        return h

    def _set_batch(self, T: int, batch) -> "_Step":
        """The step's T and attention metadata from a ForwardBatch of T tokens (checked: the C
        trusts them), its scratch grown to T; the step struct."""
        slots, bt, cl, cu, mask = (batch.slot_mapping, batch.block_tables, batch.context_lens,
                                   batch.cu_seqlens_q, batch.mask_bits)
        if (slots.dtype is not _I64 or slots.shape != (T,) or bt.dtype is not _I32 or bt.dim() != 2
                or cl.dtype is not _I32 or cu.dtype is not _I32 or cl.shape != (bt.shape[0],)
                or cu.shape != (bt.shape[0] + 1,) or not (slots.is_contiguous() and bt.is_contiguous()
                                                          and cl.is_contiguous() and cu.is_contiguous())):
            raise ValueError("batch: slot_mapping int64 [T], block_tables int32 [S, B], context_lens int32 [S] "
                             "and cu_seqlens_q int32 [S + 1], all contiguous")
        self._reserve(T)
        s = self._step
        s.h = 0  # set by the caller (forward) or by pl_forward: final_norm never pairs T with an older h
        s.T = T
        s.slot_mapping = slots.data_ptr()
        s.block_tables = bt.data_ptr()
        s.num_seqs, s.max_blocks = bt.shape
        s.context_lens = cl.data_ptr()
        s.cu_seqlens_q = cu.data_ptr()
        if mask is None:
            s.mask_bits = s.num_words = 0
        else:
            if mask.dtype is not _I32 or mask.dim() != 2 or mask.shape[0] != T or mask.shape[1] < 1:
                raise ValueError(f"mask_bits must be int32 [{T}, num_words >= 1], got {mask.dtype} {tuple(mask.shape)}")
            if not mask.is_contiguous():
                mask = mask.contiguous()
            s.mask_bits = mask.data_ptr()
            s.num_words = mask.shape[1]
        # torch's own OpenMP worker spinning on the second core (a caller that did not set torch
        # to one thread, as CpuForward does): the attention stays on this thread (cpu_attention.py's
        # PA_SOLO rule); the GEMV pool decides for itself
        s.attn_flags = 1 if _torch_threads() > 1 else 0
        return s

    def logits(self, model, batch) -> Optional[torch.Tensor]:
        """The forward's logits [len(batch.logits_indices), vocab] fp32 in one native call
        (pl_forward: the embedding, RoPE rows, every layer, the final norm and the LM head), the
        bits of CpuForward's composed calls (model.embed_tokens, model.rope.tables, forward,
        final_norm, model._logits); or None where `model`'s ends cannot go there (a per-layer
        object, an embedding or LM head without a native descriptor, a head whose bias torch
        adds: ends_why_not says why), and the caller composes those calls instead.  h stays in
        the object's scratch: a caller that wants the hidden states composes them too."""
        args = self._ends if self._ends_model is not None and self._ends_model() is model else self._bind_ends(model)
        if args is None:
            return None
        ids, pos, rows = batch.input_ids, batch.positions, batch.logits_indices
        T = ids.shape[0]
        if not 1 <= T <= MAX_T:
            raise ValueError(f"a forward of 1..{MAX_T} tokens, got {T}")
        for t, what in ((ids, "input_ids"), (pos, "positions")):
            if t.dtype is not _I64 or t.shape != (T,) or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"batch.{what} must be contiguous int64 [{T}] on the CPU")
        if rows.dtype is not _I64 or rows.dim() != 1 or not rows.is_contiguous():
            raise ValueError("batch.logits_indices must be contiguous int64 [n]")
        self._set_batch(T, batch)
        n = rows.shape[0]
        out = torch.empty(n, self._head_n, dtype=torch.float32)
        args.ids, args.positions = ids.data_ptr(), pos.data_ptr()
        args.rows, args.num_rows, args.logits = rows.data_ptr(), n, out.data_ptr()
        rc = _forward_fn(self._ends_ptr)
        if rc == 5:
            raise IndexError(f"cpu_layer: {_ERRORS[5]} (vocabulary {args.vocab}, positions {args.max_pos})")
        if rc == 1:
            raise ValueError("cpu_layer: pl_forward: bad shapes, or a logits row outside [0, T)")
        if rc:
            raise _error(rc)
        return out

    def _bind_ends(self, model) -> Optional["_ForwardArgs"]:
        """pl_forward's arguments for `model`'s embedding, RoPE tables, final norm and LM head
        (built once per model), or None with the reason in ends_why_not."""
        self._ends, self._ends_model, self._ends_keep = None, weakref.ref(model), None
        try:
            self._ends, self._head_n, self._ends_keep = self._ends_args(model)
            self._ends_ptr = ctypes.addressof(self._ends)
            self.ends_why_not = None
        except ValueError as e:
            self.ends_why_not = str(e)
            log.debug("prescient cpu_layer: forwards composed around the layers (%s)", e)
        return self._ends

    def _ends_args(self, model) -> tuple["_ForwardArgs", int, tuple]:
        dtype, hidden, D = self.dtype, self._hidden, self._head_dim
        if self.per_layer:
            raise ValueError("one native call per layer was asked for")
        if getattr(model, "is_sharded", False):
            raise ValueError("a tensor-parallel shard (its head gathers the ranks' logits)")
        if self.num_layers != len(model.layers) or model.layers is not self.model_layers:
            raise ValueError("not every layer of the model is bound to this KV cache")

        def table(t, what: str, cols: int) -> int:
            if (not isinstance(t, torch.Tensor) or t.dtype is not dtype or t.dim() != 2 or t.shape[1] != cols
                    or not t.is_contiguous() or not t.is_cpu):
                raise ValueError(f"{what}: want a contiguous [rows, {cols}] {dtype} CPU tensor")
            return t.data_ptr()

        args = _ForwardArgs(step=self._step_ptr, layers=self._args_ptr, num_layers=self.num_layers)
        embed_q = getattr(model, "_embed_q", None)
        if embed_q is not None:
            packed = getattr(embed_q, "packed", None)
            if getattr(packed, "_dptr", None) is None or not getattr(packed, "_deq_native", False):
                raise ValueError("the embedding table has no native dequantizer")
            if packed.in_features != hidden:
                raise ValueError("the embedding table's width is not the hidden size")
            args.embed_q, args.vocab = packed._dptr, packed.out_features
        else:
            args.embed, args.vocab = table(model.embed, "the embedding table", hidden), model.embed.shape[0]
        cos, sin = model.rope.cos, model.rope.sin
        args.cos_table, args.sin_table = table(cos, "rope.cos", D), table(sin, "rope.sin", D)
        if sin.shape != cos.shape:
            raise ValueError("rope.cos and rope.sin differ in shape")
        args.max_pos = cos.shape[0]
        norm = model.norm
        if norm.dtype is not dtype or norm.shape != (hidden,) or not norm.is_contiguous():
            raise ValueError(f"the final norm: want a contiguous [{hidden}] {dtype} tensor")
        args.norm = norm.data_ptr()
        head = model.lm_head
        if type(head).__name__ not in ("Linear", "QuantizedLinear"):  # e.g. a vocab-parallel head
            raise ValueError(f"the LM head is a {type(head).__name__}")
        packed = getattr(head, "packed", None)
        dptr = getattr(packed, "_dptr", None)
        if dptr is None or getattr(packed, "_native", True) is False or not getattr(packed, "native", True):
            raise ValueError("the LM head has no native kernel")
        try:
            torch_bias = _bias_after(head, dptr, -1)
        except ValueError:
            raise ValueError("the LM head has a bias the native call cannot place") from None
        if torch_bias is not None:
            raise ValueError("the LM head's bias is added by torch")
        if getattr(packed, "in_features", hidden) != hidden:
            raise ValueError("the LM head's input is not the hidden size")
        args.head = dptr
        return args, int(packed.out_features), (embed_q, model.embed, cos, sin, norm, head)

    def final_norm(self, h: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rms_norm(h[rows]) * weight as the model's _rms_norm computes it, for the h the last
        forward() returned (same tensor, same step).  rows: [n] int64 (batch.logits_indices);
        weight: [hidden] the model dtype -> [n, hidden].  One native call instead of the ~7 torch
        ops whose dispatch, right after the layers streamed every weight through the caches, costs
        some 0.1-0.3 ms a step."""
        s = self._step
        if h.data_ptr() != s.h or weight.dtype is not self.dtype or weight.shape != (self._hidden,) \
                or not weight.is_contiguous():
            raise ValueError("final_norm: h must be the last forward()'s and weight a contiguous "
                             f"[{self._hidden}] {self.dtype} tensor")
        if rows.dtype is not _I64 or rows.dim() != 1 or not rows.is_contiguous():
            raise ValueError("final_norm: rows must be contiguous int64 [n]")
        n = rows.shape[0]
        out = h.new_empty((n, self._hidden))
        rc = _norm_fn(self._step_ptr, weight.data_ptr(), rows.data_ptr(), n, out.data_ptr())
        if rc:
            raise ValueError(f"final_norm: rows must lie in [0, {s.T})")
        return out


def fused_layers(model, kv_caches, per_layer: bool = False) -> Optional[FusedLayers]:
    """The model hook: a FusedLayers for (model.layers, kv_caches) when the kernels' switches
    (``enabled()``) and the model allow it, else None.  Built on the first call for a given KV
    cache (``per_layer`` applies then: a cached entry keeps its own) and cached on the model (a
    few entries: the engine's cache, a draft's, a calibration's scratch cache; an early-exit
    draft shares the list, its entries told apart by their layers)."""
    if not enabled() or not kv_caches:
        return None
    cache = model.__dict__.get("_fused_layers_cache")
    if cache is None:
        cache = model.__dict__["_fused_layers_cache"] = []
    layers, k0 = model.layers, kv_caches[0][0]
    for entry_layers, k0_ref, fl in cache:
        if entry_layers is layers and k0_ref() is k0 and (fl is None or fl.bound_to(kv_caches)):
            return fl
    fl = FusedLayers.build(model, kv_caches, per_layer)
    cache[:] = [e for e in cache if e[1]() is not None][-7:]  # entries whose KV cache is gone go
    cache.append((layers, weakref.ref(k0), fl))
    return fl
