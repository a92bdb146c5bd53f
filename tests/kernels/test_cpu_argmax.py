"""The native argmax (kernels/cpu_argmax.c) is torch.argmax(x, -1), index for index, at every ISA
tier the CPU runs: the first maximum on ties (within a lane, across lanes and lane sets, in the
tail), the first NaN when a row has one, -0.0 equal to 0.0, infinities, rows of every length
around the vector widths; and the greedy paths that call it pick the same tokens."""

from __future__ import annotations

import pytest
import torch

from prescient.kernels import cpu_argmax, cpu_linear
from prescient.runtime.sampler import sample_row, target_probs_from_logits
from prescient.runtime.sampling_params import SamplingParams
from tests.kernels.kernel_oracles import run_at_tier


@pytest.fixture(autouse=True)
def _kernel():
    if not cpu_argmax.available():
        pytest.skip("the C library is unavailable")
    yield
    cpu_linear._set_isa_cap(99)


_tier = run_at_tier  # reset by the autouse fixture


def _same(x: torch.Tensor) -> None:
    got = cpu_argmax.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    # the one-row entry (greedy sampling's) answers the same for each row
    assert [cpu_argmax.argmax_row(x[r:r + 1]) for r in range(x.shape[0])] == x.argmax(-1).tolist()


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
def test_random_rows_of_every_length(tier):
    _tier(tier)
    g = torch.Generator().manual_seed(0)
    for n in [*range(1, 70), 95, 96, 97, 255, 256, 257, 1000, 49152, 49155]:
        _same(torch.randn(3, n, generator=g))
        # few distinct values: ties everywhere
        _same(torch.randint(0, 3, (4, n), generator=g).float())


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
def test_the_first_of_equal_maxima_wins(tier):
    _tier(tier)
    n = 300
    # every pair of positions (a, b), a < b, holding the maximum: lanes, lane sets, the tail
    for a in [0, 1, 7, 8, 31, 32, 33, 63, 64, 100, 287, 288, 290]:
        for b in [a + 1, a + 8, a + 32, a + 40, n - 1]:
            if b < n:
                x = torch.zeros(1, n)
                x[0, a] = x[0, b] = 5.0
                _same(x)
                _same(x[:, torch.arange(n - 1, -1, -1)].contiguous())  # b before a
    x = torch.zeros(1, 100)
    x[0, 40] = -0.0
    x[0, 10] = 0.0
    _same(x - 1.0)  # all -1: index 0
    _same(torch.full((2, 77), float("-inf")))  # nothing larger than the first
    y = torch.full((1, 77), -0.0)
    y[0, 5] = 0.0
    _same(y)  # -0.0 == 0.0: the first
    z = torch.randn(1, 500)
    z[0, 333] = float("inf")
    z[0, 400] = float("inf")
    _same(z)


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
def test_a_nan_is_the_maximum(tier):
    _tier(tier)
    g = torch.Generator().manual_seed(1)
    for n in (5, 40, 129, 1000):
        for where in sorted({0, 1, n // 2, n - 1, min(n - 1, 35)}):
            x = torch.randn(2, n, generator=g)
            x[0, where] = float("nan")
            x[1, n - 1 - where] = float("nan")
            x[1, where] = float("nan")
            x[0, (where + 3) % n] = float("inf")
            _same(x)


def test_strided_and_other_tensors_fall_back_to_torch():
    x = torch.randn(6, 200)
    _same(x[::2])  # rows apart: the kernel's row stride
    _same(x[:, ::2])  # elements apart: torch
    _same(x.double())
    _same(x.bfloat16())
    assert cpu_argmax.argmax_rows(torch.empty(0, 10)).shape == (0,)


def test_greedy_sampling_takes_the_first_maximum():
    row = torch.zeros(1, 49152)
    row[0, 30000] = row[0, 40000] = 3.0
    greedy = SamplingParams(temperature=0)
    assert sample_row(row, greedy, None) == 30000
    probs = target_probs_from_logits(torch.cat([row, -row]), greedy)
    assert probs[0, 30000] == 1 and probs[0].sum() == 1 and probs[1].argmax() == int((-row).argmax())


def test_one_row_of_any_layout():
    """argmax_row takes a row as [1, n] or [n], strided or not, and refuses several rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1000, generator=g)
    assert cpu_argmax.argmax_row(x[2]) == int(x[2].argmax())
    col = x[:, 7:8].t()  # [1, 4] with a stride of 1000 between its entries: torch's path
    assert cpu_argmax.argmax_row(col) == int(col.argmax())
    assert cpu_argmax.argmax_row(x[1:2].double()) == int(x[1].argmax())
    with pytest.raises(ValueError, match="one row"):
        cpu_argmax.argmax_row(x[:2])
