"""The import layers of docs/ARCHITECTURE.md, enforced: every `prescient` import in the package,
module-level or inside a function, goes from a layer to the same or a lower one.

    leaves (cache_dir, help_format, import_shadow, speculative/tree.py) < kernels < grammar < runtime < speculative
        < build (prescient/build.py) < server < latency_bench < cli
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"prescient": "prescient", "runtime": "prescient.runtime", "speculative": "prescient.speculative",
           "kernels": "prescient.kernels", "grammar": "prescient.grammar", "server": "prescient.server",
           "latency_bench": "prescient.latency_bench"}
RANKS = {"leaf": 0, "kernels": 1, "grammar": 2, "runtime": 3, "speculative": 4, "build": 5, "server": 6,
         "latency_bench": 7, "cli": 8}
LEAVES = ("prescient.cache_dir", "prescient.help_format", "prescient.import_shadow", "prescient.speculative.tree")


def layer(module: str) -> str:
    if module == "prescient" or module.startswith(LEAVES):
        return "leaf"
    sub = module.split(".")[1]
    # a command beside the CLI: `prescient train-head` builds an engine
    return {"build": "build", "cli": "cli", "train_head": "cli"}.get(sub, sub)


def package_modules():
    for folder, package in FOLDERS.items():
        root = REPO / folder
        files = root.glob("*.py") if folder == "prescient" else root.rglob("*.py")
        for path in files:
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join((package, *parts)).removesuffix(".__init__")
            yield module, path


def prescient_imports(module: str, path: pathlib.Path):
    """(line, imported module) for every import of prescient in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "prescient":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            # the package imports absolutely (`prescient.*`), so a relative import is an error too
            assert not node.level, f"{path}:{node.lineno}: relative import"
            if (node.module or "").split(".")[0] == "prescient":
                yield node.lineno, node.module


def test_every_module_is_in_a_layer():
    modules = dict(package_modules())
    assert "prescient.build" in modules and "prescient.runtime.engine" in modules
    assert all(layer(m) in RANKS for m in modules), sorted(m for m in modules if layer(m) not in RANKS)


def test_imports_follow_the_layer_order():
    back_edges = []
    for module, path in package_modules():
        for line, target in prescient_imports(module, path):
            if RANKS[layer(target)] > RANKS[layer(module)]:
                back_edges.append(f"{path.relative_to(REPO)}:{line}: {layer(module)} imports {target} ({layer(target)})")
    assert not back_edges, "\n".join(back_edges)


def test_nothing_imports_the_cli():
    importers = [f"{path.relative_to(REPO)}:{line}" for module, path in package_modules() if module != "prescient.cli"
                 for line, target in prescient_imports(module, path) if target.startswith("prescient.cli")]
    assert not importers


@pytest.mark.parametrize("source,target,ok", [
    ("prescient.runtime.engine", "prescient.speculative.tree", True),
    ("prescient.runtime.engine", "prescient.speculative.speculator", False),
    ("prescient.speculative.speculator", "prescient.runtime.request", True),
    ("prescient.kernels.ops", "prescient.grammar", False),
    ("prescient.server.app", "prescient.build", True),
    ("prescient.build", "prescient.server.app", False),
])
def test_the_layer_rule_itself(source, target, ok):
    assert (RANKS[layer(target)] <= RANKS[layer(source)]) is ok
