"""Output classification of the model-based compliance benchmark: valid, invalid (not JSON, or a
schema violation), and the overlapping-oneOf case reported apart as unsatisfiable."""

from __future__ import annotations

from prescient.latency_bench.model_compliance import classify

ONE_OF = {"oneOf": [{"type": "integer"}, {"type": "number"}]}  # an integer matches both branches


def test_valid_and_invalid_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert classify(schema, '{"a": 1}') == ("valid", None)
    kind, error = classify(schema, '{"a": "x"}')
    assert kind == "invalid" and error.startswith("type")
    kind, error = classify(schema, '{"a": 1')
    assert kind == "invalid" and error.startswith("not JSON")


def test_overlapping_one_of_is_reported_apart():
    assert classify(ONE_OF, "3")[0] == "oneof_overlap"
    assert classify(ONE_OF, "3.5") == ("valid", None)
    assert classify(ONE_OF, '"x"')[0] == "invalid"  # matches no branch: a real violation
