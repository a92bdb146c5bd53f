"""The native grammar mask (kernels/cpu_bitmask.c) is kernels/reference.apply_token_bitmask, logit
for logit, at every ISA tier the CPU runs: rows of every length around the vector widths, a
bitmask narrower or wider than the logits, selected rows (indices) or the first rows, rows apart in
a wider buffer; a banned NaN becomes -inf (as the Triton kernel makes it), an allowed one stays;
bad indices raise and write nothing; and kernels/ops sends CPU fp32 logits to it."""

from __future__ import annotations

import pytest
import torch

from prescient.kernels import cpu_bitmask, cpu_linear, ops, reference
from tests.kernels.kernel_oracles import run_at_tier


@pytest.fixture(autouse=True)
def _kernel(monkeypatch):
    if not cpu_bitmask.available():
        pytest.skip("the C library is unavailable")
    monkeypatch.delenv("PRESCIENT_KERNELS", raising=False)
    monkeypatch.delenv("PRESCIENT_CPU_ATTENTION", raising=False)
    yield
    cpu_linear._set_isa_cap(99)


def _bits(rows: int, words: int, g: torch.Generator, p_allowed: float = 0.5) -> torch.Tensor:
    """[rows, words] int32: each bit set with probability p_allowed, plus all-set and all-clear words."""
    bits = torch.rand(rows, words * 32, generator=g) < p_allowed
    if words >= 2:
        bits[:, :32] = True  # a whole word allowed (the AVX2 rows skip it)
    if words >= 4:
        bits[:, 64:96] = False  # and a whole word banned
    w = (bits.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    return (w - ((w >> 31) << 32)).to(torch.int32)  # the low 32 bits as signed


def _same(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None) -> None:
    want = logits.clone()
    reference.apply_token_bitmask(want, bitmask, indices)
    got = logits.clone()
    assert cpu_bitmask.apply(got, bitmask, indices)
    assert torch.equal(got, want)


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
def test_rows_of_every_length_and_bitmask_width(tier):
    run_at_tier(tier)
    g = torch.Generator().manual_seed(0)
    for n in [*range(1, 70), 95, 96, 97, 255, 256, 257, 1000, 49152, 49155]:
        for words in {(n + 31) // 32, max(1, n // 32), (n + 31) // 32 + 2}:  # exact, narrower, wider
            logits = torch.randn(3, n, generator=g)
            _same(logits, _bits(3, words, g))
            _same(logits, _bits(2, words, g, 0.05))  # the first rows only, mostly banned


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
def test_selected_rows_and_rows_apart_in_a_wider_buffer(tier):
    run_at_tier(tier)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 49152 + 100, generator=g)
    logits = wide[:, :49152]  # row stride 49252
    idx = torch.tensor([5, 0, 3], dtype=torch.int64)
    _same(logits, _bits(3, 1536, g), idx)
    got = wide.clone()
    assert cpu_bitmask.apply(got[:, :49152], _bits(3, 1536, torch.Generator().manual_seed(2)), idx)
    assert torch.equal(got[:, 49152:], wide[:, 49152:])  # past the row's columns: untouched
    assert torch.equal(got[[1, 2, 4]], wide[[1, 2, 4]])  # rows not selected: untouched


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
def test_banned_nan_becomes_minus_inf_and_allowed_values_stay(tier):
    run_at_tier(tier)
    n = 100
    logits = torch.full((1, n), float("nan"))
    logits[0, 50:] = float("inf")
    bits = torch.zeros(1, n, dtype=torch.bool)
    bits[0, ::3] = True
    w = torch.zeros(1, 4, dtype=torch.int64)
    for t in bits[0].nonzero().flatten().tolist():
        w[0, t // 32] |= 1 << (t % 32)
    bitmask = (w - ((w >> 31) << 32)).to(torch.int32)
    assert cpu_bitmask.apply(logits, bitmask)
    assert torch.isneginf(logits[0, ~bits[0]]).all()
    assert torch.isnan(logits[0, :50][bits[0, :50]]).all() and torch.isposinf(logits[0, 50:][bits[0, 50:]]).all()


def test_bad_indices_raise_and_write_nothing():
    logits = torch.randn(2, 64)
    before = logits.clone()
    with pytest.raises(IndexError):
        cpu_bitmask.apply(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0, 2]))
    with pytest.raises(ValueError):
        cpu_bitmask.apply(logits, torch.zeros(3, 2, dtype=torch.int32))
    assert torch.equal(logits, before)


def test_what_the_reference_reads_otherwise_goes_to_it():
    """Repeated, negative or bool indices, overlapping rows and tracked logits: the kernel declines
    (the caller runs the reference); a lone row with any row stride is the kernel's."""
    g = torch.Generator().manual_seed(3)
    logits, bitmask = torch.randn(4, 64, generator=g), _bits(2, 2, g)
    for idx in (torch.tensor([1, 1]), torch.tensor([-1, 0]), torch.tensor([True, False, True, False])):
        before = logits.clone()
        assert not cpu_bitmask.apply(logits, bitmask, idx) and torch.equal(logits, before)
    assert not cpu_bitmask.apply(torch.randn(1, 64).expand(3, 64), bitmask)
    assert not cpu_bitmask.apply(torch.randn(2, 64, requires_grad=True), bitmask)
    column = torch.randn(64, 1, generator=g).t()  # [1, 64], row stride 1
    _same(column, bitmask[:1])


def test_ops_sends_cpu_fp32_logits_to_the_kernel(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(reference, "apply_token_bitmask", refuse)
    logits = torch.randn(2, 40)
    ops.apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32))
    assert torch.isneginf(logits).all()
    with pytest.raises(AssertionError):  # bf16 logits: the reference's (no native kernel)
        ops.apply_token_bitmask(logits.bfloat16(), torch.zeros(2, 2, dtype=torch.int32))
