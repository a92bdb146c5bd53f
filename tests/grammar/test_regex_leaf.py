"""grammar/regex/ stays the leaf every pattern rule imports downward from: it imports nothing else
of prescient, grammar/ imports no private (`_x`) name across modules, and no import in grammar/
hides inside a function (the way around a cycle that the leaf exists to make unnecessary)."""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
GRAMMAR = REPO / "grammar"
LEAF = "prescient.grammar.regex"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(GRAMMAR).with_suffix("").parts
    return ".".join(("prescient.grammar", *parts)).removesuffix(".__init__")


MODULES = {module_name(p): p for p in sorted(GRAMMAR.rglob("*.py"))}


def prescient_imports(path: pathlib.Path):
    """(line, imported module, imported names, inside a function) for each prescient import."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "prescient":
                found.append((child.lineno, child.module, [a.name for a in child.names], in_function))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "prescient":
                        found.append((child.lineno, alias.name, [], in_function))
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(REPO)}:{line}"


def test_the_leaf_exists_and_is_seen():
    assert {f"{LEAF}.{m}" for m in ("charset", "dialects", "classes", "parser", "anchors", "json_escape",
                                     "dfa", "errors")} <= set(MODULES)
    assert "prescient.grammar.regex_dfa" not in MODULES and "prescient.grammar.class_dialects" not in MODULES


def test_the_regex_leaf_imports_nothing_else_of_prescient():
    outside = [f"{where(m, line)}: {target}" for m in MODULES if m == LEAF or m.startswith(LEAF + ".")
               for line, target, _, _ in prescient_imports(MODULES[m])
               if not (target == LEAF or target.startswith(LEAF + "."))]
    assert not outside, "\n".join(outside)


def test_no_private_name_crosses_modules():
    private = [f"{where(m, line)}: `{name}` from {target}" for m in MODULES
               for line, target, names, _ in prescient_imports(MODULES[m]) if target != m
               for name in names if name.startswith("_")]
    assert not private, "\n".join(private)


def test_no_import_inside_a_function():
    hidden = [f"{where(m, line)}: {target}" for m in MODULES
              for line, target, _, in_function in prescient_imports(MODULES[m]) if in_function]
    assert not hidden, "\n".join(hidden)


@pytest.mark.parametrize("source, ok", [
    ("from prescient.grammar.regex.charset import complement", True),
    ("from prescient.grammar.pattern import _complement", False),
    ("def f():\n    from prescient.grammar.pattern import check_pattern", False),
])
def test_the_checks_themselves(tmp_path, source, ok):
    path = tmp_path / "probe.py"
    path.write_text(source)
    (imported,) = prescient_imports(path)
    _, _, names, in_function = imported
    assert (not in_function and not any(n.startswith("_") for n in names)) is ok
