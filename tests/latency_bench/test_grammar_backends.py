"""latency_bench/grammar_backends.py on a few bundled schemas: the report's shape, the walked
valid instances accepted by both xgrammar (prescient's path) and llguidance, and llguidance's
strict / lenient split. A tiny byte-level BPE tokenizer (trained in a second from the bundled
workloads) stands in for SmolLM2's, whose GGUF takes ~15 s to load on a busy 2-core machine:
what is tested is the comparison's plumbing, on one vocabulary shared by both engines."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from prescient.latency_bench.grammar_backends import BackendsConfig, llg_feature, markdown, run  # noqa: E402
from tests.latency_bench.conftest import make_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


def test_report_on_bundled_schemas(tiny_hf):
    config = BackendsConfig(files=("Glaiveai2K.jsonl", "maskbench_bfcl.jsonl"), limit=3, progress=False)
    report = run(config, tiny_hf)
    assert set(report["files"]) == set(config.files)
    for name, r in report["files"].items():
        assert r["schemas"] == 3
        for backend in ("xgrammar", "llguidance"):
            side = r[backend]
            assert side["compiled"] + side["refused"] + side["compile_errors"] == 3, (name, backend, side)
            assert side["compile_time"]["p99_ms"] >= side["compile_time"]["p50_ms"] > 0
            # masks timed on the same tokens for both, at batch 1 and batch 8
            assert side["mask_b1"]["n"] > 0 and side["mask_b8_step"]["n"] > 0
        # the valid instances (prescient's walks, valid per jsonschema) are accepted by both, but
        # for a known narrowing (llguidance never takes the escape \/); nothing unexplained
        walks = r["instances"]
        assert walks["fed"] > 0 and walks["accepted_by_both"] > 0, r["disagreements"]
        refused = [d for d in r["disagreements"] if d["instance"].startswith("prescient")]
        assert walks["fed"] - walks["accepted_by_both"] == len(refused)
        assert r["unexplained_disagreements"] == 0, r["disagreements"]
        assert r["llg_invalid_outputs"] == []  # llguidance's own walks validate too
    verdict = report["verdict"]
    assert set(verdict["by_file"]) == set(config.files)
    assert isinstance(verdict["llguidance_wins_an_axis"], bool)
    text = markdown(report)
    assert "| Glaiveai2K.jsonl | llguidance | 3 |" in text and "Verdict" in text


def test_strict_refuses_what_lenient_ignores(tiny_hf, tmp_path):
    """`not` is unimplemented in llguidance: strict mode refuses the schema, lenient would take it
    by ignoring the keyword (counted apart, never as declared coverage)."""
    rows = [{"id": "not", "schema": {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}},
                                     "required": ["a"]}},
            {"id": "plain", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}]
    (tmp_path / "mini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run(BackendsConfig(data_dir=str(tmp_path), files=("mini.jsonl",), progress=False), tiny_hf)
    result = report["files"]["mini.jsonl"]
    llg = result["llguidance"]
    assert llg["refused_by_feature"] == {"unimplemented: not": 1}
    assert llg["lenient_only"] == 1 and llg["lenient_coverage"] == 1.0 and llg["declared_coverage"] == 0.5
    assert llg["faithful_coverage"] == 0.5  # ignoring `not` is a weakening, not an annotation
    # the plain schema's walked instance (digits and punctuation only) goes through both
    assert result["instances"]["fed"] == result["instances"]["accepted_by_both"] == 1


def test_llg_feature_names():
    assert llg_feature('Unimplemented keys: ["if", "then"]') == "unimplemented: if, then"
    assert llg_feature("Unknown format: foo") == "unknown format foo"
    assert llg_feature("oneOf constraints are not supported. Enable 'coerce_one_of'") == "oneOf (not provably disjoint)"


def test_known_narrowings_are_named():
    """The disagreements that refuse a valid instance without ever emitting an invalid one are
    told apart from real ones."""
    from prescient.latency_bench.grammar_backends import _Comparison

    assert _Comparison._llg_narrowing('{"a": "x\\/') is not None
    assert _Comparison._llg_narrowing('{"a": "x\\u3D') is not None
    assert _Comparison._llg_narrowing('{"a": "x\\n"') is None
    from prescient.latency_bench.grammar_backends import _typed_objects

    # a typeless subschema with object keywords is typed; a property *named* "required" is not
    schema = {"type": "object", "properties": {"order": {"required": ["id"]}, "required": {"type": "string"}}}
    typed = _typed_objects(schema)
    assert typed["properties"]["order"]["type"] == "object"
    assert typed["properties"]["required"] == {"type": "string"}
