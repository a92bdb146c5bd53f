"""step_profile (where a CPU step's time goes) runs end to end on a tiny checkpoint and reports the
verify / step ratio for every size it was asked for."""

import json
import os
from types import SimpleNamespace

import pytest

from prescient.latency_bench import step_profile
from prescient.runtime import weights_cache


@pytest.fixture
def no_tokenizer(monkeypatch):
    """The tiny checkpoint has no tokenizer; the profile needs none."""
    fake = SimpleNamespace(hf=SimpleNamespace(save_pretrained=lambda d: os.makedirs(d, exist_ok=True)))
    monkeypatch.setattr(weights_cache.Tokenizer, "load", classmethod(lambda cls, *a: fake))


def test_reports_verify_over_step_for_each_size(tiny_llama_dir, no_tokenizer, capsys):
    rc = step_profile.cli(["--model", str(tiny_llama_dir), "--dtype", "float32", "--weights", "float32",
                           "--reps", "2", "--context", "64", "--verify", "4,2", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "2-token verify" in out and "4-token verify" in out
    report = json.loads(out[out.index("\n{") + 1:])
    ratios = report["verify_ratio"]
    assert sorted(int(t) for t in ratios) == [2, 4]
    for per_mode in ratios.values():
        assert set(per_mode) == set(step_profile.MODES) and all(r > 0 for r in per_mode.values())
    assert {"1", "2", "4"} <= {k.split("|")[1] for k in report["steps"]}
