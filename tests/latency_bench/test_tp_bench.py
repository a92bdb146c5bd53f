"""tp_bench --outputs: every bundled workload decoded at both TP degrees, each difference
reported with its workload and first differing token."""

from types import SimpleNamespace

from prescient.latency_bench import tp_bench
from prescient.latency_bench.workloads import load_workloads


def test_compare_outputs_names_the_first_difference(monkeypatch):
    workloads, _ = load_workloads()
    tok = SimpleNamespace(apply_chat_template=lambda messages: [len(messages)])
    one, two = SimpleNamespace(tokenizer=tok, name="tp1"), SimpleNamespace(tokenizer=tok, name="tp2")
    calls = []

    def greedy(engine, ids, tokens):
        calls.append(engine.name)
        n = (len(calls) - 1) // 2  # the workload this pair of calls decodes
        if engine is two and n == 3:  # workload 3 at TP=2 differs at its third token
            return [1, 2, 9, 4]
        return [1, 2, 3, 4]

    monkeypatch.setattr(tp_bench, "_greedy", greedy)
    seen = []
    got = tp_bench._compare_outputs(one, two, 64, seen.append)
    assert got["of"] == len(workloads) and got["identical"] == len(workloads) - 1
    assert got["diverged"] == [{"workload": workloads[3].index, "kind": workloads[3].kind, "first_difference": 2}]
    assert seen == ["tp1", "tp2"] * len(workloads)  # threads switched before each engine runs
