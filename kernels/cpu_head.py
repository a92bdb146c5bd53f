"""The EAGLE draft head's step in one native call: the wrapper of pl_head_step (cpu_layer.c).

A draft depth of the head (speculative/eagle_head.HeadRunner.step_at) is one decoder layer over
1-8 rows, and in torch ops it cost ~0.65 ms on a 2-core Zen 4, of which the matrix products
were ~0.15 ms: the rest was the dispatch of ~40 small ops, paid at every depth of every draft.
Here the fc, the layer, the attention over the head's own K/V rows and the draft LM head run in
one C call through the same GEMV kernels (any linear with a native descriptor).

    step = HeadStep.build(runner)   # None: use the torch arithmetic (why in the debug log)
    h, logits = step(embeds, feats, positions, k_buf, v_buf, start, free, attend, logit_rows)
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from prescient.kernels import cpu_layer, cpu_linear

log = logging.getLogger(__name__)

_fn = None  # pl_head_step, once bound
_scratch_fn = None


class _HeadArgs(ctypes.Structure):
    """Mirror of pl_head_args (cpu_layer.c)."""
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "step", "fc", "qkv", "o", "gate_up", "down", "lm_head", "mlp_norm", "embeds", "feats",
        "cos_table", "sin_table", "positions", "k_buf", "v_buf")] + [
        (name, ctypes.c_int64) for name in ("cap", "start", "free_rows")] + [
        ("attend", ctypes.c_void_p), ("logit_rows", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("num_logit_rows", "max_pos")] + [
        ("h", ctypes.c_void_p), ("logits", ctypes.c_void_p)]


def _bind() -> bool:
    global _fn, _scratch_fn
    if _fn is not None:
        return True
    if not cpu_layer.available():
        return False
    lib = cpu_linear.library()
    lib.pl_head_step.argtypes = [ctypes.c_void_p]
    lib.pl_head_step.restype = ctypes.c_int
    lib.pl_head_scratch_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.pl_head_scratch_bytes.restype = ctypes.c_int64
    _fn, _scratch_fn = lib.pl_head_step, lib.pl_head_scratch_bytes
    return True


def _desc(lin, what: str) -> int:
    packed = getattr(lin, "packed", None)
    p = getattr(packed, "_dptr", None)
    if p is None or getattr(packed, "_native", True) is False:
        raise ValueError(f"the head's {what} has no native kernel ({type(lin).__name__})")
    return p


class HeadStep:
    """A HeadRunner's matrices bound to pl_head_step. Not reentrant (its scratch is its own)."""

    def __init__(self, runner):
        if not _bind():
            raise ValueError(f"native layers unavailable: {cpu_layer.why_not()}")
        c = runner.cfg
        self._hidden, self._vocab, self._kv = c.hidden_size, c.draft_vocab, runner.kv_size
        self._ptrs = {what: _desc(getattr(runner, what), what)
                      for what in ("fc", "qkv", "o", "gate_up", "down", "lm_head")}
        rows = getattr(runner.lm_head, "out_features", None)
        if rows is not None and rows != c.draft_vocab:  # the logits buffer is sized by the vocab
            raise ValueError(f"the draft LM head has {rows} rows, the head's draft vocab {c.draft_vocab}")
        self._norm = runner.mlp_norm.float().contiguous()
        self._cos = runner.rope.cos.float().contiguous()  # [max_pos, head_dim]
        self._sin = runner.rope.sin.float().contiguous()
        self._step = cpu_layer._Step(
            T=0, hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, inter=c.intermediate_size, dtype=0,
            sum_lanes=cpu_layer.torch_sum_lanes(c.hidden_size), eps=float(c.rms_norm_eps),
            scale=float(runner.scale))
        self._args = _HeadArgs(step=ctypes.addressof(self._step), mlp_norm=self._norm.data_ptr(),
                               cos_table=self._cos.data_ptr(), sin_table=self._sin.data_ptr(),
                               max_pos=self._cos.shape[0], **self._ptrs)
        self._args_ptr = ctypes.addressof(self._args)
        self._scratch, self._room = None, (0, 0)

    @classmethod
    def build(cls, runner) -> Optional["HeadStep"]:
        try:
            return cls(runner)
        except ValueError as e:
            log.debug("prescient cpu_head: the head's torch arithmetic (%s)", e)
            return None

    def _reserve(self, n: int, rows: int) -> None:
        if n <= self._room[0] and rows <= self._room[1]:
            return
        n, rows = max(n, self._room[0], 8), max(rows, self._room[1], 1024)
        nbytes = _scratch_fn(ctypes.byref(self._step), n, rows)
        raw = torch.empty(nbytes + 64, dtype=torch.uint8)
        self._step.scratch = raw.data_ptr() + (-raw.data_ptr() % 64)
        self._scratch, self._room = raw, (n, rows)

    def __call__(self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor, start: int, free: int,
                 attend: Optional[torch.Tensor], logit_rows: Optional[list[int]] = None):
        """HeadRunner.step_at's arguments (embeds, feats [n, hidden] fp32; positions [n] int64;
        k_buf [kv, cap] (K transposed), v_buf [cap, kv], fp32 contiguous; attend
        [n, start + n - free] bool or None)
        -> (f^ [n, hidden] fp32, draft logits [len(logit_rows) or n, draft vocab] fp32)."""
        n = embeds.shape[0]
        embeds, feats = embeds.float().contiguous(), feats.float().contiguous()
        positions = positions.to(torch.int64).contiguous()
        if feats.shape != embeds.shape or embeds.shape[1:] != (self._hidden,) or positions.shape != (n,):
            raise ValueError(f"embeds and feats must be [n, {self._hidden}] and positions [n], got "
                             f"{tuple(embeds.shape)}, {tuple(feats.shape)}, {tuple(positions.shape)}")
        if attend is not None and tuple(attend.shape) != (n, start + n - free):
            raise ValueError(f"attend must be [{n}, {start + n - free}], got {tuple(attend.shape)}")
        cap = v_buf.shape[0]
        for t, shape in ((k_buf, (self._kv, cap)), (v_buf, (cap, self._kv))):
            if t.dtype is not torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
                raise ValueError(f"the head's K/V buffers must be contiguous fp32 [kv, cap] (K) and [cap, kv] (V), "
                                 f"got {tuple(k_buf.shape)} and {tuple(v_buf.shape)}")
        self._reserve(n, cap)
        self._step.T = n
        h = torch.empty(n, self._hidden)
        rows = None if logit_rows is None else torch.tensor(logit_rows, dtype=torch.int64)
        logits = torch.empty(n if rows is None else len(rows), self._vocab)
        mask = None if attend is None else attend.to(torch.uint8).contiguous()
        a = self._args
        a.embeds, a.feats, a.positions = embeds.data_ptr(), feats.data_ptr(), positions.data_ptr()
        a.k_buf, a.v_buf, a.cap, a.start, a.free_rows = k_buf.data_ptr(), v_buf.data_ptr(), cap, start, free
        a.attend = None if mask is None else mask.data_ptr()
        a.logit_rows = None if rows is None else rows.data_ptr()
        a.num_logit_rows = -1 if rows is None else len(rows)  # -1: every row
        a.h, a.logits = h.data_ptr(), logits.data_ptr()
        rc = _fn(self._args_ptr)
        if rc:
            raise RuntimeError(f"cpu_head: pl_head_step failed ({cpu_layer._ERRORS.get(rc, rc)})")
        return h, logits
