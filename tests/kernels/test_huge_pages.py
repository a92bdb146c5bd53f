"""kernels/huge_pages.py: the memory the kernels stream (weight copies, float weights, the KV cache)
lies in mappings advised for transparent huge pages, holds what was put there, and goes when its
tensors do; PRESCIENT_HUGEPAGES=0 gives ordinary memory."""

from __future__ import annotations

import gc
import mmap
import re
import sys

import pytest
import torch

from prescient.kernels import huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="transparent huge pages are Linux's")

BIG = 3 << 20  # past MIN_BYTES, and more than one huge page


def _vma_at(p: int) -> dict | None:
    """/proc/self/smaps' record of the mapping holding address p: its range and VmFlags."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= p < int(m.group(2), 16):
            rec = {"start": int(m.group(1), 16), "end": int(m.group(2), 16), "flags": set()}
            for rest in lines[i + 1:]:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", rest):
                    break
                if rest.startswith("VmFlags:"):
                    rec["flags"] = set(rest.split()[1:])
            return rec
    return None


def _vma(t: torch.Tensor) -> dict | None:
    return _vma_at(t.data_ptr())


def _advised(t: torch.Tensor) -> bool:
    """Whether t lies in a mapping advised for huge pages (VmFlags `hg`)."""
    rec = _vma(t)
    return rec is not None and "hg" in rec["flags"]


def _ordinary_is_unadvised() -> bool:
    """Ordinary allocations here are not advised (they are under GLIBC_TUNABLES=glibc.malloc.hugetlb=1
    or torch's THP_MEM_ALLOC_ENABLE=1: then "ordinary memory" cannot be told apart by its flags)."""
    return not _advised(torch.empty(BIG, dtype=torch.uint8))


@pytest.fixture
def thp(monkeypatch):
    """The advice is available here and /proc/self/smaps shows it (a kernel built without THP
    refuses it, an emulated /proc may list no VmFlags: skip)."""
    try:
        m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pytest.skip("this kernel refuses MADV_HUGEPAGE")
    probe = torch.frombuffer(m, dtype=torch.uint8)
    shown = _advised(probe)
    del probe
    if not shown:
        pytest.skip("/proc/self/smaps does not show the advice (VmFlags hg)")
    monkeypatch.setattr(huge_pages, "_refused", False)


def test_empty_hands_out_aligned_advised_memory_in_order(thp, monkeypatch):
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    monkeypatch.setattr(huge_pages, "_arena", None)
    a, b = huge_pages.empty(BIG + 5), huge_pages.empty(BIG)
    assert a.dtype == torch.uint8 and a.numel() == BIG + 5 and b.numel() == BIG
    assert a.data_ptr() % huge_pages.ALIGN == 0 and b.data_ptr() % huge_pages.ALIGN == 0
    assert _advised(a) and _advised(b)
    # carved in the order asked, so a model's weights stream on from one matrix to the next
    assert a.data_ptr() + a.numel() <= b.data_ptr() < a.data_ptr() + a.numel() + huge_pages.ALIGN
    a.fill_(7)
    b.fill_(9)
    assert int(a.sum()) == 7 * a.numel() and int(b.sum()) == 9 * b.numel()


def test_a_request_larger_than_an_arena_gets_its_own(thp, monkeypatch):
    """...and the arena goes on after it (a transient large buffer must not become the arena
    that later weights are carved from: they would keep its pages alive)."""
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    monkeypatch.setattr(huge_pages, "_arena", None)
    a = huge_pages.empty(BIG)
    big = huge_pages.empty(huge_pages.ARENA_BYTES + 1)
    b = huge_pages.empty(BIG)
    assert _advised(big) and big.numel() == huge_pages.ARENA_BYTES + 1
    assert not a.data_ptr() <= big.data_ptr() < a.data_ptr() + huge_pages.ARENA_BYTES  # not carved from a's arena
    assert a.data_ptr() + a.numel() <= b.data_ptr() < a.data_ptr() + a.numel() + huge_pages.ALIGN


def test_small_requests_the_switch_and_a_refusal_give_ordinary_memory(thp, monkeypatch):
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    unadvised = _ordinary_is_unadvised()
    small = [huge_pages.empty(huge_pages.MIN_BYTES - 1), huge_pages.zeros(huge_pages.ZEROS_MIN_BYTES - 64)]
    assert not unadvised or not any(_advised(t) for t in small)
    assert int(small[1].sum()) == 0 and small[1].data_ptr() % huge_pages.ALIGN == 0
    monkeypatch.setenv("PRESCIENT_HUGEPAGES", "0")
    assert not huge_pages.enabled()
    w = torch.ones(BIG // 4)
    off = [huge_pages.empty(BIG), huge_pages.zeros(BIG), huge_pages.adopt(w)]
    assert not unadvised or not any(_advised(t) for t in off)
    assert int(off[1].sum()) == 0 and off[1].data_ptr() % huge_pages.ALIGN == 0
    assert off[2] is w  # nothing to copy it into: the tensor itself
    # a mapping refused (a sandbox): ordinary memory, and not asked again
    monkeypatch.delenv("PRESCIENT_HUGEPAGES")
    monkeypatch.setattr(huge_pages, "_arena", None)
    asked = []

    def refuse(*args, **kwargs):
        asked.append(1)
        raise OSError("refused")
    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    got = [huge_pages.empty(BIG), huge_pages.zeros(BIG), huge_pages.adopt(w), huge_pages.empty(BIG)]
    assert len(asked) == 1 and not huge_pages.enabled() and got[2] is w
    assert int(got[1].sum()) == 0 and all(t.numel() == BIG for t in (got[0], got[1], got[3]))


def test_an_arena_goes_with_its_tensors(thp, monkeypatch):
    """The current arena holds its mapping weakly once carved from: dropping every tensor carved
    from it unmaps it, and the next request starts another."""
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    huge_pages.fresh_arena()
    t = huge_pages.empty(BIG)
    p = t.data_ptr()
    del t
    gc.collect()
    rec = _vma_at(p)
    assert rec is None or "hg" not in rec["flags"]
    u = huge_pages.empty(BIG)
    assert _advised(u) and int(u.fill_(1).sum()) == BIG


def test_zeros_are_zero_and_their_mapping_goes_with_them(thp, monkeypatch):
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    t = huge_pages.zeros(BIG)
    assert _advised(t) and t.data_ptr() % huge_pages.ALIGN == 0
    assert int(t.sum()) == 0
    t[123] = 5
    assert int(t.sum()) == 5
    view = t.view(torch.bfloat16)[: BIG // 4]
    start = _vma(t)["start"]
    del t
    gc.collect()
    assert _vma(view)["start"] == start  # a view keeps the mapping
    p = view.data_ptr()
    del view
    gc.collect()
    rec = _vma_at(p)
    assert rec is None or "hg" not in rec["flags"]  # unmapped


def test_adopt_copies_large_cpu_tensors_once(thp, monkeypatch):
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    w = torch.randn(1024, 576).to(torch.bfloat16)
    a = huge_pages.adopt(w)
    assert _advised(a) and a.dtype == w.dtype and a.shape == w.shape and a.is_contiguous()
    assert torch.equal(a, w) and a.data_ptr() != w.data_ptr()
    assert huge_pages.adopt(a) is a  # a tied embedding and LM head keep one copy
    small = torch.randn(8, 8)
    assert huge_pages.adopt(small) is small
    strided = torch.randn(576, 1024).t()
    b = huge_pages.adopt(strided)
    assert _advised(b) and b.is_contiguous() and torch.equal(b, strided)
    # rows of a larger tensor (a tensor-parallel rank's LM head: its share of the embedding) stay
    # where they are: a copy would hold them twice while the embedding lives
    embed = torch.randn(4096, 576)
    rows = embed[1024:2048]
    assert huge_pages.adopt(rows).data_ptr() == rows.data_ptr()


def test_a_model_streams_from_advised_memory(thp, monkeypatch, tmp_path):
    """Float weights, a tied embedding and the KV cache of a loaded model: advised, one copy of
    the tied matrix, the outputs those of the same model on ordinary memory."""
    from prescient.runtime.loader import load_checkpoint
    from prescient.runtime.model import LlamaModel
    from tests.conftest import make_tiny_checkpoint

    # [4096, 64] fp32 tied embedding and head (1 MiB), gate_up [2048, 64] (512 KiB)
    ck = load_checkpoint(str(make_tiny_checkpoint(tmp_path / "tied", vocab_size=4096, intermediate_size=1024,
                                                  tie_word_embeddings=True)))
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    on = LlamaModel(ck.config, ck.weights, dtype=torch.float32)
    monkeypatch.setenv("PRESCIENT_HUGEPAGES", "0")
    off = LlamaModel(ck.config, ck.weights, dtype=torch.float32)
    head = on.lm_head.weight
    assert _advised(head) and head.data_ptr() == on.embed.data_ptr()
    assert _advised(on.layers[0].gate_up.weight)
    assert not _ordinary_is_unadvised() or not (_advised(off.lm_head.weight) or _advised(off.layers[0].gate_up.weight))
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    kv = on.allocate_kv_cache(256, 16, stacked=True)  # the engine's: [layers, 2, 256, 16, 2, 16] fp32
    assert _advised(kv.stack) and all(_advised(t) for layer in kv for t in layer)

    from prescient.latency_bench.step_profile import _batch
    outs = []
    for model in (on, off):
        cache = model.allocate_kv_cache(8, 16)
        outs.append(model.forward(_batch(model, 0, 5), cache))
    assert torch.equal(outs[0], outs[1])


def test_a_quantized_weight_s_copy_is_advised(thp, monkeypatch):
    """The copy the VNNI / AVX-512 block kernels stream (kernels/quant_linear.py regroup)."""
    from prescient.kernels import cpu_linear
    from prescient.kernels import quant_reference as qr
    from prescient.kernels.quant_linear import QuantLinear

    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    g = torch.Generator().manual_seed(3)
    N, K = 1024, 576  # 360 KiB of Q4_1 blocks
    lin = QuantLinear(qr.quantize(torch.randn(N, K, generator=g), "q4_1"), "q4_1", N, K)
    if not lin.regrouped:
        pytest.skip(f"no regrouped copy at tier {cpu_linear.kernel_info().get('isa')}")
    assert _advised(lin._regrouped)
    x = torch.randn(3, K, generator=g)
    monkeypatch.setenv("PRESCIENT_HUGEPAGES", "0")
    plain = QuantLinear(qr.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(3)), "q4_1"),
                        "q4_1", N, K)
    if not plain.regrouped:
        pytest.skip("the copies' budget is spent (PRESCIENT_REGROUP_MB)")
    assert (not _ordinary_is_unadvised() or not _advised(plain._regrouped)) and torch.equal(lin(x), plain(x))


def test_the_startup_line_says_whether_the_advice_is_taken(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    monkeypatch.delenv("PRESCIENT_HUGEPAGES", raising=False)
    monkeypatch.setattr(huge_pages, "_refused", False)
    setting.write_text("always [madvise] never\n")
    assert huge_pages.describe(str(setting)) == "on huge pages"
    setting.write_text("always madvise [never]\n")
    assert "never" in huge_pages.describe(str(setting))
    assert "no transparent huge pages" in huge_pages.describe(str(tmp_path / "missing"))
    monkeypatch.setattr(huge_pages, "_refused", True)
    assert "refused" in huge_pages.describe(str(setting))
    monkeypatch.setenv("PRESCIENT_HUGEPAGES", "0")
    assert huge_pages.describe(str(setting)) == "huge pages off (PRESCIENT_HUGEPAGES=0)"
