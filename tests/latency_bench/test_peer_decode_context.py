"""peer-decode's `--context` (latency_bench/peer_decode.py): each workload's filler brings its prompt
to about the asked length, and no further than one filler paragraph past it; a prompt already that
long gets none; and the floor counts every layer's K and V per cached position."""

from __future__ import annotations

from types import SimpleNamespace

from prescient.latency_bench.peer_decode import FILLER, context_fillers, kv_bytes_per_position


def _encode(text: str) -> list[str]:
    return text.split()


WORK = [{"messages": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Write a haiku about autumn."}]},
        {"messages": [{"role": "user", "content": "word " * 500}]}]


def test_each_prompt_is_padded_to_about_the_context():
    per = len(_encode(FILLER))
    fillers = context_fillers(WORK, 300, _encode)
    own = len(_encode(" ".join(m["content"] for m in WORK[0]["messages"])))
    padded = own + len(_encode(fillers[0]))
    assert 300 <= padded < 300 + per
    assert fillers[1] == ""  # 500 words already


def test_no_context_means_no_filler():
    assert context_fillers(WORK, 0, _encode) == ["", ""]


def test_the_floor_counts_k_and_v_of_every_layer():
    smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    assert kv_bytes_per_position(smollm2) == 30 * 3 * 64 * 2 * 2
    assert kv_bytes_per_position(smollm2, esz=1) == 30 * 3 * 64 * 2
