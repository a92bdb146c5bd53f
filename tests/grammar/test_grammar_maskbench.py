"""Matcher correctness on real tool schemas (JSONSchemaBench maskbench_bfcl, 100 of 1043: the
first 100 rows of the bundled sample, which are the full file shuffled with random.Random(0)).

Every valid instance, serialized and tokenized by the real SmolLM2 tokenizer, is accepted token
by token and the matcher terminates on the stop token. Invalid instances made by mutating valid
ones (a required key dropped, a value of the wrong type, an undeclared key where
additionalProperties is false, an enum value changed; each confirmed invalid by `jsonschema`)
are rejected at some token, the stop token included.

Instances are serialized with keys in the schema's declared order, because the grammar emits
properties in that order (stricter than JSON Schema; every output still validates), and with
`ensure_ascii=False`, as a model writes text.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from prescient.grammar import GrammarSpec
from prescient.latency_bench.bundled import jsonschemabench_file

from .conftest import accepts_text

NUM_SCHEMAS = 100


def _sample():
    # The sample file is already in seed-0 shuffled order (make_sample.py in
    # latency_bench/jsonschemabench-sample), so its head is the random draw this test used to
    # make from the full file.
    rows = [json.loads(line) for line in open(jsonschemabench_file("maskbench_bfcl.jsonl"))]
    assert len(rows) >= NUM_SCHEMAS
    return rows[:NUM_SCHEMAS]


SAMPLE = _sample()


def _branch(schema: dict, instance):
    """The anyOf branch the instance matches (BFCL roots are an anyOf over functions)."""
    for option in schema.get("anyOf", []):
        if jsonschema.Draft202012Validator(option).is_valid(instance):
            return option
    return schema


def in_schema_order(instance, schema):
    """Copy of `instance` with object keys in declared order, undeclared keys last."""
    if not isinstance(schema, dict):
        return instance
    schema = _branch(schema, instance)
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        keys = [k for k in props if k in instance] + [k for k in instance if k not in props]
        return {k: in_schema_order(instance[k], props.get(k, {})) for k in keys}
    if isinstance(instance, list):
        return [in_schema_order(x, schema.get("items", {})) for x in instance]
    return instance


def _objects(instance, schema, path=()):
    """(path, object value, its schema) for every object in the instance."""
    if not isinstance(schema, dict):
        return
    schema = _branch(schema, instance)
    if isinstance(instance, dict):
        yield path, instance, schema
        for key, value in instance.items():
            yield from _objects(value, schema.get("properties", {}).get(key, {}), path + (key,))
    elif isinstance(instance, list):
        for i, value in enumerate(instance):
            yield from _objects(value, schema.get("items", {}), path + (i,))


def mutations(instance, schema):
    """Invalid variants of a valid instance: (kind, mutated instance)."""
    out = []
    for path, obj, sub in _objects(instance, schema):
        props = sub.get("properties", {})
        for key in sub.get("required", []):
            if key in obj:
                out.append(("drop_required", _edit(instance, path, lambda o, k=key: o.pop(k))))
                break
        if sub.get("additionalProperties") is False:
            out.append(("extra_key", _edit(instance, path,
                                           lambda o: o.__setitem__("zz_extra", 1))))
        for key, value in obj.items():
            prop = props.get(key, {})
            if "enum" in prop and isinstance(value, str):
                out.append(("enum_changed", _edit(instance, path,
                                                  lambda o, k=key: o.__setitem__(k, o[k] + "_x"))))
            elif prop.get("type") in ("string", "integer", "number", "boolean", "array"):
                wrong = {"string": 12345, "array": "oops"}.get(prop["type"], "oops")
                out.append(("wrong_type", _edit(instance, path,
                                                lambda o, k=key, w=wrong: o.__setitem__(k, w))))
    return [(kind, m) for kind, m in out
            if not jsonschema.Draft202012Validator(schema).is_valid(m)]


def _edit(instance, path, change):
    mutated = copy.deepcopy(instance)
    target = mutated
    for step in path:
        target = target[step]
    change(target)
    return mutated


def _serialize(instance, schema) -> str:
    return json.dumps(in_schema_order(instance, schema), ensure_ascii=False)


@pytest.fixture(scope="module")
def compiled(real_compiler):
    pending = [real_compiler.submit(GrammarSpec("json_schema", json.dumps(r["schema"])))
               for r in SAMPLE]
    return [p.result() for p in pending]


def test_valid_instances_accepted_and_terminate(compiled, real_tokenizer):
    num_instances = 0
    for row, grammar in zip(SAMPLE, compiled):
        for test in row["tests"]:
            assert test["valid"]
            text = _serialize(test["data"], row["schema"])
            assert accepts_text(grammar.matcher(), real_tokenizer, text), (row["id"], text)
            num_instances += 1
    assert num_instances >= NUM_SCHEMAS


def test_mutated_instances_rejected(compiled, real_tokenizer):
    kinds_seen = {}
    for row, grammar in zip(SAMPLE, compiled):
        for test in row["tests"]:
            for kind, bad in mutations(test["data"], row["schema"]):
                text = _serialize(bad, row["schema"])
                assert not accepts_text(grammar.matcher(), real_tokenizer, text), (
                    row["id"], kind, text)
                kinds_seen[kind] = kinds_seen.get(kind, 0) + 1
    assert set(kinds_seen) == {"drop_required", "extra_key", "enum_changed", "wrong_type"}
    assert sum(kinds_seen.values()) >= 2 * NUM_SCHEMAS
